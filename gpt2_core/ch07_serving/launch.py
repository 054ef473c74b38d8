"""Start ``python -m gpt2_core serve`` (or ``route``) in a child process on a free loopback port, and stop it
(SIGTERM): what the tests, the load benchmarks and the serving notebooks do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

BLAS_THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")


def blas_env(threads: int) -> dict:
    """Environment variables giving a child process's BLAS (OpenBLAS, OpenMP builds, MKL) ``threads`` threads."""
    return {name: str(threads) for name in BLAS_THREAD_VARIABLES}


class ServerProcess:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``base_url`` (``.../v1``), ``pid``; ``stop()`` sends
    SIGTERM and returns the exit code. Also a context manager."""

    command = "serve"

    def __init__(self, *args: str, timeout: float = 120.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "gpt2_core", self.command, "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.stderr: list[str] = []
        threading.Thread(target=self._drain, args=(self.proc.stderr, self.stderr), daemon=True).start()
        line, deadline = "", time.monotonic() + timeout
        while time.monotonic() < deadline:  # the first line says where it listens
            line = self.proc.stdout.readline()
            if line or self.proc.poll() is not None:
                break
        match = re.search(r"on (http://[^/\s]+)/v1", line)
        if not match:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"the server did not start: {line!r}\n{''.join(self.stderr)}")
        self.url = match.group(1)
        self.base_url = self.url + "/v1"
        self.pid = self.proc.pid
        threading.Thread(target=self._drain, args=(self.proc.stdout, []), daemon=True).start()

    @staticmethod
    def _drain(stream, into: list) -> None:
        for line in stream:
            into.append(line)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class RouterProcess(ServerProcess):
    """A running ``python -m gpt2_core route`` (``args``: its flags, e.g. ``--replica URL --replica URL``)."""

    command = "route"


def start_servers(n: int, *args: str, threads: int = 1, timeout: float = 120.0) -> list[ServerProcess]:
    """``n`` servers started side by side (``args`` for each), each with ``threads`` BLAS threads; if one fails to
    start, the others are stopped and the error raised."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(ServerProcess, *args, timeout=timeout, env=blas_env(threads)) for _ in range(n)]
    servers, errors = [], []
    for f in futures:
        try:
            servers.append(f.result())
        except Exception as e:
            errors.append(e)
    if errors:
        for s in servers:
            s.stop()
        raise errors[0]
    return servers
