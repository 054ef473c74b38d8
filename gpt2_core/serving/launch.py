"""Start ``python -m gpt2_core serve`` in a child process on a free loopback port, and stop it (SIGTERM): what the
tests, the load benchmark and the serving notebook do."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time


class ServerProcess:
    """A running server: ``url`` (``http://127.0.0.1:PORT``), ``base_url`` (``.../v1``), ``pid``; ``stop()`` sends
    SIGTERM and returns the exit code. Also a context manager."""

    def __init__(self, *args: str, timeout: float = 120.0, env: dict | None = None):
        cmd = [sys.executable, "-m", "gpt2_core", "serve", "--port", "0", *args]
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
