"""Calling an ASGI app directly, as a server would, with the client misbehaving on purpose: a body cut off by a
disconnect, a stream abandoned after a few events. Used by the server's hardening and fuzz tests (fast: no sockets,
many requests at once on one event loop)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class Answer:
    status: int | None  # None: no response started (the client went away first)
    headers: dict = field(default_factory=dict)  # lower-case names; the last value of each
    body: bytes = b""
    events: int = 0  # body messages sent

    def json(self):
        return json.loads(self.body)


async def call(app, method: str = "POST", path: str = "/v1/completions", body: bytes | list = b"",
               headers: list | None = None, json_body=None, cut_body: bool = False, hang_up: bool = False,
               leave_after: int | None = None, timeout: float = 120.0) -> Answer:
    """One request to ``app``. ``body``: bytes, or a list of chunks (sent as a body of unknown length);
    ``json_body``: sent as JSON with its Content-Type. ``cut_body``: the client sends the chunks, then goes away
    before the end of the body. ``hang_up``: the client goes away as soon as its body is sent. ``leave_after``:
    the client goes away after that many body messages of the response. Raises whatever the app raises, and
    ``TimeoutError`` if it does not answer within ``timeout``."""
    headers = list(headers or [])
    if json_body is not None:
        body = json.dumps(json_body).encode()
        headers.append((b"content-type", b"application/json"))
    chunks = list(body) if isinstance(body, list) else [body]
    if not isinstance(body, list) and not cut_body:
        headers.append((b"content-length", str(len(body)).encode()))
    raw_path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": method, "scheme": "http", "path": raw_path, "raw_path": raw_path.encode("utf-8", "replace"),
             "query_string": query.encode("utf-8", "replace"), "root_path": "",
             "headers": [(k.lower(), v) for k, v in headers], "client": ("127.0.0.1", 40000),
             "server": ("testserver", 80), "state": {}}
    answer, gone = Answer(None), asyncio.Event()

    async def receive():
        if chunks:
            chunk = chunks.pop(0)
            return {"type": "http.request", "body": chunk, "more_body": bool(chunks) or cut_body}
        if cut_body or hang_up:
            gone.set()
            return {"type": "http.disconnect"}
        await gone.wait()  # the client waits for the answer; it hangs up once the answer is over (or it leaves)
        return {"type": "http.disconnect"}

    async def send(message):
        if gone.is_set():
            return  # nobody is listening (as uvicorn drops what is sent after a disconnect)
        if message["type"] == "http.response.start":
            answer.status = message["status"]
            answer.headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in message.get("headers", [])}
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")
            answer.events += 1
            if not message.get("more_body") or (leave_after is not None and answer.events >= leave_after):
                gone.set()

    await asyncio.wait_for(app(scope, receive, send), timeout)
    return answer


def sse_events(body: bytes) -> list:
    """The JSON events of a server-sent-events body, and "[DONE]" for the last one."""
    out = []
    for line in body.decode().splitlines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out
