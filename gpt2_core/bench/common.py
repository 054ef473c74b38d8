"""Measuring, for the benchmarks: medians of repeated timings, peak memory with tracemalloc, and what machine the numbers came from.

Machines are noisy (two cores shared with whatever else runs), so every figure is a median of repeats, and methods
are compared as ratios measured side by side in the same run, never against numbers from another day.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from ..a1_cpu_kernels.malloc import freed_memory_kept
from ..a1_cpu_kernels.tiles import small_kernel_here
from ..errors import is_integer

# nbgrader sets NBGRADER_EXECUTION ("autograde" or "validate") while it executes a notebook to grade it. Grades
# depend on the exercises, never on timings, so a graded run times everything once, on a shallower model.
GRADING = os.environ.get("NBGRADER_EXECUTION", "") != ""
QUICK = GRADING or os.environ.get("GPT2_QUICK", "") not in ("", "0")  # small benchmark sizes (CI sets GPT2_QUICK=1)


def timing_model_shape():
    """The shape the notebooks time: GPT-2 124M ("gpt2"); while nbgrader grades, the same widths and vocabulary
    with 2 layers instead of 12 (every cell runs the same code, in a sixth of the time)."""
    if not GRADING:
        return "gpt2"
    from dataclasses import replace

    from ..loading.config import preset

    return replace(preset("gpt2"), n_layer=2)


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` untimed calls (one call, no warmup, when grading)."""
    for name, value, least in (("repeats", repeats, 1), ("warmup", warmup, 0)):
        if not is_integer(value, least):
            raise ValueError(f"median_time: {name} must be an integer >= {least}, got {value!r}")
    if GRADING:
        repeats, warmup = 1, 0
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_memory(fn: Callable[[], object]) -> tuple[int, object]:
    """Peak bytes allocated while ``fn()`` runs (NumPy reports its buffers to tracemalloc), and its result.

    A caller already tracing keeps its tracing on, but tracemalloc has one peak: the caller's recorded peak is
    reset here."""
    started_here = not tracemalloc.is_tracing()  # a caller already tracing keeps its tracing on
    if started_here:
        tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = fn()
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        if started_here:
            tracemalloc.stop()
    return peak, result


def blas_info() -> list[dict]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keep = ("internal_api", "version", "num_threads", "threading_layer", "architecture")
    return [{k: lib.get(k) for k in keep} for lib in threadpool_info() if lib.get("user_api") == "blas"]


def blas_thread_count(default: int | None = None) -> int | None:
    """Threads of this process's BLAS (its first library's), or ``default`` where threadpoolctl sees none."""
    info = blas_info()
    return int(info[0]["num_threads"]) if info else default


LLAMA_CPP_INSTALL = "pip install llama-cpp-python"  # it builds llama.cpp from source: no extra of this package has it


def llama_cpp_available() -> bool:
    """Is llama-cpp-python installed (the benchmarks' optional llama.cpp rows)?"""
    return importlib.util.find_spec("llama_cpp") is not None


def cpu_model() -> str | None:
    """The CPU's model name as Linux reports it (the same host name can hide another CPU from one day to the next)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def machine_info() -> dict:
    """Versions, BLAS and its threads, cores and the load on them: the context every benchmark records."""
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "blas": blas_info(),
        "tiles": small_kernel_here(),  # accelerate()'s default: tiles only where this BLAS has its small kernel
        "malloc_keeps_freed_memory": freed_memory_kept(),  # keep_freed_memory() was called (glibc)
        "env": {k: os.environ[k] for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_CORETYPE",
                                           "OPENBLAS_L2_SIZE", "GPT2_QUICK") if k in os.environ},
    }
    return info


def blas_threads(n: int | None):
    """Context manager pinning the BLAS thread count (``None``: leave it as it is)."""
    from contextlib import nullcontext

    if n is None:
        return nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=n, user_api="blas")


def turn_order(items, r: int) -> list:
    """``items`` in their order in even rounds ``r``, reversed in odd ones: whatever the machine's drift does during
    a round falls on the first and the last alike over two rounds."""
    items = list(items)
    return items if r % 2 == 0 else items[::-1]


def interleaved(runs: dict, rounds: int, measure=None) -> dict:
    """``{name: [one reading per round]}``: each of ``runs`` (name -> function) measured in every round, in the
    dict's order in even rounds and reversed in odd ones, so that the machine's drift falls on all of them alike.
    ``measure(function, round)`` takes one reading; by default the seconds of the function, the median of 3 calls
    after a warm-up."""
    if measure is None:
        def measure(run, r):
            return median_time(run, repeats=3, warmup=1)
    readings: dict = {name: [] for name in runs}
    for r in range(rounds):
        for name in turn_order(runs, r):
            readings[name].append(measure(runs[name], r))
    return readings


class WorkerFailed:
    """What ``in_spawned_process``'s worker sends when its target raised: the exception, as text."""

    def __init__(self, message: str):
        self.message = message


def _answer_or_failure(conn, target: Callable, args: tuple) -> None:  # the spawned process's entry point
    try:
        target(conn, *args)
    except Exception as e:  # told to the parent, which raises it with the worker's name
        conn.send(WorkerFailed(f"{type(e).__name__}: {e}"))


def in_spawned_process(target: Callable, args: tuple, what: str, timeout_s: float = 3600.0):
    """``target(conn, *args)`` in a spawned process, which sends one answer on ``conn``: -> that answer. Raises
    ``RuntimeError`` naming ``what`` if the target raised (with its exception), if the process ends without an
    answer (with its exit code) or gives none in ``timeout_s`` (it is killed)."""
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    worker = ctx.Process(target=_answer_or_failure, args=(child, target, args), daemon=True)
    try:
        worker.start()
        child.close()  # if the worker dies, recv() raises EOFError instead of waiting forever
        if not conn.poll(timeout_s):
            raise RuntimeError(f"{what} gave no answer in {timeout_s:.0f} s (killed)")
        answer = conn.recv()
    except (EOFError, OSError):  # it ended without an answer, or in the middle of sending one
        worker.join(timeout=10)
        raise RuntimeError(f"{what} ended without an answer (exit code {worker.exitcode})") from None
    finally:
        child.close()
        conn.close()
        if worker.is_alive():
            worker.join(timeout=5)  # it has answered (or is hung): a few seconds to exit
        if worker.is_alive():
            worker.kill()
            worker.join(timeout=10)
    if isinstance(answer, WorkerFailed):
        raise RuntimeError(f"{what} failed: {answer.message}")
    return answer
