"""Appendix, "making NumPy fast on a CPU": opt-in kernels that no chapter imports.

``accelerate(model)`` wraps the weights so that every chapter's ``x @ W`` runs the kernel this CPU does best for the
number of rows (``fast_model``); ``small_batch`` and ``tiles`` are those kernels, ``memory`` the allocator setting
the benchmarks use. ``attention``'s ``SlotAttentionKVStore`` is chapter 3's contiguous store with a step's decode
attention in one numba kernel call per layer. The benchmarks (``python -m gpt2_core bench ...``) run on an
accelerated model by default and record it; ``notebooks/A1_cpu_performance.ipynb`` measures each piece.
"""

from .fast_model import FastWeight, TiedEmbedding, accelerate, array_of, default_kernels, is_accelerated, plain
from .malloc import keep_freed_memory

__all__ = ["FastWeight", "TiedEmbedding", "accelerate", "array_of", "default_kernels", "is_accelerated", "plain",
           "keep_freed_memory"]
