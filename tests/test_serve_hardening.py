"""The server against hostile and unusual clients, in process (Starlette's TestClient, or the ASGI app called
directly): no 500 for any input, limits checked before the work they protect, tokenizing off the event loop, quiet
disconnects, OpenAI's error objects, batches of prompts, API key, CORS, request ids, the access log, a port in
use. Each defect of the outside review (reviews/server-2026-12-06.md) has its reproduction here."""

import asyncio
import json
import logging
import re
import socket
import threading
import time

import openai
import pytest
from hypothesis import given, settings, strategies as st
from starlette.testclient import TestClient

from asgi_driver import call, sse_events
from gpt2_core import kv_cache, load_model
from gpt2_core.ch07_serving.app import listen, make_app
from gpt2_core.ch07_serving.protocol import MAX_STOP_CHARS, StopMatcher, TextStream
from gpt2_core.errors import GPT2Error

MODEL = "gpt2-numpy-embedded"
PROMPT = "It is a truth universally acknowledged"


@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def client(model):
    with TestClient(make_app(model, MODEL, max_num_seqs=8)) as c:
        yield c


def greedy(model, prompt, max_tokens: int) -> str:
    ids = model.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    return model.tokenizer.decode(kv_cache.generate(model, ids, max_tokens), skip_special_tokens=True)


def assert_error(r, status: int, param=None, code=None):
    """``r`` is OpenAI's error object with this status: message, type, param and a code, nothing else."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"], error
    assert error["type"] == ("rate_limit_error" if status == 429 else "server_error" if status >= 500
                             else "invalid_request_error")
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def post(client, raw: bytes, headers=None):
    return client.post("/v1/completions", content=raw, headers={"content-type": "application/json", **(headers or {})})


# -- D1, D2 and other shapes: never a 500 ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw", [rb'{"prompt": "abc \ud800 def", "max_tokens": 2}', rb'{"prompt": ["\udfff"]}',
                                 rb'{"prompt": ["ok", "\udc80"]}'])
def test_a_lone_surrogate_in_the_prompt_is_a_400(client, raw):
    error = assert_error(post(client, raw), 400, "prompt")
    assert "surrogate" in error["message"]


@pytest.mark.parametrize("depth", [17, 990, 1000, 5000, 100_000])
@pytest.mark.parametrize("where", ["prompt", "top", "object"])
def test_json_nested_deeply_is_a_400(client, depth, where):
    nested = {"prompt": "[" * depth + "]" * depth, "top": "[" * depth + "]" * depth,
              "object": '{"a":' * depth + "1" + "}" * depth}[where]
    raw = ('{"prompt": ' + nested + "}" if where == "prompt" else nested).encode()
    error = assert_error(post(client, raw), 400, code="invalid_json")
    assert "nested too deeply" in error["message"]


SHAPES = [b"", b"{", b"[]", b'"Emma"', b"5", b"null", b"\xff\xfe{}", b'{"prompt": NaN}', b"1" * 5000,
          b'{"prompt": {}}', b'{"prompt": [[]]}', b'{"prompt": [1.5]}', b'{"prompt": [true]}', b'{"prompt": [null]}',
          b'{"prompt": [1, "a"]}', b'{"prompt": ["a", 1]}', b'{"prompt": [[1, [2]]]}', b'{"prompt": null}',
          b'{"prompt": "Emma", "model": 5}', b'{"prompt": "Emma", "stop": {}}', b'{"prompt": "Emma", "stop": [1]}',
          b'{"prompt": "Emma", "stream": true, "stream_options": []}', b'{"prompt": "Emma", "max_tokens": 1e400}',
          b'{"prompt": "Emma", "temperature": Infinity}', b'{"prompt": "Emma", "n": 99999999999999999999999}',
          b'{"prompt": "Emma", "seed": 18446744073709551616}', b'{"prompt": "Emma", "top_k": "1"}',
          b'{"prompt": "Emma", "logprobs": true}', b'{"prompt": "Emma", "best_of": [2]}',
          b'{"prompt": "Emma", "echo": "yes"}', b'{"prompt": [4096]}', b'{"prompt": [-1]}',
          b'{"prompt": [9223372036854775808]}']


@pytest.mark.parametrize("raw", SHAPES, ids=[s[:30].decode("latin-1") for s in SHAPES])
def test_an_unexpected_body_is_a_400_that_says_what_is_wrong(client, raw):
    assert_error(post(client, raw), 400)


def test_the_review_bodies_that_gave_500_get_400_and_the_server_goes_on(client, model):
    for raw in [rb'{"prompt": "abc \ud800 def", "max_tokens": 2}', b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}"]:
        assert post(client, raw).status_code == 400
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy(model, PROMPT, 8)


# -- D3: stop strings ------------------------------------------------------------------------------------------------
def test_stop_strings_are_limited_in_number_and_length(client):
    assert_error(client.post("/v1/completions", json={"prompt": "Emma", "stop": list("abcde")}), 400, "stop")
    error = assert_error(client.post("/v1/completions", json={"prompt": "Emma", "stop": ["x" * (MAX_STOP_CHARS + 1)]}),
                         400, "stop")
    assert str(MAX_STOP_CHARS) in error["message"]
    r = client.post("/v1/completions", json={"prompt": "Emma", "max_tokens": 3, "stop": ["x" * MAX_STOP_CHARS] * 4})
    assert r.status_code == 200, r.text


def naive_first_stop(text: str, stops: list[str]):
    """Where the first stop string starts in ``text`` (None if none), and how much of its end begins one."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    if found:
        return min(found), None
    return None, max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.text("ab c", max_size=6), max_size=12),
       stops=st.lists(st.text("ab c", min_size=1, max_size=5), min_size=1, max_size=4))
def test_the_stop_matcher_finds_what_a_search_of_the_whole_text_finds(pieces, stops):
    """Fed piece by piece, the linear matcher gives the first stop string's position (or how much of the end to
    hold back) exactly as searching the whole text so far does."""
    matcher, text = StopMatcher(stops), ""
    for piece in pieces:
        text += piece
        cut = matcher.feed(piece)
        want_cut, want_held = naive_first_stop(text, stops)
        assert cut == want_cut, (text, stops)
        if cut is not None:
            break
        assert matcher.held() == want_held, (text, stops)


def test_the_stop_check_costs_the_same_per_token_whatever_the_stop_strings_length(model):
    """The review's 250 KB stop string cost seconds per token (quadratic in its length). Now a token costs the same
    with a stop string of 10 characters or of 20,000 (TextStream itself has no limit; the protocol has one):
    both measured side by side, over the same 120 tokens."""
    tokens = kv_cache.generate(model, model.tokenizer.encode(PROMPT), 120)

    def cost(stop_length: int) -> float:
        stream = TextStream(model.tokenizer, ["y" * stop_length, "q" * stop_length])
        t = time.perf_counter()
        for token in tokens:
            stream.add(token)
        return time.perf_counter() - t

    cost(10)  # warm
    short, long = min(cost(10) for _ in range(3)), min(cost(20_000) for _ in range(3))
    assert long < 5 * short, (short, long)


# -- D4: big bodies, tokenizing off the event loop -------------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_read(model):
    with TestClient(make_app(model, MODEL, max_num_seqs=2, max_body_bytes=2000)) as c:
        big = json.dumps({"prompt": "x" * 5000}).encode()
        assert_error(post(c, big), 413, code="request_too_large")
        chunked = c.post("/v1/completions", content=iter([big[:1500], big[1500:]]),
                         headers={"content-type": "application/json"})  # no Content-Length: counted as it comes
        assert_error(chunked, 413)
        assert c.post("/v1/completions", json={"prompt": "Emma", "max_tokens": 2}).status_code == 200

    async def announced_only():  # a Content-Length over the limit: answered without reading a byte
        app = make_app(model, MODEL, max_num_seqs=2, max_body_bytes=2000)
        reads = []

        async def receive():
            reads.append(1)
            return {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [
            (b"content-type", b"application/json"), (b"content-length", b"4000000")], "query_string": b""}
        await app(scope, receive, send)
        return reads, sent

    reads, sent = asyncio.run(announced_only())
    assert reads == [] and sent[0]["status"] == 413


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_tokenized(client, model, monkeypatch):
    calls = []
    real = model.tokenizer.encode
    monkeypatch.setattr(model.tokenizer, "encode", lambda text: calls.append(len(text)) or real(text))
    limit = client.app.state.server.max_prompt_chars
    assert limit is not None and limit < 1_000_000
    error = assert_error(client.post("/v1/completions", json={"prompt": "a" * (limit + 1)}), 400, "prompt",
                         "context_length_exceeded")
    assert "cannot fit" in error["message"] and calls == []
    assert_error(client.post("/v1/completions", json={"prompt": [1] * 100_000}), 400, "prompt",
                 "context_length_exceeded")
    assert_error(client.post("/v1/completions", json={"prompt": "Emma " * 200, "max_tokens": 100}), 400,
                 "max_tokens", "context_length_exceeded")


def test_prompts_are_tokenized_off_the_event_loop(client, model, monkeypatch):
    """While a prompt is being tokenized (here: held until /health has answered), /health answers: the tokenizer
    does not run on the event loop. (Were it on the loop, /health would wait for the 20 s timeout below.)"""
    entered, released = threading.Event(), threading.Event()
    real = model.tokenizer.encode

    def slow_encode(text):
        entered.set()
        result["waited out"] = not released.wait(20)
        return real(text)

    result = {}
    monkeypatch.setattr(model.tokenizer, "encode", slow_encode)
    worker = threading.Thread(target=lambda: result.setdefault("r", client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "temperature": 0})))
    worker.start()
    assert entered.wait(20)
    health = client.get("/health")
    answered_while_tokenizing = not released.is_set()
    released.set()
    worker.join(30)
    assert health.status_code == 200 and answered_while_tokenizing and not result["waited out"]
    assert result["r"].status_code == 200


# -- D5: a client gone before its body is in --------------------------------------------------------------------------
def test_a_client_gone_mid_body_leaves_one_debug_line_and_no_traceback(model, caplog):
    app = make_app(model, MODEL, max_num_seqs=2)

    async def run():
        app.state.server.loop.start()
        try:
            json_type = [(b"content-type", b"application/json")]
            return [await call(app, body=[b'{"prompt": "Em'], cut_body=True, headers=json_type),
                    await call(app, body=[b""], cut_body=True, headers=json_type)]
        finally:
            app.state.server.loop.stop()

    with caplog.at_level(logging.DEBUG, logger="gpt2_core"):
        answers = asyncio.run(run())
    assert all(a.status is None or a.status < 500 for a in answers), answers
    gone = [r for r in caplog.records if "went away" in r.getMessage()]
    assert len(gone) == 2 and all(r.levelno == logging.DEBUG for r in gone)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]


# -- conformance ------------------------------------------------------------------------------------------------------
def test_errors_are_openai_objects_with_a_code(client):
    assert_error(client.post("/v1/completions", json={"model": "gpt-5", "prompt": "Emma"}), 404, "model",
                 "model_not_found")
    error = assert_error(client.post("/v1/chat/nonsense", json={}), 404, code="not_found")
    assert "/v1/completions" in error["message"]
    r = client.get("/v1/completions")
    assert_error(r, 405, code="method_not_allowed")
    assert "POST" in r.headers["allow"]
    for ct in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]:
        headers = {"content-type": ct} if ct else {}
        r = client.post("/v1/completions", content=b'{"prompt": "Emma", "max_tokens": 2}', headers=headers)
        assert_error(r, 415, code="unsupported_media_type")
    r = client.post("/v1/completions", content=b'{"prompt": "Emma", "max_tokens": 2}',
                    headers={"content-type": "application/json; charset=utf-8"})
    assert r.status_code == 200
    assert_error(client.post("/v1/completions", json={"prompt": "Emma", "stream_options": {"include_usage": True}}),
                 400, "stream_options")


def test_a_batch_of_prompts_gets_prompts_times_n_choices(client, model):
    ids = model.tokenizer.encode("Mr. Knightley")
    for prompt, texts in [(["Emma", PROMPT], ["Emma", PROMPT]), ([ids, ids[:2]], [ids, ids[:2]])]:
        want = [greedy(model, t, 6) for t in texts]
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == [want[0], want[0], want[1], want[1]]
        prompts = [model.tokenizer.encode(t) if isinstance(t, str) else t for t in texts]
        made = 2 * sum(len(kv_cache.generate(model, p, 6)) for p in prompts)  # (eos may come before 6 tokens)
        assert body["usage"]["prompt_tokens"] == sum(map(len, prompts)) and body["usage"]["completion_tokens"] == made
        streamed = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0, "n": 2,
                                                        "stream": True, "stream_options": {"include_usage": True}})
        events = sse_events(streamed.content)
        got = [""] * 4
        for e in events[:-1]:
            for c in e["choices"]:
                got[c["index"]] += c["text"]
        assert got == [want[0], want[0], want[1], want[1]] and events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == made
    assert_error(client.post("/v1/completions", json={"prompt": ["a"] * 5, "n": 2}), 400, "prompt")  # 10 > 8
    assert_error(client.post("/v1/completions", json={"prompt": ["Emma", ""]}), 400, "prompt")


def test_logprobs_0_gives_the_sampled_token(client):
    r = client.post("/v1/completions", json={"prompt": "Emma", "max_tokens": 4, "temperature": 1, "seed": 3,
                                             "logprobs": 0})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top == {token: value}


# -- API key, CORS, request ids, access log, the port --------------------------------------------------------------
def test_an_api_key_is_required_except_on_the_open_paths(model):
    body = {"prompt": "Emma", "max_tokens": 2}
    with TestClient(make_app(model, MODEL, max_num_seqs=2, api_key="sekrit")) as c:
        for headers in [{}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"},
                        {"authorization": "Basic sekrit"}]:
            r = c.post("/v1/completions", json=body, headers=headers)
            assert_error(r, 401, code="invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"
        assert c.get("/v1/models").status_code == 401
        assert c.post("/v1/completions", json=body, headers={"authorization": "Bearer sekrit"}).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=c,
                          max_retries=0).completions.create(model=MODEL, prompt="Emma", max_tokens=2)
        ok = openai.OpenAI(base_url="http://testserver/v1", api_key="sekrit", http_client=c)
        assert ok.completions.create(model=MODEL, prompt="Emma", max_tokens=2).choices[0].text is not None
    with TestClient(make_app(model, MODEL, max_num_seqs=2, api_key="sekrit", open_paths=())) as c:
        assert_error(c.get("/health"), 401)


def test_cors_only_for_the_allowed_origins(client, model):
    preflight = {"origin": "http://ui.example", "access-control-request-method": "POST",
                 "access-control-request-headers": "authorization, content-type"}
    assert "access-control-allow-origin" not in client.options("/v1/completions", headers=preflight).headers
    app = make_app(model, MODEL, max_num_seqs=2, api_key="k", allowed_origins=["http://ui.example"])
    with TestClient(app) as c:
        r = c.options("/v1/completions", headers=preflight)  # a preflight carries no key: it passes
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        r = c.post("/v1/completions", json={"prompt": "Emma", "max_tokens": 2},
                   headers={"origin": "http://ui.example", "authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
        r = c.options("/v1/completions", headers={**preflight, "origin": "http://evil.example"})
        assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_every_answer_has_a_request_id_and_an_access_log_line(client, caplog):
    with caplog.at_level(logging.INFO, logger="gpt2_core.access"):
        answers = [client.get("/health", headers={"x-request-id": "abc-123"}), client.get("/nope"),
                   client.post("/v1/completions", content=b"x", headers={"content-type": "text/plain"}),
                   client.post("/v1/completions", json={"prompt": "Emma", "max_tokens": 2, "stream": True}),
                   client.get("/health", headers={"x-request-id": "bad id with spaces"}),
                   client.get("/health", headers={"x-request-id": "x" * 500})]
    ids = [r.headers["x-request-id"] for r in answers]
    assert ids[0] == "abc-123" and all(re.fullmatch(r"[0-9a-f]{32}", i) for i in ids[1:]) and len(set(ids)) == 6
    lines = [r.getMessage() for r in caplog.records if r.name == "gpt2_core.access"]
    assert len(lines) == 6
    for line, r, rid in zip(lines, answers, ids):
        assert f" {r.status_code} " in line and f"request_id={rid}" in line
    assert '"GET /nope HTTP/1.1" 404' in lines[1]


def test_an_unexpected_fault_is_an_openai_500_with_the_request_id(model, caplog):
    app = make_app(model, MODEL, max_num_seqs=2)

    def broken(*jobs):
        raise RuntimeError("injected")

    app.state.server.loop.submit = broken
    with TestClient(app) as c, caplog.at_level(logging.ERROR, logger="gpt2_core"):
        r = c.post("/v1/completions", json={"prompt": "Emma"}, headers={"x-request-id": "req-7"})
    error = assert_error(r, 500, code="internal_error")
    assert "req-7" in error["message"] and r.headers["x-request-id"] == "req-7"
    assert len([rec for rec in caplog.records if rec.exc_info]) == 1


def test_a_port_in_use_is_a_one_line_error(capsys):
    from gpt2_core.__main__ import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(GPT2Error, match="already in use"):
            listen("127.0.0.1", port)
        assert main(["serve", "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot listen on 127.0.0.1:") and "already in use" in err
    assert err.count("\n") == 1 and "Traceback" not in err
