"""A router in front of replicas of ``python -m gpt2_core serve``: ``python -m gpt2_core route``.

Each replica is a whole server with its own engine and its own prefix cache (chapter 5). The router proxies
``/v1/completions`` and ``/v1/chat/completions`` (streamed or whole, statuses and error bodies passed through) to
one of them, chosen by a policy of ``gpt2_core.ch08_parallel.routing``: ``round_robin`` or the cache-aware
``prefix_affinity``, which hashes a completion's prompt, or a chat's messages as text (a conversation's next turn
starts with the text of the turns before). ``/tokenize`` and ``/detokenize`` go the same way, without a prompt to
hash; ``/v1/models``, ``/v1/models/{id}`` and ``/version`` are asked of the first replica alive. What a request
goes through is chapter 7's (``middleware_stack``): request ids, JSON bodies only, a body limit (the router
holds a body whole before it forwards it: ``max_body_bytes``, 1 MiB as a server's), clocks on the headers and the
body (``--header-timeout-s``, ``--body-timeout-s``: a slow client gets its 408 from the router), OpenAI-shaped errors.

A replica that refuses connections, drops a request or fails its health probe (every second) is taken out of
rotation: its requests in flight get a 502 (or, streaming, an error event that ends the stream) naming it, never a
hang; a request that could not even connect is sent to another replica. The probe brings a replica back when it
answers again. With no replica alive, requests get a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from dataclasses import dataclass, field

from ..errors import MissingDependencyError

try:
    import httpx  # noqa: F401
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(f"serving needs the serve extra (pip install -e '.[serve]'): {e}") from None

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import BAD_JSON, InvalidInputError
from .routing import block_hashes, make_policy
from ..ch07_serving.metrics import RouterMetrics
from ..ch07_serving.middleware import EXCEPTION_HANDLERS, MAX_BODY_BYTES, middleware_stack
from ..ch07_serving.protocol import BadRequest
from ..ch07_serving.slow_clients import BODY_TIMEOUT_S, check_seconds

log = logging.getLogger("gpt2_core.router")

PROBE_INTERVAL_S, PROBE_TIMEOUT_S, CONNECT_TIMEOUT_S = 1.0, 5.0, 2.0


def replica_url(url: str) -> str:
    """``http://host:port`` from a server's URL given with or without its ``/v1``."""
    base = re.sub(r"/v1/?$", "", url.strip().rstrip("/"))
    if not re.match(r"^https?://[^/\s]+$", base):
        raise InvalidInputError(f"--replica must be a server's URL such as http://127.0.0.1:8001 (or .../v1), "
                                f"got {url!r}")
    return base


def routing_prompt(path: str, body: bytes):
    """What the policy hashes for a POST to ``path``: a completion's ``prompt``; a chat's ``messages`` as one text
    (each message's JSON in turn: the next turn of a conversation starts with the text of the one before); None
    otherwise, or for a body the replica will refuse."""
    if path not in ("/v1/completions", "/v1/chat/completions"):
        return None
    try:
        fields = json.loads(body)
        if path == "/v1/completions":
            return fields.get("prompt")
        messages = fields.get("messages")
        if not isinstance(messages, list):
            return None
        return "".join(json.dumps(m, ensure_ascii=False, sort_keys=True) for m in messages)
    except (*BAD_JSON, AttributeError, TypeError):  # not JSON (or nested too deep), not an object
        return None


class ReplicaDown(Exception):
    """The replica was taken out of rotation while a request waited on it."""


class ClientGone(Exception):
    """The router's own client hung up while its request waited on a replica."""


@dataclass
class Replica:
    url: str
    alive: bool = True
    in_flight: int = 0
    routed: int = 0
    error: str | None = None
    down: asyncio.Event = field(default_factory=asyncio.Event)  # set when taken out of rotation


def error_body(message: str, kind: str = "server_error") -> dict:
    """The OpenAI error object, as the replicas send theirs (``protocol.BadRequest``)."""
    return BadRequest(message, kind=kind).body()


async def _disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


class Router:
    """The app's state: the replicas, the policy, the HTTP client to the replicas, the metrics."""

    def __init__(self, urls: list[str], policy: str = "prefix_affinity", probe_interval_s: float = PROBE_INTERVAL_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S, connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 read_timeout_s: float = 600.0, **policy_args):
        urls = [replica_url(u) for u in urls]
        if not urls or len(set(urls)) < len(urls):
            raise InvalidInputError(f"a router needs one or more distinct replica URLs, got {urls}")
        self.replicas = [Replica(u) for u in urls]
        self.policy = make_policy(policy, len(urls), **policy_args)
        self.metrics = RouterMetrics(self.policy.name, urls)
        self.probe_interval_s, self.probe_timeout_s = probe_interval_s, probe_timeout_s
        self.timeout = httpx.Timeout(read_timeout_s, connect=connect_timeout_s)
        self.http: httpx.AsyncClient | None = None  # made in the app's lifespan, on its event loop

    # -- rotation -------------------------------------------------------------------------------------------------
    def take_out(self, r: int, reason: str) -> None:
        rep = self.replicas[r]
        if rep.alive:
            log.warning("replica %s taken out of rotation: %s", rep.url, reason)
        rep.alive, rep.error = False, reason
        rep.down.set()  # requests waiting on it stop waiting
        self.policy.forget(r)
        self.metrics.set_up(r, False, self.num_alive())

    def bring_back(self, r: int) -> None:
        rep = self.replicas[r]
        if not rep.alive:
            log.warning("replica %s is back in rotation", rep.url)
            rep.alive, rep.error, rep.down = True, None, asyncio.Event()
        self.metrics.set_up(r, True, self.num_alive())

    def num_alive(self) -> int:
        return sum(rep.alive for rep in self.replicas)

    async def probe(self, r: int) -> None:
        try:
            status = (await self.http.get(self.replicas[r].url + "/health", timeout=self.probe_timeout_s)).status_code
            reason = None if status == 200 else f"its /health answered {status}"
        except httpx.HTTPError as e:
            reason = f"its /health failed ({type(e).__name__}: {e})"
        if reason is None:
            self.bring_back(r)
        else:
            if self.replicas[r].alive:
                self.metrics.error(r, "health_probe")
            self.take_out(r, reason)

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            await asyncio.gather(*(self.probe(r) for r in range(len(self.replicas))))

    def route(self, hashes: list[bytes], exclude: set) -> int | None:
        """A live replica for the request (its in-flight count raised), or None if there is none."""
        loads = {r: rep.in_flight for r, rep in enumerate(self.replicas) if rep.alive and r not in exclude}
        if not loads:
            return None
        r = self.policy.choose(hashes, loads)
        rep = self.replicas[r]
        rep.in_flight, rep.routed = rep.in_flight + 1, rep.routed + 1
        self.metrics.routed(r, rep.in_flight)
        return r

    def release(self, r: int) -> None:
        rep = self.replicas[r]
        rep.in_flight -= 1
        self.metrics.in_flight(r, rep.in_flight)

    def failed(self, r: int, error: Exception) -> str:
        """Take replica ``r`` out after ``error`` during a request; the message its client gets."""
        rep = self.replicas[r]
        why = rep.error if isinstance(error, ReplicaDown) else f"{type(error).__name__}: {error}"
        if not isinstance(error, ReplicaDown):
            self.metrics.error(r, "request")
            self.take_out(r, f"a request failed ({why})")
        return f"replica {rep.url} failed while serving this request ({why}); it is out of rotation"

    async def until_down(self, r: int, awaitable, request: Request | None = None):
        """``awaitable``'s result; ``ReplicaDown`` if replica ``r`` is taken out of rotation first, ``ClientGone``
        if ``request``'s client hangs up first."""
        main = asyncio.ensure_future(awaitable)
        watchers = {asyncio.ensure_future(self.replicas[r].down.wait()): ReplicaDown}
        if request is not None:
            watchers[asyncio.ensure_future(_disconnected(request))] = ClientGone
        try:
            done, _ = await asyncio.wait({main, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (main, *watchers):
                task.cancel()  # no effect on a finished one
        if main in done:
            return main.result()
        raise next(error for task, error in watchers.items() if task in done)()

    # -- routes ---------------------------------------------------------------------------------------------------
    def unavailable(self) -> Response:
        self.metrics.unavailable.inc()
        why = "; ".join(f"{rep.url}: {rep.error or 'failed'}" for rep in self.replicas)
        return JSONResponse(error_body(f"no replica is alive ({why}); retry later"), status_code=503,
                            headers={"Retry-After": "1"})

    async def health(self, request: Request) -> Response:
        replicas = [{"url": rep.url, "alive": rep.alive, "in_flight": rep.in_flight, "routed": rep.routed,
                     "error": rep.error} for rep in self.replicas]
        alive = self.num_alive()
        return JSONResponse({"status": "ok" if alive else "no replica alive", "policy": self.policy.name,
                             "replicas": replicas}, status_code=200 if alive else 503)

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def relay_get(self, request: Request) -> Response:
        """A GET (``/v1/models``, ``/v1/models/{id}``, ``/version``) answered by the first replica alive."""
        path = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string", b"")
        target = (path + (b"?" + query if query else b"")).decode("latin-1")
        for r, rep in enumerate(self.replicas):
            if rep.alive:
                try:
                    upstream = await self.http.request(request.method, rep.url + target,
                                                       headers=self.forwarded(request))
                except httpx.TransportError as e:
                    self.take_out(r, f"{type(e).__name__}: {e}")
                    continue
                return Response(upstream.content, upstream.status_code,
                                media_type=upstream.headers.get("content-type"))
        return self.unavailable()

    @staticmethod
    def forwarded(request: Request) -> dict:
        """The client's headers a replica needs, as sent: the body's type (JSON if none), the API key; and the request
        id (the router's)."""
        headers = {"content-type": b"application/json"}
        headers.update((k.decode(), v) for k, v in request.scope["headers"] if k in (b"content-type", b"authorization"))
        headers["x-request-id"] = request.scope["gpt2_core.request_id"]  # RequestContext set it
        return headers

    async def forward(self, request: Request) -> Response:
        """A POST (completions, chat, tokenize, detokenize) sent to the replica the policy chooses for its prompt."""
        body, path = await request.body(), request.url.path
        hashes, tried = block_hashes(routing_prompt(path, body)), set()
        headers = self.forwarded(request)
        while True:
            r = self.route(hashes, tried)
            if r is None:
                return self.unavailable()
            tried.add(r)
            forward = self.http.build_request("POST", self.replicas[r].url + path, content=body, headers=headers)
            try:
                upstream = await self.until_down(r, self.http.send(forward, stream=True), request)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:  # nothing reached it: take it out, try another
                self.release(r)
                self.metrics.error(r, "connect")
                self.take_out(r, f"cannot connect ({type(e).__name__}: {e})")
                continue
            except ClientGone:
                self.release(r)
                return Response(status_code=499)
            except (httpx.TransportError, ReplicaDown) as e:
                self.release(r)
                return JSONResponse(error_body(self.failed(r, e)), status_code=502, headers=self.headers(r))
            if upstream.headers.get("content-type", "").startswith("text/event-stream"):
                return StreamingResponse(self.relay_stream(r, upstream), status_code=upstream.status_code,
                                         media_type="text/event-stream", headers=self.headers(r))
            return await self.relay_whole(r, upstream, request)

    def headers(self, r: int) -> dict:
        return {"x-gpt2-replica": self.replicas[r].url}  # which replica answered: for tests and benchmarks

    async def relay_whole(self, r: int, upstream: httpx.Response, request: Request) -> Response:
        try:
            content = await self.until_down(r, upstream.aread(), request)
        except ClientGone:
            return Response(status_code=499)
        except (httpx.TransportError, ReplicaDown) as e:
            return JSONResponse(error_body(self.failed(r, e)), status_code=502, headers=self.headers(r))
        finally:
            self.release(r)
            await _close(upstream)
        headers = self.headers(r)
        if "retry-after" in upstream.headers:  # a replica's 429 says when to come back
            headers["Retry-After"] = upstream.headers["retry-after"]
        return Response(content, upstream.status_code, headers=headers,
                        media_type=upstream.headers.get("content-type"))

    async def relay_stream(self, r: int, upstream: httpx.Response):
        """The replica's server-sent events, a whole event at a time; if the replica fails mid-stream, an error
        event (which the OpenAI client raises as an ``APIError``) ends the stream."""
        lines, event = upstream.aiter_lines(), []
        try:
            while (line := await self.until_down(r, _next_line(lines))) is not None:
                if line:
                    event.append(line)
                elif event:
                    yield "\n".join(event) + "\n\n"
                    event = []
        except (httpx.TransportError, ReplicaDown) as e:
            yield f"data: {json.dumps(error_body(self.failed(r, e)))}\n\n"
        finally:
            self.release(r)
            await _close(upstream)


async def _next_line(lines):
    try:
        return await lines.__anext__()
    except StopAsyncIteration:
        return None


async def _close(upstream: httpx.Response) -> None:
    import anyio

    with anyio.CancelScope(shield=True):  # even while the request is being cancelled (its client went away)
        await upstream.aclose()


def make_router_app(urls: list[str], policy: str = "prefix_affinity", max_body_bytes: int = MAX_BODY_BYTES,
                    body_timeout_s: float = BODY_TIMEOUT_S, **router_args) -> Starlette:
    """The ASGI app routing to the servers at ``urls``; ``app.state.router`` is the ``Router``. The health probe
    runs with the app (its lifespan). A body over ``max_body_bytes`` gets a 413 here, before the router holds it;
    one not whole ``body_timeout_s`` after its headers, a 408 (chapter 7's clocks, ``slow_clients``)."""
    middleware = middleware_stack(max_body_bytes=max_body_bytes,
                                  body_timeout_s=body_timeout_s)  # its checks before the router is built
    router = Router(urls, policy, **router_args)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64,
                              keepalive_expiry=2.0)  # below uvicorn's 5 s: never reuse a connection it is closing
        router.http = httpx.AsyncClient(timeout=router.timeout, limits=limits)
        await asyncio.gather(*(router.probe(r) for r in range(len(router.replicas))))
        prober = asyncio.create_task(router.probe_forever())
        try:
            yield
        finally:
            prober.cancel()
            await router.http.aclose()

    posts = [Route(path, router.forward, methods=["POST"])
             for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")]
    gets = [Route(path, router.relay_get) for path in ("/v1/models", "/v1/models/{model_id:path}", "/version")]
    app = Starlette(routes=[Route("/health", router.health), Route("/metrics", router.metrics_text), *posts, *gets],
                    lifespan=lifespan, middleware=middleware,
                    exception_handlers=EXCEPTION_HANDLERS)
    app.state.router = router
    return app


def route_main(args) -> int:
    """``python -m gpt2_core route``: start ``--replicas`` servers if asked, bind, print where it listens, route
    until SIGTERM/Ctrl-C, then stop the servers it started."""
    from ..ch07_serving.app import listen, run_app
    from ..ch07_serving.launch import start_servers

    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if args.replicas < 0 or not (args.replicas or args.replica):
        raise InvalidInputError("route needs servers: --replica URL (one or more) and/or --replicas N (N >= 1)")
    if args.balance_abs < 0 or args.balance_rel < 1:
        raise InvalidInputError("--balance-abs must be >= 0 and --balance-rel >= 1")
    for url in args.replica:
        replica_url(url)  # a bad URL is reported before any server starts
    check_seconds("--header-timeout-s", args.header_timeout_s)  # and so is a bad clock
    check_seconds("--body-timeout-s", args.body_timeout_s)
    started = []
    try:
        started = start_servers(args.replicas, *serve_args, threads=1) if args.replicas else []
        urls = [*args.replica, *(s.url for s in started)]
        policy_args = {"balance_abs": args.balance_abs, "balance_rel": args.balance_rel}
        app = make_router_app(urls, args.policy, args.max_body_bytes, args.body_timeout_s,
                              **(policy_args if args.policy == "prefix_affinity" else {}))
        sock, host, port = listen(args.host, args.port)
        print(f"routing to {len(urls)} replicas ({args.policy}) on http://{host}:{port}/v1 "
              f"(metrics: http://{host}:{port}/metrics)", flush=True)
        run_app(app, sock, args.log_level, graceful_shutdown_s=5.0, header_timeout_s=args.header_timeout_s)
    finally:
        for server in started:
            server.stop()
    return 0
