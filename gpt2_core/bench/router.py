"""Chapter 8's replicas behind a router, measured in ``python -m gpt2_core bench parallel``.

Chapter 5's shared-prefix chat workload (``shared_prefix_workload``: one system prompt for everyone, conversations
that resend their history every turn) served over HTTP, loaded by ``bench serve``'s client, three ways:

* ``round_robin`` and ``prefix_affinity``: two ``serve`` replicas of 1 BLAS thread each behind ``route`` with
  that policy;
* ``single_2threads_server``: one ``serve`` with 2 BLAS threads and the KV memory of both replicas, no router.

Two scenarios (``SCENARIOS``). ``chapter5_chat``: chapter 5's workload at its defaults, a long system prompt and
four turns, every replica with room to keep every prompt cached. There round robin already finds most of what
can be found: the system prompt is cached on both replicas, and with two replicas a conversation's earlier turn
was sent to the same one half the time. ``long_chat_tight_kv``: a short system prompt, eight turns (the history is
most of each prompt), and KV memory for 2,048 tokens per replica, about a third of what the conversations hold at
the end. Round robin then makes each replica cache every conversation and evict what it needs next; affinity
splits the conversations between the replicas, and each half comes much closer to fitting. That is where cache-aware routing pays,
and ``simulate_hit_rate`` predicts it without a model.

A conversation's next turn is sent once every reply of the turn before has come back (a user answers what they
read); within a turn the requests come with the workload's spacing in a seeded, shuffled order. Every arm starts on
fresh servers (empty caches) running the chapters' plain NumPy code (``--plain``). Per arm: the prefix cache hit
rate of its servers (their ``/metrics`` counters over the run: hit tokens / looked-up tokens), TTFT p50 and p99 as
the client sees it, output tokens/s over the run, and where the requests went.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import re
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.prefix_cache import PrefixCachingBlockManager, block_hashes as cache_block_hashes
from ..ch08_parallel.routing import block_hashes, make_policy
from .common import interleaved
from .prefix import BLOCK_SIZE, shared_prefix_workload
from .serve import Client, percentile

POLICIES = ("round_robin", "prefix_affinity")
SINGLE = "single_2threads_server"
ARMS = (*POLICIES, SINGLE)
MAX_NUM_SEQS = 16  # sequences in a server's batch at most
SERVER_ARGS = ("--plain", "--max-num-seqs", str(MAX_NUM_SEQS))  # the chapters' code


@dataclass(frozen=True)
class Scenario:
    """A chat workload (``shared_prefix_workload``'s arguments) and the KV blocks each replica gets (None: the
    server's default, room for ``--max-num-seqs`` full contexts; the single server gets twice a replica's)."""

    workload: dict
    num_blocks: int | None
    about: str


SCENARIOS = {
    "chapter5_chat": Scenario({"num_conversations": 12, "turns": 4, "system_len": 384}, None,
                              "chapter 5's chat workload at its defaults; room for every prompt in every cache"),
    "long_chat_tight_kv": Scenario({"num_conversations": 12, "turns": 8, "system_len": 32}, 128,
                                   "history-heavy chat (short system prompt, 8 turns); KV memory for 2,048 tokens "
                                   "per replica"),
}
TARGET_SCENARIO = "long_chat_tight_kv"  # where the 1.5x hit-rate target is measured
# Quick: the embedded model's context is 256 positions; the last turn's prompt and reply must fit in it.
_SHORT = {"user_len": (16, 0.5, 8, 32), "output_len": (8, 0.3, 4, 16)}
SCENARIOS_QUICK = {
    "chapter5_chat": Scenario({"num_conversations": 6, "turns": 3, "system_len": 64, **_SHORT}, None,
                              SCENARIOS["chapter5_chat"].about.replace("its defaults", "a small scale")),
    "long_chat_tight_kv": Scenario({"num_conversations": 6, "turns": 4, "system_len": 16, **_SHORT}, 20,
                                   "history-heavy chat (short system prompt, 4 turns); KV memory for 320 tokens "
                                   "per replica"),
}

def chat_workload(scenario: Scenario, vocab_size: int) -> list:
    return shared_prefix_workload(vocab_size=vocab_size, **scenario.workload)


def kv_blocks(scenario: Scenario, arm: str, n_positions: int, max_num_seqs: int) -> int:
    """The KV blocks of one server of ``arm``: the scenario's per replica (by default the server's own default,
    ``max_num_seqs`` full contexts, never short), twice that for the single server (the same memory in total)."""
    per_replica = scenario.num_blocks or max_num_seqs * blocks_needed(n_positions, BLOCK_SIZE)
    return per_replica * (2 if arm == SINGLE else 1)


def turn_of(request) -> tuple[int, int]:
    """(conversation, turn) of a ``shared_prefix_workload`` request (its id is ``c{conversation}t{turn}``), or of
    a client's record of one."""
    rid = request["request_id"] if isinstance(request, dict) else request.request_id
    c, t = re.fullmatch(r"c(\d+)t(\d+)", str(rid)).groups()
    return int(c), int(t)


def hit_rate_bounds(requests: list, system_len: int, block_size: int = BLOCK_SIZE) -> dict:
    """The hit rate if every full block of every earlier prompt were found (one cache that never forgets), and if
    only the system prompt were (for every request but the first): what a policy can reach at best, and what the
    prefix shared by all gives any policy. Blocks as chapter 5's cache counts them (never the last token)."""
    seen, queried, every, system = set(), 0, 0, 0
    for k, r in enumerate(requests):
        ids = r.prompt_token_ids
        chain = cache_block_hashes(ids, block_size)
        lookable = chain[:(len(ids) - 1) // block_size]
        found = next((i for i, h in enumerate(lookable) if h not in seen), len(lookable))
        seen.update(chain)  # its full blocks, cached once computed
        queried += len(ids)
        every += found * block_size
        system += (k > 0) * min(system_len // block_size, len(lookable)) * block_size
    return {"every_earlier_prompt_found": every / queried, "only_the_system_prompt_found": system / queried,
            "best_over_system_only": every / system if system else None}


def send_order(requests: list, seed: int) -> list[list]:
    """The workload's turns in order, each shuffled (seeded): as ``chat`` sends them. Shuffled because, in
    conversation order, round robin over two replicas would send conversation c to replica c % 2 at every turn
    (12 requests a turn, an even number), keeping each conversation on one replica by accident."""
    turns: dict[int, list] = {}
    for r in requests:
        turns.setdefault(turn_of(r)[1], []).append(r)
    rng = np.random.default_rng(seed)
    return [[turns[t][i] for i in rng.permutation(len(turns[t]))] for t in sorted(turns)]


async def chat(client: Client, requests: list, seed: int, one_at_a_time: bool = False) -> tuple[list[dict], float]:
    """Send the workload turn by turn (each turn once the one before has been answered; with ``one_at_a_time``
    each request once the one before has been: a run that repeats exactly); the client's records, each with its
    ``request_id``, and the seconds from the first request to the last answer."""
    records, start = [], time.perf_counter()
    for reqs in send_order(requests, seed):
        offsets = sorted(r.arrival_s for r in reqs)  # the workload's spacing within a turn
        t0, tasks = time.perf_counter(), []
        for r, offset in zip(reqs, offsets):
            await asyncio.sleep(max(0.0, t0 + offset - offsets[0] - time.perf_counter()))
            tasks.append(asyncio.create_task(client.complete(r.prompt_token_ids, 1, r.max_new_tokens)))
            if one_at_a_time:
                await tasks[-1]
        for r, rec in zip(reqs, await asyncio.gather(*tasks)):
            records.append({**rec, "request_id": r.request_id})
    return records, time.perf_counter() - start


def simulate_hit_rate(requests: list, arm: str, num_blocks: int, seed: int = 0) -> float:
    """An arm's hit rate predicted without a model: one chapter-5 block manager per server (bookkeeping only, no
    K/V) with ``num_blocks`` blocks each (the single server: one manager, pass it twice the blocks), the router's
    own policy, the requests served one at a time in ``chat``'s order. Each reply's blocks are allocated and
    registered as a server does (random tokens: they take room and are never found again)."""
    replicas = 1 if arm == SINGLE else 2
    policy = make_policy("round_robin" if arm == SINGLE else arm, replicas)
    managers = [PrefixCachingBlockManager(num_blocks, BLOCK_SIZE) for _ in range(replicas)]
    replies = np.random.default_rng(seed + 1)
    for r in (r for turn in send_order(requests, seed) for r in turn):
        prompt = list(r.prompt_token_ids)
        m = managers[policy.choose(block_hashes(prompt), dict.fromkeys(range(replicas), 0))]
        tokens = prompt + replies.integers(1 << 30, 1 << 31, r.max_new_tokens).tolist()
        m.allocate_prefix(r.request_id, prompt, len(prompt))  # looks the prompt up (counted), then computes it
        m.ensure(r.request_id, len(tokens) - 1)  # the last token sampled is never fed back: never computed
        m.cache_blocks(r.request_id, tokens, len(tokens) - 1)
        m.free(r.request_id)
    return sum(m.num_hit_tokens for m in managers) / sum(m.num_queried_tokens for m in managers)


async def prefix_counters(server: Client) -> tuple[float, float, float]:
    """(tokens looked up, tokens found) in a server's prefix cache so far, and its preemptions, from its
    ``/metrics``."""
    return (await server.metric("gpt2_prefix_cache_queries_total") or 0.0,
            await server.metric("gpt2_prefix_cache_hits_total") or 0.0,
            await server.metric("gpt2_num_preemptions_total") or 0.0)


async def measure_arm(base_url: str, server_urls: list[str], requests: list, vocab_size: int, seed: int,
                      one_at_a_time: bool = False) -> dict:
    """Warm the servers up (directly, on prompts the workload never sends), then run the chat through
    ``base_url``; the arm's figures."""
    import httpx

    async with httpx.AsyncClient(timeout=60) as http:
        model = (await http.get(base_url + "/models")).json()["data"][0]["id"]
    client, servers = Client(base_url, model, 16), [Client(u, model, 4) for u in server_urls]
    try:
        rng = np.random.default_rng(10_000 + seed)
        warm = [rng.integers(0, vocab_size, 32).tolist() for _ in range(2)]
        await asyncio.gather(*(s.complete(prompt, 1) for s in servers for prompt in warm))
        before = [await prefix_counters(s) for s in servers]
        records, seconds = await chat(client, requests, seed, one_at_a_time)
        after = [await prefix_counters(s) for s in servers]
        health = (await client.http.get(base_url.removesuffix("/v1") + "/health")).json()
    finally:
        for c in (client, *servers):
            await c.http.aclose()
    queried = sum(a[0] - b[0] for a, b in zip(after, before))
    hits = sum(a[1] - b[1] for a, b in zip(after, before))
    preemptions = sum(a[2] - b[2] for a, b in zip(after, before))
    replicas = health.get("replicas")  # a router's /health lists its replicas; a server's does not
    return summarize_arm(records, seconds, queried, hits, replicas, preemptions)


def summarize_arm(records: list[dict], seconds: float, queried: float, hits: float, replicas: list | None,
                  preemptions: float = 0.0) -> dict:
    ok = [r for r in records if r["status"] == 200 and r.get("complete")]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    tokens = sum(r["tokens"] for r in ok)
    urls = [rep["url"] for rep in replicas or []]
    placement: dict = {}  # conversation -> the replica (index) of each of its turns
    for r in sorted(records, key=lambda r: turn_of(r)[::-1]):
        placement.setdefault(f"c{turn_of(r)[0]}", []).append(urls.index(r["replica"]) if r.get("replica") in urls
                                                             else None)
    return {"hit_rate": hits / queried if queried else None, "prompt_tokens_looked_up": int(queried),
            "prompt_tokens_found_cached": int(hits), "num_preemptions": int(preemptions), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99), "tokens_per_s": tokens / seconds, "output_tokens": tokens,
            "seconds": seconds, "num_requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
            "requests_per_replica": [rep["routed"] for rep in replicas] if replicas else None,
            "conversations_on_one_replica": (sum(len(set(p)) == 1 for p in placement.values()) / len(placement)
                                             if replicas else None),
            "replica_by_conversation": placement if replicas else None}


def run_async(coroutine):
    """``asyncio.run(coroutine)``, also where an event loop is running already (a notebook's): then in a thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coroutine).result()


def run_arm(arm: str, server_args: list[str], requests: list, vocab_size: int, seed: int,
            one_at_a_time: bool = False, num_blocks: int | None = None) -> dict:
    """One arm on fresh servers (and router), stopped at the end; ``num_blocks``: each server's KV blocks
    (None: the server's default)."""
    from ..ch07_serving.launch import RouterProcess, start_servers

    policy = arm if arm in POLICIES else None
    args = [*server_args, *(("--num-blocks", str(num_blocks)) if num_blocks else ())]
    with contextlib.ExitStack() as stack:
        servers = start_servers(2 if policy else 1, *args, threads=1 if policy else 2)
        for s in servers:
            stack.callback(s.stop)
        base_url = servers[0].base_url
        if policy:
            router = RouterProcess(*(a for s in servers for a in ("--replica", s.url)), "--policy", policy)
            stack.callback(router.stop)
            base_url = router.base_url
        out = run_async(measure_arm(base_url, [s.base_url for s in servers], requests, vocab_size, seed,
                                    one_at_a_time))
    return {"method": arm, "batch": int(server_args[server_args.index("--max-num-seqs") + 1]),
            "workload": "shared_prefix_chat", "processes": len(servers), "router": policy,
            "blas_threads_per_process": 1 if policy else 2, "kv_blocks_per_process": num_blocks, **out}


def write_random_checkpoint(model, directory: Path) -> Path:
    """``model`` (random weights) as an HF-layout folder that ``serve --model`` loads; GPT-2's vocabulary brings
    GPT-2's tokenizer with it."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2", **model.config.to_dict()}))
    return directory


def missing_extra() -> str | None:
    missing = [m for m in ("starlette", "uvicorn", "prometheus_client", "httpx") if importlib.util.find_spec(m) is None]
    return f"needs the serve extra (missing: {', '.join(missing)})" if missing else None


def router_records(quick: bool, model=None) -> dict:
    """Each scenario's three arms, taking turns over rounds (order reversed every other round), each reported by
    its median run by throughput; with ``quick``, the embedded model on small chats, else ``model`` (random weights
    of GPT-2 124M's shape) written to a temporary folder for the servers to load."""
    from ..loading.config import GPT2Config
    from ..loading.weights import EMBEDDED_MODEL_DIR

    with tempfile.TemporaryDirectory(prefix="gpt2_router_") as tmp:
        if quick or model is None:
            scenarios, server_args, served = SCENARIOS_QUICK, [*SERVER_ARGS], "the embedded model"
            config = GPT2Config.from_json(EMBEDDED_MODEL_DIR / "config.json")  # its vocabulary and context
        else:
            scenarios, config = SCENARIOS, model.config
            server_args = [*SERVER_ARGS, "--model", str(write_random_checkpoint(model, Path(tmp))),
                           "--served-model-name", "gpt2-random"]
            served = "random weights of GPT-2 124M's shape"
        rounds, results, about = 1 if quick else 3, [], {}
        for name, scenario in scenarios.items():
            requests = chat_workload(scenario, config.vocab_size)
            blocks = {arm: kv_blocks(scenario, arm, config.n_positions, MAX_NUM_SEQS) for arm in ARMS}
            runs = {arm: [] for arm in ARMS}
            interleaved({arm: arm for arm in ARMS}, rounds, lambda arm, r: runs[arm].append(run_arm(
                arm, server_args, requests, config.vocab_size, seed=r,
                num_blocks=blocks[arm])))
            for arm in ARMS:
                median = sorted(runs[arm], key=lambda x: x["tokens_per_s"])[len(runs[arm]) // 2]
                results.append(dict(median, scenario=name, rounds=rounds, **{
                    f"{k}_runs": [x[k] for x in runs[arm]]
                    for k in ("hit_rate", "ttft_p50_s", "tokens_per_s", "num_preemptions")}))
            about[name] = scenario_summary(scenario, requests, blocks, rounds)
    return {"results": results, **router_summary(results, about, server_args, served)}


def scenario_summary(scenario: Scenario, requests: list, blocks: dict, rounds: int) -> dict:
    params = ", ".join(f"{k}={v}" for k, v in scenario.workload.items())
    return {"about": scenario.about,
            "workload": {"name": f"shared_prefix_workload({params})", "num_requests": len(requests),
                         "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
                         "max_new_tokens": sum(r.max_new_tokens for r in requests), "prompts": "token ids",
                         "order": "turn by turn (a turn once the one before is answered), shuffled within a turn "
                                  "(seeded), the workload's spacing", "temperature": 0},
            "kv_blocks_per_replica": blocks["round_robin"], "kv_blocks_single_server": blocks[SINGLE],
            "hit_rate_bounds": hit_rate_bounds(requests, scenario.workload["system_len"]),
            # the rounds' seeds, each arm's hit rate predicted by bookkeeping alone, as measured (median)
            "predicted_hit_rate": {arm: float(np.median([simulate_hit_rate(requests, arm, blocks[arm], seed=r)
                                                         for r in range(rounds)])) for arm in ARMS}}


def router_summary(results: list[dict], about: dict, server_args: list, served: str) -> dict:
    def ratio(a: dict, b: dict, key: str) -> float | None:
        """The median over rounds of a's figure over b's in the same round (same seed, same send order)."""
        pairs = [x / y for x, y in zip(a[f"{key}_runs"], b[f"{key}_runs"]) if x is not None and y]
        return float(np.median(pairs)) if pairs else None

    ratios = {}
    for name in about:
        by = {r["method"]: r for r in results if r["scenario"] == name}
        rr, pa, single = by["round_robin"], by["prefix_affinity"], by[SINGLE]
        ratios.update({
            f"prefix_affinity_over_round_robin_hit_rate_{name}": ratio(pa, rr, "hit_rate"),
            f"round_robin_over_prefix_affinity_ttft_p50_{name}": ratio(rr, pa, "ttft_p50_s"),
            f"prefix_affinity_over_round_robin_tokens_per_s_{name}": ratio(pa, rr, "tokens_per_s"),
            f"prefix_affinity_over_single_2threads_server_tokens_per_s_{name}": ratio(pa, single, "tokens_per_s")})
    key = f"prefix_affinity_over_round_robin_hit_rate_{TARGET_SCENARIO}"
    return {"ratios": ratios, "targets_met": {f"{key} >= 1.5": ratios[key] is not None and ratios[key] >= 1.5},
            "router": {"model": served, "server_args": server_args, "scenarios": about,
                       "target_scenario": TARGET_SCENARIO,
                       "note": "hit rates from the servers' /metrics; TTFT and tokens/s as the load client sees "
                               "them, through the router for the two policies; ratios: medians over rounds of "
                               "the two arms' figures in the same round; a preempted request is looked up again "
                               "when it resumes (its own blocks then count as hits), which the prediction, "
                               "requests one at a time, never does; predicted_hit_rate from "
                               "simulate_hit_rate (block bookkeeping, requests one at a time)"}}
