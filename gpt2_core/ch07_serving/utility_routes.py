"""The small routes beside the completions: ``/tokenize`` and ``/detokenize`` (vLLM's shapes), ``/version``, and
``/v1/models/{id}`` (OpenAI's ``models.retrieve``); and ``read_json``, the body reader of these.

* ``POST /tokenize`` ``{"prompt": text}`` or ``{"messages": [...]}`` (rendered with the chat template first) ->
  ``{"tokens": [...], "count": n, "max_model_len": n_ctx, "token_strs": null}``: the ids a completion of that
  prompt would start from (``"return_token_strs": true`` adds each token's vocabulary entry);
* ``POST /detokenize`` ``{"tokens": [...]}`` -> ``{"prompt": text}``;
* ``GET /version`` -> ``{"version": "0.1.0"}`` (the installed package's);
* ``GET /v1/models/{id}`` -> the model's card, as in ``/v1/models``; 404 with an error object for any other id.
"""

from __future__ import annotations

import asyncio
import json

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import BAD_JSON, GPT2Error, is_integer
from .protocol import BadRequest

MAX_BODY_BYTES = 1 << 20  # 1 MiB: far more text than the context can hold; a larger body gets a 413 unread


async def read_json(request: Request, limit: int = MAX_BODY_BYTES):
    """The request's body as JSON, or a ``BadRequest``: 413 past ``limit`` bytes (read no further), 400 if it is
    not JSON (nesting too deep included), 499 if the client went away before sending all of it."""
    too_large = BadRequest(f"the request body is larger than {limit} bytes", None, 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
    except ClientDisconnect:
        raise BadRequest("the client disconnected before sending its whole body", None, 499) from None
    try:
        return json.loads(b"".join(chunks))
    except BAD_JSON as e:
        raise BadRequest(f"the request body is not valid JSON ({type(e).__name__}: {e})") from None


def check_model(body, served: str) -> None:
    """A ``BadRequest`` unless ``body`` is an object whose ``model`` (if given) is the one served: 404 otherwise."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served:
        raise unknown_model(model, served)


def unknown_model(name, served: str) -> BadRequest:
    return BadRequest(f"the model {name!r} does not exist; this server serves {served!r}", "model", 404,
                      "model_not_found")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gpt2-numpy")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def error_response(e: BadRequest) -> Response:
    return JSONResponse(e.body(), status_code=e.status)


class UtilityRoutes:
    """The routes of this module's docstring, on a ``Server`` (its model, name and tokenizer)."""

    def __init__(self, server):
        self.server = server

    def routes(self) -> list[Route]:
        return [Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/detokenize", self.detokenize, methods=["POST"]),
                Route("/version", self.version), Route("/v1/models/{model_id:path}", self.model)]

    async def tokenize(self, request: Request) -> Response:
        tokenizer = self.server.model.tokenizer
        try:
            body = await read_json(request)
            check_model(body, self.server.model_name)
            strs = body.get("return_token_strs", False)
            if not isinstance(strs, bool):
                raise BadRequest(f"return_token_strs must be true or false, got {strs!r}", "return_token_strs")
            ids = await asyncio.to_thread(self._tokens, body)
        except BadRequest as e:
            return error_response(e)
        return JSONResponse({"count": len(ids), "max_model_len": self.server.model.config.n_positions, "tokens": ids,
                             "token_strs": [tokenizer.hf.id_to_token(i) for i in ids] if strs else None})

    def _tokens(self, body: dict) -> list[int]:
        """The token ids of ``body``'s prompt, or of its conversation rendered with the chat template (in a worker
        thread: a long text does not hold up the event loop)."""
        tokenizer, param = self.server.model.tokenizer, "messages" if "messages" in body else "prompt"
        try:
            if param == "messages":
                generation = body.get("add_generation_prompt", True)
                if not isinstance(generation, bool):
                    raise BadRequest(f"add_generation_prompt must be true or false, got {generation!r}",
                                     "add_generation_prompt")
                return tokenizer.encode(tokenizer.apply_chat_template(body["messages"], generation))
            if not isinstance(body.get("prompt"), str):
                raise BadRequest("prompt (text) or messages (a conversation) is required", "prompt")
            return tokenizer.encode(body["prompt"])
        except GPT2Error as e:  # no tokenizer, no chat template, a template's refusal, text that is not UTF-8
            raise BadRequest(f"{param}: {e}", param) from None

    async def detokenize(self, request: Request) -> Response:
        model = self.server.model
        try:
            body = await read_json(request)
            check_model(body, self.server.model_name)
            tokens, vocab = body.get("tokens"), model.config.vocab_size
            if not isinstance(tokens, list) or not all(is_integer(t, 0, vocab - 1) for t in tokens):
                raise BadRequest(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
            try:
                text = model.tokenizer.decode(tokens)
            except GPT2Error as e:
                raise BadRequest(f"tokens: {e}", "tokens") from None
        except BadRequest as e:
            return error_response(e)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": package_version()})

    async def model(self, request: Request) -> Response:
        s = self.server
        if request.path_params["model_id"] == "":  # /v1/models/ is the list, as before this route existed
            return await s.models(request)
        if request.path_params["model_id"] != s.model_name:
            return error_response(unknown_model(request.path_params["model_id"], s.model_name))
        return JSONResponse({"id": s.model_name, "object": "model", "created": s.created, "owned_by": "gpt2_core",
                             "max_model_len": s.model.config.n_positions})
