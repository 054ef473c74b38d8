"""From a request's events to its HTTP answer: one loop for ``/v1/completions`` and ``/v1/chat/completions``.

The engine's thread puts each job's events (``engine_loop.Job``) on the handler's asyncio queue. ``answer`` waits
for the first one (a refusal by the engine can still be a 4xx), then streams the events as server-sent events
(``sse``) or collects the whole text (``collect``). A client gone meanwhile (looked for every
``DISCONNECT_POLL_S`` seconds by ``next_event``) has its request aborted: its KV blocks are freed before the next
step. The two APIs differ only in how a chunk is written: a ``CompletionShape``, or chat's ``ChatShape``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from .middleware import error_response
from .protocol import BadRequest, CompletionRequest

DISCONNECT_POLL_S = 0.25  # how often a handler waiting for its next token checks that its client is still there


@dataclass
class Batch:
    """One HTTP request in the engine: a job per prompt, all with the same fields. Sample ``i`` of prompt ``p`` is
    choice ``p * n + i`` of the answer, as OpenAI and vLLM number them."""

    id: str
    jobs: list
    events: asyncio.Queue  # every job's events, as ("token" | "finish", choice, ...)

    @property
    def request(self) -> CompletionRequest:  # the fields every prompt shares
        return self.jobs[0].request

    @property
    def n(self) -> int:
        return len(self.jobs) * self.request.n

    def usage(self, counts: list[int]) -> dict:
        p, c = sum(len(job.request.prompt_token_ids) for job in self.jobs), sum(counts)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def abort(self, loop) -> None:
        for job in self.jobs:  # (a job that finished already is not in the engine: nothing happens)
            loop.abort(job.request_id)


async def next_event(events: asyncio.Queue, request: Request):
    """The next event, or None if the client disconnected while we waited (looked for every
    ``DISCONNECT_POLL_S`` seconds, tokens arriving or not)."""
    state = request.scope.setdefault("gpt2_core.poll", {"next": time.monotonic() + DISCONNECT_POLL_S})
    while True:
        wait = state["next"] - time.monotonic()
        if wait > 0:
            try:
                return await asyncio.wait_for(events.get(), wait)
            except asyncio.TimeoutError:
                pass
        state["next"] = time.monotonic() + DISCONNECT_POLL_S
        if await request.is_disconnected():
            return None


def completion_logprobs(entries: list, offset: int) -> dict:
    """(text, logprob, {alternative: logprob}) per token -> the completions API's ``logprobs`` object."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for text, lp, top in entries:
        out["tokens"].append(text)
        out["token_logprobs"].append(lp if math.isfinite(lp) else -1e30)
        out["top_logprobs"].append({t: (v if math.isfinite(v) else -1e30) for t, v in top.items()})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


class CompletionShape:
    """How ``/v1/completions`` writes its answer: choices with ``text``, log-probabilities with ``text_offset``s
    that run on across a stream's chunks."""

    object, chunk_object, id_prefix = "text_completion", "text_completion", "cmpl"

    def __init__(self, batch: Batch, model_name: str):
        self.batch, self.model_name = batch, model_name
        self.offsets = [0] * batch.n  # per choice: characters streamed so far

    def chunk(self, choices: list, counts: list | None = None, whole: bool = False) -> dict:
        out = {"id": self.batch.id, "object": self.object if whole else self.chunk_object,
               "created": int(time.time()), "model": self.model_name, "choices": choices}
        if counts is not None:
            out["usage"] = self.batch.usage(counts)
        return out

    def opening(self) -> list[dict]:
        """The chunks a stream starts with, before any token."""
        return []

    def token(self, i: int, piece: str, lp) -> dict | None:
        """A stream's chunk for a token of choice ``i`` (None: nothing to send yet, a stop string may follow)."""
        logprobs = None
        if self.batch.request.logprobs is not None and lp is not None:
            logprobs = completion_logprobs([lp], self.offsets[i])
        self.offsets[i] += len(piece)
        if not (piece or logprobs):
            return None
        return self.chunk([{"index": i, "text": piece, "logprobs": logprobs, "finish_reason": None}])

    def finish(self, i: int, reason: str) -> dict:
        return self.chunk([{"index": i, "text": "", "logprobs": None, "finish_reason": reason}])

    def whole(self, texts: list, lps: list, reasons: list, counts: list) -> dict:
        want = self.batch.request.logprobs is not None
        return self.chunk([{"index": i, "text": texts[i], "finish_reason": reasons[i],
                            "logprobs": completion_logprobs(lps[i], 0) if want else None}
                           for i in range(len(texts))], counts, whole=True)


async def answer(shape: CompletionShape, request: Request, loop) -> Response:
    """The answer once the first event is in: an error (refused by the engine), a stream, or the whole text.
    ``loop``: the ``EngineLoop``, which aborts the request if its client goes away."""
    batch, done = shape.batch, False
    try:
        first = await next_event(batch.events, request)  # before answering: a refusal can still be a 400
        if first is None:
            return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
        if first[0] == "finish" and first[2] == "error":  # (the batch's other prompts are aborted below)
            job = batch.jobs[first[1] // batch.request.n]
            return error_response(BadRequest(first[3] or "the request failed", None, job.error_status))
        if batch.request.stream:
            done = True  # the generator owns the request from here on
            return StreamingResponse(sse(shape, first, request, loop), media_type="text/event-stream")
        body = await collect(shape, first, request)
        if body is None:  # the client went away: the finally below aborts the request
            return Response(status_code=499)
        done = True
        return JSONResponse(body, status_code=500 if "error" in body else 200)
    finally:
        if not done:
            batch.abort(loop)


async def collect(shape: CompletionShape, event, request: Request) -> dict | None:
    """The whole answer, from ``event`` (the first) on; None if the client went away first."""
    n = shape.batch.n
    texts, lps, reasons, counts, errors = [""] * n, [[] for _ in range(n)], [None] * n, [0] * n, []
    while True:
        if event[0] == "token":
            _, i, piece, _, lp = event
            texts[i] += piece
            if lp is not None:
                lps[i].append(lp)
        else:
            _, i, reasons[i], error, counts[i] = event
            if error:
                errors.append(error)
            if all(r is not None for r in reasons):
                break
        event = await next_event(shape.batch.events, request)
        if event is None:
            return None
    if errors:  # a sample failed after it started (its own sampling raised): say so
        return BadRequest(errors[0], None, 500).body()
    return shape.whole(texts, lps, reasons, counts)


def data(chunk) -> str:
    return f"data: {json.dumps(chunk)}\n\n"


async def sse(shape: CompletionShape, event, request: Request, loop):
    """The answer as server-sent events, from ``event`` (the first) on: the shape's opening chunks, a chunk per
    token and per finished choice, the token counts if asked (``stream_options.include_usage``), ``[DONE]``."""
    batch, finished, counts = shape.batch, 0, [0] * shape.batch.n
    try:
        for chunk in shape.opening():
            yield data(chunk)
        while True:
            if event[0] == "token":
                _, i, piece, _, lp = event
                chunk = shape.token(i, piece, lp)
                if chunk is not None:
                    yield data(chunk)
            else:
                _, i, reason, error, counts[i] = event
                finished += 1
                chunk = shape.finish(i, reason)
                if error:
                    chunk["error"] = BadRequest(error, None, 500).body()["error"]
                yield data(chunk)
                if finished == batch.n:
                    break
            event = await next_event(batch.events, request)
            if event is None:
                return
        if batch.request.include_usage:
            yield data(shape.chunk([], counts))
        yield "data: [DONE]\n\n"
    finally:
        if finished < batch.n:  # the client went away (or the server is stopping): free its blocks now
            batch.abort(loop)
