"""``/v1/chat/completions``: OpenAI's chat API over the same engine loop as ``/v1/completions``.

A chat request is a completions request whose prompt is the conversation rendered with the model's chat template
(``Tokenizer.apply_chat_template``: the Jinja2 template of its ``tokenizer_config.json``, run in a sandbox as
transformers runs it) and tokenized, in a worker thread. The same ``parse_completion`` checks it, once the chat's
names are mapped: ``max_completion_tokens`` (or the older ``max_tokens``; by default the rest of the context, as
vLLM does) and ``logprobs: true`` with ``top_logprobs`` (0 to 20). It is queued as a ``Job`` and answered in the
chat's shape: a ``message`` when whole; when streamed, ``delta``s (the role first, then the text, then the finish
reason, and the token counts last with ``stream_options: {"include_usage": true}``); log-probabilities as a list
of ``{token, logprob, bytes, top_logprobs}``. A model without a chat template gets a 400 that says so.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..errors import GPT2Error, is_integer
from .engine_loop import Job
from .protocol import BadRequest, CompletionRequest, parse_completion
from .utility_routes import check_model, error_response, read_json

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions
DISCONNECT_POLL_S = 0.25  # how often a handler waiting for its next token checks that its client is still there
# The chat's own fields, mapped here onto a completion's; the rest of the body is checked as a completion's.
CHAT_FIELDS = ("messages", "max_completion_tokens", "max_tokens", "logprobs", "top_logprobs", "add_generation_prompt")
# Chat features this server does not have (tools, structured output): accepted only at their neutral values.
NEUTRAL = {"tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
           "function_call": (None, "none"), "response_format": (None, {"type": "text"})}


def _check(body: dict, name: str, ok, what: str):
    value = body.get(name)
    if value is not None and not ok(value):
        raise BadRequest(f"{name} must be {what}, got {value!r}", name)
    return value


def parse_chat(body, model_name: str, tokenizer, vocab_size: int, n_ctx: int, max_n: int) -> CompletionRequest:
    """A ``/v1/chat/completions`` body as a checked ``CompletionRequest`` whose prompt is the rendered conversation,
    or a ``BadRequest`` naming the field at fault."""
    check_model(body, model_name)
    if "messages" not in body:
        raise BadRequest("messages is required", "messages")
    for name, neutral in NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise BadRequest(f"{name} is not supported by this server (leave it out)", name)
    boolean = lambda v: isinstance(v, bool)  # noqa: E731
    generation = _check(body, "add_generation_prompt", boolean, "true or false")
    logprobs = _check(body, "logprobs", boolean, "true or false")
    top = _check(body, "top_logprobs", lambda v: is_integer(v, 0, MAX_TOP_LOGPROBS),
                 f"an integer from 0 to {MAX_TOP_LOGPROBS}")
    if top and not logprobs:
        raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
    try:
        ids = tokenizer.encode(tokenizer.apply_chat_template(body["messages"], generation is not False))
    except GPT2Error as e:  # no tokenizer, no chat template, malformed messages, the template's refusal, bad text
        raise BadRequest(f"messages: {e}", "messages") from None
    if not ids:
        raise BadRequest("messages: the chat template rendered this conversation as an empty prompt", "messages")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    given = body.get(limit)
    completion = {k: v for k, v in body.items() if k not in CHAT_FIELDS}
    completion.update(prompt=ids, max_tokens=given if given is not None else max(n_ctx - len(ids), 1))  # vLLM's
    try:
        request = parse_completion(completion, model_name, tokenizer, vocab_size, n_ctx, max_n)
    except BadRequest as e:
        if e.param == "prompt":  # the rendered conversation is the prompt: the client sent messages
            raise BadRequest(f"messages: {e}", "messages", code=e.code) from None
        if e.param != "max_tokens" or (limit == "max_tokens" and given is not None):
            raise
        if given is None:  # the default limit (the rest of the context): the conversation alone is too long
            raise BadRequest(f"messages: the conversation is {len(ids)} tokens, which leaves no room for a reply in "
                             f"the model's context of {n_ctx}", "messages") from None
        raise BadRequest(e.message.replace("max_tokens", limit), limit, e.status, e.kind) from None
    request.logprobs = (top or 0) if logprobs else None
    return request


def chat_logprobs(entries: list) -> dict:
    """(text, logprob, {alternative: logprob}) per token -> the chat API's ``{"content": [...]}``."""
    def value(v: float) -> float:
        return v if math.isfinite(v) else -9999.0  # vLLM's stand-in for -inf: JSON has no infinity

    return {"content": [{"token": text, "logprob": value(lp), "bytes": list(text.encode("utf-8")),
                         "top_logprobs": [{"token": t, "logprob": value(v), "bytes": list(t.encode("utf-8"))}
                                          for t, v in top.items()]} for text, lp, top in entries]}


def usage(request: CompletionRequest, counts: list[int]) -> dict:
    p, c = len(request.prompt_token_ids), sum(counts)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


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


class ChatCompletions:
    """The ``/v1/chat/completions`` handler (``create``) on a ``Server``: its model, engine loop and metrics."""

    def __init__(self, server):
        self.server = server
        self._ids = itertools.count()

    async def create(self, request: Request) -> Response:
        s = self.server
        if s.loop.num_waiting() >= s.loop.max_waiting:  # full: refuse before reading or checking anything
            s.metrics.reject("queue_full")
            return self._busy(f"the server is at capacity: {s.loop.max_waiting} requests are waiting already; "
                              f"retry later", 429)
        try:
            body = await read_json(request)
            cfg = s.model.config
            req = await asyncio.to_thread(parse_chat, body, s.model_name, s.model.tokenizer, cfg.vocab_size,
                                          cfg.n_positions, s.engine.scheduler.max_num_seqs)
        except BadRequest as e:
            s.metrics.reject("invalid")
            return error_response(e)
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        job = Job(f"chatcmpl-{time.time_ns():x}-{next(self._ids)}", req,
                  lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev))
        try:
            s.loop.submit(job)
        except BadRequest as e:
            s.metrics.reject("queue_full" if e.status == 429 else "unavailable")
            return self._busy(e.message, e.status)
        return await self._answer(job, events, request)

    @staticmethod
    def _busy(message: str, status: int) -> Response:
        kind = "rate_limit_error" if status == 429 else "server_error"
        return JSONResponse(BadRequest(message, None, status, kind).body(), status_code=status,
                            headers={"Retry-After": "1"})

    async def _answer(self, job: Job, events: asyncio.Queue, request: Request) -> Response:
        done = False
        try:
            first = await next_event(events, request)  # before answering: a refusal can still be a 400
            if first is None:
                return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
            if first[0] == "finish" and first[2] == "error":
                done = True
                kind = "invalid_request_error" if job.error_status == 400 else "server_error"
                return error_response(BadRequest(first[3] or "the request failed", None, job.error_status, kind))
            if job.request.stream:
                done = True  # the generator owns the request from here on
                return StreamingResponse(self._stream(job, first, events, request), media_type="text/event-stream")
            body = await self._whole(job, first, events, request)
            if body is None:  # the client went away: the finally below aborts the request
                return Response(status_code=499)
            done = True
            return JSONResponse(body, status_code=500 if "error" in body else 200)
        finally:
            if not done:
                self.server.loop.abort(job.request_id)

    def _chunk(self, job: Job, obj: str, choices: list, counts: list | None = None) -> dict:
        out = {"id": job.request_id, "object": obj, "created": int(time.time()), "model": self.server.model_name,
               "choices": choices}
        if counts is not None:
            out["usage"] = usage(job.request, counts)
        return out

    async def _whole(self, job: Job, event, events: asyncio.Queue, request: Request) -> dict | None:
        n = job.request.n
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
            event = await next_event(events, request)
            if event is None:
                return None
        if errors:  # a sample failed after it started: say so
            return BadRequest(errors[0], None, 500, "server_error").body()
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "finish_reason": reasons[i],
                    "logprobs": chat_logprobs(lps[i]) if job.request.logprobs is not None else None}
                   for i in range(n)]
        return self._chunk(job, "chat.completion", choices, counts)

    async def _stream(self, job: Job, event, events: asyncio.Queue, request: Request):
        req, finished, counts = job.request, 0, [0] * job.request.n

        def sse(choice: dict) -> str:
            return f"data: {json.dumps(self._chunk(job, 'chat.completion.chunk', [choice]))}\n\n"

        try:
            for i in range(req.n):  # the role first, as OpenAI and vLLM send it
                yield sse({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None})
            while True:
                if event[0] == "token":
                    _, i, piece, _, lp = event
                    logprobs = chat_logprobs([lp]) if req.logprobs is not None and lp is not None else None
                    if piece or logprobs:
                        yield sse({"index": i, "delta": {"content": piece}, "logprobs": logprobs,
                                   "finish_reason": None})
                else:
                    _, i, reason, error, counts[i] = event
                    finished += 1
                    chunk = self._chunk(job, "chat.completion.chunk",
                                        [{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])
                    if error:
                        chunk["error"] = {"message": error, "type": "server_error"}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if finished == req.n:
                        break
                event = await next_event(events, request)
                if event is None:
                    return
            if req.include_usage:
                yield f"data: {json.dumps(self._chunk(job, 'chat.completion.chunk', [], counts))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if finished < req.n:  # the client went away (or the server is stopping): free its blocks now
                self.server.loop.abort(job.request_id)
