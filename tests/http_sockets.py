"""The server over real sockets, in this process: uvicorn in a thread, configured as ``serve`` configures it
(``app.uvicorn_config``: the h11 protocol with its header clock), on a free loopback port; and raw-socket clients
that misbehave on purpose (half a body then gone, a body a byte at a time, a stream dropped after its first event,
malformed HTTP). Used by the hardening and fuzz tests: what never reaches the app (request lines, headers, framing,
timing) can only be tested this way."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import uvicorn

from gpt2_core.ch07_serving.app import listen, uvicorn_config


@contextlib.contextmanager
def serving(app, header_timeout_s: float = 10.0):
    """``app`` served on a free loopback port until the block ends; yields the port. The app's lifespan (its
    engine's thread) runs with it. uvicorn's logging is left as the tests set it (no ``dictConfig``)."""
    sock, _, port = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn_config(app, header_timeout_s, log_config=None, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the server in the thread did not start")
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@dataclass
class Reply:
    status: int | None  # None: the server closed the connection without an answer
    headers: dict = field(default_factory=dict)  # lower-case names
    body: bytes = b""

    def json(self):
        return json.loads(self.body)


def read_reply(f) -> Reply:
    """One HTTP/1.1 response from ``f`` (a socket's ``makefile("rb")``), past any ``100 Continue``: by
    Content-Length, chunks, or up to the close. A connection closed (or reset) before a status line:
    ``Reply(None)``; during the body: what came of it."""
    reply = Reply(None)
    try:
        while reply.status is None or reply.status < 200:
            line = f.readline()
            if not line:
                return Reply(None)
            reply = Reply(int(line.split()[1]))
            while (header := f.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                reply.headers[name.strip().lower()] = value.strip()
        if "content-length" in reply.headers:
            reply.body = f.read(int(reply.headers["content-length"]))
        elif reply.headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int(f.readline().split(b";")[0], 16):
                reply.body += f.read(size)
                f.readline()
            f.readline()  # the empty line after the last chunk
        else:
            reply.body = f.read()
    except ConnectionError:
        pass
    return reply


def connect(port: int, timeout: float = 60.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def request_bytes(method: str, path: str, body: bytes = b"", headers: dict | None = None) -> bytes:
    """A well-formed HTTP/1.1 request (a JSON body's headers unless ``headers`` says otherwise)."""
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", "Content-Length": str(len(body)),
              **(headers or {})}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode("latin-1") + body


def exchange(port: int, data: bytes, replies: int = 1, timeout: float = 60.0, half_close: bool = False) -> list:
    """Send ``data`` at once, read up to ``replies`` responses (fewer if the server closes first)."""
    with connect(port, timeout) as sock:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except ConnectionError:  # the server refused the rest (a header too large): its answer may be in already
            pass
        f = sock.makefile("rb")
        out = []
        while len(out) < replies:
            reply = read_reply(f)
            out.append(reply)
            if reply.status is None or reply.headers.get("connection", "").lower() == "close":
                break
        return out


def trickle(port: int, prefix: bytes, data: bytes, interval_s: float, timeout: float = 60.0) -> Reply:
    """Send ``prefix`` at once, then ``data`` a byte every ``interval_s`` seconds (a slow client), until it is all
    sent or the server answers or closes; the reply."""
    with connect(port, timeout) as sock:
        sock.sendall(prefix)
        for i in range(len(data)):
            try:
                sock.sendall(data[i:i + 1])
            except ConnectionError:  # the server closed the connection on us
                break
            time.sleep(interval_s)
            sock.settimeout(0)  # has the server answered (or closed) meanwhile? then stop sending
            try:
                sock.recv(1, socket.MSG_PEEK)
                break
            except (BlockingIOError, InterruptedError):
                pass
            except ConnectionError:
                break
            finally:
                sock.settimeout(timeout)
        return read_reply(sock.makefile("rb"))


def drop_stream_after_first_event(port: int, body: dict, timeout: float = 60.0) -> bool:
    """Ask for a streamed completion, read until its first ``data:`` event, hang up. True if an event came."""
    with connect(port, timeout) as sock:
        sock.sendall(request_bytes("POST", "/v1/completions", json.dumps({**body, "stream": True}).encode()))
        f = sock.makefile("rb")
        if not f.readline().startswith(b"HTTP/1.1 200"):  # refused (a 429 when the server is full): no stream
            return False
        while not (line := f.readline()).startswith(b"data: "):
            if not line:
                return False
        return True


# Requests that stop half way, then stay silent: one in its body (the body clock, ``--body-timeout-s``, must end it),
# one in its headers (the header clock, ``--header-timeout-s``).
STALLED = ((b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\":", b"--body-timeout-s"),
           (b"Content-Type: app", b"--header-timeout-s"))


def stalled_answers(url: str, headers: bytes = b"") -> list[tuple[bytes, bytes, float]]:
    """Each ``STALLED`` request sent to ``url`` (``http://host:port``) as ``POST /v1/completions`` with ``headers``
    (``b"Name: value\\r\\n"`` lines), then nothing more: [(the flag of the clock that should end it, all that came
    back up to the close, seconds from the last byte sent to the close)]."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    out = []
    for sent, clock in STALLED:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + headers + sent)
            t0 = time.perf_counter()
            answer = sock.makefile("rb").read()  # up to the close
        out.append((clock, answer, time.perf_counter() - t0))
    return out
