"""The measuring knobs: GPT2_QUICK shrinks benchmark sizes; nbgrader's NBGRADER_EXECUTION makes a graded run time
everything once on a 2-layer model of GPT-2's width (grades never depend on timings); and the allocator setting
every benchmark runs with (``keep_freed_memory``)."""

import json
import os
import platform
import subprocess
import sys

import pytest

from helpers import ROOT

PROBE = """
import json
from gpt2_core.bench import common as measure
calls = []
measure.median_time(lambda: calls.append(1), repeats=5, warmup=2)
shape = measure.timing_model_shape()
print(json.dumps({"grading": measure.GRADING, "quick": measure.QUICK, "calls": len(calls),
                  "shape": shape if isinstance(shape, str) else [shape.n_layer, shape.n_embd, shape.n_head,
                                                                 shape.vocab_size, shape.n_positions]}))
"""


def probe(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("NBGRADER_EXECUTION", "GPT2_QUICK")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_default_times_every_repeat_on_gpt2_small():
    assert probe() == {"grading": False, "quick": False, "calls": 7, "shape": "gpt2"}


def test_quick_mode_changes_sizes_not_timing():
    assert probe(GPT2_QUICK="1") == {"grading": False, "quick": True, "calls": 7, "shape": "gpt2"}
    assert probe(GPT2_QUICK="0")["quick"] is False


def test_nbgrader_grading_times_once_on_a_shallow_gpt2():
    for value in ("autograde", "validate"):
        got = probe(NBGRADER_EXECUTION=value)
        assert got == {"grading": True, "quick": True, "calls": 1, "shape": [2, 768, 12, 50257, 1024]}


TEMPORARIES = """
import resource
import numpy as np
from gpt2_core.bench import common as measure
from gpt2_core.a1_cpu_kernels import keep_freed_memory

def faults_of_temporaries():
    x = np.ones(2**20, dtype=np.float32)  # 4 MiB
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a, b, c = x * 2, x * 3, x * 4  # three 4 MiB temporaries alive together, then freed
        del a, b, c
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

faults_of_temporaries()
before = faults_of_temporaries()
recorded_before = measure.machine_info()["malloc_keeps_freed_memory"]
kept = keep_freed_memory()
faults_of_temporaries()
print(kept, before, faults_of_temporaries(), recorded_before, measure.machine_info()["malloc_keeps_freed_memory"])
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or sys.maxsize < 2**32, reason="mallopt is 64-bit glibc's")
def test_keeping_freed_memory_stops_the_page_faults_of_repeated_temporaries():
    """In a fresh process (the setting is process-wide): with glibc's defaults, three 4 MiB temporaries made and
    freed 20 times fault their pages in again and again; after ``keep_freed_memory()`` they reuse the heap."""
    out = subprocess.run([sys.executable, "-c", TEMPORARIES], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    kept, before, after = out[0] == "True", int(out[1]), int(out[2])
    assert kept and out[3:] == ["False", "True"]  # and machine_info() records it
    assert before >= 100, before  # 30,000 here (4 KiB pages); fewer, but still many, with huge pages
    assert after < before / 100, (before, after)


@pytest.mark.parametrize("kwargs, named", [({"repeats": 0}, "repeats"), ({"repeats": -1}, "repeats"),
                                           ({"repeats": 2.5}, "repeats"), ({"repeats": True}, "repeats"),
                                           ({"warmup": -1}, "warmup"), ({"warmup": 1.0}, "warmup")])
def test_median_time_refuses_counts_that_time_nothing(kwargs, named):
    from gpt2_core.bench import common as measure

    calls = []
    with pytest.raises(ValueError, match=f"median_time: {named} must be an integer"):
        measure.median_time(lambda: calls.append(1), **kwargs)
    assert calls == []  # refused before anything ran


def test_peak_memory_leaves_a_callers_tracing_on():
    import tracemalloc

    import numpy as np

    from gpt2_core.bench import common as measure

    peak, result = measure.peak_memory(lambda: np.ones(2**20, dtype=np.float32).sum())
    assert peak >= 4 * 2**20 and result == 2**20 and not tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        measure.peak_memory(lambda: np.ones(10))
        assert tracemalloc.is_tracing()  # the caller's own tracing survives the measurement
    finally:
        tracemalloc.stop()


def answers(conn, x):  # the workers of the test below: module-level, so that a spawned process can import them
    conn.send(x * 2)


def dies(conn, code):
    os._exit(code)


def raises(conn):
    raise ValueError("no such row")


def hangs(conn):
    import time
    time.sleep(60)


def test_in_spawned_process_returns_the_answer_or_names_a_death_or_a_hang():
    import time

    from gpt2_core.bench import capstone
    from gpt2_core.bench import common as measure

    assert measure.in_spawned_process(answers, (21,), "doubler") == 42
    with pytest.raises(RuntimeError, match=r"^the worker ended without an answer \(exit code 3\)$"):
        measure.in_spawned_process(dies, (3,), "the worker")
    with pytest.raises(RuntimeError, match=r"^the worker failed: ValueError: no such row$"):
        measure.in_spawned_process(raises, (), "the worker")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"^the sleeper gave no answer in 2 s \(killed\)$"):
        measure.in_spawned_process(hangs, (), "the sleeper", timeout_s=2)
    assert time.perf_counter() - t0 < 30  # not the worker's 60 s


def test_a_failing_int8_numba_worker_costs_its_row_not_the_run(monkeypatch):
    from gpt2_core.bench import capstone

    def fail(*args, **kwargs):
        raise RuntimeError("the int8_numba worker ended without an answer (exit code -9)")
    monkeypatch.setattr(capstone.quant_kernels, "numba_available", lambda: True)
    monkeypatch.setattr(capstone, "in_spawned_process", fail)
    assert capstone.numba_row(None, [], None) == (
        None, None, "int8_numba: the int8_numba worker ended without an answer (exit code -9)")
