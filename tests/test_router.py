"""``python -m gpt2_core route``: replicas of ``serve`` behind a router, tested as clients use it (real processes on
loopback ports, the embedded model, the official ``openai`` client and raw HTTP), and its policies alone.

Through the router a client gets what a server gives (greedy tokens, streamed or not, completions and chat, the
replica's own 400s, /tokenize, /detokenize, /version and model cards); round robin alternates; prefix affinity
keeps a conversation (text or chat) on one replica while a prompt shared by everyone still spreads over both; a
replica killed mid-request fails that request with an error naming it, not a hang, and leaves the rotation; with
none alive requests get a 503; a replica that comes back is taken back.
"""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from gpt2_core import kv_cache, load_model
from gpt2_core.errors import InvalidInputError
from gpt2_core.ch08_parallel.routing import BALANCE_ABS, BALANCE_REL, PrefixAffinity, RoundRobin, block_hashes, make_policy
from gpt2_core.ch07_serving.launch import RouterProcess, ServerProcess, start_servers
from gpt2_core.ch08_parallel.http_router import replica_url
from helpers import CHAT, ROOT, chat_model_folder, wait_until
from http_sockets import stalled_answers

MODEL = "gpt2-numpy-embedded"
SYSTEM = ("You are a helpful assistant who answers in the style of Jane Austen, briefly, politely, and always "
          "with a remark about the weather in Hampshire. ")  # 3 full blocks of 64 characters, and a bit


# --- the policies alone --------------------------------------------------------------------------------------------

def test_block_hashes_are_chained_over_full_blocks_only():
    ids = list(range(40))
    h = block_hashes(ids)
    assert len(h) == 2 and block_hashes(ids[:32]) == h and block_hashes([ids]) == h  # [[ids]]: one prompt
    other = block_hashes(ids[:16] + [99] + ids[17:])
    assert other[0] == h[0] and other[1] != h[1]
    changed = block_hashes([99] + ids[1:])
    assert changed[0] != h[0] and changed[1] != h[1]  # a block's hash stands for everything before it too
    text = "x" * 130
    assert len(block_hashes(text)) == 2 and block_hashes([text]) == block_hashes(text)
    for bad in (None, 3, {"a": 1}, [1.5, 2], [True] * 20, ["a", "b"]):
        assert block_hashes(bad) == []


def test_round_robin_alternates_over_the_live_replicas():
    rr = RoundRobin(3)
    assert [rr.choose([], {0: 0, 1: 5, 2: 0}) for _ in range(4)] == [0, 1, 2, 0]
    assert [rr.choose([], {0: 0, 2: 0}) for _ in range(3)] == [2, 0, 2]  # replica 1 is out of rotation


def conversation(c: int, turns: int) -> list[list[int]]:
    """Token-id prompts of one conversation: a system prompt of 64 ids (4 blocks) shared by all, then its turns."""
    system, history, out = list(range(64)), [], []
    for t in range(turns):
        history = history + [1000 + 100 * c + 10 * t + k for k in range(20)]
        out.append(system + history)
    return out


def test_prefix_affinity_keeps_conversations_and_spreads_the_shared_prompt():
    """Sent one at a time (no load anywhere): new conversations, which share only the system prompt, spread over
    both replicas; every later turn goes where its conversation went."""
    policy, convs, where = PrefixAffinity(2), [conversation(c, 3) for c in range(8)], {}
    for t in range(3):
        for c, turns in enumerate(convs):
            r = policy.choose(block_hashes(turns[t]), {0: 0, 1: 0})
            assert where.setdefault(c, r) == r, (c, t)
    assert sorted(where.values()).count(0) == 4  # 4 conversations each
    assert policy.shared(block_hashes(convs[0][2])) == 4  # the system prompt's 4 blocks are seen as shared


def test_ties_go_to_the_least_loaded_and_an_overloaded_match_is_passed_over():
    policy = PrefixAffinity(2, balance_abs=4, balance_rel=1.5)
    prompt = block_hashes(list(range(100)))
    policy.record(0, prompt)
    policy.record(1, prompt)  # both hold the same prefix: a tie
    assert policy.choose(prompt, {0: 3, 1: 1}) == 1 and policy.choose(prompt, {0: 1, 1: 3}) == 0
    own = block_hashes(list(range(100)) + list(range(500, 532)))
    policy.record(0, own)  # replica 0 holds more of this one
    assert policy.choose(own, {0: 5, 1: 1}) == 0  # 4 more in flight: not over balance_abs
    assert policy.choose(own, {0: 20, 1: 14}) == 0  # 6 more, but not 1.5 x as many: not overloaded
    assert policy.choose(own, {0: 6, 1: 1}) == 1  # 5 more and 6 > 1.5 x 1: overloaded, the least loaded gets it
    assert policy.matched(1, own) == 8  # and is remembered to hold it now
    assert policy.choose(own, {1: 0}) == 1  # replica 0 out of rotation
    policy.forget(0)  # it died: its cache is gone
    assert policy.matched(0, own) == 0


def test_memory_is_bounded_and_forgets_extensions_before_prefixes():
    policy = PrefixAffinity(1, max_blocks=10)
    for c in range(5):
        policy.choose(block_hashes(list(range(64)) + [c] * 48), {0: 0})  # 4 shared blocks + 3 own, each time
    assert len(policy.blocks[0]) == 10
    assert policy.matched(0, block_hashes(list(range(64)) + [4] * 48)) == 7  # the latest is whole
    assert policy.matched(0, block_hashes(list(range(64)) + [0] * 48)) == 4  # the oldest's own blocks went first
    assert len(policy.successors) <= 10


def test_the_hit_rate_simulation_reaches_its_bound_and_shows_where_affinity_pays():
    """``simulate_hit_rate`` (chapter 5's block manager per server, the router's own policies, bookkeeping only):
    one cache that never runs out finds every earlier prompt, exactly the bound; with room everywhere, two replicas
    under round robin already find most history; with tight KV memory round robin thrashes and affinity does not."""
    from gpt2_core.bench import router as bench

    for name, scenario in bench.SCENARIOS.items():
        requests = bench.chat_workload(scenario, 50257)
        bounds = bench.hit_rate_bounds(requests, scenario.workload["system_len"])
        roomy = {arm: bench.simulate_hit_rate(requests, arm, 4096) for arm in bench.ARMS}
        assert roomy[bench.SINGLE] == pytest.approx(bounds["every_earlier_prompt_found"])
        assert bounds["only_the_system_prompt_found"] < roomy["round_robin"] < roomy["prefix_affinity"] \
            <= roomy[bench.SINGLE]
        assert roomy["prefix_affinity"] / roomy["round_robin"] < 1.3  # every replica may keep everything
        if scenario.num_blocks:
            tight = {arm: bench.simulate_hit_rate(requests, arm, bench.kv_blocks(scenario, arm, 1024, 16))
                     for arm in bench.ARMS}
            assert tight["prefix_affinity"] / tight["round_robin"] >= 1.5
            assert all(tight[arm] < roomy[arm] for arm in bench.ARMS)  # evictions cost every arm something
    assert bench.kv_blocks(bench.SCENARIOS["chapter5_chat"], bench.SINGLE, 1024, 16) == 2 * 16 * 64


def test_policy_names_urls_and_cli_defaults():
    assert replica_url("http://127.0.0.1:8001/v1/") == replica_url(" http://127.0.0.1:8001 ") == "http://127.0.0.1:8001"
    for bad in ("127.0.0.1:8001", "http://", "ftp://host:1", "http://host:1/other"):
        with pytest.raises(InvalidInputError, match="--replica"):
            replica_url(bad)
    with pytest.raises(InvalidInputError, match="round_robin"):
        make_policy("random", 2)
    from gpt2_core.__main__ import build_parser

    args = build_parser().parse_args(["route", "--replica", "http://h:1"])  # the CLI's defaults: routing's
    assert (args.policy, args.balance_abs, args.balance_rel) == ("prefix_affinity", BALANCE_ABS, BALANCE_REL)
    args = build_parser().parse_args(["route", "--replicas", "2", "--port", "0", "--", "--model", "m", "--plain"])
    assert args.replicas == 2 and args.port == 0 and args.serve_args[-3:] == ["--model", "m", "--plain"]


def test_route_refuses_bad_arguments_in_one_line():
    for args, message in ((["route"], "route needs servers"), (["route", "--replica", "localhost:1"], "--replica"),
                          (["route", "--replica", "http://h:1", "--balance-rel", "0.5"], "--balance-rel"),
                          (["route", "--replicas", "2", "--body-timeout-s", "0"], "--body-timeout-s must be a positive")):
        r = subprocess.run([sys.executable, "-m", "gpt2_core", *args], capture_output=True, text=True, timeout=60,
                           cwd=ROOT)
        assert r.returncode == 2 and r.stderr.startswith("error:") and message in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


# --- through HTTP ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model():
    return load_model()


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    """Two servers with the defaults a user gets (1 BLAS thread each) on the embedded model, given a chat template
    (the same weights: the same greedy text) so that chat requests can be routed too."""
    folder = chat_model_folder(tmp_path_factory.mktemp("chat_model"))
    servers = start_servers(2, "--model", str(folder), "--served-model-name", MODEL, threads=1)
    yield servers
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def affinity(replicas):
    with RouterProcess(*(a for s in replicas for a in ("--replica", s.base_url))) as r:
        yield r


@pytest.fixture(scope="module")
def round_robin(replicas):
    with RouterProcess(*(a for s in replicas for a in ("--replica", s.url)), "--policy", "round_robin") as r:
        yield r


def greedy_text(model, prompt: str, max_tokens: int) -> str:
    return model.tokenizer.decode(kv_cache.generate(model, model.tokenizer.encode(prompt), max_tokens),
                                  skip_special_tokens=True)


def complete(router, prompt, max_tokens=4, **fields) -> tuple[str, str]:
    """(the replica that answered, the text) of one whole greedy completion through ``router``."""
    r = httpx.post(router.base_url + "/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.headers["x-gpt2-replica"], r.json()["choices"][0]["text"]


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_tokens_through_the_router_are_a_servers_greedy_tokens(affinity, replicas, model):
    client = openai.OpenAI(base_url=affinity.base_url, api_key="unused", max_retries=0, timeout=60)
    prompt = "It is a truth universally acknowledged"
    want, count = greedy_text(model, prompt, 24), len(kv_cache.generate(model, model.tokenizer.encode(prompt), 24))
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    assert whole.choices[0].text == want and whole.usage.completion_tokens == count
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == count
    ids = model.tokenizer.encode("Emma Woodhouse, handsome, clever, and rich")
    direct = openai.OpenAI(base_url=replicas[1].base_url, api_key="unused").completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0).choices[0].text == \
        direct.choices[0].text
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_round_robin_alternates_between_the_replicas(round_robin, replicas):
    before = metrics(round_robin.url)
    served = [complete(round_robin, f"Mr. Knightley said {i}")[0] for i in range(6)]
    assert all(a != b for a, b in zip(served, served[1:])) and set(served) == {s.url for s in replicas}
    after = metrics(round_robin.url)
    for s in replicas:
        key = f'gpt2_router_requests_routed_total{{policy="round_robin",replica="{s.url}"}}'
        assert after[key] - before.get(key, 0) == 3


def test_prefix_affinity_keeps_each_conversation_on_one_replica(replicas):
    """Four conversations (text prompts sharing a system prompt), three turns each, one request at a time, through
    a fresh router: the system prompt alone spreads the conversations over both replicas, and every later turn
    follows its first."""
    with RouterProcess(*(a for s in replicas for a in ("--replica", s.url))) as router:
        where, history = {}, {c: SYSTEM for c in range(4)}
        for turn in range(3):
            for c in range(4):
                history[c] += f"User {c} asks question {turn} about the ball at Netherfield, in some detail. Reply:"
                replica, text = complete(router, history[c], max_tokens=8)
                history[c] += text
                where.setdefault(c, set()).add(replica)
        health = httpx.get(router.url + "/health").json()
    assert all(len(places) == 1 for places in where.values()), where
    assert {p for places in where.values() for p in places} == {s.url for s in replicas}
    assert health["status"] == "ok" and health["policy"] == "prefix_affinity"
    assert [r["alive"] for r in health["replicas"]] == [True, True]


def test_chat_through_the_router_is_a_servers_chat_whole_and_streamed(affinity, replicas):
    client = openai.OpenAI(base_url=affinity.base_url, api_key="unused", max_retries=0, timeout=60)
    direct = openai.OpenAI(base_url=replicas[0].base_url, api_key="unused", max_retries=0, timeout=60)
    want = direct.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.content == want.choices[0].message.content
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (want.usage.prompt_tokens,
                                                                          want.usage.completion_tokens)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    with pytest.raises(openai.BadRequestError, match="messages"):  # the replica's 400, passed through
        client.chat.completions.create(model=MODEL, messages="Emma", max_tokens=4)


def test_prefix_affinity_keeps_each_chat_on_one_replica(replicas):
    """Four chats (a shared system message, then each its own questions), three turns each, through a fresh router:
    the router hashes the messages as text, so every later turn follows its first, and the chats spread over both
    replicas."""
    with RouterProcess(*(a for s in replicas for a in ("--replica", s.url))) as router:
        where = {}
        for c in range(4):
            messages = [{"role": "system", "content": SYSTEM}]
            for turn in range(3):
                messages.append({"role": "user", "content": f"User {c} asks question {turn} about the ball at "
                                                            f"Netherfield, in some detail."})
                r = httpx.post(router.base_url + "/chat/completions", timeout=60, json={
                    "model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
                assert r.status_code == 200, r.text
                where.setdefault(c, set()).add(r.headers["x-gpt2-replica"])
                messages.append(r.json()["choices"][0]["message"])
    assert all(len(places) == 1 for places in where.values()), where
    assert {p for places in where.values() for p in places} == {s.url for s in replicas}


def test_tokenize_detokenize_version_and_model_cards_through_the_router(affinity, replicas):
    """What the router passes on is the first replica's answer (the one it asks), statuses and errors included."""
    for path, body in (("/tokenize", {"prompt": "Emma Woodhouse, handsome"}), ("/tokenize", {"messages": CHAT}),
                       ("/detokenize", {"tokens": [30, 31, 32]}), ("/tokenize", {"prompt": 5}),
                       ("/detokenize", {"tokens": [1, 10**6]}), ("/tokenize", {"model": "gpt-5", "prompt": "a"})):
        via, direct = httpx.post(affinity.url + path, json=body), httpx.post(replicas[0].url + path, json=body)
        assert (via.status_code, via.json()) == (direct.status_code, direct.json()), (path, body)
    for path in ("/version", f"/v1/models/{MODEL}", "/v1/models/gpt-5", "/v1/models", "/v1/models/"):
        via, direct = httpx.get(affinity.url + path), httpx.get(replicas[0].url + path)
        assert (via.status_code, via.json()) == (direct.status_code, direct.json()), path
    client = openai.OpenAI(base_url=affinity.base_url, api_key="unused", max_retries=0)
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-5")
    r = httpx.get(affinity.url + "/nope", headers={"x-request-id": "r-1"})  # the router's own: OpenAI's shape
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found" and r.headers["x-request-id"] == "r-1"


def test_the_router_refuses_what_a_server_refuses_before_holding_it(replicas):
    """Chapter 7's checks run in the router too, before it reads a body into memory or picks a replica: a body
    over ``route --max-body-bytes`` gets 413 (announced or not), a body that is not JSON 415, headers or a body
    slower than ``--header-timeout-s`` / ``--body-timeout-s`` a 408 naming that flag and the connection closed; none
    reaches a replica (no ``x-gpt2-replica``), and a body within the limits is served."""
    with RouterProcess(*(a for s in replicas for a in ("--replica", s.url)), "--max-body-bytes", "5000",
                       "--header-timeout-s", "1", "--body-timeout-s", "1") as router:
        for clock, answer, seconds in stalled_answers(router.url):
            # the router's 408, within a few seconds, and the connection closed
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer and clock in answer, answer
            assert b"x-gpt2-replica" not in answer.lower() and seconds < 10
        big = json.dumps({"model": MODEL, "prompt": "x" * 6000}).encode()
        json_type = {"content-type": "application/json"}
        r = httpx.post(router.base_url + "/completions", content=big, headers=json_type)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        assert "--max-body-bytes" in r.json()["error"]["message"] and "x-gpt2-replica" not in r.headers
        chunks = (big[i:i + 1000] for i in range(0, len(big), 1000))  # no Content-Length: cut off once over
        r = httpx.post(router.base_url + "/completions", content=chunks, headers=json_type)
        assert r.status_code == 413 and "x-gpt2-replica" not in r.headers
        r = httpx.post(router.base_url + "/completions", content=b'{"prompt": "Emma"}',
                       headers={"content-type": "text/plain"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
        assert "x-gpt2-replica" not in r.headers
        r = httpx.post(router.base_url + "/completions", json={"model": MODEL, "prompt": "Emma", "max_tokens": 2},
                       timeout=60)
        assert r.status_code == 200 and "x-gpt2-replica" in r.headers, r.text


def test_bad_requests_get_the_replicas_answer(affinity):
    r = httpx.post(affinity.base_url + "/completions", json={"model": MODEL, "prompt": "Emma", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = httpx.post(affinity.base_url + "/completions", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(affinity.base_url + "/completions", json={"model": "gpt-5", "prompt": "Emma"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    client = openai.OpenAI(base_url=affinity.base_url, api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="Emma " * 200, max_tokens=100)
    m = metrics(affinity.url)
    assert m["gpt2_router_replicas_alive"] == 2 and "process_resident_memory_bytes" in m


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (all held open together while they are picked)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_a_killed_replica_fails_its_requests_and_leaves_the_rotation():
    """Steps slowed to 50 ms: requests are in flight when one replica is SIGKILLed. Its stream ends with an error
    naming it (the openai client raises it) and its whole request gets a 502 naming it, within seconds; the next
    requests all go to the other replica and succeed; once that one is killed too, a 503."""
    servers = start_servers(2, "--step-delay-s", "0.05", threads=1)
    try:
        with RouterProcess(*(a for s in servers for a in ("--replica", s.url)), "--policy", "round_robin") as router:
            client = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0, timeout=20)
            stream = client.completions.create(model=MODEL, prompt="Emma", max_tokens=200, temperature=0, stream=True)
            victim = stream.response.headers["x-gpt2-replica"]
            chunks = iter(stream)
            next(chunks)  # tokens are coming
            whole = {}
            for i in range(2):  # round robin: one of these two is in flight on the victim too
                threading.Thread(target=lambda i=i: whole.update({i: httpx.post(
                    router.base_url + "/completions", timeout=20,
                    json={"model": MODEL, "prompt": "Harriet", "max_tokens": 60, "temperature": 0})})).start()
            assert wait_until(lambda: metrics(router.url)[f'gpt2_router_requests_in_flight{{replica="{victim}"}}'] == 2)
            [s for s in servers if s.url == victim][0].proc.send_signal(signal.SIGKILL)
            t = time.perf_counter()
            with pytest.raises(openai.APIError, match=re.escape(victim)):
                list(chunks)
            assert wait_until(lambda: len(whole) == 2, 20) and time.perf_counter() - t < 15
            failed = [r for r in whole.values() if r.status_code != 200]
            assert len(failed) == 1 and failed[0].status_code == 502 and victim in failed[0].json()["error"]["message"]
            survivor = next(s.url for s in servers if s.url != victim)
            for i in range(4):
                assert complete(router, f"Mr. Elton {i}")[0] == survivor
            health = httpx.get(router.url + "/health").json()
            assert {r["url"]: r["alive"] for r in health["replicas"]} == {victim: False, survivor: True}
            assert metrics(router.url)["gpt2_router_replicas_alive"] == 1
            [s for s in servers if s.url == survivor][0].proc.send_signal(signal.SIGKILL)
            r = httpx.post(router.base_url + "/completions", json={"model": MODEL, "prompt": "Emma"}, timeout=20)
            assert r.status_code == 503 and "no replica is alive" in r.json()["error"]["message"]
            assert httpx.get(router.url + "/health").status_code == 503
    finally:
        for s in servers:
            s.stop()


def test_no_replica_alive_is_a_503_until_one_comes_back():
    """A router whose replicas are not running: 503s with a clear message; a server started on one of their ports
    is taken into rotation by the health probe."""
    ports = free_ports(2)
    with RouterProcess(*(a for p in ports for a in ("--replica", f"http://127.0.0.1:{p}"))) as router:
        r = httpx.post(router.base_url + "/completions", json={"model": MODEL, "prompt": "Emma"})
        assert r.status_code == 503 and "no replica is alive" in r.json()["error"]["message"]
        assert str(ports[0]) in r.json()["error"]["message"] and r.headers["retry-after"]
        assert httpx.get(router.base_url + "/models").status_code == 503
        with ServerProcess("--port", str(ports[1])) as server:
            assert server.url.endswith(f":{ports[1]}")
            assert wait_until(lambda: httpx.get(router.url + "/health").status_code == 200, 10)
            assert complete(router, "Emma")[0] == server.url


README = (ROOT / "README.md").read_text()


def test_the_readme_route_example_runs_as_typed(model):
    """The README's route command (two replicas started by the router), with the README's curl example sent to it
    (the port: any free one in place of the README's 8000)."""
    route = re.search(r"<!-- route-command -->\s*```bash\n(.*?)```", README, re.S).group(1).strip()
    assert route.startswith(".venv/bin/python -m gpt2_core route") and "8000" in route  # the README's venv
    curl = re.search(r"<!-- serve-curl -->\s*```bash\n(.*?)```", README, re.S).group(1).strip()
    with RouterProcess(*route.replace("8000", "0").split()[4:]) as router:
        port = router.url.rsplit(":", 1)[1]
        r = subprocess.run(["bash", "-c", curl.replace("8000", port)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        import json

        assert json.loads(r.stdout)["choices"][0]["text"] == greedy_text(model, "It is a truth universally "
                                                                                "acknowledged", 20)
        health = httpx.get(router.url + "/health").json()
        assert len(health["replicas"]) == 2 and all(rep["alive"] for rep in health["replicas"])
        pids = [int(p) for p in re.findall(r"\d+", subprocess.run(
            ["pgrep", "-P", str(router.pid)], capture_output=True, text=True).stdout)]
    assert router.proc.returncode == 0
    assert wait_until(lambda: not any(os_alive(p) for p in pids), 10)  # the replicas it started are stopped too


def os_alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except (ProcessLookupError, FileNotFoundError):
        return False
