"""``python -m gpt2_core bench serve [--base-url URL] --json out.json``: the server under load, as its clients see it.

Its own client (asyncio + httpx, streaming, on loopback) first measures the server's **capacity** (requests per
second it completes with ``max_num_seqs`` clients always waiting on it), then sends requests as a Poisson process
at rising rates, 0.5x to 2x that capacity, each for ``duration_s`` (60 s; 2.5 s with ``--quick``). Per rate:
throughput, TTFT / ITL / end-to-end p50 and p99, how many were accepted, completed (every accepted one must),
refused with 429 and how fast the refusal came. A quarter of the requests are urgent (priority 0, the rest 1):
their TTFT beside the others' shows what priority scheduling buys. The server's resident memory
(``process_resident_memory_bytes`` from ``/metrics``) before the rates and after 2x shows whether it leaks.

``--goodput ttft:500 tpot:50`` (vLLM's flag; milliseconds; ``e2el`` too) adds **goodput** as vLLM defines it: the
completed requests that met every SLO given, per second, beside the throughput; and the **SLO attainment**, the
fraction of all the requests sent that did (DistServe's measure; a refused request misses its SLOs). TPOT is a
request's time per output token after the first, (end-to-end - TTFT) / (tokens - 1).

Without ``--base-url`` it starts ``python -m gpt2_core serve`` (the embedded model, the appendix's kernels) on a
free loopback port and stops it at the end, then does the same with ``serve --plain`` (the chapters' own NumPy code,
the result's ``chapter_code``), so that the stored run shows the code the chapter teaches beside the faster one.
With ``--base-url http://host:port/v1`` the same client and workload load any OpenAI-compatible server (vLLM,
SGLang, llama.cpp's server): compare a production engine with this one on the same trace. Prompts are text:
windows of the held-out Austen chapters.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time
from importlib import resources

import numpy as np

from ..errors import InvalidInputError
from . import progress

URGENT_FRACTION = 0.25
RATE_MULTIPLES = (0.5, 1.0, 1.5, 2.0)
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's --goodput names: time to first token, per output token, end to end


def prompts(n: int, words: tuple[int, int], seed: int = 0) -> list[str]:
    """``n`` prompts of ``words[0]``-``words[1]`` words, windows of the held-out text at seeded places."""
    text = resources.files("gpt2_core").joinpath("data/heldout/austen_validation.txt").read_text(encoding="utf-8")
    tokens = text.split()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(words[0], words[1] + 1))
        start = int(rng.integers(0, len(tokens) - length))
        out.append(" ".join(tokens[start:start + length]))
    return out


def percentile(values, q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


class Client:
    """Streams completions from ``base_url`` and records what each request saw."""

    def __init__(self, base_url: str, model: str, max_tokens: int):
        import httpx

        self.base_url, self.model, self.max_tokens = base_url.rstrip("/"), model, max_tokens
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0),
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def complete(self, prompt: str | list[int], priority: int, max_tokens: int | None = None) -> dict:
        """One streamed, greedy completion of ``prompt`` (text or token ids): its status, TTFT, inter-token gaps,
        end-to-end time, tokens, and the replica that served it when a router says so."""
        import json

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens or self.max_tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "priority": priority}
        rec = {"priority": priority, "status": None, "ttft_s": None, "itl_s": [], "e2e_s": None, "tokens": 0}
        start = time.perf_counter()
        last = None
        try:
            async with self.http.stream("POST", self.base_url + "/completions", json=body) as r:
                rec["status"], rec["replica"] = r.status_code, r.headers.get("x-gpt2-replica")
                if r.status_code != 200:
                    await r.aread()
                    rec["e2e_s"] = time.perf_counter() - start
                    return rec
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        rec["tokens"] = chunk["usage"]["completion_tokens"]
                    if any(c.get("text") for c in chunk.get("choices", [])):
                        if last is None:
                            rec["ttft_s"] = now - start
                        else:
                            rec["itl_s"].append(now - last)
                        last = now
            rec["e2e_s"] = time.perf_counter() - start
            rec["complete"] = True
        except Exception as e:  # a dropped connection: an accepted request lost
            rec["error"] = f"{type(e).__name__}: {e}"
        return rec

    async def metric(self, name: str) -> float | None:
        """One series of the server's ``/metrics`` (summed over labels), or None if it has none."""
        try:
            r = await self.http.get(re.sub(r"/v1$", "", self.base_url) + "/metrics")
            values = [float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", r.text, re.M)]
        except Exception:
            return None
        return sum(values) if values else None

    async def idle(self, timeout: float) -> None:
        """Wait until the server says nothing runs or waits (if it says; else a short pause)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running, waiting = (await self.metric("gpt2_num_requests_running"),
                                await self.metric("gpt2_num_requests_waiting"))
            if running is None or (running == 0 and waiting == 0):
                return
            await asyncio.sleep(0.1)


async def capacity(client: Client, texts: list[str], concurrency: int, seconds: float) -> dict:
    """Requests/s the server completes with ``concurrency`` clients each sending its next request at once."""
    done, stop, i = [], time.perf_counter() + seconds, iter(range(10**9))

    async def worker():
        while time.perf_counter() < stop:
            rec = await client.complete(texts[next(i) % len(texts)], 1)
            done.append(rec)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    ok = [r for r in done if r["status"] == 200 and r.get("complete")]
    return {"concurrency": concurrency, "seconds": wall, "requests": len(ok),
            "requests_per_s": len(ok) / wall, "tokens_per_s": sum(r["tokens"] for r in ok) / wall}


async def at_rate(client: Client, texts: list[str], rate: float, seconds: float, seed: int, slos: dict | None,
                  drain_s: float) -> tuple[dict, list]:
    """Poisson arrivals at ``rate`` per second for ``seconds``; then wait (at most ``drain_s``) for every answer."""
    rng = np.random.default_rng(seed)
    tasks, start = [], time.perf_counter()
    t = float(rng.exponential(1 / rate))
    while t < seconds:
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        urgent = rng.random() < URGENT_FRACTION
        tasks.append(asyncio.create_task(client.complete(texts[len(tasks) % len(texts)], 0 if urgent else 1)))
        t += float(rng.exponential(1 / rate))
    sent_s = time.perf_counter() - start
    finished, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
    for task in pending:
        task.cancel()
    records = [task.result() for task in tasks if task in finished]
    wall = time.perf_counter() - start
    return summarize(records, len(tasks), len(pending), rate, sent_s, wall, slos), records


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """vLLM's ``--goodput ttft:500 tpot:50`` (milliseconds) -> ``{"ttft": 0.5, "tpot": 0.05}`` (seconds)."""
    slos = {}
    for pair in pairs or []:
        name, _, value = pair.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if name not in GOODPUT_METRICS or not ms >= 0 or name in slos:
            raise InvalidInputError(f"--goodput {pair!r}: give each SLO once as NAME:MILLISECONDS, NAME one of "
                                    f"{', '.join(GOODPUT_METRICS)} and a number >= 0 (e.g. --goodput ttft:500 tpot:50)")
        slos[name] = ms / 1000
    return slos


def request_slo_values(rec: dict) -> dict[str, float]:
    """A completed request's TTFT, TPOT and end-to-end latency (seconds), as vLLM's benchmark measures them: TPOT
    is the time per output token after the first, (e2e - TTFT) / (tokens - 1), and 0 for a one-token answer; a
    request that streamed no text has its TTFT at its end."""
    tokens = rec["tokens"] or (len(rec["itl_s"]) + 1 if rec["ttft_s"] is not None else 0)
    ttft = rec["ttft_s"] if rec["ttft_s"] is not None else rec["e2e_s"]
    tpot = (rec["e2e_s"] - ttft) / (tokens - 1) if tokens > 1 else 0.0
    return {"ttft": ttft, "tpot": tpot, "e2el": rec["e2e_s"]}


def goodput(completed: list, sent: int, wall: float, slos: dict[str, float]) -> dict:
    """Goodput as vLLM defines it: completed requests that met every SLO given (each value <= its limit) per second
    of the run; and SLO attainment, the fraction of the requests sent that did (a refused or lost one did not)."""
    good = sum(all(request_slo_values(r)[k] <= limit for k, limit in slos.items()) for r in completed)
    return {"good_requests": good, "goodput_requests_per_s": good / wall if wall else 0.0,
            "slo_attainment": good / sent if sent else None}


def summary_line(r: dict) -> str:
    """A rate's latencies and goodput on one line of ``bench serve``'s printed summary."""
    def ms(key: str) -> str:
        return "n/a" if r.get(key) is None else f"{1e3 * r[key]:.0f} ms"

    line = (f"  {'':16s} TTFT p50 {ms('ttft_p50_s')}, p99 {ms('ttft_p99_s')}; ITL p50 {ms('itl_p50_s')}, "
            f"p99 {ms('itl_p99_s')}")
    if "goodput_requests_per_s" in r:
        attained = "n/a" if r["slo_attainment"] is None else f"{100 * r['slo_attainment']:.1f}%"
        line += (f"; goodput {r['goodput_requests_per_s']:.2f} req/s of {r['requests_per_s']:.2f} "
                 f"(SLO attainment {attained})")
    if r.get("errors"):
        line += "; errors: " + ", ".join(f"{n} x {kind}" for kind, n in r["errors"].items())
    return line + "\n"


def error_kinds(records: list, unanswered: int = 0) -> tuple[dict[str, int], dict[str, str]]:
    """What went wrong, counted by kind: an answer other than 200, 429 or 503 by its status (``HTTP 500``), a request
    whose stream or connection failed by the client's exception type (``Client.complete``'s ``error``), and requests
    still unanswered when the drain ended. -> (count per kind, one message per kind). A request cut mid-stream
    counts here and in ``lost``; ``other_errors`` counts only the requests without a 200, 429 or 503."""
    counts, examples = {}, {}
    for r in records:
        if r.get("error"):
            kind, message = r["error"].split(":", 1)[0], r["error"]
        elif r["status"] not in (200, 429, 503):
            kind = message = f"HTTP {r['status']}"
        else:
            continue
        counts[kind] = counts.get(kind, 0) + 1
        examples.setdefault(kind, message)
    if unanswered:
        kind = "unanswered when the drain ended"
        counts[kind], examples[kind] = unanswered, kind
    return dict(sorted(counts.items())), dict(sorted(examples.items()))


def summarize(records: list, sent: int, unanswered: int, rate: float, sent_s: float, wall: float,
              slos: dict[str, float] | None = None) -> dict:
    ok = [r for r in records if r["status"] == 200 and r.get("complete")]
    accepted = [r for r in records if r["status"] == 200] + [None] * unanswered
    rejected = [r for r in records if r["status"] in (429, 503)]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [x for r in ok for x in r["itl_s"]]
    e2e = [r["e2e_s"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    urgent = [r["ttft_s"] for r in ok if r["priority"] == 0 and r["ttft_s"] is not None]
    rest = [r["ttft_s"] for r in ok if r["priority"] != 0 and r["ttft_s"] is not None]
    reject_s = [r["e2e_s"] for r in rejected]
    tpot = [request_slo_values(r)["tpot"] for r in ok]
    errors, examples = error_kinds(records, unanswered)
    out = {"request_rate": rate, "sent": sent, "sent_over_s": sent_s, "wall_s": wall, "accepted": len(accepted),
           "completed": len(ok), "lost": len(accepted) - len(ok), "rejected": len(rejected),
           "other_errors": sum(r["status"] not in (200, 429, 503) for r in records),
           "errors": errors, "error_examples": examples,
           "output_tokens": tokens, "tokens_per_s": tokens / wall if wall else 0.0,
           "requests_per_s": len(ok) / wall if wall else 0.0,
           "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
           "itl_p50_s": percentile(itl, 50), "itl_p99_s": percentile(itl, 99),
           "tpot_p50_s": percentile(tpot, 50), "tpot_p99_s": percentile(tpot, 99),
           "e2e_p50_s": percentile(e2e, 50), "e2e_p99_s": percentile(e2e, 99),
           "reject_latency_p99_s": percentile(reject_s, 99), "reject_latency_max_s": max(reject_s, default=None),
           "urgent_ttft_p50_s": percentile(urgent, 50), "rest_ttft_p50_s": percentile(rest, 50),
           "urgent_requests": len(urgent), "rest_requests": len(rest),
           "urgent_ttft_speedup": (statistics.median(rest) / statistics.median(urgent)
                                   if urgent and rest and statistics.median(urgent) > 0 else None)}
    if slos:
        out.update(goodput(ok, sent, wall, slos))
    return out


async def run_load(base_url: str, model: str, quick: bool, num_seqs: int, slos: dict | None = None) -> dict:
    max_tokens = 16 if quick else 64
    duration_s = 2.5 if quick else 60.0
    texts = prompts(64 if quick else 512, (8, 24) if quick else (16, 64), seed=0)
    client = Client(base_url, model, max_tokens)
    try:
        await asyncio.gather(*(client.complete(t, 1) for t in texts[:num_seqs]))  # warm-up: kernels, tiles, pools
        progress.advance(10, "the server's capacity")
        cap = await capacity(client, texts, 2 * num_seqs, 2.0 if quick else 15.0)  # the queue never empties
        progress.advance(15, f"Poisson arrivals at {RATE_MULTIPLES[0]}x capacity")
        await client.idle(60)
        rss_before = await client.metric("process_resident_memory_bytes")
        rates = []
        for i, multiple in enumerate(RATE_MULTIPLES):
            summary, _ = await at_rate(client, texts, multiple * cap["requests_per_s"], duration_s, 1 + i, slos,
                                       drain_s=30.0 if quick else 300.0)
            rates.append({"method": f"rate_{multiple}x", "rate_multiple": multiple, "batch": num_seqs, **summary})
            progress.advance(70, f"Poisson arrivals at {multiple}x capacity done")
            await client.idle(60)
        rss_after = await client.metric("process_resident_memory_bytes")
    finally:
        await client.http.aclose()
    workload = {"prompts": "windows of the held-out Austen chapters", "prompt_words": [8, 24] if quick else [16, 64],
                "max_tokens": max_tokens, "temperature": 0, "duration_s_per_rate": duration_s,
                "rate_multiples_of_capacity": list(RATE_MULTIPLES), "urgent_fraction": URGENT_FRACTION,
                "arrivals": "Poisson, seeded", "goodput_slos_ms": {k: 1000 * v for k, v in (slos or {}).items()}}
    growth = (rss_after - rss_before) / rss_before if rss_before and rss_after else None
    by = {r["rate_multiple"]: r for r in rates}
    return {"workload": workload, "capacity": cap, "results": rates,
            "memory": {"rss_before_bytes": rss_before, "rss_after_2x_bytes": rss_after, "growth": growth},
            "ratios": {"urgent_ttft_speedup_at_1.5x": by[1.5]["urgent_ttft_speedup"],
                       "rss_growth_after_2x": growth,
                       "lost_accepted_requests": float(sum(r["lost"] for r in rates)),
                       "max_reject_latency_s": max((r["reject_latency_max_s"] for r in rates
                                                    if r["reject_latency_max_s"] is not None), default=None)}}


def load_server(base_url: str, quick: bool, max_num_seqs: int, slos: dict) -> tuple[str, dict]:
    """``run_load`` against the server at ``base_url`` (its first model) -> (the model's id, what the load saw)."""
    import httpx

    models = httpx.get(base_url.rstrip("/") + "/models", timeout=30).json()["data"]
    progress.advance(10, "warming up")
    model = models[0]["id"]
    return model, asyncio.run(run_load(base_url, model, quick, max_num_seqs, slos))


def own_server(args: list[str], quick: bool, max_num_seqs: int, slos: dict) -> tuple[str, dict, dict]:
    """``python -m gpt2_core serve ARGS`` started on a free loopback port, loaded (``load_server``), stopped.
    -> (model id, what the load saw, the server's record)."""
    from ..ch07_serving.launch import ServerProcess

    server = ServerProcess(*args)
    try:
        model, out = load_server(server.base_url, quick, max_num_seqs, slos)
    finally:
        code = server.stop()
    return model, out, {"base_url": "started here (loopback)", "args": args, "exit_code_after_sigterm": code}


def bench_serve(quick: bool = False, base_url: str | None = None, max_num_seqs: int = 16,
                goodput: list[str] | None = None, chapter_code: bool = True) -> dict:
    """The load benchmark (see the module's docstring); ``base_url`` to load a server already running; ``goodput``
    the SLOs of vLLM's ``--goodput`` (``["ttft:500", "tpot:50"]``, milliseconds) to count goodput against.

    Without ``base_url`` it loads its own server, with the appendix's kernels as ``serve`` runs by default, and then
    (``chapter_code``) a second one started with ``--plain``, the chapters' NumPy code, under the same load (its own
    capacity, the same multiples of it): that run is the result's ``chapter_code``."""
    slos = parse_goodput(goodput)
    if base_url is not None and not re.match(r"^https?://[^/]+(/.*)?$", base_url):
        raise InvalidInputError(f"--base-url must be an http(s) URL such as http://127.0.0.1:8000/v1, got {base_url!r}")
    servers = 1 if base_url is not None or not chapter_code else 2
    progress.plan(servers * (10 + 10 + 15 + 70 * len(RATE_MULTIPLES)), "starting the server")  # rough seconds
    if base_url is not None:
        model, out = load_server(base_url, quick, max_num_seqs, slos)
        return {"benchmark": "serve", "quick": quick, "model": model, "kernels": None,
                "server": {"base_url": base_url, "args": None, "exit_code_after_sigterm": None}, **out}
    args = ["--max-num-seqs", str(max_num_seqs), "--max-waiting", str(4 * max_num_seqs)]
    model, out, server = own_server(args, quick, max_num_seqs, slos)
    result = {"benchmark": "serve", "quick": quick, "model": model, "kernels": "cpu_kernels.accelerate",
              "server": server, **out}
    if chapter_code:
        progress.advance(0, "the chapter code's server (serve --plain)")
        _, plain, server = own_server(args + ["--plain"], quick, max_num_seqs, slos)
        result["chapter_code"] = {"kernels": "chapter code (serve --plain)", "server": server, **plain}
    return result
