"""Chapter 2's benchmark, ``python -m gpt2_core bench kv-cache``, and the machine limits the others use.

All on random weights of GPT-2 124M's shape, float32, every method measured in the same run so that ratios are
fair on a noisy machine. Output: ``{"machine": {...}, "results": [{"method", "batch", "tokens_per_s", ...}]}``.
"""

from __future__ import annotations

import inspect
import os
import time
from typing import NamedTuple

import numpy as np

from ..ch02_kv_cache import kv_cache
from ..ch01_forward import model as model_module
from ..a1_cpu_kernels import accelerate, array_of
from ..errors import is_integer
from ..ch01_forward.generation import next_token_logits
from ..loading.weights import GPT2Model, random_model
from .common import GRADING, QUICK, blas_thread_count, interleaved, median_time
from . import progress


# ----------------------------------------------------------------------------------------------------------------
# Machine limits


COLD_COPIES = 3  # head-shaped matrices the bound reads in turn (``gemv_bandwidth``)


def bound_matrices(shape: tuple[int, int], copies: int) -> list[np.ndarray]:
    """``copies`` float32 matrices of ``shape``, each in its own buffer with every page written: ``np.zeros`` would
    leave the pages mapped to one shared page of zeros, which the CPU would read from its cache. A GEMV's time does
    not depend on the values."""
    return [np.full(shape, 0.01 * (i + 1), dtype=np.float32) for i in range(copies)]


def gemv_bandwidth(rows: int = 768, cols: int = 50257, repeats: int = 7, transposed: bool = False,
                   copies: int = COLD_COPIES) -> float:
    """Bytes/s a BLAS matrix-vector product streams from memory: the ceiling of batch-1 decoding, which reads every
    weight once per token. Measured on the LM head's shape (the largest GEMV in the model, 154 MB), the median of
    ``repeats`` products (one when grading) after one untimed round.

    Each product reads one of ``copies`` distinct matrices, taken in turn: with 3, a matrix is read again only after
    two others (308 MB) have pushed it out of the caches, as a decode step reads each weight after half a gigabyte
    of others. ``copies=1`` reads the same matrix every time; the part of it that the L3 cache (32 MB here) still
    holds from the last product then makes memory look faster than a decode step ever sees it (by up to 1.17x here,
    ``gemv_cache_effect``). The matrices take ``copies`` x 154 MB while the call runs.

    ``x @ W`` with W stored [in, out] row-major (the Conv1D layout) is the fast case; ``transposed=True`` measures
    ``x @ W.T`` with W stored [out, in], as the tied head ``x @ wte.T`` reads it.
    """
    _check_integers("gemv_bandwidth", ("rows", rows, 1, None), ("cols", cols, 1, None),
                    ("repeats", repeats, 1, None), ("copies", copies, 1, None))
    if GRADING:
        repeats = 1
    matrices = bound_matrices((cols, rows) if transposed else (rows, cols), copies)
    x = np.random.default_rng(0).standard_normal((1, rows), dtype=np.float32)
    seconds = []
    for i in range(copies + repeats):  # the first round, one product per matrix, untimed
        W = matrices[i % copies]
        t0 = time.perf_counter()
        x @ W.T if transposed else x @ W
        if i >= copies:
            seconds.append(time.perf_counter() - t0)
    return matrices[0].nbytes / float(np.median(seconds))


def gemv_cache_effect(rounds: int = 5, repeats: int = 3, rows: int = 768, cols: int = 50257) -> dict:
    """``gemv_bandwidth`` read cold (``COLD_COPIES`` matrices in turn, as the bound reads them) and warm (one matrix
    read again and again), side by side: ``rounds`` rounds of both, in alternating order. -> medians in bytes/s,
    and ``warm_over_cold``: how much the L3 cache flatters a bandwidth measured on a single matrix. ``rows``,
    ``cols``: the matrices' shape (the LM head's; tests pass a small one)."""
    _check_integers("gemv_cache_effect", ("rounds", rounds, 1, None), ("repeats", repeats, 1, None))
    rates = interleaved({"cold": lambda: gemv_bandwidth(rows, cols, repeats=repeats, copies=COLD_COPIES),
                         "warm": lambda: gemv_bandwidth(rows, cols, repeats=repeats, copies=1)},
                        rounds, measure=lambda run, r: run())
    cold, warm = (float(np.median(rates[name])) for name in ("cold", "warm"))
    return {"cold_bytes_per_s": cold, "warm_bytes_per_s": warm, "warm_over_cold": warm / cold,
            "per_round": rates}


def weight_bytes_per_token(model: GPT2Model) -> int:
    """Bytes of weights one decode step must read: all of them, except the position table (one row is read)."""
    return model.nbytes() - model.params["wpe"].nbytes


# ----------------------------------------------------------------------------------------------------------------
# Chapter 2: naive vs KV cache


def decode_step_times(model: GPT2Model, prompt_len: int, new_tokens: int, between=None) -> list[float]:
    """Seconds of each ``decode_step`` while generating ``new_tokens`` after a random prompt (greedy).

    ``between=(every, fn)`` calls ``fn()`` (untimed) after every ``every`` steps: another measurement taken at the
    same moment as the steps around it."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, model.config.vocab_size, size=prompt_len)
    logits, cache = kv_cache.prefill(model, prompt, capacity=prompt_len + new_tokens, last_only=True)
    token, times = int(np.argmax(logits[0])), []
    for step in range(new_tokens):
        t0 = time.perf_counter()
        logits = kv_cache.decode_step(model, token, cache)
        times.append(time.perf_counter() - t0)
        token = int(np.argmax(logits))
        if between is not None and (step + 1) % between[0] == 0:
            between[1]()
    return times


def step_matrices(model: GPT2Model) -> list:
    """Every weight one step multiplies, in order, as the model holds it (a ``FastWeight`` multiplies with the
    appendix's kernels): each block's ``c_attn`` [E, 3E], ``attn.c_proj`` [E, E], ``c_fc`` [E, 4E], ``mlp.c_proj``
    [4E, E], then the head [E, V] (``wte.T``, the accelerated model's own contiguous copy). A matrix's input is
    [rows, its first dimension]."""
    names = (("attn", "c_attn"), ("attn", "c_proj"), ("mlp", "c_fc"), ("mlp", "c_proj"))
    return [b[module][name]["weight"] for b in model.params["h"] for module, name in names] + [model.params["wte"].T]


def step_weights(model: GPT2Model) -> list[np.ndarray]:
    """``step_matrices`` as arrays, in the memory layout the step reads."""
    return [array_of(w) for w in step_matrices(model)]


def decode_gemvs(model: GPT2Model) -> list[tuple[np.ndarray, np.ndarray]]:
    """One decode step's matrix-vector products as (input row, weight) pairs (``step_weights``; inputs are random:
    timing does not depend on the values)."""
    rng = np.random.default_rng(3)
    rows = {n: rng.standard_normal((1, n), dtype=np.float32) for n in {w.shape[0] for w in step_weights(model)}}
    return [(rows[w.shape[0]], w) for w in step_weights(model)]


def gemv_chain_seconds(model: GPT2Model, repeats: int = 3) -> float:
    """Seconds of one decode step's matrix-vector products (``decode_gemvs``) back to back, and nothing else.

    The bandwidth bound streams one 154 MB matrix in a single call. A step makes 49 calls on matrices of 2-9 MB,
    and each call starts afresh (most likely, BLAS's hand-off of half the call to its second thread and the memory
    streams ramping up again cost a little every time): the chain shows what the calls cost before anything else a
    step does (attention, layer norms, GELU, Python)."""
    gemvs = decode_gemvs(model)

    def chain():
        for v, w in gemvs:
            v @ w
    return median_time(chain, repeats=repeats)


STEP_MATRIX_KINDS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # each block's, in step_weights order


def gemv_chain_by_kind(model: GPT2Model, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of each kind of matrix inside the GEMV chain: every call of ``decode_gemvs`` timed on its own, in
    the step's order (so each matrix is read cold, as in a real step), the median of ``repeats`` chains per call,
    summed per kind (the 12 blocks' ``attn.c_attn``, ..., and the ``lm_head``). Beside it, ``bound``: the one
    head-shaped GEMV of ``gemv_bandwidth``, measured just before. Shows which shapes hold the chain back."""
    if not is_integer(repeats, 1):
        raise ValueError(f"gemv_chain_by_kind: repeats must be an integer >= 1, got {repeats!r}")
    gemvs = decode_gemvs(model)
    kinds = [STEP_MATRIX_KINDS[i % 4] for i in range(len(gemvs) - 1)] + ["lm_head"]
    bound = gemv_bandwidth(repeats=3)
    calls = np.empty((repeats, len(gemvs)))
    for r in range(repeats + 1):  # the first chain warms up, untimed
        for i, (v, w) in enumerate(gemvs):
            t0 = time.perf_counter()
            v @ w
            if r:
                calls[r - 1, i] = time.perf_counter() - t0
    seconds = np.median(calls, axis=0)  # [calls]
    out = {"bound": bound}
    for kind in dict.fromkeys(kinds):
        mine = [i for i, k in enumerate(kinds) if k == kind]
        out[kind] = sum(gemvs[i][1].nbytes for i in mine) / float(seconds[mine].sum())
    out["chain"] = sum(w.nbytes for _, w in gemvs) / float(seconds.sum())
    return out


class DecodeBeside(NamedTuple):
    """One moment's batch-1 decode speed and the two ceilings it is compared with, in tokens/s."""

    decode: float  # median decode step of the pair
    bound: float  # GEMV bytes/s (LM-head-shaped products, read cold: ``gemv_bandwidth``) / weight bytes per token
    chain: float  # the step's own GEMVs alone (``gemv_chain_seconds``)


def decode_beside_bandwidth(model: GPT2Model, pairs: int = 15, steps: int = 24,
                            prompt_len: int = 16) -> list[DecodeBeside]:
    """Batch-1 decode and the bandwidth bound, measured side by side: ``pairs`` times, ``steps`` decode steps (one
    generation running on, positions ``prompt_len ..``) then the GEMV bandwidth and the GEMV chain. Two shared
    cores drift in speed by tens of percent within a minute; a pair shares one moment, so its ratio is fair.
    -> one ``DecodeBeside`` per pair."""
    ceilings: list[tuple[float, float]] = []
    weight_bytes = weight_bytes_per_token(model)

    def measure():
        ceilings.append((gemv_bandwidth(repeats=3) / weight_bytes, 1 / gemv_chain_seconds(model)))
    times = decode_step_times(model, prompt_len, pairs * steps, between=(steps, measure))
    return [DecodeBeside(1 / float(np.median(times[i * steps:(i + 1) * steps])), bound, chain)
            for i, (bound, chain) in enumerate(ceilings)]


def hf_reference_model(model: GPT2Model, threads: int):
    """``(torch, an HF GPT2LMHeadModel of model's shape, random weights, eval mode)``, or None without the
    ``reference`` extra. Torch gets the same thread count as our BLAS."""
    try:
        import torch
        from transformers import GPT2Config as HFConfig, GPT2LMHeadModel
    except ImportError:
        return None
    torch.set_num_threads(threads)
    c = model.config
    hf = GPT2LMHeadModel(HFConfig(vocab_size=c.vocab_size, n_positions=c.n_positions, n_embd=c.n_embd,
                                  n_head=c.n_head, n_layer=c.n_layer)).eval()
    return torch, hf


def hf_decode_step_times(model: GPT2Model, prompt_len: int, new_tokens: int, threads: int) -> list[float] | None:
    """The same loop with HuggingFace transformers (torch, CPU, its own KV cache), or None if not installed."""
    reference = hf_reference_model(model, threads)
    if reference is None:
        return None
    torch, hf = reference
    c = model.config
    ids = torch.randint(0, c.vocab_size, (1, prompt_len))
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"  # renamed in 5.x
    times = []
    with torch.inference_mode():
        out = hf(ids, use_cache=True)
        past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
        for _ in range(new_tokens):
            t0 = time.perf_counter()
            out = hf(token, use_cache=True, **{name: past})
            times.append(time.perf_counter() - t0)
            past, token = getattr(out, name), out.logits[:, -1:].argmax(-1)
    return times


def profile_decode_step(model: GPT2Model, position: int, repeats: int = 5) -> dict[str, float]:
    """Median milliseconds of each part of one decode step at ``position``: where the time goes."""
    from ..ch01_forward.model import attention, gelu, layer_norm

    c, p = model.config, model.params
    rng = np.random.default_rng(2)
    x = rng.standard_normal((1, c.n_embd), dtype=np.float32)
    h = rng.standard_normal((1, 4 * c.n_embd), dtype=np.float32)
    q = rng.standard_normal((c.n_head, 1, c.head_dim), dtype=np.float32)
    k = rng.standard_normal((c.n_layer, c.n_head, position, c.head_dim), dtype=np.float32)
    blocks = p["h"]

    def every_layer(fn):  # each layer's own weights, as a real step reads them (not one cache-hot matrix)
        return lambda: [fn(i, b) for i, b in enumerate(blocks)]

    parts = {
        "c_attn (E x 3E)": every_layer(lambda i, b: x @ b["attn"]["c_attn"]["weight"]),
        "attn c_proj (E x E)": every_layer(lambda i, b: x @ b["attn"]["c_proj"]["weight"]),
        "mlp c_fc (E x 4E)": every_layer(lambda i, b: x @ b["mlp"]["c_fc"]["weight"]),
        "mlp c_proj (4E x E)": every_layer(lambda i, b: h @ b["mlp"]["c_proj"]["weight"]),
        "attention over the cache": every_layer(lambda i, b: attention(q, k[i], k[i])),
        "layer norms + GELU": every_layer(lambda i, b: (layer_norm(x, **b["ln_1"], eps=1e-5),
                                                        layer_norm(x, **b["ln_2"], eps=1e-5), gelu(h))),
    }
    ms = {name: 1e3 * median_time(fn, repeats=repeats) for name, fn in parts.items()}
    head = model.params["wte"].T  # [E, V], as decode_step reads it
    ms["lm head (E x V)"] = 1e3 * median_time(lambda: x @ head, repeats=repeats)
    return ms


def _check_integers(where: str, *checks) -> None:
    """``ValueError`` naming ``where`` and the argument, unless each ``(name, value, least, most)`` holds an integer
    in ``least .. most`` (``most`` None: no upper limit)."""
    for name, value, low, high in checks:
        if not is_integer(value, low, high):
            raise ValueError(f"{where}: {name} must be an integer from {low}"
                             f"{f' to {high}' if high is not None else ''}, got {value!r}")


def profile_decode_in_step(model: GPT2Model, position: int, steps: int = 24) -> dict[str, float]:
    """``profile_decode_step``'s parts, timed inside real ``kv_cache.decode_step`` calls at ``position``: median
    milliseconds per step of each part, plus ``everything else`` (Python, residual adds, ``split_qkv``, writing the
    cache, the embedding, the checks), the step's time less its timed parts and less the timers' own cost.

    Inside a step every part runs right after megabytes of weights have streamed through the caches, so the small
    operations find their data and code evicted; alone, as ``profile_decode_step`` times them, they run warm. For
    the step's length chapter 1's functions are wrapped with a timer where ``kv_cache`` and ``model`` look them up,
    and put back after; each part's time excludes the timed parts it calls. Two differences from the parts timed
    alone: a GEMV's part includes its bias add, and the head's part includes its layer norm. The cost
    of a timer outside its own window (about a microsecond, measured on a no-op before the steps) is taken off
    ``everything else``, once per timed call."""
    c = model.config
    _check_integers("profile_decode_in_step", ("position", position, 1, c.n_positions - 1), ("steps", steps, 1, None))
    gemv_names = {(c.n_embd, 3 * c.n_embd): "c_attn (E x 3E)", (c.n_embd, c.n_embd): "attn c_proj (E x E)",
                  (c.n_embd, 4 * c.n_embd): "mlp c_fc (E x 4E)", (4 * c.n_embd, c.n_embd): "mlp c_proj (4E x E)"}
    names = [*gemv_names.values(), "attention over the cache", "layer norms + GELU", "lm head (E x V)"]
    spent: dict[str, float] = {}
    children = [0.0]  # time of the timed parts running inside the current one
    calls = [0]

    def timed(fn, name_of):
        def wrapper(*args, **kwargs):
            name = name_of(*args, **kwargs)
            calls[0] += 1
            outer, children[0] = children[0], 0.0
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - t0
                spent[name] = spent.get(name, 0.0) + elapsed - children[0]
                children[0] = outer + elapsed
        return wrapper

    def timer_cost(n: int = 2000) -> float:  # seconds a timed call costs outside its own window
        probe = timed(lambda: None, lambda: "probe")
        t0 = time.perf_counter()
        for _ in range(n):
            pass
        loop = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(n):
            probe()
        wrapped = time.perf_counter() - t0
        return max(0.0, (wrapped - loop - spent.pop("probe")) / n)

    patches = [(kv_cache, "linear", lambda x, weight, bias: gemv_names[weight.shape]),
               (model_module, "linear", lambda x, weight, bias: gemv_names[weight.shape]),
               (kv_cache, "attention", lambda *a: "attention over the cache"),
               (kv_cache, "layer_norm", lambda *a, **k: "layer norms + GELU"),
               (model_module, "gelu", lambda *a: "layer norms + GELU"),
               (kv_cache, "lm_head", lambda *a: "lm head (E x V)")]
    rng = np.random.default_rng(4)
    _, cache = kv_cache.prefill(model, rng.integers(0, c.vocab_size, size=position), capacity=position + 1,
                                last_only=True)
    overhead = timer_cost()
    originals = [(module, attr, getattr(module, attr)) for module, attr, _ in patches]
    per_step = []
    try:
        for module, attr, name_of in patches:
            setattr(module, attr, timed(getattr(module, attr), name_of))
        for step in range(steps + 1):  # the first step warms up
            spent.clear()
            calls[0] = 0
            cache.length = position  # the same position every step
            t0 = time.perf_counter()
            kv_cache.decode_step(model, int(rng.integers(c.vocab_size)), cache)
            total = time.perf_counter() - t0
            if step:
                per_step.append({**{n: spent.get(n, 0.0) for n in names},
                                 "everything else": total - sum(spent.values()) - calls[0] * overhead})
    finally:
        for module, attr, fn in originals:
            setattr(module, attr, fn)
    return {name: 1e3 * float(np.median([s[name] for s in per_step])) for name in per_step[0]}


def bench_kv_cache(quick: bool = QUICK, threads: int | None = None) -> dict:
    hf_units = progress.if_installed(35, "torch", "transformers")
    progress.plan(65 + hf_units, "building the model")  # units: rough shares of a full run
    model = accelerate(random_model("gpt2", seed=0))  # the appendix's kernels under chapter 2's code
    threads = threads or blas_thread_count(os.cpu_count() or 1)
    prompt_len = 16
    positions = [16, 32, 64, 128] if quick else [16, 64, 128, 256, 384, 512]
    new_tokens = positions[-1] - prompt_len
    repeats = 3 if quick else 5
    results = []
    rng = np.random.default_rng(0)
    # naive: one step at position n is a full forward over n tokens
    progress.advance(2, "naive forward at each position")
    naive = {}
    for n in positions:
        seq = rng.integers(0, model.config.vocab_size, size=n)
        naive[n] = median_time(lambda: next_token_logits(model, seq), repeats=repeats)
    progress.advance(8, "KV-cache decode steps")
    # KV cache: decode steps over the same range of positions, repeated
    runs = [decode_step_times(model, prompt_len, new_tokens) for _ in range(repeats)]
    step = np.median(np.array(runs), axis=0)  # [new_tokens] median over runs, step i is at position 16 + i
    cached = {n: float(np.median(step[max(0, n - prompt_len - 4): n - prompt_len + 4])) for n in positions}
    naive_total = sum(np.interp(np.arange(prompt_len, positions[-1]), positions, [naive[n] for n in positions]))
    for n in positions:
        results.append({"method": "naive", "batch": 1, "position": n, "seconds_per_token": naive[n],
                        "tokens_per_s": 1 / naive[n]})
        results.append({"method": "kv_cache", "batch": 1, "position": n, "seconds_per_token": cached[n],
                        "tokens_per_s": 1 / cached[n]})
    decode_tps = 1 / float(np.median(step))
    results.append({"method": "kv_cache", "batch": 1, "position": "all", "prompt_len": prompt_len,
                    "new_tokens": new_tokens, "tokens_per_s": decode_tps})
    results.append({"method": "naive", "batch": 1, "position": "all", "prompt_len": prompt_len,
                    "new_tokens": new_tokens, "tokens_per_s": new_tokens / naive_total,
                    "note": "from the per-position medians above, interpolated"})
    progress.advance(25, "HF transformers decode steps" if hf_units else None)
    hf = [hf_decode_step_times(model, prompt_len, new_tokens, threads) for _ in range(repeats)]
    hf_tps = None if hf[0] is None else 1 / float(np.median(np.array(hf)))
    if hf_tps is not None:
        results.append({"method": "hf_transformers", "batch": 1, "position": "all", "prompt_len": prompt_len,
                        "new_tokens": new_tokens, "tokens_per_s": hf_tps, "threads": threads})
    progress.advance(hf_units, "decode beside the bandwidth bound, in pairs")
    pairs = decode_beside_bandwidth(model, pairs=5 if quick else 15)  # decode and ceilings, side by side
    bound_tps = float(np.median([p.bound for p in pairs]))
    results.append({"method": "bandwidth_bound", "batch": 1, "tokens_per_s": bound_tps,
                    "gemv_bytes_per_s": bound_tps * weight_bytes_per_token(model),
                    "weight_bytes_per_token": weight_bytes_per_token(model),
                    "pairs": [{"kv_cache_tokens_per_s": p.decode, "bound_tokens_per_s": p.bound,
                               "gemv_chain_tokens_per_s": p.chain} for p in pairs]})
    results.append({"method": "gemv_chain", "batch": 1, "tokens_per_s": float(np.median([p.chain for p in pairs])),
                    "note": "one decode step's 49 GEMVs back to back, nothing else; measured in the pairs above"})
    progress.advance(15, "prefill, then where a decode step's time goes")
    prefill_len = 128 if quick else 512
    prompt = rng.integers(0, model.config.vocab_size, size=prefill_len)
    t_prefill = median_time(lambda: kv_cache.prefill(model, prompt, last_only=True), repeats=repeats)
    results.append({"method": "kv_cache", "phase": "prefill", "batch": 1, "prompt_len": prefill_len,
                    "tokens_per_s": prefill_len / t_prefill, "seconds": t_prefill})
    profile = profile_decode_step(model, positions[-1] // 2)
    profile_in_step = profile_decode_in_step(model, positions[-1] // 2)
    progress.advance(8, "GEMV bandwidth by matrix kind")
    by_kind = [gemv_chain_by_kind(model) for _ in range(3 if quick else 9)]  # bytes/s per round
    progress.advance(5, "the bound's GEMV read cold and warm")
    cache_effect = gemv_cache_effect(rounds=3 if quick else 7)  # the bound's GEMV read cold vs warm
    ratios = {
        "kv_cache_over_naive_at_last_position": naive[positions[-1]] / cached[positions[-1]],
        "kv_cache_over_hf": None if hf_tps is None else decode_tps / hf_tps,
        "kv_cache_fraction_of_bandwidth_bound": float(np.median([p.decode / p.bound for p in pairs])),  # median pair
        "gemv_chain_fraction_of_bandwidth_bound": float(np.median([p.chain / p.bound for p in pairs])),
        "kv_cache_fraction_of_gemv_chain": float(np.median([p.decode / p.chain for p in pairs])),
    }
    return {"benchmark": "kv-cache", "model": "random GPT-2 124M shape, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate", "results": results, "ratios": ratios, "profile_ms_per_step": profile,
            "profile_in_step_ms_per_step": profile_in_step,
            "gemv_bytes_per_s_by_kind": by_kind, "gemv_cache_effect": cache_effect}
