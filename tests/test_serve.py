"""``python -m gpt2_core serve``, tested as a real client uses it: a server process on a loopback port, the official
``openai`` client and raw HTTP; greedy tokens equal to the library's, faults (disconnects, bad requests, overload,
a failing step, SIGTERM) handled, priorities served first."""

import asyncio
import concurrent.futures
import json
import re
import signal
import time

import httpx
import openai
import pytest

from gpt2_core import kv_cache, load_model
from gpt2_core.ch07_serving.launch import ServerProcess
from helpers import ROOT, wait_until
from http_sockets import stalled_answers

MODEL = "gpt2-numpy-embedded"
PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich",
           "Mr. Knightley", "She was", "The rain", "\"My dear,\" said", "In the morning", "Harriet"]


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as s:  # the defaults a user gets (accelerated kernels, 32 sequences)
        yield s


@pytest.fixture(scope="module")
def small_server():
    """Two running sequences at most and six waiting, steps slowed to 20 ms as a model 10x larger would take: easy
    to overload; aging too slow to matter here."""
    with ServerProcess("--max-num-seqs", "2", "--max-waiting", "6", "--priority-aging-s", "1000",
                       "--step-delay-s", "0.02") as s:
        yield s


def greedy_text(model, prompt: str, max_tokens: int) -> tuple[str, int]:
    new = kv_cache.generate(model, model.tokenizer.encode(prompt), max_tokens)
    return model.tokenizer.decode(new, skip_special_tokens=True), len(new)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {series without labels: value} (the model_name label dropped; other labels kept)."""
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            base, _, labels = name.partition("{")
            kept = [kv for kv in re.findall(r'\w+="[^"]*"', labels) if not kv.startswith("model_name=")]
            out[base + ("{" + ",".join(kept) + "}" if kept else "")] = float(value)
    return out


def test_health_models_and_metrics(server):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = openai.OpenAI(base_url=server.base_url, api_key="unused").models.list()
    assert [m.id for m in models.data] == [MODEL]
    m = metrics(server.url)
    for name in ("gpt2_num_requests_running", "gpt2_num_requests_waiting", "gpt2_kv_cache_blocks_used",
                 "gpt2_kv_cache_blocks_free", "gpt2_prefix_cache_hit_rate", "gpt2_num_preemptions_total",
                 "gpt2_generation_tokens_total", "gpt2_time_to_first_token_seconds_count",
                 "gpt2_inter_token_latency_seconds_count", "gpt2_e2e_request_latency_seconds_count",
                 "process_resident_memory_bytes"):
        assert name in m, name


def test_the_openai_client_streams_and_not(server, model):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    want, count = greedy_text(model, PROMPTS[0], 24)
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert whole.choices[0].text == want and whole.usage.completion_tokens == count
    assert whole.choices[0].finish_reason == "length" and whole.usage.prompt_tokens == len(
        model.tokenizer.encode(PROMPTS[0]))
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == count
    # token ids as the prompt; a seed repeats a sampled text; n samples; logprobs of the greedy token are the top
    ids = model.tokenizer.encode(PROMPTS[1])
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0).choices[0].text == \
        greedy_text(model, PROMPTS[1], 10)[0]
    sampled = [client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=0.9, seed=7,
                                         n=3).choices for _ in range(2)]
    assert [c.text for c in sampled[0]] == [c.text for c in sampled[1]] and len(sampled[0]) == 3
    lp = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=5, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == 5 and "".join(logprobs.tokens) == lp.choices[0].text
    for tok, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and max(top.values()) == pytest.approx(value) and len(top) <= 2


def test_stop_strings_end_the_text_before_them(server, model):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused")
    full, _ = greedy_text(model, PROMPTS[0], 40)
    stop = full[12:15]
    for stream in (False, True):
        out = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop],
                                        stream=stream)
        text = "".join(c.choices[0].text for c in out if c.choices) if stream else out.choices[0].text
        assert text == full[:full.index(stop)]


def test_32_concurrent_clients_get_the_librarys_greedy_tokens(server, model):
    """32 clients at once (half streaming), prompts and lengths varied: each gets what ``kv_cache.generate`` gives
    the same prompt alone."""
    jobs = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + (5 * i) % 29, i % 2 == 0) for i in range(32)]

    async def one(client, prompt, max_tokens, stream):
        if not stream:
            r = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
            return r.choices[0].text
        text = ""
        async for chunk in await client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                           temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, *job) for job in jobs))

    got = asyncio.run(all_at_once())
    assert got == [greedy_text(model, prompt, n)[0] for prompt, n, _ in jobs]
    assert wait_until(lambda: metrics(server.url)["gpt2_kv_cache_blocks_used"] == 0)


def test_killed_clients_leave_no_blocks_behind(small_server):
    """Streams cut after their first tokens and whole requests whose client gives up: every one is aborted and
    its blocks freed, as /metrics shows."""
    before = metrics(small_server.url).get('gpt2_request_success_total{finished_reason="abort"}', 0)
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.Client(base_url=small_server.url, timeout=60) as http:
        for i in range(6):
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")  # a token arrived: it is running; now hang up
    for i in range(4):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(small_server.url + "/v1/completions", json={**body, "stream": False}, timeout=0.3)
    assert wait_until(lambda: metrics(small_server.url).get('gpt2_request_success_total{finished_reason="abort"}', 0)
                      >= before + 10)
    m = metrics(small_server.url)
    assert m["gpt2_kv_cache_blocks_used"] == 0 and m["gpt2_num_requests_running"] == 0


BAD = [({"prompt": "Emma", "temperature": "hot"}, "temperature"), ({"prompt": "Emma", "top_p": 0}, "top_p"),
       ({"prompt": "Emma", "n": 0}, "n"), ({"prompt": "Emma", "max_tokens": -1}, "max_tokens"),
       ({"prompt": "Emma", "logprobs": 9}, "logprobs"), ({"prompt": "Emma", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
       ({"prompt": "Emma", "priority": "high"}, "priority"), ({"prompt": [1, 2, 99999]}, "prompt"),
       ({"prompt": ""}, "prompt"), ({"max_tokens": 5}, "prompt"), ({"prompt": "Emma", "seed": -3}, "seed"),
       ({"prompt": "Emma", "stream": "yes"}, "stream"), ({"prompt": "Emma", "echo": True}, "echo"),
       ({"prompt": "Emma " * 200, "max_tokens": 100}, "max_tokens"),  # over the context of 256
       ({"prompt": "Emma", "max_tokens": 300}, "max_tokens")]


@pytest.mark.parametrize("body, field", BAD, ids=[f for _, f in BAD])
def test_a_bad_request_gets_a_400_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_malformed_bodies_and_unknown_models(server):
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/completions", json=["Emma"]).status_code == 400
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-5", "prompt": "Emma"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="Emma", temperature=5)
    assert httpx.get(server.url + "/health").status_code == 200  # and the server goes on


def test_overload_gets_429_at_once_and_every_accepted_request_completes(small_server):
    """At most six waiting (sent at once, none is running yet): of 16 requests sent together, six are accepted and
    the rest refused with 429 without waiting (well under a second here; the load benchmark measures it), and every
    accepted one completes."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 60, "temperature": 0}

    def send(_):
        t = time.perf_counter()
        r = httpx.post(small_server.url + "/v1/completions", json=body, timeout=120)
        return r.status_code, time.perf_counter() - t, r

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(send, range(16)))
    codes = [c for c, _, _ in results]
    assert set(codes) == {200, 429} and codes.count(200) >= 6, codes
    assert max(t for c, t, _ in results if c == 429) < 1.0
    assert all(r.json()["choices"][0]["finish_reason"] == "length" for c, _, r in results if c == 200)
    refused = next(r for c, _, r in results if c == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error" and refused.headers["retry-after"]
    assert metrics(small_server.url)['gpt2_requests_rejected_total{reason="queue_full"}'] >= codes.count(429)


def test_urgent_requests_are_served_before_the_queue(small_server):
    """Six requests of priority 1 fill the two places and the queue; two urgent ones (priority 0) sent after them
    get their first token before any of the four that were waiting."""
    first_token = {}

    def stream(name, priority):
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 50, "temperature": 0, "stream": True,
                "priority": priority}
        with httpx.stream("POST", small_server.url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    first_token.setdefault(name, time.perf_counter())

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        low = [pool.submit(stream, f"low{i}", 1) for i in range(2)]
        assert wait_until(lambda: metrics(small_server.url)["gpt2_num_requests_running"] == 2)
        low += [pool.submit(stream, f"low{i}", 1) for i in range(2, 6)]
        assert wait_until(lambda: metrics(small_server.url)["gpt2_num_requests_waiting"] == 4)
        urgent = [pool.submit(stream, f"urgent{i}", 0) for i in range(2)]
        for f in low + urgent:
            f.result()
    started_before = sorted(first_token, key=first_token.get)
    assert set(started_before[2:4]) == {"urgent0", "urgent1"}, started_before


def test_sigterm_ends_in_flight_requests_and_exits_cleanly():
    with ServerProcess("--graceful-shutdown-s", "1") as s:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 250, "temperature": 0.8, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)
            s.proc.send_signal(signal.SIGTERM)
            t = time.perf_counter()
            rest = list(lines)  # the stream ends (finished, or cut when the grace period is over)
        assert s.proc.wait(15) == 0 and time.perf_counter() - t < 15
        assert "Traceback" not in "".join(s.stderr), "".join(s.stderr)
        assert rest is not None


def test_sigterm_aborts_requests_that_outlast_the_grace_period(model):
    """Streams that cannot finish within ``--graceful-shutdown-s`` (200 tokens at >= 50 ms a step: over 10 s,
    against a grace of 1 s) are aborted when it ends: each client's stream ends properly, early, with finish reason
    ``abort`` and ``[DONE]`` (not a connection cut mid-stream, never a hang), and the process exits 0 soon after,
    without a traceback."""
    long = [p for p in PROMPTS if greedy_text(model, p, 200)[1] == 200][:3]  # no eos before 200 tokens
    assert long, "a prompt whose greedy run lasts 200 tokens"
    chunks = {p: [] for p in long}
    with ServerProcess("--graceful-shutdown-s", "1", "--step-delay-s", "0.05") as s:
        body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "stream": True}

        def stream(prompt):
            try:
                with httpx.stream("POST", s.url + "/v1/completions", json={**body, "prompt": prompt},
                                  timeout=30) as r:
                    lines = list(r.iter_lines())
            except httpx.HTTPError as e:  # the connection was cut mid-stream
                return type(e).__name__
            chunks[prompt] += [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            return "ended with [DONE]" if "data: [DONE]" in lines else "ended without [DONE]"

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(stream, p) for p in chunks]
            assert wait_until(lambda: metrics(s.url)["gpt2_num_requests_running"] == len(chunks), timeout=30)
            time.sleep(0.5)  # a few tokens each
            s.proc.send_signal(signal.SIGTERM)
            t = time.perf_counter()
            outcomes = [f.result(timeout=20) for f in futures]
        assert s.proc.wait(15) == 0 and time.perf_counter() - t < 10, outcomes
        assert "Traceback" not in "".join(s.stderr), "".join(s.stderr)
    assert outcomes == ["ended with [DONE]"] * len(chunks)
    for prompt, got in chunks.items():  # every stream was aborted before its 200 tokens
        assert 1 < len(got) < 200, (prompt, len(got))
        assert [c["choices"][0]["finish_reason"] for c in got] == [None] * (len(got) - 1) + ["abort"], prompt


def test_a_failing_step_fails_its_requests_and_the_loop_goes_on(model):
    """In process: the engine's step raises once; the request in it gets an error, the next one is served."""
    from starlette.testclient import TestClient

    from gpt2_core.ch07_serving.app import make_app

    app = make_app(model, MODEL, max_num_seqs=4)
    engine = app.state.server.engine
    real_step, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = step
    with TestClient(app) as client:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0}
        failed = client.post("/v1/completions", json=body)
        assert failed.status_code == 500 and "injected fault" in failed.json()["error"]["message"]
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == greedy_text(model, PROMPTS[0], 5)[0]
        assert client.get("/health").status_code == 200
        text = client.get("/metrics").text
        assert re.search(r"gpt2_engine_step_errors_total\{[^}]*\} 1\.0", text)
        assert re.search(r"gpt2_kv_cache_blocks_used\{[^}]*\} 0\.0", text)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp16"])
def test_serve_keeps_the_kv_blocks_in_the_kv_dtype_asked(kv_dtype, model):
    """``serve --kv-dtype int8`` (or fp16): chapter 5's engine over blocks kept by chapter 6's codec. Greedy texts
    equal those of chapter 5's engine with that codec in process, one request at a time as the client sends them;
    one of them (int8 K/V part from fp32 K/V after 115 tokens on it) tells the formats apart. Blocks freed."""
    from gpt2_core.ch03_batching.sequence import Request
    from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
    from gpt2_core.ch06_quantization.quant_kv_store import kv_codec

    def alone(fmt, prompt, max_tokens):
        engine = CachingLLMEngine(model, max_num_seqs=4, kv_codec=kv_codec(fmt))
        out = engine.generate_many([Request(0, model.tokenizer.encode(prompt), max_tokens)])[0]
        return model.tokenizer.decode(out.output_token_ids, skip_special_tokens=True)

    jobs = [(p, 24) for p in PROMPTS[:3]] + [("Mr. Darcy was not", 128)]
    want = [alone(kv_dtype, p, n) for p, n in jobs]
    assert (want[-1] != alone("fp32", *jobs[-1])) == (kv_dtype == "int8")
    with ServerProcess("--kv-dtype", kv_dtype, "--plain", "--max-num-seqs", "4") as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused")
        got = [client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0).choices[0].text
               for p, n in jobs]
        assert got == want
        assert wait_until(lambda: metrics(s.url)["gpt2_kv_cache_blocks_used"] == 0)


README = (ROOT / "README.md").read_text()


def test_the_readme_serving_examples_run_as_typed(model):
    """The README's serve command, its curl example and its openai client example, as typed (the port: any free
    one in place of the README's 8000)."""
    import subprocess
    import sys

    serve = re.search(r"<!-- serve-command -->\s*```bash\n(.*?)```", README, re.S).group(1).strip()
    assert serve.startswith(".venv/bin/python -m gpt2_core serve") and "8000" in serve  # the README's venv
    curl = re.search(r"<!-- serve-curl -->\s*```bash\n(.*?)```", README, re.S).group(1).strip()
    code = re.search(r"<!-- serve-openai -->\s*```python\n(.*?)```", README, re.S).group(1)
    with ServerProcess(*serve.replace("8000", "0").split()[4:]) as server:
        port = server.url.rsplit(":", 1)[1]
        r = subprocess.run(["bash", "-c", curl.replace("8000", port)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        text = json.loads(r.stdout)["choices"][0]["text"]
        assert text == greedy_text(model, "It is a truth universally acknowledged", 20)[0]
        r = subprocess.run([sys.executable, "-c", code.replace("8000", port)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0 and len(r.stdout.strip()) > 20, r.stderr


def test_bench_serve_loads_a_server_given_by_base_url(small_server):
    """``bench serve --base-url URL --quick``: the same client and workload against a server already running (here
    the small one); every accepted request completes, refusals are counted, the records are complete."""
    from gpt2_core.bench.serve import bench_serve

    out = bench_serve(quick=True, base_url=small_server.base_url, max_num_seqs=2)
    assert out["benchmark"] == "serve" and out["model"] == MODEL and out["server"]["base_url"] == small_server.base_url
    assert [r["rate_multiple"] for r in out["results"]] == [0.5, 1.0, 1.5, 2.0]
    for r in out["results"]:
        assert r["lost"] == 0 and r["completed"] + r["rejected"] == r["sent"] and r["tokens_per_s"] > 0
        assert r["ttft_p50_s"] <= r["ttft_p99_s"] and r["itl_p50_s"] <= r["itl_p99_s"]
    assert out["capacity"]["requests_per_s"] > 0 and out["memory"]["rss_before_bytes"] > 0
    with pytest.raises(Exception, match="base-url"):
        bench_serve(quick=True, base_url="localhost:8000")


def test_bench_serve_runs_the_chapter_code_beside_the_appendix_kernels(monkeypatch):
    """``bench serve`` without ``--base-url`` loads its own server (the appendix's kernels), then a second one started
    with ``--plain`` under the same load, stored as ``chapter_code`` and labelled; each server is stopped after its
    load. (The servers and the load are stand-ins here: the loads themselves are tested above.)"""
    from gpt2_core.bench import serve as bench
    from gpt2_core.ch07_serving import launch

    started, loaded = [], []

    class Server:
        def __init__(self, *args):
            self.args, self.base_url, self.stopped = list(args), f"http://127.0.0.1:{9000 + len(started)}/v1", False
            self.running_beside = [s for s in started if not s.stopped]  # servers still up when this one starts
            started.append(self)

        def stop(self):
            self.stopped = True
            return 0

    def load(base_url, quick, max_num_seqs, slos):
        loaded.append(base_url)
        return MODEL, {"capacity": {"requests_per_s": float(len(loaded))}, "results": [], "memory": {}}

    monkeypatch.setattr(launch, "ServerProcess", Server)
    monkeypatch.setattr(bench, "load_server", load)
    out = bench.bench_serve(quick=True, max_num_seqs=2)
    assert [s.args[-1] for s in started] == ["8", "--plain"] and all(s.stopped for s in started)
    assert not started[1].running_beside  # one after the other: two servers would share the two cores
    assert loaded == [s.base_url for s in started]
    assert out["kernels"] == "cpu_kernels.accelerate" and out["capacity"]["requests_per_s"] == 1.0
    plain = out["chapter_code"]
    assert plain["kernels"] == "chapter code (serve --plain)" and plain["capacity"]["requests_per_s"] == 2.0
    assert plain["server"]["args"] == out["server"]["args"] + ["--plain"]
    started.clear()
    assert "chapter_code" not in bench.bench_serve(quick=True, max_num_seqs=2, chapter_code=False)
    assert len(started) == 1
    started.clear()
    assert "chapter_code" not in bench.bench_serve(quick=True, base_url="http://127.0.0.1:9/v1") and not started


def test_the_hardening_flags_work_from_the_command_line():
    """``serve --api-key --allowed-origins --max-body-bytes --header-timeout-s --body-timeout-s --log-level info`` as
    typed: a wrong key is refused, /health stays open, CORS answers the allowed origin, a big body gets 413, a body
    or headers slower than their clock get 408, a client that hangs up mid-body leaves no traceback, and every
    request has its access-log line with its request id."""
    import socket

    with ServerProcess("--api-key", "k1", "--allowed-origins", "http://ui.example", "--max-body-bytes", "5000",
                       "--header-timeout-s", "1", "--body-timeout-s", "1", "--log-level", "info") as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model=MODEL, prompt="Emma", max_tokens=2)
        ok = openai.OpenAI(base_url=s.base_url, api_key="k1").completions.create(model=MODEL, prompt="Emma",
                                                                                 max_tokens=2)
        assert ok.choices[0].finish_reason in ("length", "stop")
        assert httpx.get(s.url + "/health", headers={"x-request-id": "probe-1"}).headers["x-request-id"] == "probe-1"
        r = httpx.post(s.base_url + "/completions", json={"prompt": "x" * 6000}, headers={
            "authorization": "Bearer k1", "origin": "http://ui.example"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert r.headers["access-control-allow-origin"] == "http://ui.example"
        for clock, answer, _ in stalled_answers(s.url, b"Authorization: Bearer k1\r\n"):
            # a 408 naming the clock, and the connection closed
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and clock in answer, answer
        host, port = s.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:  # the review's D5: half a body, then gone
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\":")
        assert wait_until(lambda: sum("request_id=" in line for line in s.stderr) >= 6)
        assert s.stop() == 0
    log = "".join(s.stderr)
    assert "Traceback" not in log and "ERROR" not in log, log
    assert re.search(r'"GET /health HTTP/1.1" 200 [\d.]+ ms request_id=probe-1', log), log
    assert re.search(r'"POST /v1/completions HTTP/1.1" 401 ', log) and re.search(r" 413 [\d.]+ ms", log), log
