"""The HTTP server: an OpenAI-compatible ``/v1/completions`` (streamed as server-sent events, or whole),
``/v1/models``, ``/health`` and Prometheus ``/metrics``, on Starlette + uvicorn, over one ``EngineLoop``.

``python -m gpt2_core serve`` runs it (``serve_main``); ``make_app`` builds the ASGI app for any other ASGI
server or a test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math
import signal
import socket
import sys
import threading
import time

from ..errors import MissingDependencyError

try:
    import prometheus_client  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(f"serving needs the serve extra (pip install -e '.[serve]'): {e}") from None

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch06_quantization.quant_kv_store import kv_codec
from .priority_scheduler import PriorityScheduler
from .engine_loop import EngineLoop, Job
from .metrics import ServerMetrics
from .protocol import BadRequest, CompletionRequest, completion_id, parse_completion

DISCONNECT_POLL_S = 0.25  # how often a handler waiting for its next token checks that its client is still there


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
    engine.scheduler.clock = engine.clock  # arrival times are stamped with the engine's clock
    return engine


class Server:
    """The app's state: the model's name and tokenizer, the engine loop, the metrics."""

    def __init__(self, model, model_name: str, engine, max_waiting: int = 64):
        self.model, self.model_name, self.engine = model, model_name, engine
        self.metrics = ServerMetrics(model_name)
        self.loop = EngineLoop(engine, model.tokenizer, self.metrics, max_waiting)
        self.created = int(time.time())
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
        if self.loop.num_waiting() >= self.loop.max_waiting:  # full: refuse before reading or checking anything
            self.metrics.reject("queue_full")
            error = BadRequest(f"the server is at capacity: {self.loop.max_waiting} requests are waiting already; "
                               f"retry later", None, 429, "rate_limit_error")
            return JSONResponse(error.body(), status_code=429, headers={"Retry-After": "1"})
        try:
            try:
                body = json.loads(await request.body())
            except ValueError as e:
                raise BadRequest(f"the request body is not valid JSON ({e})") from None
            cfg = self.model.config
            req = parse_completion(body, self.model_name, self.model.tokenizer, cfg.vocab_size, cfg.n_positions,
                                   self.engine.scheduler.max_num_seqs)
        except BadRequest as e:
            self.metrics.reject("invalid")
            return JSONResponse(e.body(), status_code=e.status)
        events: asyncio.Queue = asyncio.Queue()
        aio = asyncio.get_running_loop()
        job = Job(f"{completion_id()}-{next(self._ids)}", req, lambda ev: aio.call_soon_threadsafe(events.put_nowait, ev))
        try:
            self.loop.submit(job)
        except BadRequest as e:
            self.metrics.reject("queue_full" if e.status == 429 else "unavailable")
            return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"})
        done = False
        try:
            first = await self._next(events, request)  # before answering: a refusal can still be a 400
            if first is None:
                return Response(status_code=499)  # the client went away (nginx's code; nobody reads it)
            if first[0] == "finish" and first[2] == "error":
                done = True
                error = BadRequest(first[3] or "the request failed", None, job.error_status,
                                   "invalid_request_error" if job.error_status == 400 else "server_error")
                return JSONResponse(error.body(), status_code=error.status)
            if req.stream:
                done = True  # the generator below owns the request from here on
                return StreamingResponse(self._sse(job, first, events, request), media_type="text/event-stream")
            body = await self._whole(job, first, events, request)
            if body is None:  # the client went away: the finally below aborts the request
                return Response(status_code=499)
            done = True
            return JSONResponse(body, status_code=500 if "error" in body else 200)
        finally:
            if not done:
                self.loop.abort(job.request_id)

    # -- helpers --------------------------------------------------------------------------------------------------
    @staticmethod
    async def _next(events: asyncio.Queue, request: Request):
        """The next event, or None if the client disconnected while we waited. The client is looked for every
        ``DISCONNECT_POLL_S`` seconds, tokens arriving or not."""
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

    def _chunk(self, job: Job, choices: list, usage: dict | None = None) -> dict:
        out = {"id": job.request_id, "object": "text_completion", "created": int(time.time()),
               "model": self.model_name, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def _usage(req: CompletionRequest, tokens: list[int]) -> dict:
        p, c = len(req.prompt_token_ids), sum(tokens)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    @staticmethod
    def _logprobs(entries: list, offset: int) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, lp, top in entries:
            out["tokens"].append(text)
            out["token_logprobs"].append(lp if math.isfinite(lp) else -1e30)
            out["top_logprobs"].append({t: (v if math.isfinite(v) else -1e30) for t, v in top.items()})
            out["text_offset"].append(offset)
            offset += len(text)
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
                _, i, reason, error, count = event
                reasons[i], counts[i] = reason, count
                if error:
                    errors.append(error)
                if all(r is not None for r in reasons):
                    break
            event = await self._next(events, request)
            if event is None:
                return None
        if errors:  # a sample failed after it started (its own sampling raised): say so, with what was made
            raise_ = BadRequest(errors[0], None, 500, "server_error")
            return raise_.body()
        choices = [{"index": i, "text": texts[i], "finish_reason": reasons[i],
                    "logprobs": self._logprobs(lps[i], 0) if job.request.logprobs is not None else None}
                   for i in range(n)]
        return self._chunk(job, choices, self._usage(job.request, counts))

    async def _sse(self, job: Job, event, events: asyncio.Queue, request: Request):
        req, finished, counts = job.request, 0, [0] * job.request.n
        offsets = [0] * req.n
        try:
            while True:
                if event[0] == "token":
                    _, i, piece, _, lp = event
                    lp_json = None
                    if req.logprobs is not None and lp is not None:
                        lp_json = self._logprobs([lp], offsets[i])
                    offsets[i] += len(piece)
                    if piece or lp_json:
                        choice = {"index": i, "text": piece, "logprobs": lp_json, "finish_reason": None}
                        yield f"data: {json.dumps(self._chunk(job, [choice]))}\n\n"
                else:
                    _, i, reason, error, count = event
                    counts[i], finished = count, finished + 1
                    choice = {"index": i, "text": "", "logprobs": None, "finish_reason": reason}
                    chunk = self._chunk(job, [choice])
                    if error:
                        chunk["error"] = {"message": error, "type": "server_error"}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if finished == req.n:
                        break
                event = await self._next(events, request)
                if event is None:
                    return
            if req.include_usage:
                yield f"data: {json.dumps(self._chunk(job, [], self._usage(req, counts)))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            if finished < req.n:  # the client went away (or the server is stopping): free its blocks now
                self.loop.abort(job.request_id)


def make_app(model, model_name: str = "gpt2-numpy", engine=None, max_waiting: int = 64, step_delay_s: float = 0.0,
             **engine_args) -> Starlette:
    """The ASGI app serving ``model`` (an engine is built with ``engine_args`` unless given). The engine's thread
    starts and stops with the app (its lifespan); ``app.state.server`` is the ``Server``."""
    server = Server(model, model_name, engine if engine is not None else build_engine(model, **engine_args),
                    max_waiting)
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
        Route("/v1/completions", server.completions, methods=["POST"])], lifespan=lifespan)
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


def serve_main(args, prepare=None) -> int:
    """``python -m gpt2_core serve``: load the model, bind, print where it listens, serve until SIGTERM/Ctrl-C.
    ``prepare(model) -> model``, if given, runs on the loaded model first (the CLI passes the appendix's kernels)."""
    from ..loading.weights import load_model

    model = load_model(args.model)
    if prepare is not None:
        model = prepare(model)
    # The engine's thread holds the GIL between NumPy calls; the event loop (HTTP, 429s, streams) needs it often.
    # Hand it over every 1 ms instead of Python's default 5 ms, so that a refusal or a token goes out at once.
    sys.setswitchinterval(0.001)
    name = args.served_model_name or (args.model or "gpt2-numpy-embedded")
    app = make_app(model, name, max_waiting=args.max_waiting, step_delay_s=args.step_delay_s, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
                   aging_s=args.priority_aging_s, kv_dtype=args.kv_dtype)
    sock, host, port = listen(args.host, args.port)
    print(f"serving {name} on http://{host}:{port}/v1 (metrics: http://{host}:{port}/metrics)", flush=True)
    run_app(app, sock, args.log_level, args.graceful_shutdown_s, app.state.server.loop)
    print("server stopped", file=sys.stderr, flush=True)
    return 0


def listen(host: str, port: int) -> tuple[socket.socket, str, int]:
    """A socket bound to ``host:port`` (0: any free port) and listening, and the address it got: connections made
    from now on wait in the backlog until uvicorn accepts them."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    return sock, host, port


def run_app(app, sock: socket.socket, log_level: str, graceful_shutdown_s: float,
            engine_loop: EngineLoop | None = None) -> None:
    """Serve ``app`` with uvicorn on ``sock`` until SIGTERM or Ctrl-C. With ``engine_loop`` (a server), requests
    still running when the grace period ends are aborted (``GracefulServer``); uvicorn's own timeout comes
    ``ABORT_MARGIN_S`` later, for their streams to end."""
    margin = ABORT_MARGIN_S if engine_loop is not None else 0.0
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=graceful_shutdown_s + margin,
                            access_log=False)
    # uvicorn stops gracefully on SIGTERM, then raises the signal again for the handler found at start: a no-op
    # one, so that a SIGTERM ends the process with status 0 once everything is shut down
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    if engine_loop is None:
        uvicorn.Server(config).run(sockets=[sock])
    else:
        GracefulServer(config, engine_loop, graceful_shutdown_s).run(sockets=[sock])
