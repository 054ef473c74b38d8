"""Chapter 9, a modern model: SmolLM2-135M-Instruct, a Llama, through the same engine. Chapter 1's forward with four
swaps (``model``: RMSNorm, RoPE, SwiGLU, grouped-query attention), a KV-cached decode over chapter 2's cache, and
chapter 3's model step for this architecture, registered so that every engine runs it; what the KV cache costs by
architecture (``memory``). The file comes from PyPI and is read by ``loading.gguf`` / ``loading.llama``."""

from . import model  # noqa: F401  registers the Llama model step in chapter 3's MODEL_STEPS
