"""What a slow client may hold: a connection for ``header_timeout_s`` while its request's headers arrive, a request
for ``body_timeout_s`` while its body arrives. Past either, a 408 and the connection closed.

A client that sends its request a byte at a time (slowloris) never reaches the engine: the engine sees a request
only once its body is whole. But it holds a connection, a file descriptor and a task for as long as it likes, and
enough of them exhaust the server. uvicorn closes an idle connection between two requests (its keep-alive timeout,
5 s), but sets no limit before the first request's headers are in, nor on a body: nginx (``client_header_timeout``,
``client_body_timeout``) and Apache (``RequestReadTimeout``) do.

* ``GuardedH11Protocol``: uvicorn's h11 protocol, with a clock on the headers (they never reach the app). It runs
  from the connection's start until the first request's headers are in; for a later request on the same
  connection, from its first byte (before that, uvicorn's keep-alive timeout closes the idle connection). When it
  runs out, a connection that sent part of a request gets a 408 (as JSON, OpenAI's error object) and is closed; one
  that sent nothing is closed (a browser's pre-connection is no error to answer). The same clock runs on the rest
  of a body whose request is answered already (a 404, 415 or 429, sent without reading it): nobody reads it, and
  uvicorn would keep the connection open as long as it trickles in.
* ``BodyTimeout``: an ASGI middleware, with a clock on the body from the moment the app has the headers: a body
  still incomplete ``body_timeout_s`` later gets a 408 and the connection closed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time

import h11
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import InvalidInputError
from .protocol import BadRequest

HEADER_TIMEOUT_S = 10.0  # a client sends its headers in one packet; 10 s is room for any real network
BODY_TIMEOUT_S = 30.0  # the largest body allowed (1 MiB) at 35 KB/s


def timeout_message(what: str, seconds: float, flag: str) -> str:
    return f"the request's {what} did not arrive within {seconds:g} s ({flag}); the connection is closed"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's ``H11Protocol`` with a clock on the client while the connection waits on it alone (see the
    module's docstring): for a request's headers, or for the rest of a body whose request is answered already
    (a 404, 415 or 429 answered unread: nobody reads it, and uvicorn would keep the connection for it).

    It leans on what is public: asyncio's ``Protocol`` methods, which it extends, and the state of the h11
    connection uvicorn parses with (``self.conn``): ``their_state`` is ``IDLE`` exactly while a request's headers
    are incomplete, ``SEND_BODY`` while its body comes; ``our_state`` is ``DONE`` once it is answered;
    ``trailing_data`` holds the bytes received and not parsed yet."""

    def __init__(self, *args, header_timeout_s: float = HEADER_TIMEOUT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout_s = header_timeout_s
        self.header_timer: asyncio.TimerHandle | None = None
        self.guarded_transport = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.guarded_transport = transport
        self.arm_header_timer()  # the first request's headers: on the clock from the connection's start

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.waiting_on_client():  # a request in progress (the app has it), or the connection ending
            self.cancel_header_timer()
        elif self.header_timer is None:  # a later request's first bytes, or an answered one's body: from now
            self.arm_header_timer()

    def connection_lost(self, exc) -> None:
        self.cancel_header_timer()
        super().connection_lost(exc)

    def waiting_on_client(self) -> bool:
        their, ours = self.conn.their_state, self.conn.our_state
        return their is h11.IDLE or (their is h11.SEND_BODY and ours is h11.DONE)

    def arm_header_timer(self) -> None:
        self.cancel_header_timer()
        self.header_timer = asyncio.get_running_loop().call_later(self.header_timeout_s, self.headers_timed_out)

    def cancel_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def headers_timed_out(self) -> None:
        """The clock ran out: if the connection still waits on the client, close it; with a 408 if part of a
        request's headers came."""
        self.header_timer = None
        transport = self.guarded_transport
        if not self.waiting_on_client() or transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:  # part of a request's headers
            error = BadRequest(timeout_message("headers", self.header_timeout_s, "--header-timeout-s"), None, 408)
            body = json.dumps(error.body()).encode()
            transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        transport.close()


def check_seconds(name: str, value) -> None:
    """``InvalidInputError`` unless ``value`` (the setting ``name``) is a positive number of seconds."""
    if not (isinstance(value, (int, float)) and value > 0):
        raise InvalidInputError(f"{name} must be a positive number of seconds, got {value!r}")


def guarded_protocol(header_timeout_s: float = HEADER_TIMEOUT_S):
    """The protocol for ``uvicorn.Config(http=...)``."""
    check_seconds("header_timeout_s", header_timeout_s)
    return functools.partial(GuardedH11Protocol, header_timeout_s=header_timeout_s)


class BodyTimeout:
    """A 408 (and the connection closed) for a request whose body is not whole ``body_timeout_s`` after its
    headers (see the module's docstring). After the body, ``receive`` is the server's own (disconnects)."""

    def __init__(self, app, body_timeout_s: float = BODY_TIMEOUT_S):
        self.app, self.timeout_s = app, float(body_timeout_s)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline, complete = time.monotonic() + self.timeout_s, False

        async def receive_in_time():
            nonlocal complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                raise HTTPException(408, timeout_message("body", self.timeout_s, "--body-timeout-s"),
                                    headers={"Connection": "close"}) from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, receive_in_time, send)
