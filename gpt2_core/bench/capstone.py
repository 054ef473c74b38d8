"""The capstone's benchmark: ``python -m gpt2_core bench capstone [--trace PATH] [--json PATH] [--quick]``.

Every engine of the series on one workload, in one run, each beside its own physical limit:

* ``naive`` (chapter 1: every generated token recomputes the whole sequence), on a subset of the requests (every
  ``NAIVE_STRIDE``-th: its cost grows with the square of the length), scaled to the whole workload by positions
  processed: the workload's naive time = its naive positions / the positions per second measured on the subset;
* ``kv_cache`` (chapter 2, one request at a time); ``static`` (chapter 3's first try: batches of ``MAX_BATCH``,
  left-padded, each run to its longest row); ``continuous`` (chapter 3's ``LLMEngine``); ``paged`` (the same
  engine over chapter 4's paged store); ``prefix_cached`` (chapter 5's ``CachingLLMEngine``: paged attention,
  prefix caching, chunked prefill);
* ``int8_kv`` (chapter 6 inside chapter 5: ``prefix_cached`` with int8 K/V blocks, a scale per token and head, and
  fp32 weights): the same engine in 3.8x fewer KV bytes, its decoding queries reading int8 K/V;
* ``int8`` (chapter 6: int8 weights, the tied head too, chapter 3's engine over chapter 4's store) with NumPy's
  path (dequantize, then BLAS) and ``int8_numba`` with the kernel that reads the bytes (in its own process: numba's
  threads slow OpenBLAS in the process they live in; skipped with a note without numba);
* ``hf_transformers`` (batched ``generate``, batched like ``static``; random weights of its own) when torch is
  installed; ``llamacpp`` is listed as skipped unless ``llama_cpp`` is importable (no GGUF writer here yet).

Throughput is measured offline (every request submitted at t=0, as vLLM's throughput benchmark does); time to
first token and inter-token latency with the workload's arrivals (as its serving benchmark does). The two
one-at-a-time servers (naive, kv_cache) serve each request in the same time whenever it arrives, so their
latencies come from the offline run placed on the arrivals (first come, first served): no second run.

Each row's limit, measured in the same run (``limits``): the FLOPs of the forward passes that engine performs
(``forward_flops``: naive recomputes, static computes its padding, the others compute each position once) at the
GEMM rate, and the bytes it reads (its weights once per model step, the K/V each decoding query reads) at the
memory bandwidth: ``bound_tokens_per_s`` = output tokens / max(FLOP time, byte time), ``bound_kind`` the larger.
``compute_bound``: the workload's FLOPs for an engine that computes each position once, at the GEMM rate.

Timings use random weights of GPT-2 124M's shape (the time of a matmul does not depend on the numbers in it);
``--quick``: 2 of its 12 layers, 8 short requests, a short sweep.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import time
from dataclasses import replace

import numpy as np

from ..ch01_forward import generation
from ..ch02_kv_cache import kv_cache
from ..ch06_quantization import quant_kernels
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..loading.config import GPT2Config, preset
from ..a1_cpu_kernels import accelerate
from ..ch03_batching.engine import LLMEngine, RequestOutput
from ..ch02_kv_cache.kv_cache import kv_cache_bytes
from ..ch04_paged.paged_kv_store import FP32, PagedKVStore
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch06_quantization.quant_kv_store import Int8Codec
from ..ch06_quantization.quantization import MATRICES, QuantizedEmbedding, bytes_per_token, quantize_model
from ..ch11_capstone.roofline import (count_work, forward_flops, request_passes, roofline, static_passes,
                                     workload_passes)
from ..ch03_batching.sequence import FinishReason, Request, SequenceMetrics
from ..loading.weights import GPT2Model, random_model
from . import workload as wl
from . import progress
from .batching import gemm_bound_tokens_per_s, replay_hf, warm_up
from .common import GRADING, QUICK, blas_info, blas_threads, median_time
from .kv_cache import gemv_bandwidth
from .paged import fresh
from .replay import replay, replay_static

MAX_BATCH = 32  # max_num_seqs of the batched engines, the batch of static and HF
MAX_NUM_BATCHED_TOKENS = 2048
BLOCK_SIZE = 16
NAIVE_STRIDE = 8  # naive runs every 8th request (quick: every 4th)
QUANT_FORMAT = "int8"  # chapter 6's best form: 3.9x fewer bytes, perplexity +0.2%, the kernel ~1.8x at batch 1
GEMM_ROWS = 256  # the GEMM rate: a step's matmuls at this many rows (a prefill's), each timed alone
ENGINES = ("naive", "kv_cache", "static", "continuous", "paged", "prefix_cached")
ESSAY = [("naive", 10), ("kv_cache", 100), ("serving engine", 1000)]  # the essay's table, tok/s


# ----------------------------------------------------------------------------------------------------------------
# Serving: one engine, one workload


def at_zero(requests: list[Request]) -> list[Request]:
    """Copies of ``requests``, every one arriving at t=0 (offline)."""
    return [replace(r, arrival_s=0.0) for r in fresh(requests)]


def kv_bytes_per_position(config: GPT2Config) -> int:
    return kv_cache_bytes(config, 1)


def serve_one_by_one(model: GPT2Model, requests: list[Request], stream) -> tuple[list[RequestOutput], float]:
    """Serve ``requests`` one at a time with ``stream`` (chapter 1's or 2's ``generate_stream``), offline, in
    order; each output's metrics count from its own start. -> (outputs, seconds)."""
    outputs, t0 = [], time.perf_counter()
    for r in requests:
        start = time.perf_counter()
        times, tokens = [], []
        for token in stream(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos):
            tokens.append(token)
            times.append(time.perf_counter())
        m = SequenceMetrics(arrival_time=start, first_scheduled_time=start, token_times=times,
                            finished_time=times[-1] if times else start)
        outputs.append(RequestOutput(r.request_id, list(r.prompt_token_ids), tokens, FinishReason.LENGTH, None, m))
    return outputs, time.perf_counter() - t0


def queue_latencies(service: list[tuple[float, list[float]]], arrivals: list[float]) -> dict:
    """A one-at-a-time server, first come first served: request i starts at max(its arrival, the end of i-1) and
    takes the same time as when it was served alone. ``service``: per request (its seconds, its tokens' offsets
    from its start). -> p50 time to first token and p50/p99 inter-token latency, in seconds."""
    order = np.argsort(arrivals, kind="stable")
    free, ttft, gaps = 0.0, [], []
    for i in order:
        seconds, offsets = service[i]
        start = max(arrivals[i], free)
        free = start + seconds
        if offsets:
            ttft.append(start + offsets[0] - arrivals[i])
            gaps += list(np.diff(offsets))
    return latency_fields(ttft, gaps)


def latency_fields(ttft, gaps) -> dict:
    def pct(v, q):
        return float(np.percentile(v, q)) if len(v) else None
    return {"ttft_p50_s": pct(ttft, 50), "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99)}


def latencies_of(outputs: list[RequestOutput]) -> dict:
    ok = [o for o in outputs if o.finish_reason is not FinishReason.ERROR]
    return latency_fields([o.metrics.time_to_first_token for o in ok if o.metrics.time_to_first_token is not None],
                          [g for o in ok for g in o.metrics.inter_token_latencies])


def make_engine(model: GPT2Model, method: str, requests: list[Request], max_num_seqs: int = MAX_BATCH):
    """The engine of ``method`` with KV room for ``max_num_seqs`` of the longest request (nothing preempted)."""
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    blocks = max_num_seqs * -(-longest // BLOCK_SIZE)
    if method == "continuous":
        return LLMEngine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                         max_len=min(longest, model.config.n_positions))
    if method in ("prefix_cached", "int8_kv"):
        codec = Int8Codec() if method == "int8_kv" else FP32
        return CachingLLMEngine(model, PrefixCachingKVStore(model.config, blocks, BLOCK_SIZE, codec),
                                max_num_seqs=max_num_seqs, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    return LLMEngine(model, store=PagedKVStore(model.config, blocks, BLOCK_SIZE), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)  # paged, and the quantized rows


def serve_engine(model: GPT2Model, method: str, requests: list[Request], arrivals: bool,
                 max_num_seqs: int = MAX_BATCH) -> dict:
    """Serve ``requests`` with ``method``'s engine (``continuous``, ``paged``, ``prefix_cached``, ``int8_kv`` or a
    quantized model's paged engine): offline (``arrivals=False``) or with their arrival times on the wall clock.
    -> {outputs, seconds, model_steps, kv_bytes_peak, kv_bytes_allocated, num_preemptions}."""
    engine = make_engine(model, method, requests, max_num_seqs)
    t0 = time.perf_counter()
    outputs = replay(engine, fresh(requests)) if arrivals else engine.generate_many(at_zero(requests))
    seconds = time.perf_counter() - t0
    per_position = engine.store.bytes_per_token  # K/V of one position as the store keeps them
    return {"outputs": outputs, "seconds": seconds, "model_steps": engine.num_steps,
            "kv_bytes_peak": per_position * max(s.kv_reserved_tokens for s in engine.step_stats),
            "kv_bytes_allocated": int(engine.store.nbytes), "num_preemptions": engine.scheduler.num_preemptions}


def serve_static(model: GPT2Model, requests: list[Request], arrivals: bool, batch: int = MAX_BATCH) -> dict:
    """Static batches (chapter 3's first try) offline or on the arrivals; the KV buffer of the largest batch."""
    t0 = time.perf_counter()
    outputs, batches = replay_static(model, fresh(requests), batch_size=batch,
                                     clock="wall" if arrivals else "offline")
    seconds = time.perf_counter() - t0
    columns = max(len(r.prompt_token_ids) for r in requests) + max(r.max_new_tokens for r in requests)
    kv = kv_bytes_per_position(model.config) * min(batch, len(requests)) * columns
    return {"outputs": outputs, "seconds": seconds, "model_steps": sum(len(b["step_times"]) for b in batches),
            "kv_bytes_peak": kv, "kv_bytes_allocated": kv, "num_preemptions": 0}


# ----------------------------------------------------------------------------------------------------------------
# The limits of the machine, measured in the run


def measure_limits(model: GPT2Model, rows: int = GEMM_ROWS) -> dict:
    """One reading of the machine's two limits: the GEMM rate (a model step's matmuls at ``rows`` rows, each timed
    alone, as chapter 3's ``gemm_bound_tokens_per_s`` times them) and the bandwidth a GEMV streams (chapter 2's
    ``gemv_bandwidth``, on the LM head's shape)."""
    gemm = gemm_bound_tokens_per_s(model, rows, repeats=3)
    return {"gemm_flops_per_s": gemm["gemm_flops_per_s"], "bytes_per_s": gemv_bandwidth(repeats=5)}


def median_limits(readings: list[dict]) -> dict:
    return {k: float(np.median([r[k] for r in readings])) for k in readings[0]}


# ----------------------------------------------------------------------------------------------------------------
# The rows. Each is measured first and given its bound at the end, once the limits of the whole run are known.


def record(method: str, model: GPT2Model, offline: dict, latency: dict, passes, weights: GPT2Model | None = None,
           kv_bytes_per_position: int | None = None, **extra) -> dict:
    """One benchmark row: offline throughput, latencies on the arrivals, the work counted (``weights``: the model
    whose bytes a step reads, if not ``model`` itself; ``kv_bytes_per_position``: what a decoding query reads per
    key, if not float32 K/V)."""
    tokens = sum(len(o.output_token_ids) for o in offline["outputs"] if o.finish_reason is not FinishReason.ERROR)
    weights = model if weights is None else weights
    work = count_work(model.config, passes, offline["model_steps"], bytes_per_token(weights), kv_bytes_per_position)
    return {"method": method, "batch": extra.pop("batch", 1), "tokens_per_s": tokens / offline["seconds"],
            **latency, "kv_bytes_peak": int(offline["kv_bytes_peak"]), "weight_bytes": int(weights.nbytes()),
            "output_tokens": tokens, "seconds": offline["seconds"], **work,
            "num_preemptions": offline.get("num_preemptions", 0), **extra}


def with_bound(row: dict, limits: dict) -> dict:
    """``row`` with its roofline at the run's ``limits`` and the fraction of it reached."""
    bound = roofline(row["flops"], row["bytes_read"], row["output_tokens"], limits["gemm_flops_per_s"],
                     limits["bytes_per_s"])
    return {**row, **bound, "fraction_of_bound": row["tokens_per_s"] / bound["bound_tokens_per_s"]}


def lengths_of(requests) -> list[tuple[int, int]]:
    return [(len(r.prompt_token_ids), r.max_new_tokens) for r in requests]


def naive_subset(requests: list, stride: int) -> list:
    """Every ``stride``-th request, from the first: the subset chapter 1's loop runs."""
    return requests[::stride]


def naive_row(model: GPT2Model, requests, stride: int, weights: GPT2Model | None = None) -> tuple[dict, list]:
    """Chapter 1 on a subset, scaled to the whole workload by positions processed (see the module's docstring)."""
    subset = naive_subset(requests, stride)
    outputs, seconds = serve_one_by_one(model, at_zero(subset), generation.generate_stream)
    lengths = lengths_of(requests)
    positions = sum(q for q, _, _ in workload_passes("naive", lengths))
    sub_positions = sum(q for q, _, _ in workload_passes("naive", naive_subset(lengths, stride)))
    rate = sub_positions / seconds  # positions per second, measured on the subset
    scaled = {"outputs": [RequestOutput(r.request_id, [], [0] * r.max_new_tokens, FinishReason.LENGTH, None,
                                        SequenceMetrics(0.0)) for r in requests],
              "seconds": positions / rate, "model_steps": sum(N for _, N in lengths), "kv_bytes_peak": 0}
    service = [(sum(q for q, _, _ in request_passes("naive", P, N)) / rate, []) for P, N in lengths]
    measured = {o.request_id: o for o in outputs}
    for i, r in enumerate(requests):  # the subset's measured token times; the others' by positions at the rate
        if r.request_id in measured:
            m = measured[r.request_id].metrics
            service[i] = (m.finished_time - m.arrival_time, [t - m.arrival_time for t in m.token_times])
    latency = queue_latencies(service, [r.arrival_s for r in requests])
    row = record("naive", model, scaled, latency, workload_passes("naive", lengths), weights,
                 subset={"requests": len(subset), "of": len(requests), "stride": stride,
                         "positions": sub_positions, "of_positions": positions, "seconds": seconds,
                         "positions_per_s": rate,
                         "rule": "chapter 1's generate on every stride-th request; the workload's time = its naive "
                                 "positions / the positions per second measured on the subset"},
                 latency_basis="the subset's measured token times and the others' times by positions, placed on "
                               "the arrivals, first come first served; kv_bytes_peak 0: no cache, K/V recomputed")
    return row, outputs


def kv_cache_row(model: GPT2Model, requests, weights: GPT2Model | None = None) -> tuple[dict, list]:
    """Chapter 2, one request at a time, offline; its latencies by placing each service time on the arrivals."""
    outputs, seconds = serve_one_by_one(model, at_zero(requests), kv_cache.generate_stream)
    service = [(o.metrics.finished_time - o.metrics.arrival_time,
                [t - o.metrics.arrival_time for t in o.metrics.token_times]) for o in outputs]
    lengths = lengths_of(requests)
    kv = max(kv_cache_bytes(model.config, generation.positions_needed(P, N)) for P, N in lengths)
    offline = {"outputs": outputs, "seconds": seconds, "model_steps": sum(N for _, N in lengths), "kv_bytes_peak": kv}
    latency = queue_latencies(service, [r.arrival_s for r in requests])
    return record("kv_cache", model, offline, latency, workload_passes("kv_cache", lengths), weights,
                  latency_basis="offline service times placed on the arrivals, first come first served"), outputs


def batched_row(model: GPT2Model, method: str, requests, engine: str | None = None,
                weights: GPT2Model | None = None, **extra) -> tuple[dict, list]:
    """``static`` or an engine (``engine``: which one runs ``method``): offline, then on the arrivals."""
    def serve(arrivals):
        if method == "static":
            return serve_static(model, requests, arrivals)
        return serve_engine(model, engine or method, requests, arrivals)
    offline = serve(False)
    online = serve(True)
    row = record(method, model, offline, latencies_of(online["outputs"]), workload_passes(method, lengths_of(requests)),
                 weights, batch=MAX_BATCH, kv_bytes_allocated=int(offline["kv_bytes_allocated"]), **extra)
    return row, offline["outputs"]


def int8_kv_row(model: GPT2Model, requests, weights: GPT2Model | None = None) -> tuple[dict, list]:
    """Chapter 6's int8 K/V in chapter 5's engine, fp32 weights: ``prefix_cached`` with its blocks kept by
    ``Int8Codec`` (D int8 values and a float32 scale a head: what a decoding query reads per key)."""
    codec = Int8Codec()
    return batched_row(model, "int8_kv", requests, weights=weights, kv_format=codec.name,
                       kv_bytes_per_position=codec.bytes_per_token(model.config))


def quant_model(config: GPT2Config, kernel: str, base: GPT2Model | None = None) -> GPT2Model:
    """Chapter 6's best form of ``base`` (default: the timing weights, ``random_model(config, seed=0)``): int8 per
    output channel, the tied head too."""
    base = random_model(config, seed=0) if base is None else base
    return quantize_model(base, QUANT_FORMAT, kernel=kernel, embeddings=True)


def quant_row(config: GPT2Config, kernel: str, requests, base: GPT2Model | None = None) -> tuple[dict, list]:
    """int8 weights (``kernel``: "numpy" or "numba"), chapter 3's engine over chapter 4's store (float32 K/V)."""
    model = quant_model(config, kernel, base)
    serve_engine(model, "paged", requests[:2], arrivals=False, max_num_seqs=2)  # warm-up (numba compiles here)
    method = QUANT_FORMAT if kernel == "numpy" else f"{QUANT_FORMAT}_numba"
    how = "dequantize, then BLAS" if kernel == "numpy" else "the numba kernel reads the int8 bytes"
    return batched_row(model, method, requests, engine="paged", kernel=kernel,
                       kernels=f"chapter code; int8 weights ({how}); float32 K/V in chapter 4's paged store")


def dequantize_seconds(model: GPT2Model, repeats: int = 3) -> float:
    """What NumPy's path adds to every model step of a quantized ``model``: each matmul first turns its whole
    weight back into float32 (``QuantizedWeight.dequantize``), whatever the batch. The median of ``repeats`` rounds
    of dequantizing every quantized weight once, as one step does."""
    weights = [b[m][n]["weight"] for b in model.params["h"] for m, n in (k.split(".") for k in MATRICES)]
    if isinstance(model.params["wte"], QuantizedEmbedding):
        weights.append(model.params["wte"].T)  # the tied head
    return median_time(lambda: [w.dequantize() for w in weights], repeats=repeats, warmup=1)


def composed_quant_row(config: GPT2Config, paged: dict, requests, base: GPT2Model | None = None) -> dict:
    """The ``int8`` row (NumPy's path) from the paged row of the same run: its steps, each longer by the measured
    ``dequantize_seconds`` (a full-size step takes about a second here, so the end-to-end run would take many
    minutes; ``--quick`` runs it end to end). Its latencies on the arrivals are not composed: None."""
    model = quant_model(config, "numpy", base)
    added = dequantize_seconds(model)
    seconds = paged["seconds"] + paged["model_steps"] * added
    passes = workload_passes("paged", lengths_of(requests))
    work = count_work(config, passes, paged["model_steps"], bytes_per_token(model))
    return {**{k: paged[k] for k in ("batch", "output_tokens", "kv_bytes_peak", "num_preemptions")},
            "method": QUANT_FORMAT, "tokens_per_s": paged["output_tokens"] / seconds, "seconds": seconds,
            "ttft_p50_s": None, "itl_p50_s": paged["itl_p50_s"] + added, "itl_p99_s": paged["itl_p99_s"] + added,
            "weight_bytes": int(model.nbytes()), **work, "kernel": "numpy", "dequantize_seconds_per_step": added,
            "basis": "composed: the paged engine's measured run, each of its steps longer by the measured time "
                     "NumPy's path adds to a step (dequantizing every weight); ITL likewise; TTFT on the "
                     "arrivals not composed (the server falls behind them)",
            "kernels": "chapter code; int8 weights (dequantize, then BLAS); float32 K/V in chapter 4's paged store"}


def numba_worker(conn, config, requests, threads) -> None:
    """The ``int8_numba`` row in its own process (numba's threads would slow OpenBLAS in the main one)."""
    with blas_threads(threads):
        row, outputs = quant_row(config, "numba", requests)
    conn.send((row, [o.output_token_ids for o in outputs]))


def numba_row(config: GPT2Config, requests, threads: int | None) -> tuple[dict | None, list | None, str]:
    """The kernel's row and its tokens from a spawned worker process, or (None, None, why not)."""
    if not quant_kernels.numba_available():
        return None, None, f"numba is not installed: no int8_numba row ({quant_kernels.INSTALL})"
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=numba_worker, args=(child, config, requests, threads), daemon=True)
    worker.start()
    child.close()  # if the worker dies, recv() raises EOFError instead of waiting forever
    try:
        row, tokens = conn.recv()
    finally:
        worker.join(timeout=60)
    return row, tokens, "int8_numba: measured in a spawned worker process (numba's threads slow OpenBLAS)"


def hf_row(model: GPT2Model, requests, threads: int, weights: GPT2Model | None = None,
           arrivals: bool = True) -> tuple[dict | None, str]:
    """HF transformers' batched ``generate`` (random weights of its own, the same shape), offline and (if
    ``arrivals``) on the arrivals, or (None, why not). Its clock starts after torch's warm-up call."""
    got = replay_hf(model, at_zero(requests), MAX_BATCH, threads)
    if got is None:
        return None, "torch/transformers not installed: no hf_transformers row (pip install 'gpt2-numpy[reference]')"
    outputs, batches = got
    if arrivals:
        latency = latencies_of(replay_hf(model, fresh(requests), MAX_BATCH, threads)[0])
    else:
        latency = {"ttft_p50_s": None, "itl_p50_s": None, "itl_p99_s": None}
    lengths = lengths_of(requests)
    columns = max(P for P, _ in lengths) + max(N for _, N in lengths)
    offline = {"outputs": outputs, "seconds": wl.summarize(outputs)["duration_s"],
               "model_steps": sum(len(b["step_times"]) for b in batches),
               "kv_bytes_peak": kv_bytes_per_position(model.config) * min(MAX_BATCH, len(requests)) * columns}
    import torch

    row = record("hf_transformers", model, offline, latency, workload_passes("hf_transformers", lengths),
                 weights, batch=MAX_BATCH, threads=threads, kernels=f"torch {torch.__version__} (its own BLAS)",
                 latency_basis="the arrivals" if arrivals else "not replayed on the arrivals in a full run (it "
                                                                "would add minutes): throughput only")
    return row, f"hf_transformers: torch {torch.__version__}, {threads} threads, random weights of its own"


def llamacpp_note() -> str:
    if importlib.util.find_spec("llama_cpp") is None:
        return ("llama-cpp-python is not installed: no llamacpp rows (measured on this machine before: batch-1 "
                "decode in f32 about 60 tok/s, equal to chapter 2's; q8_0 about 2.4x faster)")
    return "llama-cpp-python is installed, but this benchmark does not write GGUF files yet: no llamacpp rows"


def compute_bound_row(config: GPT2Config, requests, limits: dict) -> dict:
    """The workload's FLOPs for an engine that computes each position once (prompt positions without the LM
    head but the last, each generated token's position with it), at the run's GEMM rate."""
    lengths = lengths_of(requests)
    flops = sum(forward_flops(config, q, k, h) for q, k, h in workload_passes("continuous", lengths))
    tokens = sum(N for _, N in lengths)
    return {"method": "compute_bound", "batch": "all", "tokens_per_s": tokens * limits["gemm_flops_per_s"] / flops,
            "bound_tokens_per_s": tokens * limits["gemm_flops_per_s"] / flops, "bound_kind": "flops",
            "flops": int(flops), "output_tokens": tokens, "ttft_p50_s": None, "itl_p50_s": None, "itl_p99_s": None,
            "kv_bytes_peak": None, "weight_bytes": None}


# ----------------------------------------------------------------------------------------------------------------
# The sweep: the naive -> final span against length


def sweep_point(model: GPT2Model, prompt_len: int, new_tokens: int, num_requests: int, naive_passes: int,
                engine: str = "continuous") -> dict:
    """``num_requests`` requests of ``prompt_len`` + ``new_tokens``, offline: the engine's throughput, and
    chapter 1's naive loop measured on ``naive_passes`` of its forward passes (at lengths spread evenly over the
    request's), scaled to all its passes by positions processed."""
    V = model.config.vocab_size
    requests = [Request(i, wl.random_prompt(V, prompt_len, 7_000 + i), new_tokens, stop_at_eos=False)
                for i in range(num_requests)]
    final = serve_engine(model, engine, requests, arrivals=False, max_num_seqs=num_requests)
    final_tps = num_requests * new_tokens / final["seconds"]
    ids = wl.random_prompt(V, prompt_len + new_tokens - 1, 7_000)
    lengths = sorted({int(x) for x in np.linspace(prompt_len, prompt_len + new_tokens - 1, naive_passes).round()})
    seconds = []
    for T in lengths:
        t0 = time.perf_counter()
        generation.next_token_logits(model, ids[:T])
        seconds.append(time.perf_counter() - t0)
    rate = sum(lengths) / sum(seconds)  # positions per second
    naive_seconds = sum(q for q, _, _ in request_passes("naive", prompt_len, new_tokens)) / rate
    naive_tps = new_tokens / naive_seconds
    return {"prompt_len": prompt_len, "new_tokens": new_tokens, "num_requests": num_requests, "engine": engine,
            "final_tokens_per_s": final_tps, "naive_tokens_per_s": naive_tps, "span": final_tps / naive_tps,
            "naive_passes_measured": lengths, "naive_positions_per_s": rate,
            "naive_positions_per_request": sum(q for q, _, _ in request_passes("naive", prompt_len, new_tokens))}


def sweep(model: GPT2Model, points, num_requests: int, naive_passes: int) -> list[dict]:
    return [sweep_point(model, P, N, num_requests, naive_passes) for P, N in points]


def shortest_span_over(points: list[dict], threshold: float = 100.0) -> dict | None:
    """The sweep point with the fewest positions (prompt + new tokens) whose span reaches ``threshold``."""
    over = [p for p in points if p["span"] >= threshold]
    return min(over, key=lambda p: (p["prompt_len"] + p["new_tokens"], p["span"])) if over else None


# ----------------------------------------------------------------------------------------------------------------
# The benchmark


def quick_capstone_workload(vocab_size: int = 50257) -> list[Request]:
    """``--quick``: 6 short requests arriving at 8/s (prompts 8-48 tokens, outputs 8-20)."""
    return wl.poisson_workload(6, 8.0, vocab_size, seed=0, prompt_len=(24, 0.5, 8, 48), output_len=(12, 0.4, 8, 20))


def capstone_shape(quick: bool) -> GPT2Config:
    """GPT-2 124M; in quick runs and while grading, 2 of its 12 layers (same widths and vocabulary)."""
    return replace(preset("gpt2"), n_layer=2) if quick or GRADING else preset("gpt2")


def bench_capstone(quick: bool = QUICK, trace: str | None = None, config: GPT2Config | None = None,
                   sweep_points=None, include_optional: bool = True) -> dict:
    t_start = time.perf_counter()
    config = capstone_shape(quick) if config is None else config
    base = random_model(config, seed=0)
    model = accelerate(base)  # the appendix's kernels under the chapters' code, as every benchmark
    threads = int(blas_info()[0]["num_threads"]) if blas_info() else 1
    if trace is not None:
        requests, name = wl.load_trace(trace, config.vocab_size, tokenizer=model.tokenizer), str(trace)
    elif quick:
        requests, name = quick_capstone_workload(config.vocab_size), "quick_capstone_workload(): 6 requests at 8/s"
    else:
        requests, name = wl.standard_workload(vocab_size=config.vocab_size), "standard_workload(48, seed=0, 4/s)"
    requests = [replace(r, stop_at_eos=False) for r in requests]  # eos ignored: every engine makes every token
    numba_units = progress.if_installed(8, "numba")
    hf_units = progress.if_installed(15, "torch", "transformers") if include_optional else 0
    progress.plan(80 + numba_units + hf_units, "warming up; the GEMM rate and bandwidth")  # units: rough shares
    warm_up(model)
    readings = [measure_limits(model)]
    rows, skipped = [], []
    progress.advance(5, "naive: the whole sequence recomputed each token")
    rows.append(naive_row(model, requests, 4 if quick else NAIVE_STRIDE, base)[0])
    progress.advance(20, "KV cache, one request at a time")
    rows.append(kv_cache_row(model, requests, base)[0])
    progress.advance(10, "static batches")
    for method, units in (("static", 10), ("continuous", 3), ("paged", 3), ("prefix_cached", 4)):
        rows.append(batched_row(model, method, requests, weights=base)[0])
        progress.advance(units, f"the batched engines: {method} done")
    rows.append(int8_kv_row(model, requests, base)[0])
    progress.advance(0, "int8 weights")
    readings.append(measure_limits(model))
    paged = next(r for r in rows if r["method"] == "paged")
    rows.append(quant_row(config, "numpy", requests)[0] if quick else composed_quant_row(config, paged, requests))
    progress.advance(5, "int8 with the numba kernel" if numba_units else None)
    got, _, note = numba_row(config, requests, threads)
    progress.advance(numba_units, "the span from naive to the final engine, by length")
    (rows.append(got) if got is not None else skipped.append({"method": f"{QUANT_FORMAT}_numba", "reason": note}))
    points = sweep_points or ([(16, 16), (32, 32), (64, 64)] if quick else
                              [(32, 32), (64, 64), (128, 128), (256, 256), (512, 512)])
    span_sweep = sweep(model, points, 4 if quick else 8, 4 if quick else 8)
    progress.advance(15, "HF transformers" if hf_units else None)
    readings.append(measure_limits(model))
    if include_optional:
        got, note = hf_row(model, requests, threads, base, arrivals=quick)
        (rows.append(got) if got is not None else skipped.append({"method": "hf_transformers", "reason": note}))
    skipped.append({"method": "llamacpp", "reason": llamacpp_note()})
    limits = median_limits(readings)
    rows = [with_bound(r, limits) for r in rows] + [compute_bound_row(config, requests, limits)]
    return summarize_run(rows, skipped, span_sweep, limits, readings, requests, name, quick, config,
                         time.perf_counter() - t_start)


def summarize_run(rows, skipped, span_sweep, limits, readings, requests, name, quick, config, seconds) -> dict:
    by = {r["method"]: r for r in rows}
    fp32_serving = [m for m in ("continuous", "paged", "prefix_cached") if m in by]
    final = max(fp32_serving, key=lambda m: by[m]["tokens_per_s"])
    naive = by["naive"]["tokens_per_s"]
    ratios = {f"{m}_over_naive": by[m]["tokens_per_s"] / naive for m in by if m not in ("naive", "compute_bound")}
    ratios["final_fraction_of_compute_bound"] = by[final]["tokens_per_s"] / by["compute_bound"]["tokens_per_s"]
    first_100 = shortest_span_over(span_sweep)
    targets = {"final >= 0.8 x compute_bound": ratios["final_fraction_of_compute_bound"] >= 0.8,
               "sweep reaches 100x naive": first_100 is not None}
    shape = "GPT-2 124M shape" if config.n_layer == 12 else f"GPT-2 124M widths, {config.n_layer} layers"
    return {"benchmark": "capstone", "model": f"random weights, {shape}, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate (fp32 rows); chapter code + quantization kernels (int8 rows)",
            "duration_s": seconds, "workload": {"name": name, "num_requests": len(requests),
                                                "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                                                "output_tokens": sum(r.max_new_tokens for r in requests),
                                                "last_arrival_s": max(r.arrival_s for r in requests)},
            "limits": limits, "limits_readings": readings, "final_method": final, "results": rows,
            "skipped": skipped, "ratios": ratios, "targets_met": targets, "sweep": span_sweep,
            "sweep_first_over_100x": first_100, "essay": [{"engine": e, "tokens_per_s": t} for e, t in ESSAY],
            "method_notes": {"throughput": "offline: every request submitted at t=0, eos ignored",
                             "latency": "the workload's arrivals on the wall clock",
                             "bound": "max(FLOPs / GEMM rate, bytes / bandwidth), both measured in this run"}}
