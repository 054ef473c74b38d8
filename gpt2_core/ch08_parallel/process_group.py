"""Chapter 8: worker processes that share memory with the driver (the plumbing of both kinds of parallelism).

A ``ProcessGroup`` starts ``world_size`` worker processes (spawned: a fresh interpreter each, inheriting none of
the driver's threads or BLAS state), maps named shared-memory arrays into all of them
(``multiprocessing.shared_memory``: the same physical pages in every process, so writing an activation there *is*
sending it), and runs one command at a time on every worker. Each worker runs NumPy on 1 BLAS thread: two workers,
two cores. Commands travel through a pipe per worker (a few bytes); tensors through the shared arrays.

Faults: the driver waits on the workers' replies *and* on their process sentinels, so a worker that dies (killed,
out of memory, crashed in C) is seen at once, not after a timeout. The call raises ``WorkerError`` naming the
worker and its exit code, and the group shuts itself down: the other workers are stopped (they may be waiting for
the dead one) and every shared-memory segment is unlinked. A worker whose driver dies sees its pipe close and
exits; a worker waiting at a barrier for a peer that never comes gives up after ``BARRIER_TIMEOUT_S``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import signal
import traceback
import weakref
from multiprocessing import connection, shared_memory

import numpy as np

from ..errors import WorkerError

SHM_PREFIX = "gpt2core_"  # every segment's name starts with this (/dev/shm/gpt2core_...), so leaks are easy to find
BARRIER_TIMEOUT_S = 120.0  # a worker waiting this long for its peers assumes they are gone, and exits
CONTEXT = mp.get_context("spawn")


ALIGN = 64  # bytes: every array in a segment starts on a cache line


def create_shared(specs: dict, tag: str = "arrays") -> tuple[dict, shared_memory.SharedMemory, tuple]:
    """``{name: (shape, dtype)}`` -> ({name: array}, the one new shared-memory segment holding them all, its layout
    for ``attach_shared``). Arrays start zeroed."""
    offsets, size = {}, 0
    for name, (shape, dtype) in specs.items():
        offsets[name] = (size, tuple(shape), np.dtype(dtype).str)
        size += -(-int(np.prod(shape)) * np.dtype(dtype).itemsize // ALIGN) * ALIGN
    name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}_{tag}"
    segment = shared_memory.SharedMemory(name=name, create=True, size=max(size, 1))
    layout = (segment.name, offsets)
    return _arrays(segment, offsets), segment, layout


def attach_shared(layout: tuple) -> tuple[dict, shared_memory.SharedMemory]:
    """The arrays of a segment made by ``create_shared``, mapped into this process."""
    segment = shared_memory.SharedMemory(name=layout[0])
    return _arrays(segment, layout[1]), segment


def _arrays(segment, offsets: dict) -> dict:
    return {name: np.ndarray(shape, dtype=dtype, buffer=segment.buf, offset=offset)
            for name, (offset, shape, dtype) in offsets.items()}


def flatten(tree, prefix: str = "") -> dict:
    """Nested dicts and lists of arrays -> ``{"h.0.attn.c_attn.weight": array, ...}``, as checkpoints name them."""
    if isinstance(tree, np.ndarray):
        return {prefix[:-1]: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    return {k: v for key, sub in items for k, v in flatten(sub, f"{prefix}{key}.").items()}


def unflatten(flat: dict):
    """The inverse of ``flatten`` (a level whose keys are all digits becomes a list)."""
    tree: dict = {}
    for key, value in flat.items():
        node, *path, leaf = [tree, *key.split(".")]
        for step in path:
            node = node.setdefault(step, {})
        node[leaf] = value
    return _lists(tree)


def _lists(node):
    if not isinstance(node, dict):
        return node
    if node and all(k.isdigit() for k in node):
        return [_lists(node[str(i)]) for i in range(len(node))]
    return {k: _lists(v) for k, v in node.items()}


def release_shared(arrays: list, segments: list, unlink: bool) -> None:
    """Drop the arrays (they pin the mapping), unmap the segments and, for their creator, unlink them."""
    for named in arrays:
        named.clear()
    for segment in segments:
        try:
            segment.close()
        except BufferError:  # someone still holds a view: the mapping goes when they do; the name goes anyway
            pass
        if unlink:
            try:
                segment.unlink()
            except FileNotFoundError:
                pass
    segments.clear()


def _worker_main(worker_cls, rank: int, conn, layouts: tuple, barrier, init_args: tuple) -> None:
    """A worker's life: pin BLAS to one thread, map the arrays and its weights, build the worker, serve commands."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle; it stops us cleanly
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")
    (arrays, common), (weights, own) = attach_shared(layouts[0]), attach_shared(layouts[1])
    segments = [common, own]
    try:
        worker = worker_cls(rank, arrays, barrier, unflatten(weights), *init_args)
        conn.send(("ok", None))
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # the driver is gone
                break
            if method == "stop":
                break
            try:
                conn.send(("ok", getattr(worker, method)(*args)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        conn.send(("error", traceback.format_exc()))
    finally:
        release_shared([arrays, weights], segments, unlink=False)


def _shutdown(procs: list, conns: list, arrays: list, segments: list) -> None:
    """Stop every worker (politely, then by force), close the pipes, free the shared memory. Idempotent."""
    for conn in conns:
        try:
            conn.send(("stop", ()))
        except (OSError, ValueError):
            pass
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
    release_shared(arrays, segments, unlink=True)


def describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


class ProcessGroup:
    """``len(weights)`` workers, worker ``rank`` built as ``worker_cls(rank, arrays, barrier, weights[rank],
    *init_args[rank])``: ``weights[rank]`` (nested dicts/lists of arrays) arrive mapped from shared memory, read-only
    by convention, and ``arrays`` (from ``specs``: ``{name: (shape, dtype)}``) are shared by the driver and all.


    ``call(method, *args)`` runs ``worker.method(*args)`` on every worker at once and returns their results in rank
    order; the shared ``arrays`` are visible to the driver as ``group.arrays``. Use as a context manager (or call
    ``close()``); a group that is garbage-collected or left at exit is closed too.
    """

    def __init__(self, worker_cls, weights: list, init_args: list, specs: dict, name: str = "worker"):
        self.name, self.world_size = name, len(weights)
        self._procs, self._conns, self._segments, named = [], [], [], []
        self._closer = weakref.finalize(self, _shutdown, self._procs, self._conns, named, self._segments)
        try:
            self.arrays, segment, layout = create_shared(specs)
            named.append(self.arrays)
            self._segments.append(segment)
            self.barrier = CONTEXT.Barrier(self.world_size)
            for rank, (tensors, args) in enumerate(zip(weights, init_args)):
                self._start(worker_cls, rank, layout, self._share_weights(rank, tensors), tuple(args))
            self._collect()  # every worker built (or the first failure raised)
        except BaseException:
            self.close()
            raise
        self._names = [seg.name for seg in self._segments]

    def _share_weights(self, rank: int, tensors: dict) -> tuple:
        """Copy one worker's weights into a segment of their own (the driver's copy can go; the worker maps it)."""
        flat = flatten(tensors)
        arrays, segment, layout = create_shared({k: (v.shape, v.dtype) for k, v in flat.items()}, f"weights{rank}")
        self._segments.append(segment)
        for k, v in flat.items():
            arrays[k][...] = v
        return layout

    def _start(self, worker_cls, rank: int, layout: tuple, weights_layout: tuple, args: tuple) -> None:
        ours, theirs = CONTEXT.Pipe()
        p = CONTEXT.Process(target=_worker_main, name=f"{self.name}-{rank}", daemon=True,
                            args=(worker_cls, rank, theirs, (layout, weights_layout), self.barrier, args))
        p.start()  # small arguments only (names of segments): the weights travel through shared memory
        theirs.close()  # only the worker holds its end: if it dies, our recv sees EOF, not a hang
        self._procs.append(p)
        self._conns.append(ours)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def segment_names(self) -> list[str]:
        """The shared-memory segments this group made (``/dev/shm/<name>`` on Linux while they exist)."""
        return list(self._names)

    @property
    def closed(self) -> bool:
        return not self._closer.alive

    def call(self, method: str, *args) -> list:
        if self.closed:
            raise WorkerError(f"the {self.name} group is closed (shut down after a failure, or by close())")
        for rank, conn in enumerate(self._conns):
            try:
                conn.send((method, args))
            except OSError:
                self._fail(rank)
        return self._collect()

    def _collect(self) -> list:
        """Every worker's reply, watching their sentinels: a death is noticed while we wait."""
        results, pending = [None] * self.world_size, dict(zip(self._conns, range(self.world_size)))
        sentinels = {p.sentinel: rank for rank, p in enumerate(self._procs)}
        while pending:
            ready = connection.wait(list(pending) + list(sentinels))
            for obj in sorted(ready, key=lambda o: o in sentinels):  # replies first, then deaths
                if obj in sentinels:
                    self._fail(sentinels[obj])
                rank = pending.pop(obj)
                try:
                    status, value = obj.recv()
                except (EOFError, OSError):
                    self._fail(rank)
                if status == "error":
                    self._fail(rank, value)
                results[rank] = value
        return results

    def _fail(self, rank: int, worker_traceback: str | None = None):
        p = self._procs[rank]
        p.join(timeout=1)  # a dying process may need a moment to be reaped
        what = (f"raised an exception:\n{worker_traceback}" if worker_traceback else
                f"died ({describe_exit(p.exitcode)})")
        self.close()
        raise WorkerError(f"{self.name} worker {rank} (pid {p.pid}) {what}; the group is shut down (its other "
                          f"workers stopped, its shared memory freed): start a new one")

    def close(self) -> None:
        self._closer()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class OwnsGroup:
    """``close()`` and ``with`` for a class whose workers are ``self.group`` (a ``ProcessGroup``)."""

    group: ProcessGroup

    def close(self) -> None:
        self.group.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
