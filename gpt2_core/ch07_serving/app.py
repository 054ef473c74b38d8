"""The HTTP server: an OpenAI-compatible ``/v1/completions`` (streamed as server-sent events, or whole),
``/v1/models``, ``/health`` and Prometheus ``/metrics``, on Starlette + uvicorn, over one ``EngineLoop``; with
``/v1/chat/completions`` (``chat``), ``/tokenize``, ``/detokenize``, ``/version``, ``/v1/models/{id}``
(``utility_routes``), and every HTTP request counted (``http_metrics``).

``python -m gpt2_core serve`` runs it (``serve_main``); ``make_app`` builds the ASGI app for any other ASGI
server or a test. What every route goes through (request ids, the access log, API key, CORS, content type, body
limit, OpenAI-shaped errors) is in ``middleware``; what a slow client may hold, in ``slow_clients``; how a
request's events become its answer (whole or streamed, for completions and chat alike), in ``answers``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import errno
import functools
import itertools
import signal
import socket
import sys
import threading
import time

from ..errors import GPT2Error, InvalidInputError, MissingDependencyError

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(f"serving needs the serve extra (pip install -e '.[serve]'): {e}") from None

import uvicorn
from uvicorn.config import LOGGING_CONFIG
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch06_quantization.quant_kv_store import kv_codec
from .answers import Batch, CompletionShape, answer
from .chat import ChatCompletions
from .http_metrics import HTTPMetrics
from .priority_scheduler import PriorityScheduler
from .engine_loop import EngineLoop, Job
from .metrics import ServerMetrics
from .middleware import EXCEPTION_HANDLERS, MAX_BODY_BYTES, OPEN_PATHS, error_response, middleware_stack
from .protocol import BadRequest, CompletionRequest, completion_id, max_prompt_chars, parse_completions, parse_json
from .slow_clients import BODY_TIMEOUT_S, HEADER_TIMEOUT_S, guarded_protocol
from .utility_routes import UtilityRoutes


def build_engine(model, max_num_seqs: int = 32, max_num_batched_tokens: int = 512, num_blocks: int | None = None,
                 block_size: int = 16, aging_s: float = 60.0, kv_dtype: str = "fp32") -> CachingLLMEngine:
    """Chapter 5's engine (paged store with prefix caching, chunked prefill, n > 1 by forking) with the priority
    scheduler. ``num_blocks`` defaults to room for ``max_num_seqs`` full contexts; ``kv_dtype`` (fp32, fp16 or
    int8) is the format the blocks keep K/V in (chapter 6's codecs)."""
    if num_blocks is None:
        num_blocks = max_num_seqs * blocks_needed(model.config.n_positions, block_size)
    store = PrefixCachingKVStore(model.config, num_blocks=num_blocks, block_size=block_size, codec=kv_codec(kv_dtype))
    engine = CachingLLMEngine(model, store, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                              scheduler_cls=functools.partial(PriorityScheduler, aging_s=aging_s))
    return engine  # the scheduler got the engine's clock, the one arrival times are stamped with


class Server:
    """The app's state: the model's name and tokenizer, the engine loop, the metrics (``metric_parts``: a later
    chapter's, see ``ServerMetrics``)."""

    def __init__(self, model, model_name: str, engine, max_waiting: int = 64, metric_parts=()):
        self.model, self.model_name, self.engine = model, model_name, engine
        self.metrics = ServerMetrics(model_name, metric_parts)
        self.loop = EngineLoop(engine, model.tokenizer, self.metrics, max_waiting)
        self.created = int(time.time())
        self.max_prompt_chars = max_prompt_chars(model.tokenizer, model.config.n_positions)
        self._ids = itertools.count()

    # -- routes ---------------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.loop.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine loop not running"}, status_code=503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "gpt2_core",
            "max_model_len": self.model.config.n_positions}]})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def completions(self, request: Request) -> Response:
        return await self.generate(request, self.parse, CompletionShape)

    # -- what completions and chat share ----------------------------------------------------------------------------
    async def generate(self, request: Request, parse, shape) -> Response:
        """Read the body, ``parse`` it (bytes -> a ``CompletionRequest`` per prompt, or a ``BadRequest``) in a
        worker thread, queue a job per prompt, answer in the ``shape`` of the API (ids ``<shape.id_prefix>-...``)."""
        if self.loop.num_waiting() >= self.loop.max_waiting:  # full: refuse before reading or checking anything
            return self._refuse(BadRequest(f"the server is at capacity: {self.loop.max_waiting} requests are waiting "
                                           f"already; retry later", None, 429), "queue_full")
        raw = await request.body()  # (a client gone before sending it all: RequestContext ends this quietly)
        try:  # JSON and tokenizing in a worker thread: the event loop (other clients, /health) goes on meanwhile
            requests = await run_in_threadpool(parse, raw)
        except BadRequest as e:
            return self._refuse(e, "invalid")
        batch = self._batch(requests, asyncio.Queue(), shape.id_prefix)
        try:
            self.loop.submit(*batch.jobs)
        except BadRequest as e:
            return self._refuse(e, "queue_full" if e.status == 429 else "unavailable")
        return await answer(shape(batch, self.model_name), request, self.loop)

    def parse(self, raw: bytes) -> list[CompletionRequest]:
        """A ``/v1/completions`` body, checked: a ``CompletionRequest`` per prompt, or a ``BadRequest``."""
        cfg = self.model.config
        return parse_completions(parse_json(raw), self.model_name, self.model.tokenizer, cfg.vocab_size,
                                 cfg.n_positions, self.engine.scheduler.max_num_seqs, self.max_prompt_chars)

    def _refuse(self, error: BadRequest, reason: str) -> Response:
        self.metrics.reject(reason)
        return error_response(error)

    def _batch(self, requests: list[CompletionRequest], events: asyncio.Queue, prefix: str) -> Batch:
        """A job per prompt; each one's events go to ``events`` numbered as the answer's choices."""
        aio = asyncio.get_running_loop()
        rid = f"{completion_id(prefix)}-{next(self._ids)}"

        def emitter(offset: int):
            return lambda ev: aio.call_soon_threadsafe(events.put_nowait, (ev[0], ev[1] + offset, *ev[2:]))

        jobs = [Job(rid if len(requests) == 1 else f"{rid}-{p}", r, emitter(p * r.n)) for p, r in enumerate(requests)]
        return Batch(rid, jobs, events)


def make_app(model, model_name: str = "gpt2-numpy", engine=None, max_waiting: int = 64, step_delay_s: float = 0.0,
             api_key: str | None = None, open_paths=OPEN_PATHS, allowed_origins=(),
             max_body_bytes: int = MAX_BODY_BYTES, body_timeout_s: float = BODY_TIMEOUT_S, metric_parts=(),
             **engine_args) -> Starlette:
    """The ASGI app serving ``model`` (an engine is built with ``engine_args`` unless given). The engine's thread
    starts and stops with the app (its lifespan); ``app.state.server`` is the ``Server``. ``api_key``,
    ``open_paths``, ``allowed_origins`` and ``max_body_bytes``: see ``middleware``; ``body_timeout_s``: see
    ``slow_clients``; ``metric_parts``: more metrics on ``/metrics`` (see ``ServerMetrics``)."""
    middleware = middleware_stack(api_key, open_paths, allowed_origins, max_body_bytes, body_timeout_s)  # checks
    if api_key is not None and not (isinstance(api_key, str) and api_key.strip()):
        raise InvalidInputError("the API key must not be empty (leave --api-key out for none)")
    server = Server(model, model_name, engine if engine is not None else build_engine(model, **engine_args),
                    max_waiting, metric_parts)
    server.loop.step_delay_s = float(step_delay_s)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop.start()
        try:
            yield
        finally:
            server.loop.stop()

    app = Starlette(routes=[
        Route("/health", server.health), Route("/v1/models", server.models), Route("/metrics", server.metrics_text),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", ChatCompletions(server).create, methods=["POST"]),
        *UtilityRoutes(server).routes()], lifespan=lifespan,
        middleware=middleware,
        exception_handlers=EXCEPTION_HANDLERS)
    app.add_middleware(HTTPMetrics, metrics=server.metrics, routes=app.routes)  # outermost: every answer counted
    app.state.server = server
    return app


ABORT_MARGIN_S = 1.0  # after the grace period, the aborted streams get this long to send their last event


class GracefulServer(uvicorn.Server):
    """uvicorn's server, which on the first SIGTERM/SIGINT also starts the grace period's clock: when it runs out,
    every request still in the engine is aborted, so that each stream ends with finish reason ``abort`` and
    ``[DONE]`` instead of being cancelled mid-write (uvicorn's own timeout, ``ABORT_MARGIN_S`` later, is then a
    backstop)."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, grace_s: float):
        super().__init__(config)
        self.engine_loop, self.grace_s = engine_loop, grace_s

    def handle_exit(self, sig, frame) -> None:
        if not self.should_exit:
            timer = threading.Timer(self.grace_s, self.engine_loop.abort_all)
            timer.daemon = True
            timer.start()
        super().handle_exit(sig, frame)


def serve_main(args, prepare=None, build=None, metric_parts=()) -> int:
    """``python -m gpt2_core serve``: bind (a port in use is reported before anything loads), load the model, print
    where it listens, serve until SIGTERM/Ctrl-C. ``prepare(model) -> model``, if given, runs on the loaded model
    first (the CLI passes the appendix's kernels); ``build(model, **engine_args) -> engine``, if given, builds the
    engine instead of ``build_engine`` (the CLI passes a later chapter's, for ``--speculative``), and ``metric_parts``
    add that engine's metrics to ``/metrics`` (see ``ServerMetrics``)."""
    from ..loading.weights import load_model

    sock, host, port = listen(args.host, args.port)
    try:
        model = load_model(args.model)
        if prepare is not None:
            model = prepare(model)
        # The engine's thread holds the GIL between NumPy calls; the event loop (HTTP, 429s, streams) needs it
        # often. Hand it over every 1 ms instead of Python's default 5 ms, so that a refusal or a token goes out
        # at once.
        sys.setswitchinterval(0.001)
        name = args.served_model_name or (args.model or "gpt2-numpy-embedded")
        origins = [o.strip() for arg in args.allowed_origins for o in arg.split(",") if o.strip()]
        engine_args = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                           num_blocks=args.num_blocks, aging_s=args.priority_aging_s)
        if build is None:
            engine_args["kv_dtype"] = args.kv_dtype
        elif args.kv_dtype != "fp32":
            raise SystemExit("--kv-dtype with --speculative: the speculative engine keeps its K/V in float32")
        app = make_app(model, name, engine=None if build is None else build(model, **engine_args),
                       max_waiting=args.max_waiting, step_delay_s=args.step_delay_s, api_key=args.api_key,
                       open_paths=[p for p in args.open_paths.split(",") if p], allowed_origins=origins,
                       max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
                       metric_parts=metric_parts, **engine_args)
        print(f"serving {name} on http://{host}:{port}/v1 (metrics: http://{host}:{port}/metrics)", flush=True)
        run_app(app, sock, args.log_level, args.graceful_shutdown_s, app.state.server.loop, args.header_timeout_s)
    finally:
        sock.close()
    print("server stopped", file=sys.stderr, flush=True)
    return 0


def listen(host: str, port: int) -> tuple[socket.socket, str, int]:
    """A socket bound to ``host:port`` (0: any free port) and listening, and the address it got: connections made
    from now on wait in the backlog until uvicorn accepts them. An address that cannot be had (in use, not
    ours, not an address) is a ``GPT2Error`` of one line."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except (OSError, OverflowError) as e:  # OverflowError: a port outside 0-65535
        sock.close()
        reason = ("the address is already in use (another server? choose another --port, or --port 0 for any "
                  "free one)" if getattr(e, "errno", None) == errno.EADDRINUSE else getattr(e, "strerror", None)
                  or str(e))
        raise GPT2Error(f"cannot listen on {host}:{port}: {reason}") from None
    host, port = sock.getsockname()[:2]
    return sock, host, port


def log_config(log_level: str) -> dict:
    """uvicorn's logging setup, with the package's loggers (the access log ``gpt2_core.access``, the engine's
    errors) on its handler at ``log_level``."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["gpt2_core"] = {"handlers": ["default"], "level": log_level.upper(), "propagate": False}
    return config


def uvicorn_config(app, header_timeout_s: float = HEADER_TIMEOUT_S, **config) -> uvicorn.Config:
    """uvicorn's configuration for ``app``: its h11 protocol with a clock on each request's headers
    (``slow_clients``), uvicorn's access log off (the app's own, ``middleware.RequestContext``, has the request ids),
    and ``config`` (uvicorn's own arguments: ``log_level``, ``timeout_graceful_shutdown``, ...)."""
    return uvicorn.Config(app, http=guarded_protocol(header_timeout_s), access_log=False, **config)


def run_app(app, sock: socket.socket, log_level: str, graceful_shutdown_s: float,
            engine_loop: EngineLoop | None = None, header_timeout_s: float = HEADER_TIMEOUT_S) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until SIGTERM or Ctrl-C. With ``engine_loop`` (a server), requests
    still running when the grace period ends are aborted (``GracefulServer``); uvicorn's own timeout comes
    ``ABORT_MARGIN_S`` later, for their streams to end."""
    margin = ABORT_MARGIN_S if engine_loop is not None else 0.0
    config = uvicorn_config(app, header_timeout_s, log_level=log_level, log_config=log_config(log_level),
                            timeout_graceful_shutdown=graceful_shutdown_s + margin)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again for the handler found at start: a no-op
    # one, so that a SIGTERM ends the process with status 0 once everything is shut down
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if engine_loop is None:
        uvicorn.Server(config).run(sockets=[sock])
    else:
        GracefulServer(config, engine_loop, graceful_shutdown_s).run(sockets=[sock])
