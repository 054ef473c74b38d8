"""``/v1/chat/completions``: OpenAI's chat API over the same engine loop as ``/v1/completions``.

A chat request is a completions request whose prompt is the conversation rendered with the model's chat template
(``Tokenizer.apply_chat_template``: the Jinja2 template of its ``tokenizer_config.json``, run in a sandbox as
transformers runs it) and tokenized, in a worker thread. The same ``parse_completion`` checks it, once the chat's
names are mapped: ``max_completion_tokens`` (or the older ``max_tokens``; by default the rest of the context, as
vLLM does) and ``logprobs: true`` with ``top_logprobs`` (0 to 20). It is queued and answered as a completion is
(``Server.generate``, ``answers``), in the chat's shape (``ChatShape``): a ``message`` when whole; when streamed,
``delta``s (the role first, then the text, then the finish reason, and the token counts last with
``stream_options: {"include_usage": true}``); log-probabilities as a list of ``{token, logprob, bytes,
top_logprobs}``. A model without a chat template gets a 400 that says so.
"""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import Response

from ..errors import GPT2Error, is_integer
from .answers import CompletionShape
from .protocol import BadRequest, CompletionRequest, parse_completion, parse_json
from .utility_routes import check_model

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat completions
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


class ChatShape(CompletionShape):
    """How the chat API writes its answer: a ``message`` per choice when whole; streamed, a ``delta`` with the role
    first, then the text, then the finish reason (``answers`` runs the loop)."""

    object, chunk_object, id_prefix = "chat.completion", "chat.completion.chunk", "chatcmpl"

    def opening(self) -> list[dict]:  # the role first, as OpenAI and vLLM send it
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.batch.n)]

    def token(self, i: int, piece: str, lp) -> dict | None:
        logprobs = chat_logprobs([lp]) if self.batch.request.logprobs is not None and lp is not None else None
        if not (piece or logprobs):
            return None
        return self.chunk([{"index": i, "delta": {"content": piece}, "logprobs": logprobs, "finish_reason": None}])

    def finish(self, i: int, reason: str) -> dict:
        return self.chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}])

    def whole(self, texts: list, lps: list, reasons: list, counts: list) -> dict:
        want = self.batch.request.logprobs is not None
        return self.chunk([{"index": i, "message": {"role": "assistant", "content": texts[i]},
                            "finish_reason": reasons[i], "logprobs": chat_logprobs(lps[i]) if want else None}
                           for i in range(len(texts))], counts, whole=True)


class ChatCompletions:
    """The ``/v1/chat/completions`` handler (``create``) on a ``Server``: a chat body parsed into a completion's
    request, queued and answered as the completions are (``Server.generate``), in the chat's shape."""

    def __init__(self, server):
        self.server = server

    async def create(self, request: Request) -> Response:
        return await self.server.generate(request, self.parse, ChatShape)

    def parse(self, raw: bytes) -> list[CompletionRequest]:
        """A chat body (in a worker thread: the template and the tokenizer run here), as one request."""
        s, cfg = self.server, self.server.model.config
        return [parse_chat(parse_json(raw), s.model_name, s.model.tokenizer, cfg.vocab_size, cfg.n_positions,
                           s.engine.scheduler.max_num_seqs)]
