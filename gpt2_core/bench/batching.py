"""Chapter 3's benchmark: ``python -m gpt2_core bench batching [--trace PATH] [--json PATH] [--quick]``.

One workload (``workload.standard_workload`` or a JSONL trace), served four ways in the same run on GPT-2 124M-
shaped random weights (float32; the time of a matmul does not depend on the numbers in it):

* ``sequential``: chapter 2, one request at a time, first come first served;
* ``static``: static batches of up to ``max_batch`` requests, left-padded, each batch run to its longest row;
* ``continuous``: the ``LLMEngine`` (``max_num_seqs = max_batch``), requests join and leave every step; run
  before and after the two strategies above and reported as the mean of both runs (the machine drifts);
* ``hf_transformers``: HF's batched ``generate`` with left padding, batched like ``static`` (if installed).

Every NumPy strategy runs on ``cpu_kernels.accelerate``'s kernels (the appendix). Plus the machine's limits: ``gemm_bound`` = tokens/s if a decode step at batch B took only the time of its
matmuls, each timed alone on its shape with the kernel the step uses (``matmul_seconds``), beside the measured
batched decode step (``decode_sweep``); ``tiled``, the decode step with the weights in tiles (what the package
runs) against without, at 2-64 sequences (``tiled_speedup``); and ``small_batch_gemv``, the step without tiles
with one GEMV per row against one GEMM per matrix at 2-8 sequences (``small_batch_gemv_speedup``).
"""

from __future__ import annotations

import time

import numpy as np

from .common import QUICK, blas_thread_count, interleaved, median_time
from . import progress
from .kv_cache import gemv_bandwidth, hf_reference_model, step_weights, weight_bytes_per_token
from ..ch03_batching.engine import LLMEngine, RequestOutput
from ..ch02_kv_cache.kv_cache import generate_stream
from ..ch03_batching.kv_store import ContiguousKVStore
from ..a1_cpu_kernels import FastWeight, accelerate, default_kernels
from ..a1_cpu_kernels.small_batch import GEMV_MAX_ROWS, HEAD_BLOCK, gemm, gemm_rows, padded_gemm
from ..ch03_batching.model_runner import Chunk, ragged_forward
from ..ch03_batching.sequence import FinishReason, Request, SequenceMetrics
from .replay import arrival_batches, replay, replay_static
from ..loading.weights import GPT2Model, random_model
from . import workload as wl


# ----------------------------------------------------------------------------------------------------------------
# The strategies


def replay_sequential(model: GPT2Model, requests, clock: str = "wall") -> list[RequestOutput]:
    """Chapter 2, one request at a time in arrival order (a server with one sequence slot)."""
    queue = sorted(requests, key=lambda r: r.arrival_s)
    t0, results = time.perf_counter(), []
    for r in queue:
        wait = t0 + r.arrival_s - time.perf_counter()
        if clock == "wall" and wait > 0:
            time.sleep(wait)
        start = time.perf_counter()
        params = r.sampling_params if isinstance(r.sampling_params, dict) else r.sampling_params.__dict__
        tokens, times = [], []
        for token in generate_stream(model, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=r.stop_at_eos,
                                     **params):
            tokens.append(token)
            times.append(time.perf_counter())
        m = SequenceMetrics(arrival_time=t0 + r.arrival_s if clock == "wall" else t0, first_scheduled_time=start,
                            token_times=times, finished_time=times[-1] if times else start)
        results.append(RequestOutput(r.request_id, list(r.prompt_token_ids), tokens,
                                     FinishReason.LENGTH, None, m))
    return results


def replay_hf(model: GPT2Model, requests, batch_size: int, threads: int):
    """HF transformers' batched ``generate`` (greedy, left padding, its own KV cache), batched like ``static``.
    Returns (outputs, batches) like ``replay_static``, or None if torch/transformers are not installed."""
    reference = hf_reference_model(model, threads)
    if reference is None:
        return None
    torch, hf = reference
    hf.generation_config.eos_token_id = None  # eos ignored, as in the workload: every row makes its budget
    hf.generation_config.pad_token_id = 0
    with torch.inference_mode():  # warm-up, untimed: torch's first call pays for its own start-up
        hf.generate(torch.zeros((2, 4), dtype=torch.long), attention_mask=torch.ones((2, 4), dtype=torch.long),
                    max_new_tokens=2, min_new_tokens=2, do_sample=False)

    class Clock:  # a generate() streamer: put() is called with the prompt, then once per generated column
        def __init__(self):
            self.times, self.calls = [], 0

        def put(self, value):
            self.calls += 1
            if self.calls > 1:
                self.times.append(time.perf_counter())

        def end(self):
            pass

    t0, results, batches = time.perf_counter(), [], []
    for batch in arrival_batches(requests, batch_size, t0=t0):
        T = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long)
        mask = torch.zeros((len(batch), T), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, T - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, T - len(r.prompt_token_ids):] = 1
        steps = max(r.max_new_tokens for r in batch)
        streamer = Clock()
        start = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                              do_sample=False, streamer=streamer)
        times = streamer.times
        batches.append({"start_time": start, "step_times": times, "batch_size": len(batch),
                        "active_rows": [sum(r.max_new_tokens > s for r in batch) for s in range(len(times))]})
        for row, r in enumerate(batch):
            n = r.max_new_tokens
            m = SequenceMetrics(arrival_time=t0 + r.arrival_s, first_scheduled_time=start, token_times=times[:n],
                                finished_time=times[n - 1])
            results.append(RequestOutput(r.request_id, list(r.prompt_token_ids), out[row, T:T + n].tolist(),
                                         FinishReason.LENGTH, None, m))
    return results, batches


def run_continuous(model: GPT2Model, requests, max_num_seqs: int, max_num_batched_tokens: int = 2048,
                   max_len: int = 512, clock: str = "wall"):
    """Serve the workload with the chapter 3 engine; returns (outputs, engine) — the engine has the step stats."""
    engine = LLMEngine(model, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                       max_len=max_len)
    return replay(engine, requests, clock=clock), engine


# ----------------------------------------------------------------------------------------------------------------
# Slot utilisation: how many of the max_batch places did useful work, averaged over the serving time


def utilisation_from_steps(intervals, max_batch: int) -> float:
    """``intervals`` = [(start, end, useful_rows)], -> time-weighted mean of useful_rows / max_batch."""
    busy = sum((e - s) * n for s, e, n in intervals)
    total = sum(e - s for s, e, _ in intervals)
    return busy / (total * max_batch) if total else 0.0


def static_intervals(batches) -> list:
    out = []
    for b in batches:
        starts = [b["start_time"]] + b["step_times"][:-1]
        out += list(zip(starts, b["step_times"], b["active_rows"]))
    return out


def engine_intervals(engine: LLMEngine) -> list:
    return [(s.start_time, s.end_time, s.num_seqs) for s in engine.step_stats]


def sequential_intervals(outputs) -> list:
    return [(o.metrics.first_scheduled_time, o.metrics.finished_time, 1) for o in outputs]


# ----------------------------------------------------------------------------------------------------------------
# Machine limits and the batched decode step


def matmul_seconds(m: int, k: int, n: int, repeats: int = 5, head: bool = False,
                   column_major: bool = False, kernels: dict | str | None = None) -> float:
    """Seconds of one float32 [m, k] x [k, n] product, run the way the step runs it: ``kernels`` are the
    ``cpu_kernels.FastWeight`` settings of the model's weights (``weight_kernels``; None: ``accelerate()``'s on this
    machine), or ``"plain"`` for an array (the chapter code's ``x @ W``). A FastWeight multiplies from the weight's
    tiles for 2 to 64 rows if tiled, and the LM head (``head=True``) in ``HEAD_BLOCK`` column blocks; the [k, n]
    weight is column-major if the model keeps it so (``column_major``)."""
    rng = np.random.default_rng(0)
    A = rng.standard_normal((m, k), dtype=np.float32)
    B = np.asarray(rng.standard_normal((k, n), dtype=np.float32), order="F" if column_major else "C")
    if kernels != "plain":
        settings = kernels or default_kernels()
        B = FastWeight(B, block=HEAD_BLOCK if head else None, **settings)
        if B.tiled:
            B.tiles()  # made before the clock starts
    return median_time(lambda: A @ B, repeats=repeats)


def weight_kernels(weight) -> dict | str:
    """How a step multiplies by ``weight``: a ``FastWeight``'s settings, or ``"plain"`` for an array."""
    if isinstance(weight, FastWeight):
        return {"tiled": weight.tiled, "gemv_max_rows": weight.gemv_max_rows}
    return "plain"


def gemm_bound_tokens_per_s(model: GPT2Model, batch: int, repeats: int = 5) -> dict:
    """Tokens/s of a decode step at ``batch`` that spent only the time of its matmuls, each timed alone on its
    own shape (``matmul_seconds``, with the kernel the ragged step uses for that many rows): per layer
    [B,E]x[E,3E], [B,E]x[E,E], [B,E]x[E,4E], [B,4E]x[4E,E]; the head [B,E]x[E,V]. Alone and repeated, the
    smaller weights stay in cache: in the real step they come from memory, which the bound does not charge."""
    E, V, L = model.config.n_embd, model.config.vocab_size, model.config.n_layer
    weights = step_weights(model)[:4]  # the first block's
    shapes = [w.shape for w in weights]  # [E, 3E], [E, E], [E, 4E], [4E, E]
    kernels = weight_kernels(model.params["h"][0]["attn"]["c_attn"]["weight"])  # tiles or not, as the model has them
    per_layer = {f"{k}x{n}": matmul_seconds(batch, k, n, repeats=repeats, column_major=np.isfortran(w),
                                            kernels=kernels)
                 for (k, n), w in zip(shapes, weights)}  # each in the memory order the model keeps it
    head = matmul_seconds(batch, E, V, repeats=max(3, repeats // 2), head=True, kernels=kernels)
    seconds = L * sum(per_layer.values()) + head
    flops = 2 * batch * (L * sum(k * n for k, n in shapes) + E * V)
    return {"seconds_per_step": seconds, "tokens_per_s": batch / seconds, "gemm_flops_per_s": flops / seconds,
            "lm_head_share": head / seconds}


def decode_step_runner(model: GPT2Model, batch: int, context: int, store_cls: type = ContiguousKVStore):
    """A function running one ragged step of ``batch`` decode chunks, each with ``context`` tokens cached (the cache
    holds arbitrary numbers: timing does not depend on them), on ``model``'s kernels, in a ``store_cls`` (chapter
    3's contiguous store or one like it)."""
    store = store_cls(model.config, num_slots=batch, max_len=context + 1)
    for i in range(batch):
        store.allocate(i, context + 1)
    store.k[:] = 0.01
    store.v[:] = 0.01
    chunks = [Chunk(i, np.array([i % model.config.vocab_size]), context) for i in range(batch)]
    return lambda: ragged_forward(model, store, chunks)


def decode_beside_gemm_bound(model: GPT2Model, batch: int, context: int, pairs: int = 5,
                             steps: int = 3) -> list[tuple[float, dict]]:
    """The decode step and its GEMM bound, measured side by side ``pairs`` times: the median of ``steps`` steps,
    then the bound (``gemm_bound_tokens_per_s``). The machine's speed drifts; a pair shares one moment, so its
    ratio is fair. -> [(step seconds, bound)] per pair."""
    step = decode_step_runner(model, batch, context)
    step()  # warm-up
    return [(median_time(step, repeats=steps, warmup=0), gemm_bound_tokens_per_s(model, batch, repeats=3))
            for _ in range(pairs)]


def small_batch_gemv_speedup(model: GPT2Model, batches=(2, 3, 4, 5, 6, 8), context: int = 128,
                             rounds: int = 7) -> list[dict]:
    """The ragged decode step without tiles (``tiled=False``) with one GEMV per row (the head in cached column
    blocks) against one GEMM per matrix, interleaved round by round, at each batch size (also past
    ``GEMV_MAX_ROWS``, where the untiled step uses GEMM). -> one record per batch size: the median step of each
    path, the median of the per-round ratios GEMM time / GEMV time, and which path the untiled step takes."""
    records = []
    for b in batches:
        times = interleaved({"gemm": decode_step_runner(accelerate(model, tiled=False, gemv_max_rows=1), b, context),
                             "gemv": decode_step_runner(accelerate(model, tiled=False, gemv_max_rows=b), b, context)},
                            rounds)
        ratios = [g / v for g, v in zip(times["gemm"], times["gemv"])]
        records.append({"batch": b, "context": context, "gemm_seconds_per_step": float(np.median(times["gemm"])),
                        "gemv_seconds_per_step": float(np.median(times["gemv"])),
                        "speedup": float(np.median(ratios)),
                        "package_path": "gemv" if 1 < b <= GEMV_MAX_ROWS else "gemm"})
    return records


def tiled_speedup(model: GPT2Model, batches=(2, 4, 8, 16, 32, 64), context: int = 128,
                  rounds: int = 7) -> list[dict]:
    """The ragged decode step with the weights in tiles (``tiled_matmul``, the package's step) against without
    (GEMVs up to ``GEMV_MAX_ROWS`` rows, then GEMMs), interleaved round by round, at each batch size.
    -> one record per batch size: the median step of each, and the median of the per-round ratios
    untiled time / tiled time."""
    records = []
    for b in batches:
        times = interleaved({"untiled": decode_step_runner(accelerate(model, tiled=False), b, context),
                             "tiled": decode_step_runner(accelerate(model, tiled=True), b, context)}, rounds)
        records.append({"batch": b, "context": context,
                        "untiled_seconds_per_step": float(np.median(times["untiled"])),
                        "tiled_seconds_per_step": float(np.median(times["tiled"])),
                        "speedup": float(np.median([u / t for u, t in zip(times["untiled"], times["tiled"])]))})
    return records


# ----------------------------------------------------------------------------------------------------------------
# The benchmark


def gemm_row_padding(model: GPT2Model, rows=range(5, 18), rounds: int = 9, units: float = 0.0) -> list[dict]:
    """All the matrix-matrix products of one step at each row count, as ``FastWeight``'s GEMM path runs them
    (``gemm_rows``: padded with zero rows where that is faster) and unpadded, interleaved round by round.
    -> one record per row count: rows, rows BLAS gets, the median seconds of each, and the median of the rounds'
    ratios (unpadded time / padded time; where ``gemm_rows`` leaves the rows alone both run the same products,
    so those ratios show the noise). ``units``: this part's share of a benchmark's progress."""
    rng = np.random.default_rng(4)
    weights = step_weights(model)

    def step(n: int, padded: bool):
        inputs = {k: rng.standard_normal((n, k), dtype=np.float32) for k in {w.shape[0] for w in weights}}
        mm = padded_gemm if padded else gemm

        def run():
            for w in weights:
                mm(inputs[w.shape[0]], w)
        return run
    records = []
    for n in rows:
        times = interleaved({"padded": step(n, True), "unpadded": step(n, False)}, rounds,  # one call a round
                            measure=lambda run, r: median_time(run, repeats=1, warmup=1 if r == 0 else 0))
        records.append({"rows": n, "gemm_rows": gemm_rows(n),
                        "unpadded_seconds": float(np.median(times["unpadded"])),
                        "padded_seconds": float(np.median(times["padded"])),
                        "speedup": float(np.median([u / q for u, q in zip(times["unpadded"], times["padded"])]))})
        progress.advance(units / len(rows))
    return records


def bench_padding(quick: bool = QUICK) -> dict:
    """``gemm_row_padding`` on its own, with more rounds than the batching benchmark can spend on it: is padding
    5-7 leftover rows to a multiple of 8 faster, beyond the noise of the row counts it leaves alone?"""
    progress.plan(100, "building the model")
    model = accelerate(random_model("gpt2", seed=0))
    progress.advance(5, "the GEMMs of a step, rows padded and not, row count by row count")
    records = gemm_row_padding(model, rows=range(12, 18) if quick else range(5, 34), rounds=3 if quick else 15,
                               units=95)
    results = [{"method": method, "batch": r["rows"], "gemm_rows": r["gemm_rows"], "seconds": r[f"{method}_seconds"],
                "tokens_per_s": r["rows"] / r[f"{method}_seconds"]}
               for r in records for method in ("unpadded", "padded")]
    padded = [r["speedup"] for r in records if r["gemm_rows"] != r["rows"]]
    alone = [r["speedup"] for r in records if r["gemm_rows"] == r["rows"]]
    ratios = {"padded_rows_median_speedup": float(np.median(padded)) if padded else None,
              "rows_left_alone_median_speedup": float(np.median(alone)) if alone else None}
    return {"benchmark": "padding", "model": "random GPT-2 124M shape, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate", "results": results, "ratios": ratios, "gemm_row_padding": records}


def quick_workload(vocab_size: int = 50257, seed: int = 0):
    """``--quick``: 8 short requests (seconds, for CI and a first look)."""
    return wl.poisson_workload(8, 8.0, vocab_size, seed=seed, prompt_len=(32, 0.5, 16, 64),
                               output_len=(20, 0.4, 12, 32))


def warm_up(model: GPT2Model) -> None:
    """Serve two short requests with each NumPy strategy, untimed, before any clock starts. What is built on
    first use (every weight in tiles, 495 MB for GPT-2 small; BLAS's threads
    and buffers; the tiles' worker thread) is then ready
    before the first strategy is measured, which would otherwise pay for the others. (HF transformers warms up
    in ``replay_hf``, just before its own clock: torch is not loaded while NumPy is timed.)"""
    n = min(16, model.config.n_positions // 2)  # prompt and output lengths
    requests = [Request(i, [(i + j) % model.config.vocab_size for j in range(n)], max_new_tokens=n,
                        stop_at_eos=False) for i in range(2)]
    run_continuous(model, requests, max_num_seqs=2, max_len=2 * n, clock="steps")
    replay_sequential(model, requests, clock="offline")
    replay_static(model, requests, batch_size=2, clock="offline")


def record(method: str, batch, summary: dict, utilisation: float | None, **extra) -> dict:
    keys = ("tokens_per_s", "output_tokens", "duration_s", "mean_ttft_s", "p50_ttft_s", "p99_ttft_s",
            "mean_itl_s", "p50_itl_s", "p99_itl_s", "mean_e2e_s", "p50_e2e_s", "p99_e2e_s", "num_errors")
    return {"method": method, "batch": batch, **{k: summary[k] for k in keys}, "slot_utilisation": utilisation,
            **extra}


def bench_batching(quick: bool = QUICK, trace: str | None = None, max_batch: int = 32,
                   sweep=None, context: int | None = None) -> dict:
    hf_units = progress.if_installed(90, "torch", "transformers")  # units: rough seconds of a full run
    progress.plan(330 + hf_units, "building the model")
    model = accelerate(random_model("gpt2", seed=0))  # the appendix's kernels under chapters 2-3's code
    threads = blas_thread_count(1)
    if trace is not None:
        requests = wl.load_trace(trace, model.config.vocab_size, tokenizer=model.tokenizer)
        name = str(trace)
    else:
        requests = quick_workload() if quick else wl.standard_workload()
        name = "quick_workload()" if quick else "standard_workload(num_requests=48, seed=0, request_rate=4.0)"
    max_len = min(model.config.n_positions, max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests))
    progress.advance(5, "warming up")
    results = []

    warm_up(model)
    progress.advance(5, "continuous batching (first run)")
    # Continuous runs twice, before and after the two slow strategies (A-B-C-A): the machine drifts over the
    # minutes this takes, and the mean of the bracketing runs compares with sequential and static fairly.
    first, engine = run_continuous(model, requests, max_num_seqs=max_batch, max_len=max_len)
    progress.advance(20, "one request at a time")

    outs = replay_sequential(model, requests)
    progress.advance(60, "static batches")
    seq = wl.summarize(outs)
    results.append(record("sequential", 1, seq, utilisation_from_steps(sequential_intervals(outs), max_batch)))

    outs, batches = replay_static(model, requests, batch_size=max_batch)
    progress.advance(45, "continuous batching (second run)")
    static = wl.summarize(outs)
    results.append(record("static", max_batch, static, utilisation_from_steps(static_intervals(batches), max_batch),
                          num_batches=len(batches)))

    second, _ = run_continuous(model, requests, max_num_seqs=max_batch, max_len=max_len)
    progress.advance(20, "HF transformers, static batches" if hf_units else None)
    runs = [wl.summarize(first), wl.summarize(second)]
    cont = {**runs[0], "tokens_per_s": float(np.mean([r["tokens_per_s"] for r in runs]))}  # latencies: run 1
    stats = engine.step_stats
    kv_used = sum(s.kv_used_tokens for s in stats) / max(1, sum(s.kv_reserved_tokens for s in stats))
    results.append(record("continuous", max_batch, cont, utilisation_from_steps(engine_intervals(engine), max_batch),
                          num_steps=len(stats), mean_batch=float(np.mean([s.num_seqs for s in stats])),
                          kv_reserved_used_fraction=kv_used, num_preemptions=cont["num_preemptions"],
                          max_len=max_len, runs=[{k: r[k] for k in ("tokens_per_s", "duration_s", "mean_ttft_s",
                                                                     "p50_itl_s")} for r in runs]))

    hf = replay_hf(model, requests, max_batch, threads)
    progress.advance(hf_units, "decode steps beside the GEMM bound")
    hf_summary = None
    if hf is not None:
        hf_outs, hf_batches = hf
        hf_summary = wl.summarize(hf_outs)
        results.append(record("hf_transformers", max_batch, hf_summary,
                              utilisation_from_steps(static_intervals(hf_batches), max_batch), threads=threads))

    # the batched decode step against the GEMM bound, at several batch sizes
    sweep = sweep or ([1, 8, 32] if quick else [1, 2, 4, 8, 16, 32, 64])
    context = context or (64 if quick else 128)
    decode_sweep = []
    for b in sweep:
        pairs = decode_beside_gemm_bound(model, b, context, pairs=3 if quick else 7)
        seconds = float(np.median([s for s, _ in pairs]))
        bound = {k: float(np.median([p[k] for _, p in pairs])) for k in pairs[0][1]}  # median of each field
        fractions = [p["seconds_per_step"] / s for s, p in pairs]  # each pair's own ratio
        decode_sweep.append({"batch": b, "context": context, "tokens_per_s": b / seconds,
                             "seconds_per_step": seconds, "gemm_bound_tokens_per_s": bound["tokens_per_s"],
                             "fraction_of_gemm_bound": float(np.median(fractions)),
                             "fraction_of_gemm_bound_per_pair": fractions})
        results.append({"method": "gemm_bound", "batch": b, **bound})
        progress.advance(60 * b / sum(sweep))
    progress.advance(0, "the step with and without tiles")
    tiled = tiled_speedup(model, batches=(2, 8) if quick else (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
                          context=context, rounds=3 if quick else 7)
    progress.advance(60, "one GEMV per row against GEMM")
    small_batch = small_batch_gemv_speedup(model, batches=(2, 4) if quick else (2, 3, 4, 5, 6, 8),
                                           context=context, rounds=3 if quick else 7)
    progress.advance(20, "GEMM rows padded and not")
    padding = gemm_row_padding(model, rows=(7, 8) if quick else range(5, 34), rounds=3 if quick else 9, units=30)
    progress.advance(0, "the bandwidth bound")
    bandwidth = gemv_bandwidth()
    bw_bound = bandwidth / weight_bytes_per_token(model)
    at = {d["batch"]: d for d in decode_sweep}
    big = max_batch if max_batch in at else max(at)
    ratios = {
        "continuous_over_sequential": cont["tokens_per_s"] / seq["tokens_per_s"],
        "continuous_over_static": cont["tokens_per_s"] / static["tokens_per_s"],
        "continuous_over_hf": None if hf_summary is None else cont["tokens_per_s"] / hf_summary["tokens_per_s"],
        "static_over_sequential": static["tokens_per_s"] / seq["tokens_per_s"],
        f"decode_batch_{big}_fraction_of_gemm_bound": at[big]["fraction_of_gemm_bound"],
        "tiled_step_speedup_median": float(np.median([r["speedup"] for r in tiled])),
    }
    return {"benchmark": "batching", "model": "random GPT-2 124M shape, float32", "quick": quick,
            "kernels": "cpu_kernels.accelerate", "workload": {"name": name, "num_requests": len(requests),
                         "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                         "max_new_tokens": sum(r.max_new_tokens for r in requests),
                         "last_arrival_s": max(r.arrival_s for r in requests)},
            "results": results, "ratios": ratios, "decode_sweep": decode_sweep, "tiled": tiled,
            "small_batch_gemv": small_batch,
            "gemm_row_padding": padding,
            "bandwidth_bound_tokens_per_s_batch_1": bw_bound, "gemv_bytes_per_s": bandwidth, "threads": threads}
