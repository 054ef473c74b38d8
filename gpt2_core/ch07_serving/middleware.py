"""What every request meets before (and after) its route, whatever the route: plain ASGI middlewares and Starlette
exception handlers, so that a route added later is covered too.

From the outside in (``middleware_stack``):

* ``RequestContext``: an ``X-Request-Id`` on every response (the client's, if sane, else a new one), one access-log
  line per request (logger ``gpt2_core.access``, at info), a client that went away ends its request quietly, and a
  bug answers an OpenAI-shaped 500 (its traceback logged once, with the request id);
* ``CORSMiddleware`` (Starlette's), only with ``--allowed-origins``: browsers of those origins may call the API;
* ``ApiKey``, only with ``--api-key``: ``Authorization: Bearer KEY`` or a 401 (``--open-paths`` stay open);
* ``JsonOnly``: a POST, PUT or PATCH whose body is not ``application/json`` gets a 415. A web page can make a
  browser send a "simple" request (``text/plain``, no CORS preflight) to a server on localhost; not this one;
* ``BodyLimit``: a body over ``--max-body-bytes`` gets a 413, before it is read when its length is announced.
* ``BodyTimeout`` (``slow_clients``): a body still incomplete ``--body-timeout-s`` after the headers gets a 408.

``EXCEPTION_HANDLERS`` answer the router's own 404 and 405 and any ``BadRequest`` a route raises with OpenAI's
error object: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
import uuid

from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from .protocol import BadRequest, shown
from ..errors import InvalidInputError
from .slow_clients import BODY_TIMEOUT_S, BodyTimeout, check_seconds

log = logging.getLogger("gpt2_core.ch07_serving")
access_log = logging.getLogger("gpt2_core.access")

MAX_BODY_BYTES = 1 << 20  # a completion request is a few KB; the context holds a few thousand characters at most
OPEN_PATHS = ("/health", "/metrics")  # without the API key (load balancers' probes, Prometheus scrapers)
REQUEST_ID = re.compile(r"[\x21-\x7e]{1,128}")  # a client's X-Request-Id is kept if it is this: visible ASCII
JSON_TYPE = re.compile(r"application/([\w.+-]+\+)?json")  # application/json, application/merge-patch+json, ...


def error_response(error: BadRequest, headers: dict | None = None) -> Response:
    """``error`` as OpenAI's error object, with its HTTP status (a 429 or 503 says when to retry). The JSON is
    ASCII: a lone surrogate quoted from a request cannot break its encoding."""
    headers = dict(headers or {})
    if error.status in (429, 503):
        headers.setdefault("Retry-After", "1")
    return Response(json.dumps(error.body()), status_code=error.status, headers=headers,
                    media_type="application/json")


async def _http_exception(request: Request, exc: HTTPException) -> Response:
    """The router's 404 and 405 (and any ``HTTPException``), as error objects that say what exists."""
    path = shown(request.scope.get("path", ""))
    if exc.status_code == 404:
        paths = sorted({p for p in (getattr(r, "path", None) for r in request.app.routes) if p})
        message = f"no route {path}; this server has {', '.join(paths)}"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {path} (allowed: {(exc.headers or {}).get('Allow', '?')})"
    else:
        message = str(exc.detail)
    return error_response(BadRequest(message, None, exc.status_code), exc.headers)


async def _bad_request(request: Request, exc: BadRequest) -> Response:
    return error_response(exc)


EXCEPTION_HANDLERS = {HTTPException: _http_exception, BadRequest: _bad_request}


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


async def _answer(error: BadRequest, scope, receive, send, headers: dict | None = None) -> None:
    await error_response(error, headers)(scope, receive, send)


def client_gone(exc: BaseException) -> bool:
    """``exc`` says that the client went away (alone, or every exception of a task group's group)."""
    if isinstance(exc, (ClientDisconnect, ConnectionError)):
        return True
    group = getattr(exc, "exceptions", None)
    return bool(group) and all(client_gone(e) for e in group)


class RequestContext:
    """The request id, the access log, and the last word on exceptions (see the module's docstring)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _header(scope, b"x-request-id")
        rid = given if given is not None and REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope["gpt2_core.request_id"] = rid
        start, status = time.perf_counter(), None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            if client_gone(e):
                log.debug("request %s: the client went away (%s)", rid, type(e).__name__)
            elif status is None:
                log.exception("request %s failed", rid)
                status = 500
                error = BadRequest(f"internal server error (request id {rid}; the server's log has the details)",
                                   None, 500)
                try:
                    await _answer(error, scope, receive, send, {"x-request-id": rid})
                except Exception:  # the client is gone too
                    pass
            else:
                log.exception("request %s failed after its response started", rid)
        finally:
            client = scope.get("client") or ("-", 0)
            access_log.info('%s:%s "%s %s HTTP/%s" %s %.1f ms request_id=%s', client[0], client[1], scope["method"],
                            repr(scope["path"])[1:-1][:200], scope.get("http_version", "1.1"),
                            status if status is not None else 499, 1e3 * (time.perf_counter() - start), rid)


class ApiKey:
    """``Authorization: Bearer KEY`` on every path but ``open_paths``, or a 401 as OpenAI answers one."""

    def __init__(self, app, api_key: str, open_paths=OPEN_PATHS):
        self.app, self.key, self.open_paths = app, api_key.encode(), frozenset(open_paths)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        scheme, _, given = (_header(scope, b"authorization") or "").strip().partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode("latin-1"), self.key):
            return await self.app(scope, receive, send)
        message = ("Incorrect API key provided" if scheme else
                   "Missing API key: send it as the header 'Authorization: Bearer KEY'")
        await _answer(BadRequest(message, None, 401), scope, receive, send, {"WWW-Authenticate": "Bearer"})


class JsonOnly:
    """A 415 for a POST, PUT or PATCH whose ``Content-Type`` is not JSON (a browser's simple request)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH"):
            media = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if not JSON_TYPE.fullmatch(media):
                error = BadRequest(f"the request body must be JSON, sent with 'Content-Type: application/json' "
                                   f"(got {shown(media) if media else 'no Content-Type'})", None, 415)
                return await _answer(error, scope, receive, send)
        await self.app(scope, receive, send)


class BodyLimit:
    """A 413 for a body over ``max_body_bytes``: at once when its ``Content-Length`` says so (nothing is read),
    else as soon as that many bytes have arrived."""

    def __init__(self, app, max_body_bytes: int = MAX_BODY_BYTES):
        self.app, self.max = app, int(max_body_bytes)

    def error(self) -> BadRequest:
        return BadRequest(f"the request body is larger than this server's limit of {self.max} bytes "
                          f"(--max-body-bytes)", None, 413)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = (_header(scope, b"content-length") or "").strip()
        if length.isascii() and length.isdigit() and int(length) > self.max:
            return await _answer(self.error(), scope, receive, send, {"Connection": "close"})
        received = 0

        async def receive_at_most():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max:  # a body sent in chunks, or longer than announced
                    raise HTTPException(413, self.error().message)
            return message

        await self.app(scope, receive_at_most, send)


def middleware_stack(api_key: str | None = None, open_paths=OPEN_PATHS, allowed_origins=(),
                     max_body_bytes: int = MAX_BODY_BYTES,
                     body_timeout_s: float = BODY_TIMEOUT_S) -> list[Middleware]:
    """The middlewares of the module's docstring, outermost first, for ``Starlette(middleware=...)``;
    ``InvalidInputError`` for a limit that is not positive."""
    if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
        raise InvalidInputError(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    check_seconds("body_timeout_s", body_timeout_s)
    stack = [Middleware(RequestContext)]
    if allowed_origins:
        stack.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                                allow_headers=["*"], expose_headers=["X-Request-Id"]))
    if api_key:
        stack.append(Middleware(ApiKey, api_key=api_key, open_paths=tuple(open_paths)))
    stack += [Middleware(JsonOnly), Middleware(BodyLimit, max_body_bytes=max_body_bytes),
              Middleware(BodyTimeout, body_timeout_s=body_timeout_s)]
    return stack
