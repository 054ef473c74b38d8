"""The benchmark commands: ``python -m gpt2_core bench NAME [--json PATH] [--trace PATH] [--quick]``."""

from __future__ import annotations

import inspect
import json
import os
import sys

from ..errors import InvalidInputError, is_writable_file
from .batching import bench_batching, bench_padding
from .capstone import bench_capstone
from . import progress
from .common import QUICK, blas_threads, machine_info
from .kv_cache import bench_kv_cache
from .layout import bench_layout
from .paged import bench_paged
from .parallel import bench_parallel
from .prefix import bench_prefix
from .quant import bench_quant
from .serve import bench_serve, summary_line
from .spec import bench_spec


BENCHMARKS = {"kv-cache": bench_kv_cache, "layout": bench_layout, "batching": bench_batching, "paged": bench_paged,
              "prefix": bench_prefix, "padding": bench_padding, "quant": bench_quant,
              "parallel": bench_parallel, "serve": bench_serve, "capstone": bench_capstone, "spec": bench_spec}

# How long each takes on this project's machine (2 cores, nothing else running), in minutes: (full size, --quick).
# The README's table of benchmarks shows the same figures (tests/test_cli.py checks that they agree).
MINUTES = {"kv-cache": (3, 1), "layout": (1, 1), "batching": (11, 2), "paged": (7, 1), "prefix": (22, 1),
           "padding": (1, 1), "quant": (6, 1), "parallel": (15, 2), "serve": (10, 2), "capstone": (25, 2),
           "spec": (14, 3)}


def announce(name: str, quick: bool, stream=None) -> None:
    """The first line of a run: how long it will take, how to make it shorter, and whether the machine is busy."""
    full, small = MINUTES[name]
    if quick:
        text = f"bench {name} (quick sizes): about {small} min on 2 idle cores (full size: about {full} min)"
    else:
        text = (f"bench {name}: about {full} min on 2 idle cores; --quick (or GPT2_QUICK=1) runs small sizes in "
                f"about {small} min")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    if load >= 1.0:
        text += f"; load {load:.1f} now: other work slows this run and skews its timings"
    print(text, file=stream or sys.stderr, flush=True)


def run_benchmark(name: str, json_path: str | None = None, trace: str | None = None, quick: bool = False,
                  threads: int | None = None, base_url: str | None = None, goodput: list[str] | None = None,
                  progress_stream=None) -> dict:
    """Run benchmark ``name`` as ``python -m gpt2_core bench`` does: its progress on ``progress_stream``
    (stderr), its summary on stdout, its results in ``json_path``."""
    if name not in BENCHMARKS:
        raise InvalidInputError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    if trace is not None and "trace" not in inspect.signature(BENCHMARKS[name]).parameters:
        takes = [n for n, fn in BENCHMARKS.items() if "trace" in inspect.signature(fn).parameters]
        raise InvalidInputError(f"--trace applies to {' and '.join(takes)}, not to {name!r}")
    if goodput and name != "serve":
        raise InvalidInputError(f"--goodput applies to serve, not to {name!r}")
    if base_url is not None and name != "serve":
        raise InvalidInputError(f"--base-url applies to serve, not to {name!r}")
    if json_path and not is_writable_file(json_path):
        raise InvalidInputError(f"--json {json_path}: cannot write a file there (a folder, a missing folder, or no "
                                f"permission); found now, not after minutes of benchmarking")
    quick = quick or QUICK
    announce(name, quick, progress_stream)
    with blas_threads(threads), progress.running(name, progress_stream):
        kwargs = {"quick": quick}
        if trace is not None:
            kwargs["trace"] = trace
        if base_url is not None:
            kwargs["base_url"] = base_url
        if goodput:
            kwargs["goodput"] = goodput
        out = {"machine": machine_info(), **BENCHMARKS[name](**kwargs)}
    text = json.dumps(out, indent=2, default=float)
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    _print_summary(out)
    return out


def _print_summary(out: dict) -> None:
    w = sys.stdout.write
    load = out["machine"]["load_average_1min"]
    busy = "" if load is None or load < 0.5 else " (0.5 or more: other work is running or just ran: skewed timings)"
    w(f"{out['benchmark']}  ({out['model']}; numpy {out['machine']['numpy']}, "
      f"BLAS {[(b['internal_api'], b['num_threads']) for b in out['machine']['blas']]}, "
      f"load average {load} at the start{busy})\n")
    if out["benchmark"] == "capstone":
        _print_capstone(out)
        return
    if out["benchmark"] == "spec":
        _print_spec(out)
        return
    for r in out["results"]:
        extra = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("method", "tokens_per_s", "batch") and
                          not isinstance(v, (float, list, dict)))
        w(f"  {r['method']:16s} batch {r['batch']:>3}  {r['tokens_per_s']:9.2f} tok/s  {extra}\n")
        if r.get("hit_rate") is not None:  # a serving record (bench parallel's router arms)
            w(f"  {'':16s} prefix-cache hit rate {r['hit_rate']:.3f}, TTFT p50 {r['ttft_p50_s']:.3f} s, "
              f"p99 {r['ttft_p99_s']:.3f} s\n")
        if out["benchmark"] == "serve":  # its latencies, and goodput when --goodput set SLOs
            w(summary_line(r))
    if out["benchmark"] == "serve" and "chapter_code" in out:  # the same load on the chapters' own code
        plain = out["chapter_code"]
        w(f"  the chapter code (serve --plain): capacity {plain['capacity']['requests_per_s']:.2f} requests/s\n")
        for r in plain["results"]:
            w(f"  {r['method']:16s} batch {r['batch']:>3}  {r['tokens_per_s']:9.2f} tok/s\n")
            w(summary_line(r))
    for r in out.get("bubble", []):
        w(f"  pipeline bubble, {r['micro_batches']} micro-batches: measured {r['bubble_measured']:.3f}, "
          f"(p-1)/(m+p-1) = {r['bubble_ideal']:.3f}\n")
    for r in out.get("all_reduce", []):
        w(f"  one all-reduce of [{r['rows']}, E] between two workers: {1e6 * r['seconds']:.0f} us\n")
    for k, v in out.get("ratios", {}).items():
        w(f"  {k}: {v:.2f}\n" if v is not None else f"  {k}: n/a{why_missing(k)}\n")
    for k, v in out.get("targets_met", {}).items():
        w(f"  target {k}: {v}\n")
    if "profile_ms_per_step" in out:
        total = sum(out["profile_ms_per_step"].values())
        w("  where a decode step's time goes (ms per step, all layers):\n")
        for k, v in out["profile_ms_per_step"].items():
            w(f"    {k:26s} {v:7.2f} ms  {100 * v / total:5.1f}%\n")
    if "profile_in_step_ms_per_step" in out:
        alone = out.get("profile_ms_per_step", {})
        w("  the same parts timed inside real decode steps (ms per step; alone, as above, in brackets; in a step\n"
          "  each GEMV includes its bias add and the layer norms include the head's):\n")
        for k, v in out["profile_in_step_ms_per_step"].items():
            w(f"    {k:26s} {v:7.2f} ms" + (f"  ({alone[k]:.2f})" if k in alone else "") + "\n")
    if "gemv_bytes_per_s_by_kind" in out:
        rounds = out["gemv_bytes_per_s_by_kind"]
        w("  GEMV bandwidth by matrix kind inside the chain, GB/s per round (bound: one head-shaped GEMV):\n")
        for k in rounds[0]:
            w(f"    {k:12s} " + " ".join(f"{r[k] / 1e9:5.1f}" for r in rounds) + "\n")


def _print_capstone(out: dict) -> None:
    w = sys.stdout.write
    lim = out["limits"]
    w(f"  workload: {out['workload']['name']}; GEMM {lim['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s, bandwidth "
      f"{lim['bytes_per_s'] / 1e9:.1f} GB/s (the best of {len(out['limits_readings'])} readings); run "
      f"{out['duration_s']:.0f} s\n")
    naive = next(r["tokens_per_s"] for r in out["results"] if r["method"] == "naive")
    w(f"  {'method':16s} {'tok/s':>9s} {'x naive':>8s} {'bound':>9s} {'kind':>6s} {'TTFT p50':>9s} {'ITL p50':>8s}\n")
    for r in out["results"]:
        ttft = "" if r["ttft_p50_s"] is None else f"{r['ttft_p50_s']:8.2f}s"
        itl = "" if r["itl_p50_s"] is None else f"{1e3 * r['itl_p50_s']:6.0f}ms"
        w(f"  {r['method']:16s} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / naive:7.1f}x "
          f"{r['bound_tokens_per_s']:9.1f} {r['bound_kind']:>6s} {ttft:>9s} {itl:>8s}\n")
    for s in out["skipped"]:
        w(f"  skipped {s['method']}: {s['reason']}\n")
    for r in out["results"]:
        if r.get("step_bound_tokens_per_s"):
            w(f"  per-step bound {r['method']:16s} {r['step_bound_tokens_per_s']:9.1f} tok/s, reached "
              f"{r['fraction_of_step_bound']:.0%} ({r['kernels']})\n")
    chapter = out.get("chapter_code")
    for r in (chapter or {}).get("results", []):
        w(f"  chapter code {r['method']:16s} {r['tokens_per_s']:9.1f} tok/s, bound {r['bound_tokens_per_s']:9.1f}" +
          (f", per-step bound {r['step_bound_tokens_per_s']:9.1f}" if r.get("step_bound_tokens_per_s") else "") + "\n")
    for p in out["sweep"]:
        w(f"  sweep {p['prompt_len']:4d} + {p['new_tokens']:4d}: final {p['final_tokens_per_s']:7.1f} tok/s, naive "
          f"{p['naive_tokens_per_s']:6.2f} tok/s, span {p['span']:6.1f}x\n")
    for k, v in out["targets_met"].items():
        w(f"  target {k}: {v}\n")


def why_missing(ratio: str) -> str:
    """Why a ratio of the summary could not be measured, when an optional package explains it."""
    if ratio.endswith("_over_hf"):
        return " (needs HF transformers and torch: the reference extra)"
    if "numba" in ratio:
        return " (needs numba: the kernels extra)"
    return ""
def _print_spec(out: dict) -> None:
    """Chapter 10's tables: the verify cost, the speed-ups, the draft's cost and the embedded model's acceptance."""
    w = sys.stdout.write
    for r in out["results"]:
        w(f"  {r['method']:13s} batch {r['batch']:>3} {r['tokens_per_s']:8.2f} tok/s" +
          (f"  alpha {r['alpha']:.2f} k={r['k']}: {r['tokens_per_pass']:.2f} tokens/pass (formula {r['formula']:.2f})"
           if r["method"] == "oracle" else "") +
          (f"  speed-up {r['speedup']:.2f}x" if "speedup" in r else "") +
          (f" (formula {r['predicted_speedup']:.2f}x)" if "predicted_speedup" in r else "") + "\n")
    w(f"  ({out['note']})\n  verify pass of k + 1 positions, in decode steps: " +
      ", ".join(f"k={r['k']}: {r['decode_steps']:.2f}" for r in out["verify_cost"]) + "\n")
    for r in out["draft_cost"]:
        w(f"  draft {r['draft']}: a step costs {r['draft_cost_in_target_steps']:.2f} target steps; with alpha "
          f"{r['alpha']:.2f}, k={r['k']} the formula predicts {r['predicted_speedup']:.2f}x\n")
    for r in out["embedded"]:
        w(f"  embedded {r['workload']:10s} {r['drafter']:10s} alpha {r['alpha']:.2f}, {r['tokens_per_pass']:.2f} "
          f"tokens/pass, speed-up {r['speedup']:.2f}x, identical {r['identical_to_greedy']}\n")
    for r in out.get("instruct", []):
        w(f"  SmolLM2 {r['workload']:9s} k={r['k']}: alpha {r['alpha']:.2f}, {r['tokens_per_pass']:.2f} tokens/pass "
          f"(formula {r['formula']:.2f}), decode {r['plain_decode_tokens_per_s']:.1f} -> {r['decode_tokens_per_s']:.1f} "
          f"tok/s, speed-up {r['speedup']:.2f}x ({r['speedup_with_prefill']:.2f}x with the prefill), identical "
          f"{r['identical_to_greedy']}\n")
    for why in out.get("skipped", {}).values():
        w(f"  {why}\n")
    w("  tokens per pass, measured / formula (oracle, embedded model): " + ", ".join(
        f"a={r['alpha']} k={r['k']}: {r['tokens_per_pass']:.2f}/{r['formula']:.2f}" for r in out["formula"]) + "\n")
    for k, v in out["ratios"].items():
        w(f"  {k}: {v:.2f}\n")
    for k, v in out["targets_met"].items():
        w(f"  target {k}: {v}\n")
