"""Chapter 2: the KV cache. Prefill the prompt once, then decode one token per step against cached K and V.

In chapter 1, step n recomputes the keys and values of all n earlier tokens, though they never change: a token's
K and V depend only on the tokens before it. Here each layer writes the new token's K/V into a preallocated
cache and attends over everything cached so far. Every layer function (``linear``, ``split_qkv``,
``attention``, ``mlp``, ...) is chapter 1's, imported unchanged; only the attention's source of K/V moves.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..loading.config import GPT2Config
from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch01_forward.generation import check_generation, positions_needed
from ..ch01_forward.model import attention, embed, layer_norm, linear, lm_head, merge_heads, mlp, split_qkv
from ..ch01_forward.sampling import Sampler, SamplingParams
from ..loading.weights import GPT2Model


class KVCache:
    """K and V of every layer for one sequence, preallocated to ``capacity`` tokens.

    ``k[layer]`` is [H, capacity, D]; positions ``0 .. length-1`` hold valid entries. Heads come first so that
    ``k[layer, :, :S]`` is the [H, S, D] operand attention wants, without a copy.
    """

    def __init__(self, config: GPT2Config, capacity: int | None = None, dtype=np.float32):
        capacity = config.n_positions if capacity is None else capacity
        if not is_integer(capacity, 1):
            raise InvalidInputError(f"KV cache capacity must be a positive integer, got {capacity!r}")
        if capacity > config.n_positions:
            raise InvalidInputError(f"KV cache capacity {capacity} exceeds the context n_ctx={config.n_positions}")
        shape = (config.n_layer, config.n_kv_head, capacity, config.head_dim)  # [L, H_kv, capacity, D]
        self.k = np.zeros(shape, dtype=dtype)
        self.v = np.zeros(shape, dtype=dtype)
        self.capacity = int(capacity)
        self.length = 0  # tokens cached so far (all layers)

    def reserve(self, num_tokens: int) -> None:
        """Fail before any work if ``num_tokens`` more tokens would not fit."""
        if self.length + num_tokens > self.capacity:
            raise CacheCapacityError(f"KV cache full: {self.length} cached + {num_tokens} new tokens exceeds "
                                     f"its capacity of {self.capacity}")

    def update(self, layer: int, k, v):  # k, v [H, T, D] -> all keys, values so far [H, length + T, D]
        start, end = self.length, self.length + k.shape[1]
        self.k[layer, :, start:end] = k
        self.v[layer, :, start:end] = v
        return self.k[layer, :, :end], self.v[layer, :, :end]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def cached_self_attention(x, attn, n_head, cache: KVCache, layer: int):  # x [T, E] -> [T, E]
    qkv = linear(x, **attn["c_attn"])  # [T, 3E]
    q, k, v = split_qkv(qkv, n_head)  # 3 x [H, T, D]
    k_all, v_all = cache.update(layer, k, v)  # [H, S, D] with S = cached + T
    return linear(merge_heads(attention(q, k_all, v_all)), **attn["c_proj"])  # [T, E]


def cached_block(x, p, n_head, eps, cache: KVCache, layer: int):  # x [T, E] -> [T, E]
    x = x + cached_self_attention(layer_norm(x, **p["ln_1"], eps=eps), p["attn"], n_head, cache, layer)
    return x + mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])


def cached_transformer(model: GPT2Model, token_ids, cache: KVCache) -> np.ndarray:  # [T] -> hidden [T, E]
    """Run the new tokens ``token_ids`` at positions ``cache.length ..``; their K/V are appended to the cache."""
    cfg = model.config
    token_ids = model.check_tokens(token_ids)
    if cache.k.shape[:2] + cache.k.shape[3:] != (cfg.n_layer, cfg.n_head, cfg.head_dim):
        L, H, _, D = cache.k.shape
        raise InvalidInputError(f"the KV cache holds {L} layers x {H} heads x head_dim {D}; the model needs "
                                f"{cfg.n_layer} x {cfg.n_head} x {cfg.head_dim}")
    if cache.length + len(token_ids) > cfg.n_positions:
        raise CacheCapacityError(f"position {cache.length + len(token_ids) - 1} is past the context "
                                 f"n_ctx={cfg.n_positions}")
    cache.reserve(len(token_ids))  # checked before anything is written: a failed call leaves the cache intact
    x = embed(model.params, token_ids, start_pos=cache.length)  # [T, E]
    for layer, p in enumerate(model.params["h"]):
        x = cached_block(x, p, cfg.n_head, cfg.layer_norm_epsilon, cache, layer)  # [T, E]
    cache.length += len(token_ids)
    return x


def cached_logits(model: GPT2Model, token_ids, cache: KVCache, last_only: bool = False) -> np.ndarray:
    """The new tokens through the model with ``cache``: the logits of each new position [T, V], or of the last
    only [1, V] (all generation needs, and the LM head is the largest matrix)."""
    x = cached_transformer(model, token_ids, cache)  # [T, E]
    if last_only:
        x = x[-1:]
    return lm_head(model.params, x, model.config.layer_norm_epsilon)


# The loop below reaches the model through one function, looked up by ``config.architecture`` as chapter 3's engine
# looks up its model step: GPT-2's is the one above; a later chapter registers its own (chapter 9: Llama's).
CACHED_FORWARDS: dict = {"gpt2": cached_logits}


def cached_forward(model):
    """The ``cached_logits`` of the model's architecture, or an ``InvalidInputError`` naming it."""
    arch = getattr(model.config, "architecture", "gpt2")
    if arch not in CACHED_FORWARDS:
        raise InvalidInputError(f"no cached forward for architecture {arch!r} (known: {', '.join(CACHED_FORWARDS)}); "
                                f"import the chapter that runs it")
    return CACHED_FORWARDS[arch]


def prefill(model: GPT2Model, token_ids, capacity: int | None = None,
            last_only: bool = False) -> tuple[np.ndarray, KVCache]:
    """Process the whole prompt in one pass; return its logits ([T, V], or [1, V] if ``last_only``) and the cache.

    ``capacity`` (default n_ctx) is how many tokens the cache can ever hold: prompt + tokens to generate.
    """
    cache = KVCache(model.config, capacity)
    return cached_forward(model)(model, token_ids, cache, last_only), cache


def decode_step(model: GPT2Model, token: int, cache: KVCache) -> np.ndarray:
    """Feed one token; its K/V join the cache; return the logits of the next token [V]."""
    return cached_forward(model)(model, [token], cache)[0]  # [V]


def generate_stream(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
                    top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                    stop_at_eos: bool = True) -> Iterator[int]:
    """Chapter 1's ``generate_stream``, same signature and same tokens, with a KV cache."""
    sample = Sampler(SamplingParams(temperature, top_k, top_p, seed))
    ids = check_generation(model, token_ids, max_new_tokens, stop_at_eos)
    if max_new_tokens == 0:
        return
    eos = model.config.eos_token_id if stop_at_eos else None
    logits, cache = prefill(model, ids, capacity=positions_needed(len(ids), max_new_tokens), last_only=True)
    logits = logits[0]  # [V]
    for step in range(max_new_tokens):
        token = sample(logits)
        yield token
        if token == eos or step == max_new_tokens - 1:
            return
        logits = decode_step(model, token, cache)


def generate(model: GPT2Model, token_ids, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             stop_at_eos: bool = True) -> list[int]:
    """The new token ids, as chapter 1's ``generate`` returns them."""
    return list(generate_stream(model, token_ids, max_new_tokens, temperature, top_k, top_p, seed, stop_at_eos))


# ----------------------------------------------------------------------------------------------------------------
# What the cache costs

# A 7B-parameter decoder in the shape of Llama-2-7B (32 layers, hidden 4096, 32 heads): the usual point of reference.
SEVEN_B = GPT2Config(vocab_size=32000, n_positions=4096, n_embd=4096, n_head=32, n_layer=32)


def kv_cache_bytes(config: GPT2Config, num_tokens: int, dtype=np.float32) -> int:
    """2 (K and V) x layers x KV heads x head_dim x tokens x bytes per element."""
    return 2 * config.n_layer * config.n_kv_head * config.head_dim * num_tokens * np.dtype(dtype).itemsize


def kv_cache_breakdown(config: GPT2Config, num_tokens: int, dtype=np.float32) -> dict:
    """The factors of ``kv_cache_bytes`` and the result, for one sequence."""
    itemsize = np.dtype(dtype).itemsize
    per_token = kv_cache_bytes(config, 1, dtype)
    return {"k_and_v": 2, "n_layer": config.n_layer, "n_head": config.n_head, "head_dim": config.head_dim,
            "num_tokens": num_tokens, "bytes_per_element": itemsize, "bytes_per_token": per_token,
            "bytes": per_token * num_tokens}


def kv_cache_table(num_tokens: int = 2048, dtype=np.float16) -> list[dict]:
    """KV cache per sequence for GPT-2 small..xl and a 7B model, beside each model's weight bytes."""
    from ..loading.config import PRESETS

    models = {name: PRESETS[name] for name in ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")}
    models["7B (32 layers, hidden 4096)"] = SEVEN_B
    rows = []
    for name, cfg in models.items():
        params = 6_738_415_616 if cfg is SEVEN_B else cfg.num_parameters()  # Llama-2-7B: its published count
        weights = params * np.dtype(dtype).itemsize
        row = {"model": name, **kv_cache_breakdown(cfg, num_tokens, dtype), "weight_bytes": weights}
        rows.append(row)
    return rows
