"""Chapter 9: what the KV cache costs, architecture by architecture, and what grouped-query attention buys.

A token's K and V take ``2 x n_layer x n_kv_head x head_dim`` numbers (chapter 2's ``kv_cache_bytes``, which
counts the heads that keep K/V). Multi-head attention keeps all ``n_head``; grouped-query attention keeps
``n_kv_head`` of them, so the same memory holds ``n_head / n_kv_head`` times more tokens: more sequences at once
in chapter 4's paged store, which ``peak_concurrency`` measures in the engine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..ch03_batching.sequence import Request
from ..ch04_paged.block_manager import blocks_needed
from ..ch04_paged.paged_kv_store import PagedKVStore
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..errors import InvalidInputError, is_integer
from ..loading.config import PRESETS
from ..loading.llama import LLAMA_2_7B, LLAMA_3_8B, SMOLLM2_135M, LlamaConfig

MODELS = {"GPT-2 124M": PRESETS["gpt2"], "SmolLM2-135M": SMOLLM2_135M, "Llama-2-7B": LLAMA_2_7B,
          "Llama-3-8B": LLAMA_3_8B}


def kv_bytes_per_token(config, dtype=np.float16) -> int:
    """K and V of one token in every layer: 2 x n_layer x n_kv_head x head_dim x bytes per number."""
    return kv_cache_bytes(config, 1, dtype)


def multi_head(config):
    """The same model with every query head keeping its own K/V (what grouped-query attention saves against)."""
    return replace(config, n_kv_head=config.n_head) if isinstance(config, LlamaConfig) else config


def kv_memory_table(num_tokens: int = 2048, dtype=np.float16) -> list[dict]:
    """Per model of ``MODELS``: its heads, the KV bytes per token and for one sequence of ``num_tokens``, and the
    bytes per token it would need with multi-head attention."""
    rows = []
    for name, cfg in MODELS.items():
        per_token = kv_bytes_per_token(cfg, dtype)
        rows.append({"model": name, "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_kv_head": cfg.n_kv_head,
                     "head_dim": cfg.head_dim, "bytes_per_token": per_token, "num_tokens": num_tokens,
                     "bytes": per_token * num_tokens,
                     "multi_head_bytes_per_token": kv_bytes_per_token(multi_head(cfg), dtype)})
    return rows


def measured_bytes_per_token(config, block_size: int = 16) -> int:
    """Bytes per token slot of the pool chapter 4's store really allocates for ``config`` (float32)."""
    store = PagedKVStore(config, num_blocks=2, block_size=block_size)
    return store.nbytes // store.capacity_tokens()


def sequences_at_budget(config, budget_bytes: int, tokens_per_seq: int, block_size: int = 16) -> int:
    """How many sequences of ``tokens_per_seq`` tokens a paged pool of ``budget_bytes`` (float32) holds at once."""
    num_blocks = budget_bytes // kv_cache_bytes(config, block_size)
    return int(num_blocks // blocks_needed(tokens_per_seq, block_size))


def peak_concurrency(model, budget_bytes: int, num_requests: int = 32, prompt_len: int = 24,
                     max_new_tokens: int = 8, block_size: int = 16) -> int:
    """Measured: the most sequences chapter 5's engine ran at once when ``num_requests`` requests (different
    prompts, nothing to share) all arrive together and its paged store has ``budget_bytes`` of K/V memory."""
    if not is_integer(num_requests, 1) or not is_integer(budget_bytes, 1):
        raise InvalidInputError("num_requests and budget_bytes must be positive integers")
    num_blocks = budget_bytes // kv_cache_bytes(model.config, block_size)
    store = PrefixCachingKVStore(model.config, num_blocks=int(num_blocks), block_size=block_size)
    engine = CachingLLMEngine(model, store, max_num_seqs=num_requests,
                              max_num_batched_tokens=num_requests * (prompt_len + 1), enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for i in range(num_requests):
        prompt = rng.integers(0, model.config.vocab_size, prompt_len).tolist()
        engine.add_request(Request(i, prompt, max_new_tokens=max_new_tokens, stop_at_eos=False))
    engine.run_until_done()
    return max(s.kv_slots_in_use for s in engine.step_stats)
