"""Progress of a long benchmark on stderr: what it is doing, how far along it is, and about how long is left.

``python -m gpt2_core bench NAME`` runs each benchmark inside ``running(NAME)``. A benchmark states its work once,
``plan(units)``, in units it weighs roughly by their cost, and reports each part as it finishes,
``advance(units, "what comes next")``. Outside ``running`` (a notebook, a test, your own code) both do nothing.

On a terminal the progress is one line redrawn every second; otherwise (a log file, CI) it is a line every 30
seconds. The time left is the time so far scaled by the work left: rough at first, firmer as the run goes.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from contextlib import contextmanager


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


class Progress:
    """One benchmark's progress, shown on ``stream`` by a background thread every ``every_s`` seconds (1 on a
    terminal, where the line is redrawn in place; 30 elsewhere, one line each time)."""

    def __init__(self, name: str, stream=None, every_s: float | None = None, clock=time.monotonic):
        self.name, self.stream, self.clock = name, stream, clock
        self.tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())
        self.every_s = every_s if every_s is not None else (1.0 if self.tty else 30.0)
        self.total: float | None = None
        self.done = 0.0
        self.what = "starting"
        self.start = clock()
        self._width = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def plan(self, total: float, what: str | None = None) -> None:
        """The whole run is ``total`` units; a second plan (a benchmark that runs another) is ignored."""
        if not total > 0:
            raise ValueError(f"progress: the planned work must be > 0 units, got {total!r}")
        with self._lock:
            if self.total is None:
                self.total = float(total)
            if what is not None:
                self.what = what

    def advance(self, units: float = 1.0, what: str | None = None) -> None:
        """``units`` of the plan are done; ``what``: the part that starts now."""
        with self._lock:
            self.done += units
            if what is not None:
                self.what = what

    def fraction(self) -> float | None:
        return None if self.total is None else min(1.0, self.done / self.total)

    def time_left(self) -> float | None:
        """Seconds left: the time so far times the work left over the work done (None until some is done)."""
        f = self.fraction()
        if not f:
            return None
        return (self.clock() - self.start) * (1 - f) / f

    def line(self) -> str:
        f, left = self.fraction(), self.time_left()
        done = "" if f is None else f"{100 * f:3.0f}%, "
        eta = "time left not known yet" if left is None else f"about {format_duration(left)} left"
        return (f"bench {self.name}: {done}{self.what}; {format_duration(self.clock() - self.start)} so far, "
                f"{eta}")

    def show(self, text: str | None = None, end: str = "") -> None:
        if self.stream is None:
            return
        text = self.line() if text is None else text
        if self.tty:  # one line, redrawn: cut to the terminal's width, or it wraps and cannot be redrawn
            text = text[:max(20, shutil.get_terminal_size().columns - 1)]
            self.stream.write("\r" + text.ljust(self._width) + end)
            self._width = 0 if end else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def __enter__(self) -> "Progress":
        if self.stream is not None:
            if self.tty:
                self.show()
            self._thread = threading.Thread(target=self._tick, name=f"progress {self.name}", daemon=True)
            self._thread.start()
        return self

    def _tick(self) -> None:
        while not self._stop.wait(self.every_s):
            with self._lock:
                self.show()

    def __exit__(self, kind, value, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            ended = "done" if kind is None else "stopped"
            self.show(f"bench {self.name}: {ended} in {format_duration(self.clock() - self.start)}", end="\n")


_current: Progress | None = None


@contextmanager
def running(name: str, stream=None, every_s: float | None = None):
    """Show the progress of benchmark ``name`` on ``stream`` (stderr) while the block runs."""
    global _current
    progress = Progress(name, sys.stderr if stream is None else stream, every_s)
    previous, _current = _current, progress
    try:
        with progress:
            yield progress
    finally:
        _current = previous


def plan(total: float, what: str | None = None) -> None:
    """The running benchmark's work, in units (nothing happens outside ``running``)."""
    if _current is not None:
        _current.plan(total, what)


def advance(units: float = 1.0, what: str | None = None) -> None:
    """``units`` done; ``what`` starts now (nothing happens outside ``running``)."""
    if _current is not None:
        _current.advance(units, what)


def if_installed(units: float, *modules: str) -> float:
    """``units`` when every one of ``modules`` can be imported, else 0: the weight of an optional arm (HF
    transformers, numba), which is skipped, and takes no time, without its extra."""
    import importlib.util

    return units if all(importlib.util.find_spec(m) is not None for m in modules) else 0.0
