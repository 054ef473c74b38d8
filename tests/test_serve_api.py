"""The server's API beside the completions: chat completions (whole and streamed, with the official ``openai``
client) on a model folder that carries a chat template, ``/tokenize``, ``/detokenize``, ``/version``,
``/v1/models/{id}``, and ``/metrics`` counting every HTTP answer (a 400, a 404, a 429, a 500) and each request's
sizes and latencies."""

import json

import httpx
import openai
import pytest

from gpt2_core import kv_cache, load_model
from gpt2_core.ch07_serving.launch import ServerProcess
from helpers import CHAT, chat_model_folder

pytest.importorskip("jinja2")
MODEL = "chat-test"


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    """The embedded model's files, and a tokenizer_config.json that adds a ChatML template."""
    return chat_model_folder(tmp_path_factory.mktemp("chat_model"))


@pytest.fixture(scope="module")
def model(chat_folder):
    return load_model(chat_folder)


@pytest.fixture(scope="module")
def server(chat_folder):
    with ServerProcess("--model", str(chat_folder), "--served-model-name", MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def chat_ids(model, messages=CHAT) -> list[int]:
    return model.tokenizer.encode(model.tokenizer.apply_chat_template(messages))


def greedy(model, ids, max_tokens) -> tuple[str, int]:
    new = kv_cache.generate(model, ids, max_tokens)
    return model.tokenizer.decode(new, skip_special_tokens=True), len(new)


def scrape(url: str) -> dict:
    """/metrics as {(sample name, frozenset of labels but model_name): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[s.name, frozenset((k, v) for k, v in s.labels.items() if k != "model_name")] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_the_chat_template_renders_the_prompt(model):
    text = model.tokenizer.apply_chat_template(CHAT)
    assert text == ("<|im_start|>system\nYou answer as Jane Austen would.<|im_end|>\n"
                    "<|im_start|>user\nWho is Emma Woodhouse?<|im_end|>\n<|im_start|>assistant\n")


def test_the_openai_client_chats_whole_and_streamed(client, model):
    ids = chat_ids(model)
    want, count = greedy(model, ids, 20)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want
    assert choice.finish_reason == "length" and choice.logprobs is None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(ids), count)
    # max_completion_tokens through extra_body: the floor's openai (1.40) predates that argument
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, extra_body={"max_completion_tokens": 20},
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_chat_parameters(client, model):
    """stop, n with a seed (repeatable), logprobs with top_logprobs in the chat shape, the default max_tokens (the
    rest of the context, as vLLM's)."""
    ids = chat_ids(model)
    full, _ = greedy(model, ids, 30)
    stop = full[10:13]
    for stream in (False, True):
        out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, stop=[stop],
                                             stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in out if c.choices) if stream else \
            out.choices[0].message.content
        assert text == full[:full.index(stop)]
    runs = [client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0.9, top_p=0.95,
                                           n=3, seed=11).choices for _ in range(2)]
    assert [c.message.content for c in runs[0]] == [c.message.content for c in runs[1]]
    assert sorted(c.index for c in runs[0]) == [0, 1, 2]
    lp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                        top_logprobs=3)
    content = lp.choices[0].logprobs.content
    assert len(content) == 6 and "".join(t.token for t in content) == lp.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and bytes(t.bytes).decode() == t.token and 1 <= len(t.top_logprobs) <= 3
        assert max(a.logprob for a in t.top_logprobs) == pytest.approx(t.logprob)
    long = [{"role": "user", "content": "Emma Woodhouse, handsome, clever, and rich. " * 21}]
    ids = chat_ids(model, long)
    assert 200 < len(ids) < 250  # a reply of at most 256 - len(ids) tokens: a short test
    rest = client.chat.completions.create(model=MODEL, messages=long, temperature=0)
    assert rest.usage.prompt_tokens == len(ids)
    assert (rest.choices[0].message.content, rest.usage.completion_tokens) == greedy(model, ids, 256 - len(ids))


BAD_CHAT = [({"messages": []}, "messages"), ({"messages": [{"role": "bot", "content": "x"}]}, "messages"),
            ({}, "messages"), ({"messages": CHAT, "temperature": 3}, "temperature"),
            ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
            ({"messages": CHAT, "max_completion_tokens": 300}, "max_completion_tokens"),
            ({"messages": CHAT, "max_tokens": 300}, "max_tokens"),
            ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs"),
            ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
            ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
            ({"messages": [{"role": "user", "content": "Emma " * 300}]}, "messages"),
            ({"messages": [{"role": "user", "content": "a \ud800 b"}]}, "messages")]


@pytest.mark.parametrize("body, field", BAD_CHAT, ids=[f"{f}-{i}" for i, (_, f) in enumerate(BAD_CHAT)])
def test_a_bad_chat_request_gets_a_400_naming_the_field(server, body, field):
    r = httpx.post(server.url + "/v1/chat/completions", content=json.dumps({"model": MODEL, **body}).encode(),
                   headers={"content-type": "application/json"})  # json.dumps: a lone surrogate as \ud800
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]


def test_a_model_without_a_chat_template_gets_a_clear_400():
    """In process: the embedded model has no template."""
    from starlette.testclient import TestClient

    from gpt2_core.ch07_serving.app import make_app

    with TestClient(make_app(load_model(), "embedded", max_num_seqs=2)) as http:
        r = http.post("/v1/chat/completions", json={"messages": CHAT})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "messages"
        r = http.post("/tokenize", json={"messages": CHAT})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]


def test_tokenize_detokenize_version_and_models_by_id(server, client, model):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Emma Woodhouse, handsome"}).json()
    ids = model.tokenizer.encode("Emma Woodhouse, handsome")
    assert r == {"tokens": ids, "count": len(ids), "max_model_len": 256, "token_strs": None}
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "return_token_strs": True}).json()
    assert r["tokens"] == chat_ids(model) and len(r["token_strs"]) == r["count"]
    assert httpx.post(server.url + "/detokenize", json={"tokens": ids}).json() == {"prompt": "Emma Woodhouse, handsome"}
    for path, body, field in [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {}, "prompt"),
                              ("/detokenize", {"tokens": [1, 4096]}, "tokens"),
                              ("/detokenize", {"tokens": "abc"}, "tokens")]:
        r = httpx.post(server.url + path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)
    r = httpx.post(server.url + "/tokenize", content=b"{bad", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/tokenize", json={"model": "other", "prompt": "a"}).status_code == 404
    version = httpx.get(server.url + "/version").json()["version"]
    assert isinstance(version, str) and version
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    r = httpx.get(server.url + "/v1/models/gpt-5")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model" and "gpt-5" in r.json()["error"]["message"]


def test_metrics_count_http_answers_and_request_sizes(server, client, model):
    before = scrape(server.url)
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, temperature=0)
    assert httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "n": 0}).status_code == 400
    assert httpx.get(server.url + "/no/such/path").status_code == 404
    assert httpx.get(server.url + "/v1/chat/completions").status_code == 405
    after = scrape(server.url)

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    chat = {"method": "POST", "handler": "/v1/chat/completions"}
    assert moved("gpt2_http_requests_total", **chat, status="200") == 1
    assert moved("gpt2_http_requests_total", **chat, status="400") == 1
    assert moved("gpt2_http_requests_total", method="GET", handler="other", status="404") == 1
    assert moved("gpt2_http_requests_total", method="GET", handler="/v1/chat/completions", status="405") == 1
    assert moved("gpt2_http_request_duration_seconds_count", **chat) == 2
    assert moved("gpt2_http_request_duration_seconds_sum", **chat) > 0
    assert moved("gpt2_request_prompt_tokens_count") == 1 and moved("gpt2_request_prompt_tokens_sum") == len(
        chat_ids(model))
    assert moved("gpt2_request_generation_tokens_sum") == greedy(model, chat_ids(model), 7)[1]
    assert moved("gpt2_request_params_max_tokens_sum") == 7 and moved("gpt2_request_params_n_count") == 1
    for name in ("gpt2_e2e_request_latency_seconds_count", "gpt2_request_queue_time_seconds_count",
                 "gpt2_time_to_first_token_seconds_count", "gpt2_request_prefill_time_seconds_count",
                 "gpt2_request_decode_time_seconds_count", "gpt2_request_inference_time_seconds_count"):
        assert moved(name) == 1, name


def test_metrics_count_a_429_and_a_500(model):
    """In process: a server with no room to wait refuses every request (429); an engine step that raises fails its
    request (500); a handler that raises is a 500 to the HTTP metrics too."""
    from starlette.applications import Starlette
    from starlette.routing import Route
    from starlette.testclient import TestClient

    from gpt2_core.ch07_serving.app import make_app
    from gpt2_core.ch07_serving.http_metrics import HTTPMetrics
    from gpt2_core.ch07_serving.metrics import ServerMetrics

    body = {"messages": CHAT, "max_tokens": 3}
    with TestClient(make_app(model, MODEL, max_waiting=0, max_num_seqs=2)) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 429
        assert http.post("/v1/completions", json={"prompt": "Emma"}).status_code == 429
        text = http.get("/metrics").text
    assert _has(text, "/v1/chat/completions", "429") and _has(text, "/v1/completions", "429")

    def failing_step():
        raise RuntimeError("injected fault")

    app = make_app(model, MODEL, max_num_seqs=2)
    app.state.server.engine.step = failing_step
    with TestClient(app) as http:
        assert http.post("/v1/chat/completions", json=body).status_code == 500
        assert _has(http.get("/metrics").text, "/v1/chat/completions", "500")

    def boom(request):
        raise RuntimeError("a bug")

    metrics = ServerMetrics("m")
    bare = Starlette(routes=[Route("/boom", boom)])
    bare.add_middleware(HTTPMetrics, metrics=metrics, routes=bare.routes)
    with TestClient(bare, raise_server_exceptions=False) as http:
        assert http.get("/boom").status_code == 500
    assert _has(metrics.text().decode(), "/boom", "500", method="GET")


def _has(text: str, handler: str, status: str, method: str = "POST") -> bool:
    """The page counts one request of ``method`` to ``handler`` answered with ``status``."""
    from prometheus_client.parser import text_string_to_metric_families

    return any(s.name == "gpt2_http_requests_total" and s.value >= 1 and s.labels.get("handler") == handler and
               s.labels.get("status") == status and s.labels.get("method") == method
               for family in text_string_to_metric_families(text) for s in family.samples)


def test_bench_serve_reports_goodput_against_the_slos_given(server):
    """``bench serve --goodput``: with SLOs no request can miss (a minute), every completed request is good;
    goodput and attainment are in each rate's record."""
    from gpt2_core.bench.serve import bench_serve

    out = bench_serve(quick=True, base_url=server.base_url, max_num_seqs=2, goodput=["ttft:60000", "e2el:60000"])
    assert out["workload"]["goodput_slos_ms"] == {"ttft": 60000.0, "e2el": 60000.0}
    for r in out["results"]:
        assert r["good_requests"] == r["completed"] > 0
        assert r["goodput_requests_per_s"] == pytest.approx(r["requests_per_s"])
        assert r["slo_attainment"] == pytest.approx(r["completed"] / r["sent"])
