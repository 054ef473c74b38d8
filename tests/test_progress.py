"""``gpt2_core.bench.progress``: a benchmark's progress and time left on stderr, only when the CLI asks for it."""

import io
import time

import pytest

from gpt2_core.bench import progress


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_durations_read_as_a_person_says_them():
    assert [progress.format_duration(s) for s in (0, 42.4, 60, 185, 3599.6, 3720)] == \
        ["0 s", "42 s", "1 min 00 s", "3 min 05 s", "1 h 00 min", "1 h 02 min"]


def test_the_time_left_is_the_time_so_far_scaled_by_the_work_left():
    clock = FakeClock()
    p = progress.Progress("kv-cache", io.StringIO(), every_s=3600, clock=clock)
    assert p.fraction() is None and p.time_left() is None
    assert p.line() == "bench kv-cache: starting; 0 s so far, time left not known yet"
    p.plan(40, "naive forward")
    clock.now += 30
    assert p.time_left() is None  # nothing done yet: no estimate
    p.advance(10, "KV-cache decode steps")
    assert p.fraction() == 0.25 and p.time_left() == pytest.approx(90.0)  # 30 s for a quarter: 90 s for the rest
    assert p.line() == "bench kv-cache:  25%, KV-cache decode steps; 30 s so far, about 1 min 30 s left"
    p.plan(1000)  # a benchmark run by another keeps the outer plan
    p.advance(50)
    assert p.total == 40 and p.fraction() == 1.0 and p.time_left() == 0.0
    with pytest.raises(ValueError, match="> 0 units"):
        progress.Progress("x").plan(0)


def test_a_log_gets_whole_lines_and_a_terminal_one_line_redrawn():
    log = io.StringIO()
    with progress.Progress("paged", log, every_s=3600) as p:
        p.plan(2)
        p.show()
        p.advance(1, "equal batch")
        p.show()
    lines = log.getvalue().splitlines()
    assert len(lines) == 3 and lines[0].startswith("bench paged:   0%") and "equal batch" in lines[1]
    assert lines[2].startswith("bench paged: done in ") and "\r" not in log.getvalue()

    term = Terminal()
    with progress.Progress("paged", term, every_s=3600) as p:  # a terminal sees the line at once
        p.plan(2)
        p.advance(1, "equal batch")
        p.show()
    text = term.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")  # one line, redrawn with \r, ended when the run ends
    assert text.count("\r") == 3 and "equal batch" in text and "bench paged: done in " in text


def test_lines_come_periodically_and_a_failed_run_says_it_stopped():
    log = io.StringIO()
    p = progress.Progress("serve", log, every_s=0.02)
    p.plan(10)
    p.advance(5, "rates")
    with pytest.raises(RuntimeError):
        with p:
            deadline = time.monotonic() + 10
            while log.getvalue().count("\n") < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            raise RuntimeError("interrupted")
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(" 50%, rates; " in line for line in lines[:-1])
    assert lines[-1].startswith("bench serve: stopped in ")


def test_outside_the_command_benchmarks_stay_silent_and_inside_it_their_plan_is_completed(capsys):
    """A benchmark called as a function (a notebook, a test) prints nothing; run under ``running`` (as the CLI
    runs it), every unit it plans is advanced by its end."""
    from gpt2_core import GPT2Config
    from gpt2_core.bench.layout import bench_layout

    config = GPT2Config(vocab_size=50, n_positions=128, n_embd=32, n_head=2, n_layer=2)
    progress.plan(10)
    progress.advance(3, "nothing runs")  # no-ops
    bench_layout(quick=True, context=8, shape=config)
    assert capsys.readouterr().err == ""
    log = io.StringIO()
    with progress.running("layout", log, every_s=3600) as p:
        bench_layout(quick=True, context=8, shape=config)
    assert p.total > 0 and p.done == pytest.approx(p.total)
    assert log.getvalue().startswith("bench layout: done in ") and progress._current is None


def test_the_command_announces_the_duration_and_warns_of_a_busy_machine(monkeypatch):
    from gpt2_core.bench import registry

    out = io.StringIO()
    monkeypatch.setattr(registry.os, "getloadavg", lambda: (0.2, 0.2, 0.2))
    registry.announce("prefix", quick=False, stream=out)
    full, quick = registry.MINUTES["prefix"]
    assert out.getvalue() == (f"bench prefix: about {full} min on 2 idle cores; --quick (or GPT2_QUICK=1) runs small "
                              f"sizes in about {quick} min\n")
    out = io.StringIO()
    monkeypatch.setattr(registry.os, "getloadavg", lambda: (3.4, 2.0, 1.0))
    registry.announce("prefix", quick=True, stream=out)
    assert out.getvalue().startswith(f"bench prefix (quick sizes): about {quick} min")
    assert "load 3.4 now: other work slows this run and skews its timings" in out.getvalue()
    assert set(registry.MINUTES) == set(registry.BENCHMARKS)


def test_a_ratio_that_needs_an_extra_says_which():
    from gpt2_core.bench.registry import why_missing

    assert "reference extra" in why_missing("kv_cache_over_hf")
    assert "kernels extra" in why_missing("int8_numba_over_fp32_batch1")
    assert why_missing("continuous_over_static") == ""
