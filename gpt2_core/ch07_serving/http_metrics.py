"""Every HTTP request in ``/metrics``: counted by method, handler and status code, its latency in a histogram.

vLLM's server gets these from prometheus-fastapi-instrumentator (``http_requests_total``,
``http_request_duration_seconds``); here a small ASGI middleware, outside every other part of the app, does the
same. ``handler`` is the path of the route that answered (``/v1/models/{model_id:path}``, not each id), or
``other`` when no route matches, so that a scan of random paths cannot blow up the number of series. The latency
runs from the request to the last byte of its response (a stream's too). A handler that raises counts as a 500:
what Starlette then answers.
"""

from __future__ import annotations

import time

from starlette.routing import Match

METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")  # any other method counts as "other"


class HTTPMetrics:
    """ASGI middleware: ``metrics.observe_http(method, handler, status, seconds)`` once per HTTP request;
    ``routes`` are the app's (``app.routes``), matched as the router matches them."""

    def __init__(self, app, metrics, routes: list):
        self.app, self.metrics, self.routes = app, metrics, routes

    def handler(self, scope) -> str:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is not Match.NONE:  # FULL, or PARTIAL: the path is right, the method is not (a 405)
                return route.path
        return "other"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), [500]

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe_http(method, self.handler(scope), status[0], time.perf_counter() - start)
