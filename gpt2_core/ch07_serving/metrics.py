"""The server's Prometheus metrics (``/metrics``), named as vLLM names its own with a ``gpt2_`` prefix.

Each server has its own registry (two servers in one process, as in the tests, do not share counts); the
process collector adds ``process_resident_memory_bytes`` and friends, which the load benchmark reads. A later
chapter's engine brings its own metrics as ``parts`` (chapter 10's speculative decoding counters): each made on the
registry and updated between steps as the others are.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest

try:  # no "_created" series beside each counter (they double /metrics and no dashboard reads them)
    from prometheus_client import disable_created_metrics
    disable_created_metrics()
except ImportError:  # older prometheus_client: it has them, harmlessly
    pass

# Seconds: from a few milliseconds (a decode step of the small model) to minutes (a queue at twice capacity).
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                   7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
# Counts (tokens, n, max_tokens): vLLM's 1-2-5 series, up to 100,000.
SIZE_BUCKETS = tuple(m * 10**e for e in range(5) for m in (1, 2, 5)) + (100_000,)


def catch_up(counter, seen: dict, key, now: int) -> None:
    """Bring the Prometheus ``counter`` up to the engine's running total ``now`` (``seen[key]``: what it shows)."""
    if now > seen[key]:
        counter.inc(now - seen[key])
        seen[key] = now


class ServerMetrics:
    """The metrics of one server. ``parts``: factories ``part(registry, labels)`` of objects with ``update(engine)``,
    called between steps by the engine's thread (a later chapter's metrics, on the same registry and labels)."""

    def __init__(self, model_name: str, parts=()):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        labels = {"model_name": model_name}
        gauge = lambda name, doc: Gauge(name, doc, list(labels), registry=r).labels(**labels)  # noqa: E731
        counter = lambda name, doc: Counter(name, doc, list(labels), registry=r).labels(**labels)  # noqa: E731
        hist = lambda name, doc: Histogram(name, doc, list(labels), buckets=LATENCY_BUCKETS,  # noqa: E731
                                           registry=r).labels(**labels)
        self.running = gauge("gpt2_num_requests_running", "Sequences in the engine's running batch")
        self.waiting = gauge("gpt2_num_requests_waiting", "Requests waiting for a place (queued or preempted)")
        self.blocks_used = gauge("gpt2_kv_cache_blocks_used", "KV blocks held by sequences (ref count > 0)")
        self.blocks_free = gauge("gpt2_kv_cache_blocks_free", "KV blocks free (cached prefixes included)")
        self.usage = gauge("gpt2_kv_cache_usage_perc", "Fraction of KV blocks held by sequences (0 to 1)")
        self.hit_rate = gauge("gpt2_prefix_cache_hit_rate", "Prompt tokens found cached / prompt tokens looked up")
        self.prefix_queries = counter("gpt2_prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("gpt2_prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.preemptions = counter("gpt2_num_preemptions", "Sequences preempted (KV freed, recomputed later)")
        self.prompt_tokens = counter("gpt2_prompt_tokens", "Prompt tokens of the requests served")
        self.generation_tokens = counter("gpt2_generation_tokens", "Tokens generated")
        self.step_errors = counter("gpt2_engine_step_errors", "Engine steps that raised (their requests failed)")
        self.ttft = hist("gpt2_time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("gpt2_inter_token_latency_seconds", "Time between two tokens of a sequence")
        self.e2e = hist("gpt2_e2e_request_latency_seconds", "Arrival to last token")
        self.queue_time = hist("gpt2_request_queue_time_seconds", "Arrival to first scheduled")
        self.finished = Counter("gpt2_request_success", "Requests finished, by finish reason",
                                [*labels, "finished_reason"], registry=r)
        self.rejected = Counter("gpt2_requests_rejected", "Requests refused before reaching the engine, by reason "
                                "(invalid: 400/404; queue_full: 429)", [*labels, "reason"], registry=r)
        sizes = lambda name, doc: Histogram(name, doc, list(labels), buckets=SIZE_BUCKETS,  # noqa: E731
                                            registry=r).labels(**labels)
        self.request_prompt_tokens = sizes("gpt2_request_prompt_tokens", "Prompt tokens per finished request")
        self.request_generation_tokens = sizes("gpt2_request_generation_tokens",
                                               "Tokens generated per finished request (all its samples)")
        self.request_params_n = sizes("gpt2_request_params_n", "The n (samples) of each finished request")
        self.request_params_max_tokens = sizes("gpt2_request_params_max_tokens",
                                               "The max_tokens of each finished request")
        self.prefill_time = hist("gpt2_request_prefill_time_seconds", "First scheduled to first token")
        self.decode_time = hist("gpt2_request_decode_time_seconds", "First token to last token")
        self.inference_time = hist("gpt2_request_inference_time_seconds", "First scheduled to last token")
        self.http_requests = Counter("gpt2_http_requests", "HTTP requests answered, by method, handler (the route's "
                                     "path; 'other': no route) and status code",
                                     [*labels, "method", "handler", "status"], registry=r)
        self.http_latency = Histogram("gpt2_http_request_duration_seconds", "HTTP request to the last byte of its "
                                      "response, by method and handler", [*labels, "method", "handler"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self._labels = labels
        self._seen = {"queries": 0, "hits": 0, "preemptions": 0}
        self.parts = [make(r, labels) for make in parts]

    def observe_http(self, method: str, handler: str, status: int, seconds: float) -> None:
        """One HTTP request answered (``http_metrics.HTTPMetrics`` calls it)."""
        self.http_requests.labels(**self._labels, method=method, handler=handler, status=str(status)).inc()
        self.http_latency.labels(**self._labels, method=method, handler=handler).observe(seconds)

    def observe_request(self, prompt_tokens: int, generation_tokens: int, n: int, max_tokens: int) -> None:
        """One finished request's sizes (the engine's thread calls it as the request leaves the engine)."""
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)
        self.request_params_n.observe(n)
        self.request_params_max_tokens.observe(max_tokens)

    def finish(self, reason: str) -> None:
        self.finished.labels(**self._labels, finished_reason=reason).inc()

    def reject(self, reason: str) -> None:
        self.rejected.labels(**self._labels, reason=reason).inc()

    def update(self, engine, num_waiting: int) -> None:
        """Gauges and the engine's own counters, read between steps (by the engine's thread)."""
        s = engine.kv_stats()
        self.running.set(s["num_running"])
        self.waiting.set(num_waiting)
        self.blocks_used.set(s["num_used_blocks"])
        self.blocks_free.set(s["num_free_blocks"])
        self.usage.set(s["num_used_blocks"] / s["num_blocks"])
        self.hit_rate.set(s["hit_rate"])
        for key, counter, now in (("queries", self.prefix_queries, s["queried_tokens"]),
                                  ("hits", self.prefix_hits, s["hit_tokens"]),
                                  ("preemptions", self.preemptions, s["num_preemptions"])):
            catch_up(counter, self._seen, key, now)
        for part in self.parts:
            part.update(engine)

    def observe(self, seq) -> None:
        """One finished sequence's latencies (its ``SequenceMetrics``)."""
        m = seq.metrics
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.e2e_latency is not None:
            self.e2e.observe(m.e2e_latency)
        if m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m.first_scheduled_time is not None and m.token_times:
            self.prefill_time.observe(m.token_times[0] - m.first_scheduled_time)
            self.decode_time.observe(m.token_times[-1] - m.token_times[0])
            self.inference_time.observe(m.token_times[-1] - m.first_scheduled_time)

    def text(self) -> bytes:
        return generate_latest(self.registry)


class RouterMetrics:
    """The router's metrics: requests routed to each replica (by policy), replicas in rotation, requests in flight,
    failures talking to a replica, requests refused because no replica was alive."""

    def __init__(self, policy: str, urls: list[str]):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)
        self.policy, self.urls = policy, urls
        self._routed = Counter("gpt2_router_requests_routed", "Requests sent to each replica", ["policy", "replica"],
                               registry=r)
        self._up = Gauge("gpt2_router_replica_up", "1 while the replica is in rotation, else 0", ["replica"],
                         registry=r)
        self.alive = Gauge("gpt2_router_replicas_alive", "Replicas in rotation", registry=r)
        self._in_flight = Gauge("gpt2_router_requests_in_flight", "Requests sent to the replica, not yet answered",
                                ["replica"], registry=r)
        self._errors = Counter("gpt2_router_proxy_errors", "Failures talking to a replica, by kind (connect: could "
                               "not connect; request: failed during a request; health_probe: its /health failed)",
                               ["replica", "kind"], registry=r)
        self.unavailable = Counter("gpt2_router_requests_unavailable", "Requests refused with 503: no replica alive",
                                   registry=r)
        for url in urls:
            self._routed.labels(policy, url)
            self._up.labels(url).set(1)
            self._in_flight.labels(url).set(0)
        self.alive.set(len(urls))

    def routed(self, replica: int, in_flight: int) -> None:
        self._routed.labels(self.policy, self.urls[replica]).inc()
        self.in_flight(replica, in_flight)

    def in_flight(self, replica: int, count: int) -> None:
        self._in_flight.labels(self.urls[replica]).set(count)

    def set_up(self, replica: int, up: bool, num_alive: int) -> None:
        self._up.labels(self.urls[replica]).set(1 if up else 0)
        self.alive.set(num_alive)

    def error(self, replica: int, kind: str) -> None:
        self._errors.labels(self.urls[replica], kind).inc()

    def text(self) -> bytes:
        return generate_latest(self.registry)
