"""Appendix: the C library's allocator, set to keep freed memory for the next NumPy temporary."""

from __future__ import annotations

_freed_memory_kept = False  # set by keep_freed_memory(), recorded by the benchmarks' machine_info()


def freed_memory_kept() -> bool:
    """Did ``keep_freed_memory()`` change the allocator in this process?"""
    return _freed_memory_kept


def keep_freed_memory() -> bool:
    """Make the C library's ``malloc`` keep freed memory for the next allocation instead of handing it back to the
    operating system; return whether it could (glibc only: elsewhere nothing changes and this returns False).

    Each NumPy temporary is a ``malloc``'d buffer. By default glibc serves a large one (past a threshold of 128 KiB,
    raised as such blocks are freed, to at most 32 MiB) from fresh pages, and returns the top of its heap to the OS
    once more than twice that threshold is free there. The next temporaries then start on fresh pages again, which
    the OS maps on first write, one 4 KiB page fault each: a 512-token prefill of GPT-2 small makes several arrays
    of 6-13 MB per layer, tens of thousands of page faults per call (the appendix notebook counts them).

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
