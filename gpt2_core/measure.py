"""Measuring: medians of repeated timings, peak memory with tracemalloc, and what machine the numbers came from.

Machines are noisy (two cores shared with whatever else runs), so every figure is a median of repeats, and methods
are compared as ratios measured side by side in the same run, never against numbers from another day.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .errors import is_integer

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

    from .config import preset

    return replace(preset("gpt2"), n_layer=2)


def available_memory_bytes(root: str = "/") -> int | None:
    """Memory this process can still get without swapping or passing its container's limit: the smaller of
    Linux's ``MemAvailable`` and what the cgroup's memory limit leaves (cgroup v2 or v1); None where the system
    tells neither. ``root``: where to find ``proc/`` and ``sys/`` (tests point it at fake files)."""
    def read(path):
        try:
            return (Path(root) / path).read_text()
        except OSError:
            return None

    found = []
    meminfo = read("proc/meminfo") or ""
    found += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    for limit_file, usage_file in (("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current"),
                                   ("sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = read(limit_file), read(usage_file)
        if limit and usage and limit.strip().isdigit() and int(limit) < 2**60:  # "max" / huge: no limit
            found.append(max(0, int(limit) - int(usage)))
    return min(found) if found else None


_freed_memory_kept = False  # set by keep_freed_memory(), recorded by machine_info()


def keep_freed_memory() -> bool:
    """Make the C library's ``malloc`` keep freed memory for the next allocation instead of handing it back to the
    operating system; return whether it could (glibc only: elsewhere nothing changes and this returns False).

    Each NumPy temporary is a ``malloc``'d buffer. By default glibc serves a large one (past a threshold of 128 KiB,
    raised as such blocks are freed, to at most 32 MiB) from fresh pages, and returns the top of its heap to the OS
    once more than twice that threshold is free there. The next temporaries then start on fresh pages again, which
    the OS maps on first write, one 4 KiB page fault each. A 512-token prefill of GPT-2 small makes several arrays
    of 6-13 MB per layer: on this project's machine every call faulted about 55,000 pages (220 MB) in.

    This sets glibc's ``M_MMAP_THRESHOLD`` to 32 MiB (blocks below it come from the heap) and turns off heap
    trimming (``M_TRIM_THRESHOLD`` = -1), for the whole process and for good (it overrides ``MALLOC_*_``
    environment settings; under a preloaded allocator such as jemalloc it changes nothing that matters). The
    price: the heap stays at its peak size, as a server's would. The benchmark commands (``python -m gpt2_core
    bench``) call this first, so every strategy they time, HF transformers too, runs with the same allocator;
    library functions never call it.
    """
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's <malloc.h>
    global _freed_memory_kept
    mmap_set = mallopt(m_mmap_threshold, 32 * 2**20) == 1  # 0 where 32 MiB is past the limit (32-bit glibc)
    trim_set = mallopt(m_trim_threshold, -1) == 1
    _freed_memory_kept = mmap_set and trim_set
    return _freed_memory_kept


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


def machine_info() -> dict:
    """Versions, BLAS and its threads, cores and the load on them: the context every benchmark records."""
    info = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "blas": blas_info(),
        "malloc_keeps_freed_memory": _freed_memory_kept,  # keep_freed_memory() was called (glibc)
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
