"""Chapter 3, first try: static batching. Pad the prompts to one length, run the batch as one [B*T, E] matrix.

Prompts of different lengths are **left**-padded, so every row's last prompt token sits in the same column and
every decode step appends one column for all rows. Two small arrays make the padding harmless:

* an **attention mask** hides the pad keys (and the future, as always);
* **per-row position ids** count only real tokens, so a row's first real token is at position 0, as when it runs
  alone.

The batch runs until its longest row is done: a row that finishes early keeps its slot (it is fed a pad token and
its output is thrown away) until the batch ends. That waste is what continuous batching removes.

Every function but attention is chapter 1's, as in the continuous engine's step (``model_runner``), so that
comparing the two measures the scheduling, not the kernels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from ..errors import CacheCapacityError, InvalidInputError, is_integer
from ..ch01_forward.generation import check_generation
from .kv_store import claimed_zeros
from ..ch01_forward.model import layer_norm, linear, lm_head, mlp, softmax
from ..ch01_forward.sampling import Sampler, sampling_params_of
from .sequence import FinishReason, check_request
from ..loading.weights import GPT2Model


def left_pad(prompts, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [B, T] (T = longest prompt) with pads on the left, and the mask [B, T] of real tokens."""
    T = max(len(p) for p in prompts)
    ids = np.full((len(prompts), T), pad_id, dtype=np.int64)  # [B, T]
    mask = np.zeros((len(prompts), T), dtype=bool)  # [B, T]
    for row, p in enumerate(prompts):
        ids[row, T - len(p):] = p
        mask[row, T - len(p):] = True
    return ids, mask


def position_ids(mask: np.ndarray) -> np.ndarray:  # mask [B, S] -> positions [B, S]
    """Each real token's position counts the real tokens before it; pads get 0 (they are never attended to)."""
    return np.maximum(np.cumsum(mask, axis=1) - 1, 0)


def left_padding_attention_mask(key_mask: np.ndarray, num_queries: int) -> np.ndarray:
    """[B, S] real-key mask -> [B, 1, T, S]: may query i (one of the last T positions) look at key j?

    Causal (j <= i) and j is a real token. A pad query may also look at itself, so that no softmax row is empty
    (its output is never used).
    """
    B, S = key_mask.shape
    q_pos = np.arange(S - num_queries, S)[:, None]  # [T, 1] absolute column of each query
    k_pos = np.arange(S)[None, :]  # [1, S]
    causal = k_pos <= q_pos  # [T, S]
    visible = causal[None] & (key_mask[:, None, :] | (k_pos == q_pos)[None])  # [B, T, S]
    return visible[:, None]  # [B, 1, T, S]: broadcast over heads


@dataclass
class StaticBatchCache:
    """K/V of a whole batch: [L, B, H, capacity, D] each. All rows share the column index (left padding)."""

    k: np.ndarray
    v: np.ndarray
    length: int = 0  # columns filled (pads included)


# The attention scores of a prefill are [B, H, T, S]: for 27 prompts padded to 256 tokens, 85 MB per array, and
# softmax makes several. Computed a few rows at a time, the scores stay under this size and the memory of one
# chunk is reused by the next; a decode step's [B, H, 1, S] scores fit in one chunk.
SCORES_BYTES = 8 << 20


def static_forward(model: GPT2Model, ids: np.ndarray, positions: np.ndarray, key_mask: np.ndarray,
                   cache: StaticBatchCache) -> np.ndarray:
    """Feed ids [B, T] at columns ``cache.length ..``; ``key_mask`` [B, cache.length + T]. -> last logits [B, V]."""
    cfg, params = model.config, model.params
    B, T = ids.shape
    H, D, eps = cfg.n_head, cfg.head_dim, cfg.layer_norm_epsilon
    start, end = cache.length, cache.length + T
    mask = left_padding_attention_mask(key_mask, T)  # [B, 1, T, S]
    rows = max(1, SCORES_BYTES // (H * T * end * cache.k.itemsize))  # batch rows per attention chunk
    x = (params["wte"][ids] + params["wpe"][positions]).reshape(B * T, cfg.n_embd)  # [B*T, E]: 2-D for BLAS
    scale = np.float32(1 / np.sqrt(D))
    for layer, p in enumerate(params["h"]):
        qkv = linear(layer_norm(x, **p["ln_1"], eps=eps), **p["attn"]["c_attn"])  # [B*T, 3E]
        q, k, v = qkv.reshape(B, T, 3, H, D).transpose(2, 0, 3, 1, 4)  # 3 x [B, H, T, D] (views, as split_qkv)
        cache.k[layer, :, :, start:end] = k
        cache.v[layer, :, :, start:end] = v
        K, V = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]  # [B, H, S, D]
        out = np.empty((B, H, T, D), dtype=x.dtype)  # [B, H, T, D]
        for r in range(0, B, rows):  # a few rows at a time: see SCORES_BYTES
            b = slice(r, r + rows)
            scores = np.where(mask[b], (q[b] @ K[b].transpose(0, 1, 3, 2)) * scale, np.float32(-np.inf))  # [b, H, T, S]
            np.matmul(softmax(scores), V[b], out=out[b])  # [b, H, T, D]
        out = out.transpose(0, 2, 1, 3).reshape(B * T, cfg.n_embd)  # [B*T, E]
        x += linear(out, **p["attn"]["c_proj"])  # [B*T, E] residual
        x += mlp(layer_norm(x, **p["ln_2"], eps=eps), p["mlp"])  # [B*T, E]
    cache.length = end
    last = x.reshape(B, T, cfg.n_embd)[:, -1]  # [B, E]
    return lm_head(params, last, eps)  # [B, V]


@dataclass
class StaticBatchOutput:
    output_token_ids: list  # [B] lists of new tokens
    finish_reasons: list  # [B] FinishReason
    step_times: list = field(default_factory=list)  # end time of each step (perf_counter)
    active_rows: list = field(default_factory=list)  # rows still generating, per step
    batch_size: int = 0
    padded_prompt_len: int = 0

    @property
    def slot_utilisation(self) -> float:
        """Useful row-steps / all row-steps: 1.0 only if every row runs for the whole batch."""
        return sum(self.active_rows) / (self.batch_size * max(1, len(self.active_rows)))


def static_kv_buffer(config, batch_size: int, columns: int) -> np.ndarray:
    """K and V for static batches of up to ``batch_size`` rows and ``columns`` columns, [2, L, B, H, C, D] float32,
    taken once. A server keeps its KV memory for its whole life, as the continuous engine's store does; each batch
    then works in a corner of it instead of asking the operating system for fresh memory at every batch."""
    shape = (2, config.n_layer, batch_size, config.n_head, columns, config.head_dim)
    return claimed_zeros(shape, np.float32, f"static batching's KV cache of {batch_size} rows x {columns} columns")


def static_generate(model: GPT2Model, prompts, max_new_tokens, sampling_params=None, stop_at_eos=True,
                    pad_id: int = 0, clock=time.perf_counter, kv_buffer: np.ndarray | None = None,
                    stop_token_ids=None) -> StaticBatchOutput:
    """Generate for a batch of prompts at once; each row's tokens equal running it alone with chapter 2.

    ``max_new_tokens``, ``sampling_params``, ``stop_at_eos`` and ``stop_token_ids`` (a token id that also ends
    the row, or None) are one value for all rows or one per row. ``kv_buffer`` (``static_kv_buffer``) is where
    the batch keeps its K/V; without one, the batch takes its own when it starts.
    """
    prompts, budgets, samplers, stops = _rows(model, prompts, max_new_tokens, sampling_params, stop_at_eos,
                                              stop_token_ids, pad_id)
    B, cfg = len(prompts), model.config
    ids, key_mask = left_pad(prompts, pad_id)  # [B, T]
    T, steps = ids.shape[1], max(budgets)
    out = StaticBatchOutput([[] for _ in range(B)], [FinishReason.LENGTH] * B, batch_size=B, padded_prompt_len=T)
    if steps == 0:
        return out
    cache = _batch_cache(cfg, kv_buffer, B, T, steps)
    logits = static_forward(model, ids, position_ids(key_mask), key_mask, cache)  # prefill: [B, V]
    done = [m == 0 for m in budgets]
    next_pos = key_mask.sum(axis=1)  # [B] each row's next real position
    for step in range(steps):
        tokens = np.full(B, pad_id, dtype=np.int64)
        active = 0
        for row in range(B):
            if done[row]:
                continue  # a finished row still occupies its slot: fed a pad, its logits thrown away
            active += 1
            token = samplers[row](logits[row])
            out.output_token_ids[row].append(token)
            tokens[row] = token
            if token in stops[row]:
                done[row], out.finish_reasons[row] = True, FinishReason.STOP
            elif len(out.output_token_ids[row]) == budgets[row]:
                done[row] = True
        out.step_times.append(clock())
        out.active_rows.append(active)
        if all(done):
            break
        key_mask = np.concatenate([key_mask, np.ones((B, 1), bool)], axis=1)  # [B, S+1]: the new column is real
        logits = static_forward(model, tokens[:, None], np.minimum(next_pos, cfg.n_positions - 1)[:, None],
                                key_mask, cache)
        next_pos = next_pos + 1
    return out


def _rows(model: GPT2Model, prompts, max_new_tokens, sampling_params, stop_at_eos, stop_token_ids, pad_id):
    """``static_generate``'s arguments checked and made one per row: (prompts, budgets, samplers, stop sets)."""
    if prompts is None or isinstance(prompts, (str, bytes)) or not hasattr(prompts, "__len__"):
        raise InvalidInputError(f"static_generate needs a list of prompts (token id lists), got {type(prompts).__name__}")
    B, V = len(prompts), model.config.vocab_size
    if B == 0:
        raise InvalidInputError("static_generate needs at least one prompt")
    budgets = list(max_new_tokens) if np.ndim(max_new_tokens) else [max_new_tokens] * B
    params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * B
    eos_rows = list(stop_at_eos) if np.ndim(stop_at_eos) else [stop_at_eos] * B
    stop_rows = list(stop_token_ids) if np.ndim(stop_token_ids) else [stop_token_ids] * B
    if not len(budgets) == len(params) == len(eos_rows) == len(stop_rows) == B:
        raise InvalidInputError(f"{B} prompts but {len(budgets)} max_new_tokens, {len(params)} sampling_params, "
                                f"{len(eos_rows)} stop_at_eos and {len(stop_rows)} stop_token_ids")
    prompts = [check_generation(model, p, m) for p, m in zip(prompts, budgets)]
    if any(not isinstance(e, (bool, np.bool_)) for e in eos_rows):
        raise InvalidInputError(f"stop_at_eos must be True or False (or one per row), got {stop_at_eos!r}")
    if any(s is not None and not is_integer(s, 0, V - 1) for s in stop_rows):
        raise InvalidInputError(f"stop_token_ids must be token ids in [0, {V}) or None (or one per row), got "
                                f"{stop_token_ids!r}")
    if not is_integer(pad_id, 0, V - 1):
        raise InvalidInputError(f"pad_id must be a token id in [0, {V}), got {pad_id!r}")
    samplers = [Sampler(sampling_params_of(p)) for p in params]
    eos = model.config.eos_token_id
    stops = [{t for t in (eos if e else None, s) if t is not None} for e, s in zip(eos_rows, stop_rows)]
    return prompts, budgets, samplers, stops


def _batch_cache(cfg, kv_buffer, B: int, T: int, steps: int) -> StaticBatchCache:
    """The batch's K/V: a corner of ``kv_buffer`` (checked), or memory of its own."""
    columns = T + steps  # columns, not positions: may exceed n_ctx
    if kv_buffer is None:
        shape = (2, cfg.n_layer, B, cfg.n_head, columns, cfg.head_dim)
        kv = claimed_zeros(shape, np.float32, f"a static batch's KV cache of {B} rows x {columns} columns")
    elif (kv_buffer.dtype != np.float32 or kv_buffer.shape[:2] != (2, cfg.n_layer)
          or kv_buffer.shape[3::2] != (cfg.n_head, cfg.head_dim)):  # [2, L, rows, H, columns, D]
        raise InvalidInputError(f"kv_buffer must be float32 [2, n_layer={cfg.n_layer}, rows, n_head={cfg.n_head}, "
                                f"columns, head_dim={cfg.head_dim}] (static_kv_buffer), got {kv_buffer.dtype} "
                                f"{list(kv_buffer.shape)}")
    elif kv_buffer.shape[2] < B or kv_buffer.shape[4] < columns:
        raise CacheCapacityError(f"a batch of {B} rows x {columns} columns (longest prompt {T} + {steps} new "
                                 f"tokens) does not fit kv_buffer of {kv_buffer.shape[2]} rows x "
                                 f"{kv_buffer.shape[4]} columns")
    else:
        kv = kv_buffer[:, :, :B, :, :columns]  # a view; columns are written before they are read
    return StaticBatchCache(kv[0], kv[1])


def _check_request(model: GPT2Model, r) -> str | None:
    """Why static batching cannot serve request ``r`` (the continuous engine's checks), or None."""
    try:
        check_generation(model, check_request(r, model).prompt_token_ids, r.max_new_tokens, r.stop_at_eos)
        if r.logits_processor is not None:  # a padded batch samples all rows at once: no per-request hook
            return "static batching runs no logits_processor (the continuous engine does)"
    except InvalidInputError as e:
        return str(e)
    except Exception as e:  # whatever is wrong with it, the request fails alone
        return f"invalid request ({type(e).__name__}: {e})"
    return None
