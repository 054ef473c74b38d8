"""Arms measured side by side in processes that take turns (chapter 6's benchmark's method, for any benchmark).

Some kernels slow others in the process they share: numba's worker threads slow OpenBLAS, and llama.cpp brings a
thread pool of its own. Each such family of arms runs in a spawned worker process (a ``TurnWorker``); the main
process and the workers take turns by round (``take_turns``), the order reversed every other round, with a pause
between turns so that the other process's threads go idle before a clock starts. A process waits on a pipe while
another measures, so no two arms ever run at once, and the machine's drift falls on every arm alike.

A reading is the median of ``repeats`` calls after one untimed call (the first call after another process's turn
finds cold caches); ``repeats`` is one number for every arm, or a number per arm's name.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

from .common import blas_threads, median_time, turn_order

SETTLE_S = 0.3  # pause between two turns: the other process's threads go idle before a clock starts


def measure_round(runners: dict, r: int, repeats: int | dict) -> dict:
    """One reading of each runner (median of its repeats after one warm-up), in order, reversed in odd rounds."""
    return {name: median_time(runners[name], repeats=repeats[name] if isinstance(repeats, dict) else repeats,
                              warmup=1) for name in turn_order(runners, r)}


def worker_main(conn, build: Callable, args: tuple, threads: int | None, repeats: int | dict) -> None:
    """A worker process: ``build(*args)`` makes ``(runners, describe)``; each runner runs once (buffers, compiling),
    then ``describe()`` (a dict) goes back to the main process, then one round of readings per round number it
    sends, until it sends None. An error while building goes back as ``{"error": text}``."""
    with blas_threads(threads):
        try:
            runners, describe = build(*args)
            for run in runners.values():
                run()
            conn.send(describe())
        except Exception as e:  # reported by the main process, naming the worker
            conn.send({"error": f"{type(e).__name__}: {e}"})
            return
        while (r := conn.recv()) is not None:
            conn.send(measure_round(runners, r, repeats))


class TurnWorker:
    """A spawned process holding some arms (``build(*args)``, a module-level function, see ``worker_main``), ready
    to take its turns; ``info`` is what its ``describe()`` said. A failure while building raises a RuntimeError."""

    def __init__(self, build: Callable, args: tuple = (), threads: int | None = None, repeats: int | dict = 3):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child, build, args, threads, repeats), daemon=True)
        self.process.start()
        child.close()  # the worker's end: if the worker dies, recv() here raises EOFError instead of waiting
        try:
            self.info = self.conn.recv()
        except EOFError:  # it died without a word (a crash in native code)
            self.process.join(timeout=60)
            raise RuntimeError(f"{build.__name__}: its worker process ended (exit code {self.process.exitcode}) "
                               f"before it was ready") from None
        if "error" in self.info:
            self.close()
            raise RuntimeError(f"{build.__name__} failed in its worker process: {self.info['error']}")

    def round(self, r: int) -> dict:
        self.conn.send(r)
        return self.conn.recv()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except OSError:  # it stopped after all
                pass
        self.process.join(timeout=60)


def take_turns(runners: dict, workers: list[TurnWorker], rounds: int, repeats: int | dict,
               settle_s: float = SETTLE_S, after_round: Callable[[int], object] | None = None) -> dict:
    """``{name: [one reading per round]}`` of the main process's ``runners`` and every worker's, by turns: the
    main process first in even rounds, last in odd ones. ``after_round(r)`` runs after each round (progress)."""
    readings: dict = {name: [] for name in runners}
    turns = ["main", *workers]
    for r in range(rounds):
        for turn in turn_order(turns, r):
            got = measure_round(runners, r, repeats) if turn == "main" else turn.round(r)
            for name, seconds in got.items():
                readings.setdefault(name, []).append(seconds)
            time.sleep(settle_s)
        if after_round is not None:
            after_round(r)
    return readings
