"""The server fuzzed in process: thousands of requests of a designed mix, 16 at a time, straight into the ASGI app
(no sockets: fast). None may get a 5xx, raise out of the app, hang or log an error; every error is OpenAI's error
object with a code; every answer has a request id; afterwards the server still answers a greedy request with the
library's text, and no KV block is held.

The mix (weights in ``KINDS``): valid requests (batches, streams, n, logprobs, stop); valid bodies mutated 1-3
times (fields deleted, set to wrong types, huge or negative numbers, NaN and Infinity, lone surrogates, long
strings, nested junk; unknown fields); raw bodies (truncated, not UTF-8, BOMs, 5,000-digit numbers, nesting up to
200,000 deep, random bytes, whitespace); token-id prompts (out of range, floats, bools, 100,000 ids); wrong methods
and paths; wrong content types; bad headers (lengths over the limit, not numbers, junk keys and request ids); big
bodies (over the body limit, prompts over the context, long and many stop strings); clients that go away mid-body,
while waiting, or after a few streamed events.

What never reaches the app is fuzzed over real sockets (the second test), against uvicorn as ``serve`` configures it:
malformed request lines, headers and chunk framing, Content-Length that lies, bodies cut off half way, pipelining,
streams dropped after their first event; and all the while slow clients (a body a byte at a time, within the body
clock and past it; headers a byte at a time; a connection that sends nothing) and a /health probe.

``GPT2_FUZZ_CASES`` sets the number of cases (default 10,000; 1,000 with GPT2_QUICK=1), ``GPT2_FUZZ_SOCKET_CASES``
the socket cases (default a tenth of that, at least 60), ``GPT2_FUZZ_SEED`` the seed (default 2026):
``GPT2_FUZZ_CASES=10000 pytest tests/test_serve_fuzz.py -s`` prints the outcome by kind.
"""

import asyncio
import collections
import dataclasses
import gc
import json
import logging
import os
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from asgi_driver import call, sse_events
from helpers import tiny_model, wait_until
from http_sockets import (connect, drop_stream_after_first_event, exchange, read_reply, request_bytes, serving,
                          trickle)
from gpt2_core import GPT2Config, kv_cache, load_model
from gpt2_core.ch07_serving.app import make_app

MODEL = "gpt2-numpy-embedded"
QUICK = os.environ.get("GPT2_QUICK") == "1"
CASES = int(os.environ.get("GPT2_FUZZ_CASES", 1000 if QUICK else 10_000))
SEED = int(os.environ.get("GPT2_FUZZ_SEED", 2026))
CONCURRENCY = 16
MAX_BODY = 1 << 20
PROMPTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich", "Mr. Knightley",
           "She was", "\"My dear,\" said", "Harriet"]
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "logprobs",
          "priority", "stream", "stream_options", "echo", "best_of", "logit_bias", "suffix", "frequency_penalty",
          "presence_penalty", "user", "foo"]


def nested(depth: int, leaf=1):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


JUNK = [None, True, False, 0, -1, 1, 2, 3, 255, 256, 2**31, 2**53 + 1, 2**63, 2**64, -2**70, 10**30, 0.5, -0.0,
        1e-300, 1e308, float("nan"), float("inf"), float("-inf"), "", "x", "\ud800", "abc \udfff def", "é€😀",
        "x" * 5000, "<|endoftext|>", [], {}, [1, 2, 3], [[1]], [[]], ["a", "b"], {"a": 1}, [0] * 300,
        nested(30), ["s"] * 50, {"include_usage": "yes"}, {"include_usage": True}, [None], [1.5], [True]]


def valid_body(rng: random.Random) -> dict:
    """A request the server should serve: text, token ids or a batch; short, so that thousands run fast."""
    kind = rng.random()
    if kind < 0.6:
        prompt = rng.choice(PROMPTS)
    elif kind < 0.8:
        prompt = [rng.randrange(4096) for _ in range(rng.randint(1, 12))]
    else:
        prompt = rng.sample(PROMPTS, 2)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": rng.randint(1, 4), "temperature": rng.choice([0, 0.7, 1])}
    if rng.random() < 0.3:
        body["n"] = rng.randint(1, 3)
    if rng.random() < 0.3:
        body["stop"] = rng.sample([" ", "e", "the", ",", "I am", "\n"], rng.randint(1, 3))
    if rng.random() < 0.3:
        body["logprobs"] = rng.randint(0, 3)
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.4:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body


def mutated(rng: random.Random) -> dict:
    body = valid_body(rng)
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.6:
            body[rng.choice(FIELDS)] = rng.choice(JUNK)
        elif op < 0.8 and body:
            del body[rng.choice(list(body))]
        elif op < 0.9:
            body[rng.choice(["prompt", "stop"])] = [rng.choice(JUNK) for _ in range(rng.randint(1, 5))]
        else:
            return rng.choice(JUNK)  # not an object at all
    return body


def raw_body(rng: random.Random) -> bytes:
    valid = json.dumps(valid_body(rng)).encode()
    depth = rng.choice([10, 17, 100, 900, 990, 1000, 5000, 50_000, 200_000])
    return rng.choice([
        b"", b" ", b"{", b"}", b"null", b"[]", valid[:rng.randrange(len(valid))], valid + b"}", b"\xef\xbb\xbf" + valid,
        b"\xff\xfe" + valid, valid.replace(b'"', b"'"), valid.replace(b"{", b"{\x00"), b'{"prompt": NaN}',
        b'{"prompt": "x", "max_tokens": Infinity}', b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
        b'{"prompt": "x", "max_tokens": 1e999}', b"[" * depth + b"]" * depth, b'{"a":' * depth + b"1" + b"}" * depth,
        b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}",
        bytes(rng.randrange(256) for _ in range(rng.randrange(64))),
        b" " * 100_000 + valid, b'{"prompt": "a", "prompt": [1, 2], "max_tokens": 2, "max_tokens": 0}',
        valid.replace(b"prompt", b"pr\\u006fmpt"), "{\"prompt\": \"caf\u00e9\"}".encode("latin-1")])


def token_ids(rng: random.Random) -> dict:
    ids = rng.choice([[-1], [4096], [2**63], [-2**63], [1.0], [True], [None], ["1"], [[1, 2], 3],
                      [rng.randrange(4096) for _ in range(300)], [7] * 100_000, [0], [4095, 0, 17]])
    return {"prompt": ids, "max_tokens": rng.randint(1, 3)}


def case(rng: random.Random) -> tuple[str, dict]:
    """(kind, arguments of ``asgi_driver.call``)."""
    kind = rng.choices(list(KINDS), weights=list(KINDS.values()))[0]
    json_type = [(b"content-type", b"application/json")]
    if kind == "valid":
        return kind, {"json_body": valid_body(rng)}
    if kind == "mutated":
        return kind, {"body": json.dumps(mutated(rng)).encode(), "headers": json_type}
    if kind == "raw":
        return kind, {"body": raw_body(rng), "headers": json_type}
    if kind == "token_ids":
        return kind, {"json_body": token_ids(rng)}
    if kind == "method_path":
        path = rng.choice(["/v1/completions", "/v1/completions/", "/health", "/metrics", "/v1/models", "/nope",
                           "/" + "a" * 8000, "/v1/\x00", "/../../etc/passwd", "/v1/chat/completions", "/v1/models/x",
                           "/v1/completions?x=1&y", "/%ff"])
        method = rng.choice(["GET", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS", "POST", "TRACE", "BREW"])
        return kind, {"method": method, "path": path, "json_body": valid_body(rng) if rng.random() < 0.5 else None}
    if kind == "content_type":
        ct = rng.choice([b"text/plain", b"application/x-www-form-urlencoded", b"multipart/form-data; boundary=x",
                         b"", b"application/jsonx", b"json", b"application/json; charset=latin-1",
                         b"APPLICATION/JSON", b"application/vnd.api+json", b"\xff\xfe"])
        return kind, {"body": json.dumps(valid_body(rng)).encode(), "headers": [(b"content-type", ct)]}
    if kind == "headers":
        header = rng.choice([(b"content-length", b"99999999999999"), (b"content-length", b"abc"),
                             (b"content-length", b"-5"), (b"content-length", str(MAX_BODY + 1).encode()),
                             (b"authorization", b"Bearer " + b"x" * 10_000), (b"authorization", b"\xff\x00"),
                             (b"x-request-id", b"\xff" * 40), (b"x-request-id", b"a" * 10_000),
                             (b"x-request-id", b"ok-id"), (b"content-type", b"text/plain"), (b"origin", b"null"),
                             (b"transfer-encoding", b"chunked"), (b"expect", b"100-continue"), (b"host", b"")])
        return kind, {"json_body": valid_body(rng), "headers": [header]}
    if kind == "big":
        return kind, {"json_body": rng.choice([
            {"prompt": "hello world " * 80_000}, {"prompt": "x" * (MAX_BODY + 10)}, {"prompt": "é" * 300_000},
            {"prompt": "Emma", "stop": ["x" * 300]}, {"prompt": "Emma", "stop": ["x" * 250_000]},
            {"prompt": "Emma", "max_tokens": 4, "stop": ["ab" * 128] * 4},
            {"prompt": "Emma", "max_tokens": 4, "stop": ["x" * 256, "y" * 256, "z" * 256, " "]},
            {"prompt": [[1, 2]] * 1000}, {"prompt": ["Emma"] * 9}])}
    body = json.dumps({**valid_body(rng), "max_tokens": rng.randint(4, 24)}).encode()
    how = rng.choice(["cut_body", "hang_up", "leave"])
    if how == "cut_body":
        return "disconnect", {"body": [body[:rng.randrange(len(body))]], "cut_body": True, "headers": json_type}
    if how == "hang_up":
        return "disconnect", {"body": body, "hang_up": True, "headers": json_type}
    stream = json.dumps({**json.loads(body), "stream": True}).encode()
    return "disconnect", {"body": stream, "leave_after": rng.randint(1, 6), "headers": json_type}


KINDS = {"valid": 6, "mutated": 40, "raw": 12, "token_ids": 6, "method_path": 8, "content_type": 6, "headers": 6,
         "big": 5, "disconnect": 11}


def problems(kind: str, args: dict, answer) -> list[str]:
    """What is wrong with ``answer``, if anything."""
    if answer.status is None:
        return [] if kind == "disconnect" else ["no response"]
    out = []
    if answer.status >= 500:
        out.append(f"status {answer.status}: {answer.body[:300]!r}")
    if "x-request-id" not in answer.headers:
        out.append("no x-request-id")
    head = args.get("method") == "HEAD"
    if answer.status >= 400 and answer.status != 499 and not head:
        try:
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"]
        except Exception:
            out.append(f"not an OpenAI error object: {answer.status} {answer.body[:300]!r}")
    if answer.status == 200 and args.get("path", "/v1/completions") == "/v1/completions" and not head:
        out += completion_problems(args, answer)
    return out


def completion_problems(args: dict, answer) -> list[str]:
    if answer.headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_events(answer.body)
        if args.get("leave_after") is None and (not events or events[-1] != "[DONE]"):
            return [f"a stream without [DONE]: {answer.body[-300:]!r}"]
        if any(isinstance(e, dict) and "error" in e for e in events):
            return [f"an error in a stream: {answer.body[-300:]!r}"]
        return []
    body = answer.json()
    if body.get("object") != "text_completion" or [c["index"] for c in body["choices"]] != list(
            range(len(body["choices"]))) or "usage" not in body:
        return [f"not a completion: {answer.body[:300]!r}"]
    return []


class Errors(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.records = []

    def emit(self, record):
        self.records.append(record)


async def fuzz(app, cases) -> tuple[collections.Counter, list[str]]:
    """Run ``cases`` (an iterator: made as they run, since some bodies are a megabyte), ``CONCURRENCY`` at a time."""
    outcomes, failures = collections.Counter(), []

    async def one(i, kind, args):
        try:
            answer = await call(app, **args, timeout=120)
        except Exception as e:  # raised out of the app, or a hang
            failures.append(f"[case {i}] {kind}: {type(e).__name__}: {e}")
            return
        outcomes[kind, answer.status] += 1
        try:
            failures.extend(f"[case {i}] {kind}: {p}" for p in problems(kind, args, answer))
        except Exception as e:  # an answer too broken to check
            failures.append(f"[case {i}] {kind}: {type(e).__name__}: {e}: {answer.body[:300]!r}")

    async def worker(numbered):
        for i, (kind, args) in numbered:  # the workers share one iterator: each takes the next case when free
            await one(i, kind, args)

    numbered = enumerate(cases)
    await asyncio.gather(*(worker(numbered) for _ in range(CONCURRENCY)))
    return outcomes, failures


async def probe_health(app, done: asyncio.Event, out: list) -> None:
    """``/health`` every 0.2 s until ``done``: (seconds to answer, status) for each, while the fuzzing runs on the
    same event loop (a request that blocked the loop would show here)."""
    while not done.is_set():
        t = time.perf_counter()
        answer = await call(app, "GET", "/health")
        out.append((time.perf_counter() - t, answer.status))
        await asyncio.sleep(0.2)


def rss_mb() -> float:
    """This process's resident memory in MB (Linux), or 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except OSError:
        return 0.0


@pytest.fixture(scope="module")
def model():
    """The embedded model's tokenizer and context on a model 10x cheaper to run (random weights, large enough that
    greedy tokens are clear-cut): the fuzzing is of the HTTP layer, not of the model."""
    embedded = load_model()
    config = GPT2Config(vocab_size=embedded.config.vocab_size, n_positions=embedded.config.n_positions, n_embd=48,
                        n_head=3, n_layer=2, eos_token_id=embedded.config.eos_token_id)
    return dataclasses.replace(tiny_model(config=config), tokenizer=embedded.tokenizer)


def test_fuzzed_requests_get_no_5xx_and_leave_the_server_whole(model, capsys):
    rng = random.Random(SEED)
    cases = (case(rng) for _ in range(CASES))
    app = make_app(model, MODEL, max_num_seqs=8, max_body_bytes=MAX_BODY)
    server = app.state.server
    canary = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    want = model.tokenizer.decode(kv_cache.generate(model, model.tokenizer.encode(PROMPTS[0]), 12),
                                  skip_special_tokens=True)
    errors = Errors()
    logging.getLogger("gpt2_core").addHandler(errors)

    async def run():
        server.loop.start()
        try:
            warm = await call(app, json_body=canary)
            rss = [rss_mb()]
            t, done, health = time.perf_counter(), asyncio.Event(), []
            prober = asyncio.create_task(probe_health(app, done, health))
            outcomes, failures = await fuzz(app, cases)
            elapsed = time.perf_counter() - t
            done.set()
            await prober
            after = await call(app, json_body=canary)
            gc.collect()
            rss.append(rss_mb())
            return outcomes, failures, elapsed, health, [warm, after], rss
        finally:
            server.loop.stop()

    try:
        outcomes, failures, elapsed, health, canaries, rss = asyncio.run(run())
    finally:
        logging.getLogger("gpt2_core").removeHandler(errors)
    by_kind = collections.defaultdict(dict)
    for (kind, status), count in sorted(outcomes.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
        by_kind[kind][status or "gone"] = count
    with capsys.disabled():
        print(f"\nfuzz: {CASES} cases (seed {SEED}) in {elapsed:.1f} s, {len(failures)} failures; /health answered "
              f"{len(health)} probes, the slowest in {max(t for t, _ in health):.3f} s; RSS after warm-up "
              f"{rss[0]:.0f} MB, at the end {rss[1]:.0f} MB; by kind and status: {dict(by_kind)}")
    assert not failures, "\n".join(failures[:20])
    assert not errors.records, [r.getMessage()[:300] for r in errors.records[:5]]
    assert all(status == 200 for _, status in health)
    assert [c.status for c in canaries] == [200, 200]  # greedy, before and after: the library's text both times
    assert [c.json()["choices"][0]["text"] for c in canaries] == [want, want]
    assert rss[1] - rss[0] < 256, rss  # what the fuzzing left behind (a leak would grow with the cases)
    manager = server.engine.store.manager
    assert not server.loop.active and not server.engine.has_unfinished()
    assert manager.num_used_blocks() == 0 and manager.num_free_blocks == manager.num_blocks
    assert sum(count for (kind, status), count in outcomes.items() if status == 200) > CASES // 20  # some served


# --- over real sockets: what never reaches the app -------------------------------------------------------------------
# Malformed HTTP, bodies cut off or longer than announced, streams dropped after their first event, and slow clients
# all the while, against uvicorn configured as ``serve`` configures it (in a thread of this process, so that the
# engine's blocks can be counted after). Its clocks are short here, so that the slow clients run into them often.
SOCKET_CASES = int(os.environ.get("GPT2_FUZZ_SOCKET_CASES", max(CASES // 10, 60)))
SOCKET_CONCURRENCY = 8
HEADER_S, BODY_S = 2.0, 3.0  # the test server's --header-timeout-s and --body-timeout-s
# The bar, kept as it is: /health answers within a second throughout, every probe. It is robust on a loaded
# 2-core box: with 500 socket cases, five slow clients and a load average near 7 (other jobs on 2 cores), the
# slowest probe took 0.02 s (0.12 s with the floor versions); a stall as the issue found one (a 4 MB prompt on the
# event loop) holds it 3-6 s.
HEALTH_S = 1.0
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
MALFORMED = [  # each answered by uvicorn (a 400) or the app (a 4xx, or a 200 where it is well-formed after all)
    b"GARBAGE\r\n\r\n", b"GET /health\r\n\r\n", b"GET /he alth HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET /health HTTP/1.1\r\n\r\n",  # no Host
    b"GET /health HTTP/1.0\r\n\r\n",  # well-formed: 200, then closed
    b"GET /health HTTP/1.1\nHost: x\n\n",  # bare line feeds
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Nul: a\x00b\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(40),
    HEAD + b"Content-Length: abc\r\n\r\n{}", HEAD + b"Content-Length: -5\r\n\r\n{}",
    HEAD + b"Content-Length: 1, 2\r\n\r\n{}", HEAD + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    HEAD + b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    HEAD + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",  # a chunk size that is not hex
    HEAD + b"Transfer-Encoding: chunked\r\n\r\n5\r\n{}\r\n0\r\n\r\n",  # a chunk shorter than its size
    HEAD + b"Transfer-Encoding: chunked\r\n\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(b'{"prompt": "Emma"}'),
                                                                               b'{"prompt": "Emma"}'),
    HEAD + b"Expect: 100-continue\r\nContent-Length: 18\r\n\r\n" + b'{"prompt": "Emma"}',
    b"GET /" + b"a" * 8000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n"]
SOCKET_KINDS = {"valid": 3, "pipelined": 1, "half_body": 2, "half_body_eof": 1, "cut_stream": 2, "malformed": 3,
                "length_mismatch": 1}


def socket_case(rng: random.Random) -> tuple[str, dict]:
    """(kind, what to send), made in the main thread: the same seed gives the same cases."""
    kind = rng.choices(list(SOCKET_KINDS), weights=list(SOCKET_KINDS.values()))[0]
    body = json.dumps(valid_body(rng)).encode()
    whole = request_bytes("POST", "/v1/completions", body)
    if kind == "valid":
        return kind, {"data": whole}
    if kind == "pipelined":
        other = request_bytes("POST", "/v1/completions", json.dumps(valid_body(rng)).encode())
        return kind, {"data": whole + other, "replies": 2}
    if kind in ("half_body", "half_body_eof"):  # the headers announce the whole body; half of it comes
        return kind, {"data": whole[:len(whole) - len(body) // 2], "half_close": kind == "half_body_eof"}
    if kind == "cut_stream":
        return kind, {"body": {**json.loads(body), "n": 1, "max_tokens": rng.randint(30, 120)}}
    if kind == "malformed":
        return kind, {"data": rng.choice(MALFORMED)}
    short = request_bytes("POST", "/v1/completions", body, {"Content-Length": str(len(body) - 7)})
    return kind, {"data": short, "replies": 2}  # the body's last 7 bytes: the start of a request that never ends


def run_socket_case(port: int, kind: str, case: dict) -> list[str]:
    """What is wrong with the server's answers to one case, if anything (a hang: the socket's timeout)."""
    try:
        return socket_case_problems(port, kind, case)
    except Exception as e:
        return [f"{type(e).__name__}: {e}"]


def socket_case_problems(port: int, kind: str, case: dict) -> list[str]:
    if kind == "cut_stream":
        drop_stream_after_first_event(port, case["body"])
        return []
    if kind == "half_body":
        with connect(port) as sock:
            sock.sendall(case["data"])  # and gone
        return []
    replies = exchange(port, case["data"], case.get("replies", 1), half_close=case.get("half_close", False))
    if kind in ("valid", "pipelined"):
        want = case.get("replies", 1)
        out = [] if len(replies) == want else [f"{len(replies)} answers to {want} requests"]
        return out + [p for reply in replies for p in problems(kind, {}, reply)]
    return [f"status {r.status}: {r.body[:200]!r}" for r in replies if r.status is not None and r.status >= 500]


def slow_clients(port: int, canary: bytes, want: str, done: threading.Event, outcomes: list) -> list:
    """Five slow clients, each over and over until ``done``: a body sent a byte at a time within the body clock
    (served: the canary's text), one that runs past it (408), headers a byte at a time past the header clock
    (408), a connection that never sends anything (closed, no answer), the body of a request answered unread (a
    404) trickling in after the answer (closed by the header clock). Each appends (kind, outcome)."""
    head, body = canary[:canary.index(b"\r\n\r\n") + 4], canary[canary.index(b"\r\n\r\n") + 4:]

    def loop(kind, run):
        while not done.is_set():
            try:
                outcomes.append((kind, run()))
            except Exception as e:  # a hang (the socket's timeout) or a reset
                outcomes.append((kind, f"{type(e).__name__}: {e}"))

    def in_time():
        reply = trickle(port, head, body, BODY_S / 4 / len(body))
        return reply.status == 200 and reply.json()["choices"][0]["text"] == want or (reply.status, reply.body[:200])

    def timed_out(reply):
        ok = reply.status == 408 and reply.json()["error"]["code"] == "request_timeout"
        return ok and reply.headers.get("connection") == "close" or (reply.status, reply.body[:200])

    def idle():
        with connect(port) as sock:
            return sock.recv(1) == b"" or "data from a connection that sent nothing"

    def unread_body():  # a 404 answered at once, the body it announced trickled in after it: closed by the clock
        with connect(port) as sock:
            sock.sendall(request_bytes("POST", "/nope", b"", {"Content-Length": "100000"}))
            reply, deadline = read_reply(sock.makefile("rb")), time.monotonic() + 10 * HEADER_S
            sock.settimeout(HEADER_S / 8)  # a byte every 1/8 of the clock
            while time.monotonic() < deadline:
                try:
                    sock.sendall(b" ")
                    if sock.recv(1) == b"":  # closed by the server
                        break
                except TimeoutError:  # still open: another byte
                    continue
                except ConnectionError:
                    break
            else:
                return "the connection is still open after 10 header clocks of an unread body trickling in"
            return reply.status == 404 or (reply.status, reply.body[:200])

    runs = {"slow_body_in_time": in_time,
            "slow_body_too_slow": lambda: timed_out(trickle(port, head, body, 2 * BODY_S / len(body))),
            "slow_headers": lambda: timed_out(trickle(port, b"", head, 2 * HEADER_S / len(head))), "idle": idle,
            "unread_body": unread_body}
    threads = [threading.Thread(target=loop, args=item, daemon=True) for item in runs.items()]
    for t in threads:
        t.start()
    return threads


def test_raw_http_abuse_and_slow_clients_get_4xx_or_a_close_and_leave_the_server_whole(model, capsys):
    """Raw-socket cases (``SOCKET_KINDS``) ``SOCKET_CONCURRENCY`` at a time while slow clients dribble and a probe
    asks /health every 0.2 s: no 5xx, no traceback or error in the log, every valid request served, the slow ones
    cut off by the clocks with a 408 (or closed, having sent nothing); afterwards no request in the engine and no
    block held (every dropped stream aborted), the greedy canary unchanged, RSS within 256 MB, /health always fast."""
    rng = random.Random(SEED)
    cases = [socket_case(rng) for _ in range(SOCKET_CASES)]
    app = make_app(model, MODEL, max_num_seqs=8, max_body_bytes=MAX_BODY, body_timeout_s=BODY_S)
    server, manager = app.state.server, app.state.server.engine.store.manager
    canary = request_bytes("POST", "/v1/completions", json.dumps(
        {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}).encode())
    want = model.tokenizer.decode(kv_cache.generate(model, model.tokenizer.encode(PROMPTS[0]), 12),
                                  skip_special_tokens=True)
    errors = Errors()
    for name in ("gpt2_core", "uvicorn.error"):
        logging.getLogger(name).addHandler(errors)
    try:
        with serving(app, header_timeout_s=HEADER_S) as port:
            first = exchange(port, canary)[0].json()["choices"][0]["text"]
            rss, done, health, slow = [rss_mb()], threading.Event(), [], []
            prober = threading.Thread(target=probe_health_socket, args=(port, done, health), daemon=True)
            prober.start()
            slow_threads = slow_clients(port, canary, want, done, slow)
            t = time.perf_counter()
            with ThreadPoolExecutor(SOCKET_CONCURRENCY) as pool:
                found = list(pool.map(lambda kc: run_socket_case(port, *kc), cases))
            elapsed = time.perf_counter() - t
            time.sleep(max(0.0, BODY_S - elapsed))  # every slow client is in its first round at least
            done.set()
            for thread in [prober, *slow_threads]:
                thread.join(60)
            settled = wait_until(lambda: not server.loop.active and not server.engine.has_unfinished()
                                 and manager.num_used_blocks() == 0, 20)
            last = exchange(port, canary)[0].json()["choices"][0]["text"]
            gc.collect()
            rss.append(rss_mb())
    finally:
        for name in ("gpt2_core", "uvicorn.error"):
            logging.getLogger(name).removeHandler(errors)
    failures = [f"[case {i}] {cases[i][0]}: {p}" for i, ps in enumerate(found) for p in ps]
    failures += [f"slow client {kind}: {outcome}" for kind, outcome in slow if outcome is not True]
    kinds = collections.Counter(kind for kind, _ in cases)
    with capsys.disabled():
        print(f"\nsocket fuzz: {SOCKET_CASES} cases (seed {SEED}) in {elapsed:.1f} s, {dict(kinds)}, "
              f"{len(failures)} failures; slow clients: {dict(collections.Counter(k for k, _ in slow))}; /health "
              f"answered {len(health)} probes, the slowest in {max(s for s, _ in health):.3f} s; RSS after "
              f"warm-up {rss[0]:.0f} MB, at the end {rss[1]:.0f} MB")
    assert not failures, "\n".join(failures[:20])
    bad_logs = [r for r in errors.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad_logs, [r.getMessage()[:300] for r in bad_logs[:5]]
    assert {kind for kind, _ in slow} == {"slow_body_in_time", "slow_body_too_slow", "slow_headers", "idle",
                                          "unread_body"}
    assert health and all(status == 200 for _, status in health)
    assert max(seconds for seconds, _ in health) < HEALTH_S
    assert settled, (list(server.loop.active), manager.num_used_blocks())  # every dropped stream freed its blocks
    assert first == last == want  # greedy, before and after: the library's text both times
    assert rss[1] - rss[0] < 256, rss


def probe_health_socket(port: int, done: threading.Event, out: list) -> None:
    """``/health`` on a new connection every 0.2 s until ``done``: (seconds to answer, status) for each."""
    while not done.is_set():
        t = time.perf_counter()
        reply = exchange(port, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")[0]
        out.append((time.perf_counter() - t, reply.status))
        time.sleep(0.2)
