"""Chapter 10, speculative decoding.

* Prompt lookup finds the last n-gram's most recent earlier occurrence; the accept rules on hand-made numbers.
* Greedy speculative decoding gives plain greedy decoding's tokens, with every drafter (prompt lookup, an int8
  draft of the model, a bad draft model, a synthetic drafter right half the time), in the generate API and in the
  engine (with chunked prefill cutting verify chunks short, prefix caching, preemption, ``n > 1``).
* Sampling keeps the target's distribution: the accept/reject rule on toy distributions, and whole generations of a
  small model (generate API and engine) against the exact distribution of their first tokens, enumerated; total
  variation distance within the sampling error's bound, and a wrong rule (output the drafts) caught by the same check.
* Rollback: after every engine step each sequence holds the blocks of its computed tokens only; at the end, every
  block is free and the allocator's invariants hold.
* Tokens per target pass against (1 - alpha^(k+1)) / (1 - alpha) with a drafter of known alpha.
"""

import subprocess
import sys

import numpy as np
import pytest
from helpers import tiny_model, wait_until

import gpt2_core
from gpt2_core import GPT2Config, kv_cache
from gpt2_core.ch01_forward.model import forward
from gpt2_core.ch01_forward.sampling import SamplingParams, sampling_probs
from gpt2_core.ch03_batching.sequence import Request
from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
from gpt2_core.ch05_sharing.prefix_cache import PrefixCachingKVStore
from gpt2_core.ch06_quantization.quantization import quantize_model
from gpt2_core.ch10_speculative import speculative
from gpt2_core.ch10_speculative.acceptance import (SpecStats, expected_speedup, expected_tokens_per_pass,
                                                   greedy_accept, rejection_sample)
from gpt2_core.ch10_speculative.drafters import (DraftModelDrafter, DraftRequest, OracleDrafter, PromptLookupDrafter,
                                                 Proposal, make_drafter, prompt_lookup)
from gpt2_core.ch10_speculative.rollback import SpeculativeKVStore
from gpt2_core.ch10_speculative.spec_engine import SpeculativeEngine
from gpt2_core.errors import InvalidInputError

CFG = GPT2Config(vocab_size=101, n_positions=512, n_embd=24, n_head=3, n_layer=2, eos_token_id=100)
TARGET = tiny_model(seed=0, config=CFG)


def noisy_copy(model_seed: int, scale: float, seed: int):
    """The target's weights plus Gaussian noise: a deliberately bad draft model (half its drafts are rejected)."""
    out = tiny_model(seed=model_seed, config=CFG)
    rng = np.random.default_rng(seed)
    for a in out.state_dict().values():
        a += (rng.standard_normal(a.shape) * scale).astype(np.float32)
    return out


BAD_DRAFT = noisy_copy(0, 0.05, 7)
EMBEDDED = gpt2_core.load_model()
EMBEDDED_INT8 = quantize_model(EMBEDDED, "int8")  # the draft: the same model in chapter 6's int8 (numpy kernel)
TEXTS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich",
         "The weather was", "Mr. Darcy said that he", "She had never seen", "In the morning the",
         "My dear Harriet, said Emma, it is", "Elizabeth could not help", "I am sure I am sure",
         "Mrs. Bennet said to her husband", "He was a very", "There was no possibility of taking a walk"]


# --- the pieces ----------------------------------------------------------------------------------------------------

def test_prompt_lookup_takes_the_longest_ngram_and_its_most_recent_occurrence():
    assert prompt_lookup([1, 2, 3, 4, 1, 2], 2) == [3, 4]  # the 2-gram [1, 2] occurred at 0
    assert prompt_lookup([5, 1, 9, 1, 7, 1], 2) == [7, 1]  # [1] occurred at 1 and 3: the most recent wins
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 8, 2, 3], 3) == [8, 2, 3]  # 2-gram [2, 3]: most recent is at 4
    assert prompt_lookup([7, 2, 3, 9, 1, 2, 3], 3) == [9, 1, 2]  # [1, 2, 3] never occurred; [2, 3] did
    assert prompt_lookup([4, 5, 6], 3) == []  # nothing repeats
    assert prompt_lookup([4, 5, 4], 5) == [5, 4]  # fewer than k tokens follow
    assert prompt_lookup([4, 5, 4], 2, min_ngram=2) == []  # unigrams not allowed
    assert prompt_lookup([3], 4) == [] and prompt_lookup([], 4) == []
    assert PromptLookupDrafter(max_ngram=1).propose([DraftRequest(0, [1, 2, 3, 1], 2)])[0].tokens == [2, 3]


def test_greedy_accept_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    logits = np.eye(6)[[3, 1, 4, 2]] * 5.0  # the target's argmax at the 4 positions: 3, 1, 4, 2
    assert greedy_accept([3, 1, 4], logits) == [3, 1, 4, 2]  # all kept, plus the bonus
    assert greedy_accept([3, 5, 4], logits) == [3, 1]  # second rejected: the target's 1 instead
    assert greedy_accept([0, 1, 4], logits) == [3]
    assert greedy_accept([], logits[:1]) == [3]


def test_the_formula():
    assert expected_tokens_per_pass(0.0, 4) == 1.0 and expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_speedup(0.5, 3, verify_cost=1.25, draft_cost=0.1) == pytest.approx(1.875 / 1.55)
    for bad in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(InvalidInputError, match="alpha"):
            expected_tokens_per_pass(bad, 3)
    with pytest.raises(InvalidInputError, match="k must be"):
        expected_tokens_per_pass(0.5, -1)


def tv_distance(counts: dict, probs: dict, n: int) -> float:
    return 0.5 * sum(abs(counts.get(x, 0) / n - probs.get(x, 0.0)) for x in set(counts) | set(probs))


def tv_bound(probs: dict, n: int) -> float:
    """A bound the sampling error alone stays under: 3 x 0.5 * sum of each cell's standard error sqrt(p(1-p)/n)
    (the expected distance is about 0.4 x that sum)."""
    return 1.5 * sum(np.sqrt(p * (1 - p) / n) for p in probs.values())


def toy_chain(seed):
    """A toy 'model' on 5 tokens: the next-token distribution after a context is a fixed random function of it."""
    table = {}

    def probs(context):
        key = tuple(context)
        if key not in table:
            table[key] = np.random.default_rng([seed, *key]).dirichlet(np.full(5, 0.7))
        return table[key]
    return probs


@pytest.mark.parametrize("drafter_kind", ["model", "guess"])
def test_rejection_sampling_keeps_the_targets_distribution(drafter_kind):
    """Two positions drafted by q (or guessed: point masses), accepted/rejected against p; the first two tokens
    emitted (a second round when the first ended early) follow p's joint distribution over 25 pairs."""
    p, q = toy_chain(1), toy_chain(2)
    rng = np.random.default_rng(0)
    n, counts, drafted = 20_000, {}, {}
    for _ in range(n):
        out = []
        while len(out) < 2:
            ctx = out[:]
            if drafter_kind == "model":
                d1 = int(rng.choice(5, p=q(ctx)))
                d2 = int(rng.choice(5, p=q(ctx + [d1])))
                qs = np.stack([q(ctx), q(ctx + [d1])])
            else:
                d1, d2, qs = 0, 1, None
            if not ctx:  # the first round's drafts: what a rule that keeps every draft would emit
                drafted[(d1, d2)] = drafted.get((d1, d2), 0) + 1
            ps = np.stack([p(ctx), p(ctx + [d1]), p(ctx + [d1, d2])])
            out += rejection_sample([d1, d2], qs, ps, rng)
        counts[tuple(out[:2])] = counts.get(tuple(out[:2]), 0) + 1
    exact = {(a, b): p([])[a] * p([a])[b] for a in range(5) for b in range(5)}
    assert tv_distance(counts, exact, n) < tv_bound(exact, n)
    assert tv_distance(drafted, exact, n) > 3 * tv_bound(exact, n)  # the check has power: the drafts are not p


def test_a_draft_with_q_zero_where_p_is_not_is_still_exact():
    """A drafter that never proposes token 0, which the target likes: the residual gives token 0 its mass."""
    p = np.array([0.5, 0.3, 0.2])
    q = np.array([0.0, 0.5, 0.5])
    rng, n = np.random.default_rng(3), 20_000
    counts = {}
    for _ in range(n):
        d = int(rng.choice(3, p=q))
        t = rejection_sample([d], q[None], np.stack([p, p]), rng)[0]
        counts[t] = counts.get(t, 0) + 1
    exact = dict(enumerate(p))
    assert tv_distance(counts, exact, n) < tv_bound(exact, n)


# --- greedy: the same tokens ---------------------------------------------------------------------------------------

def embedded_prompts():
    return [EMBEDDED.tokenizer.encode(t) for t in TEXTS]


@pytest.mark.parametrize("drafter", ["ngram", "int8 draft", "bad draft", "oracle"])
def test_greedy_generate_gives_plain_greedys_tokens(drafter):
    model = TARGET if drafter in ("bad draft", "oracle") else EMBEDDED
    prompts = embedded_prompts() if model is EMBEDDED else [np.random.default_rng(i).integers(0, 100, 9).tolist()
                                                              for i in range(8)]
    plain = [kv_cache.generate(model, p, 48, stop_at_eos=False) for p in prompts]
    make = {"ngram": lambda: PromptLookupDrafter(),
            "int8 draft": lambda: DraftModelDrafter(EMBEDDED_INT8),
            "bad draft": lambda: DraftModelDrafter(BAD_DRAFT),
            "oracle": lambda: OracleDrafter([p + t for p, t in zip(prompts, plain)], 0.5, CFG.vocab_size)}[drafter]
    stats = SpecStats()
    for k in (1, 4):
        spec = [speculative.generate(model, p, 48, stop_at_eos=False, drafter=make(), k=k, stats=stats)
                for p in prompts]
        assert spec == plain
    assert stats.num_passes > 0 and stats.num_draft_tokens > 0
    if drafter in ("int8 draft", "oracle"):
        assert stats.num_accepted_tokens > 0
    assert speculative.generate(model, prompts[0], 0, drafter=make()) == []


def test_greedy_generate_stops_at_eos_as_plain_greedy_does():
    prompt = EMBEDDED.tokenizer.encode(TEXTS[0])
    for p in [prompt] + embedded_prompts()[1:4]:
        assert speculative.generate(EMBEDDED, p, 60) == kv_cache.generate(EMBEDDED, p, 60)


def spec_requests(model, prompts, max_new):
    return [Request(i, p, max_new_tokens=m, stop_at_eos=False) for i, (p, m) in enumerate(zip(prompts, max_new))]


ENGINE_SETTINGS = {  # name -> (num_blocks, block_size, max_num_batched_tokens, max_num_seqs)
    "roomy": (400, 16, 2048, 16),
    "chunked, small budget": (400, 4, 12, 8),  # verify chunks cut short by the budget, prompts in chunks
    "tight memory": (14, 4, 64, 8),  # preemption: the drafts' room makes others wait
}


@pytest.mark.parametrize("setting", list(ENGINE_SETTINGS))
@pytest.mark.parametrize("drafter", ["ngram", "int8 draft"])
def test_greedy_engine_gives_the_plain_engines_tokens_and_leaks_no_block(setting, drafter, run_cost_tokens):
    num_blocks, bs, budget, seqs = ENGINE_SETTINGS[setting]
    prompts = embedded_prompts()
    max_new = [20 + 7 * (i % 4) for i in range(len(prompts))]
    plain = CachingLLMEngine(EMBEDDED, PrefixCachingKVStore(EMBEDDED.config, 400, 16), max_num_seqs=16)
    want = [o.output_token_ids for o in plain.generate_many(spec_requests(EMBEDDED, prompts, max_new))]
    d = PromptLookupDrafter() if drafter == "ngram" else DraftModelDrafter(EMBEDDED_INT8)
    store = SpeculativeKVStore(EMBEDDED.config, num_blocks, bs)
    engine = SpeculativeEngine(EMBEDDED, d, 4, store, max_num_seqs=seqs, max_num_batched_tokens=budget)
    ids = [engine.add_request(r) for r in spec_requests(EMBEDDED, prompts, max_new)]
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:  # rollback: room for the computed tokens only, no block more
            assert len(store.block_table(seq.seq_id)) == -(-seq.num_computed_tokens // bs)
        store.check_invariants()
    assert [engine.sequences[i].output_token_ids for i in ids] == want
    assert store.manager.num_free_blocks == num_blocks  # every block back (cached ones are free too)
    assert engine.spec_stats.num_draft_tokens > 0 and engine.spec_stats.num_accepted_tokens > 0
    if setting == "tight memory":
        assert engine.scheduler.num_preemptions > 0
    if drafter == "int8 draft":
        assert d.store.manager.num_free_blocks == d.store.num_blocks  # the drafter's store is empty too


def test_engine_with_parallel_samples_logits_processors_and_eos():
    """``n`` > 1 forks, a request with a logits processor steps without drafts, eos ends a request mid-round."""
    prompts = embedded_prompts()[:6]
    seen = []
    reqs = [Request(i, p, max_new_tokens=40, stop_at_eos=i % 2 == 0,
                    logits_processor=(lambda ids, l: seen.append(len(ids)) or l) if i == 3 else None)
            for i, p in enumerate(prompts)]
    plain = CachingLLMEngine(EMBEDDED, max_num_seqs=8)
    for r in reqs:
        plain.add_request(r, n=2 if r.request_id == 1 else 1)
    plain.run_until_done()
    engine = SpeculativeEngine(EMBEDDED, PromptLookupDrafter(), 3, max_num_seqs=8)
    before = len(seen)
    for r in reqs:
        engine.add_request(r, n=2 if r.request_id == 1 else 1)
    engine.run_until_done()
    for i in range(6):
        assert [o.output_token_ids for o in engine.samples(i)] == [o.output_token_ids for o in plain.samples(i)]
    assert len(seen) - before == 40  # one call per token: no drafts for that request
    assert engine.store.manager.num_free_blocks == engine.store.num_blocks


# --- sampling: the target's distribution ---------------------------------------------------------------------------

PARAMS = SamplingParams(temperature=1.0, top_k=3)
PROMPT = [5, 17, 42, 5, 17]


def exact_first_tokens(n_tokens: int) -> dict:
    """The target's distribution of its first ``n_tokens`` tokens after PROMPT, enumerated (top-3 sampling)."""
    out = {(): 1.0}
    for _ in range(n_tokens):
        nxt = {}
        for prefix, mass in out.items():
            p = sampling_probs(forward(TARGET, PROMPT + list(prefix))[-1], PARAMS)
            for t in np.flatnonzero(p):
                nxt[prefix + (int(t),)] = mass * p[t]
        out = nxt
    return out


class Guess:
    """Guesses fixed tokens (point masses), whatever the context."""

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, requests):
        return [Proposal(self.tokens[:r.k]) for r in requests]

    def retain(self, keys):
        pass


@pytest.mark.parametrize("drafter", ["bad draft", "guess"])
def test_sampled_generate_follows_the_targets_distribution(drafter):
    exact = exact_first_tokens(3)  # the first token comes from the prefill, the next two from one verify round
    second = {}
    for (_, t, _), mass in exact.items():
        second[t] = second.get(t, 0.0) + mass
    n, counts, drafts = 2000, {}, SpecStats()
    d = DraftModelDrafter(BAD_DRAFT) if drafter == "bad draft" else Guess([max(second, key=second.get)])
    for seed in range(n):
        out = speculative.generate(TARGET, PROMPT, 3, temperature=1.0, top_k=3, seed=seed, stop_at_eos=False,
                                   drafter=d, k=2, stats=drafts)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert drafts.num_draft_tokens == n and 0 < drafts.num_accepted_tokens < n  # one draft per run: k = 3 - 1 - 1
    assert tv_distance(counts, exact, n) < tv_bound(exact, n)


def test_sampled_engine_follows_the_targets_distribution_and_repeats_for_a_seed():
    exact = exact_first_tokens(3)
    n = 4000
    reqs = [Request(i, PROMPT, max_new_tokens=3, sampling_params=SamplingParams(1.0, 3, seed=i), stop_at_eos=False)
            for i in range(n)]
    drafter = DraftModelDrafter(BAD_DRAFT, num_blocks=300, block_size=4)
    engine = SpeculativeEngine(TARGET, drafter, 4, SpeculativeKVStore(CFG, 300, 4), max_num_seqs=64)
    outs = [tuple(o.output_token_ids) for o in engine.generate_many(reqs)]
    counts = {}
    for o in outs:
        counts[o] = counts.get(o, 0) + 1
    assert engine.spec_stats.num_draft_tokens >= n and engine.spec_stats.num_accepted_tokens > 0
    assert tv_distance(counts, exact, n) < tv_bound(exact, n)
    again = SpeculativeEngine(TARGET, DraftModelDrafter(BAD_DRAFT, 300, 4), 4, SpeculativeKVStore(CFG, 300, 4),
                              max_num_seqs=7)  # other batches, other step boundaries: the same tokens per seed
    assert [tuple(o.output_token_ids) for o in again.generate_many(reqs[:40])] == outs[:40]


# --- the formula ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
def test_tokens_per_pass_match_the_formula_with_a_drafter_of_known_alpha(alpha):
    k = 4
    prompts = [np.random.default_rng(100 + i).integers(0, 100, 8).tolist() for i in range(3)]
    refs = [p + kv_cache.generate(TARGET, p, 400, stop_at_eos=False) for p in prompts]
    stats = SpecStats()
    drafter = OracleDrafter(refs, alpha, CFG.vocab_size, seed=1)
    for p, ref in zip(prompts, refs):
        assert speculative.generate(TARGET, p, 400, stop_at_eos=False, drafter=drafter, k=k, stats=stats) == ref[8:]
    assert stats.num_passes > 150
    assert stats.tokens_per_pass == pytest.approx(expected_tokens_per_pass(alpha, k), rel=0.06)
    assert stats.alpha == pytest.approx(alpha, abs=0.05)


# --- rollback and bad input ----------------------------------------------------------------------------------------

def test_truncate_frees_the_tail_blocks_and_never_cuts_a_cached_block():
    store = SpeculativeKVStore(CFG, num_blocks=8, block_size=4)
    store.allocate("a", 11)  # 3 blocks
    assert store.truncate("a", 5) == 1 and len(store.block_table("a")) == 2 and store.manager.num_free_blocks == 6
    assert len(store.slots["a"]) == 5
    store.ensure("a", 9)
    store.cache_blocks("a", list(range(9)), 8)  # two full blocks registered
    with pytest.raises(InvalidInputError, match="cached blocks stay whole"):
        store.truncate("a", 7)
    with pytest.raises(InvalidInputError, match="num_tokens"):
        store.truncate("a", 10)
    assert store.truncate("a", 8) == 1
    store.check_invariants()
    store.free("a")
    assert store.manager.num_free_blocks == 8


def test_bad_input_is_a_clear_error():
    with pytest.raises(InvalidInputError, match="k must be"):
        speculative.generate(TARGET, PROMPT, 4, k=-1)
    with pytest.raises(InvalidInputError, match="speculative spec"):
        make_drafter("ngram", TARGET)
    with pytest.raises(InvalidInputError, match="speculative spec"):
        make_drafter("draft:int3:4", TARGET)
    with pytest.raises(InvalidInputError, match="k must be"):
        make_drafter("ngram:-2", TARGET)
    drafter, k = make_drafter("ngram:5:2", TARGET)
    assert k == 5 and drafter.max_ngram == 2
    with pytest.raises(InvalidInputError, match="SpeculativeKVStore"):
        SpeculativeEngine(TARGET, drafter, 4, PrefixCachingKVStore(CFG, 10, 4))
    with pytest.raises(InvalidInputError, match="propose"):
        SpeculativeEngine(TARGET, object(), 4)
    with pytest.raises(InvalidInputError, match="max_num_seqs"):
        SpeculativeEngine(TARGET, drafter, 4, max_num_seqs=0)
    with pytest.raises(InvalidInputError, match="min_ngram"):
        PromptLookupDrafter(max_ngram=1, min_ngram=2)


# --- the server ----------------------------------------------------------------------------------------------------

def test_serve_speculative_gives_the_openai_client_the_librarys_greedy_text():
    """``python -m gpt2_core serve --speculative ngram:4``: concurrent clients, streaming and not, get the text of
    ``kv_cache.generate``, and /metrics counts the drafts (vLLM's spec_decode counters); a bad spec is refused
    before the server starts."""
    import asyncio

    import httpx
    import openai

    from gpt2_core.ch07_serving.launch import ServerProcess

    jobs = [(TEXTS[i % len(TEXTS)], 12 + 5 * i % 23, i % 2 == 0) for i in range(16)]

    async def one(client, prompt, max_tokens, stream):
        if not stream:
            r = await client.completions.create(model="gpt2-numpy-embedded", prompt=prompt, max_tokens=max_tokens,
                                                temperature=0)
            return r.choices[0].text
        text = ""
        async for chunk in await client.completions.create(model="gpt2-numpy-embedded", prompt=prompt,
                                                           max_tokens=max_tokens, temperature=0, stream=True):
            text += chunk.choices[0].text
        return text

    async def all_at_once(url):
        client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300)
        return await asyncio.gather(*(one(client, *job) for job in jobs))

    with ServerProcess("--speculative", "ngram:4") as server:
        got = asyncio.run(all_at_once(server.base_url))
        assert wait_until(lambda: spec_counters(httpx.get(server.url + "/metrics").text)["num_drafts"] > 0)
        counters = spec_counters(httpx.get(server.url + "/metrics").text)
    check_spec_counters(counters, k=4)
    tok = EMBEDDED.tokenizer
    assert got == [tok.decode(kv_cache.generate(EMBEDDED, tok.encode(p), n), skip_special_tokens=True)
                   for p, n, _ in jobs]
    bad = subprocess.run([sys.executable, "-m", "gpt2_core", "serve", "--port", "0", "--speculative", "ngrams:4"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "speculative spec must be" in bad.stderr


def spec_counters(metrics_text: str) -> dict:
    """The spec_decode counters of a /metrics text: num_drafts, num_draft_tokens, num_accepted_tokens (0 if absent)
    and per_pos (position -> accepted there); ``present``: whether any spec_decode series is there at all."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0, "per_pos": {}, "present": False}
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if not s.name.startswith("gpt2_spec_decode_"):
                continue
            out["present"] = True
            name = s.name.removeprefix("gpt2_spec_decode_").removesuffix("_total")
            if name == "num_accepted_tokens_per_pos":
                out["per_pos"][int(s.labels["position"])] = s.value
            else:
                out[name] = s.value
    return out


def check_spec_counters(c: dict, k: int) -> None:
    """What vLLM's spec_decode counters must satisfy after some drafting: drafts were verified and some kept, no
    more kept than drafted (nor more than k per pass); per position 0..k-1, the kept drafts add up to the accepted
    total and never rise with the position (a draft is kept only if those before it in its pass were)."""
    assert c["num_drafts"] > 0 and c["num_draft_tokens"] > 0 and c["num_accepted_tokens"] > 0, c
    assert c["num_accepted_tokens"] <= c["num_draft_tokens"] <= k * c["num_drafts"], c
    per_pos = [c["per_pos"][i] for i in range(k)]
    assert sorted(c["per_pos"]) == list(range(k)) and sum(per_pos) == c["num_accepted_tokens"], c
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and per_pos[0] <= c["num_drafts"], c


def test_the_spec_decode_counters_count_what_the_engine_did_and_only_with_speculation():
    """The server's /metrics (in process): with chapter 10's engine and its counters, vLLM's spec_decode counters
    are there from the start at 0, and after a greedy request equal the engine's own ``spec_stats``; a plain
    server has none of them."""
    from starlette.testclient import TestClient

    from gpt2_core.ch07_serving.app import make_app
    from gpt2_core.ch10_speculative.spec_engine import build_speculative_engine
    from gpt2_core.ch10_speculative.spec_metrics import SpecDecodeMetrics

    engine = build_speculative_engine(EMBEDDED, "ngram:4", max_num_seqs=4)
    with TestClient(make_app(EMBEDDED, "m", engine=engine, metric_parts=[SpecDecodeMetrics])) as http:
        assert wait_until(lambda: spec_counters(http.get("/metrics").text)["per_pos"])  # the first loop's update
        start = spec_counters(http.get("/metrics").text)
        assert start["present"] and start["num_drafts"] == start["num_accepted_tokens"] == 0
        assert start["per_pos"] == {i: 0 for i in range(4)}
        for prompt in ("I am sure I am sure", TEXTS[0]):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 40, "temperature": 0})
            assert r.status_code == 200
        stats = engine.spec_stats
        assert wait_until(lambda: spec_counters(http.get("/metrics").text)["num_drafts"] == stats.num_passes)
        after = spec_counters(http.get("/metrics").text)
    check_spec_counters(after, k=4)
    assert (after["num_draft_tokens"], after["num_accepted_tokens"]) == (stats.num_draft_tokens,
                                                                         stats.num_accepted_tokens)
    kept = stats.accepted_per_position  # (as long as the longest pass's drafts: shorter if none had k)
    assert [after["per_pos"][i] for i in range(4)] == kept + [0] * (4 - len(kept))
    with TestClient(make_app(EMBEDDED, "m", max_num_seqs=2)) as http:
        assert http.post("/v1/completions", json={"prompt": TEXTS[0], "max_tokens": 5}).status_code == 200
        assert not spec_counters(http.get("/metrics").text)["present"]


def test_spec_stats_count_accepted_drafts_by_position():
    stats = SpecStats()
    stats.record(4, 2, 3)  # positions 0 and 1 kept, 2 rejected
    stats.record(4, 4, 5)  # all kept
    stats.record(2, 0, 1)  # the budget cut this pass to 2 drafts; the first rejected
    assert stats.accepted_per_position == [2, 2, 1, 1]
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens == 6
    assert (stats.num_passes, stats.num_draft_tokens, stats.num_rejections) == (3, 10, 2)


@pytest.mark.parametrize("spec", ["ngram:4", "draft:int8:3", "draft:int4:3"])
def test_chapter_9s_llama_runs_in_the_speculative_engine_with_the_plain_engines_tokens(spec):
    """The engine and both drafters reach chapter 9's model step through chapter 3's ``model_step``: the same
    greedy tokens as chapter 2's loop, every block back."""
    from dataclasses import replace

    from gguf_helpers import TINY_LLAMA

    from gpt2_core.ch10_speculative.drafters import make_drafter
    from gpt2_core.loading.llama import random_llama

    model = random_llama(replace(TINY_LLAMA, n_embd=64, n_head=4, intermediate_size=96))  # int4: groups of 32 divide them
    prompts = [list(range(1, 9)) * 2, list(range(20, 30)) * 2, [5, 6, 7]]
    want = [kv_cache.generate(model, p, 12, stop_at_eos=False) for p in prompts]
    drafter, k = make_drafter(spec, model, num_blocks=64)
    store = SpeculativeKVStore(model.config, 64, 4)
    engine = SpeculativeEngine(model, drafter, k, store, max_num_seqs=4)
    outs = engine.generate_many([Request(i, p, max_new_tokens=12, stop_at_eos=False) for i, p in enumerate(prompts)])
    assert [o.output_token_ids for o in outs] == want
    assert engine.spec_stats.num_draft_tokens > 0 and store.manager.num_free_blocks == 64
    if spec.startswith("draft"):
        assert drafter.store.manager.num_free_blocks == drafter.store.num_blocks  # the draft's store is empty too
