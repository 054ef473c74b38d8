"""Chapter 10's benchmark: ``python -m gpt2_core bench spec [--json PATH] [--quick]``.

Speed on random weights of GPT-2 124M's shape (``accelerate``d, as every benchmark): a pass's time does not depend
on the weights. Their predictions are noise, though, so no real drafter's acceptance means anything on them; the
``OracleDrafter`` (right with probability alpha, by construction) stands in for a drafter of known quality.

* ``verify_cost``: one target pass of k + 1 positions over a cached context against one decode step (k = 0),
  batch 1, chapter 2's cache: interleaved rounds, medians;
* ``results`` (method ``oracle``): batch-1 generation for several alpha and k: tokens per pass against
  (1 - alpha^(k+1)) / (1 - alpha), tok/s against plain greedy (chapter 2), and the speed-up the formula predicts
  with the measured verify cost;
* ``results`` (methods ``engine_*``): chapter 5's engine against the speculative engine (oracle drafter at
  ``ORACLE_ALPHA``, and prompt lookup) at batch 1, 4 and 16 on a copy-heavy workload (each prompt a random passage,
  then its first tokens again). Prompt lookup's acceptance there measures only how often the random model repeats
  itself: with trained weights the copy would be accepted (see ``embedded``);
* ``formula``: the oracle's tokens per pass against the formula for alpha 0.3 - 0.95 and k 1 - 8, on the embedded
  model (a count, not a time: a small model gives many passes);
* ``draft_cost``: a batch-1 decode step of the int8 draft (numpy kernel; numba's too when installed) against fp32,
  and the speed-up the formula gives a draft model at that cost;
* ``embedded``: the embedded model (trained; real text): prompt lookup and its own int8 form as drafters, on free
  text (novel openings) and on a copy task (a held-out passage, then its first words again): alpha, tokens per
  pass and the batch-1 speed-up measured (a small model: its steps are short, overheads weigh more);
* ``instruct``: a real instruct model (chapter 9's SmolLM2-135M-Instruct, ``accelerate``d) on two workloads:
  ``editing`` (fix the grammar of a paragraph, the workload prompt lookup is made for: the answer copies most of
  the question) and ``open_chat`` (questions whose answers copy nothing). Batch-1 prompt lookup at several k
  against plain greedy decoding, rounds taking turns: ``speedup`` is the decode phase's (the tokens after the
  first), the median of the rounds' ratios; ``speedup_with_prefill`` the whole request's; the target is judged
  at the k fixed in advance (``NUM_SPECULATIVE``). ``formula`` assumes k drafts in every pass (prompt lookup
  sometimes finds fewer). Skipped with a note when the model's package is not installed.
"""

from __future__ import annotations

import functools
import time
from dataclasses import replace

import numpy as np

from ..a1_cpu_kernels import accelerate
from ..ch02_kv_cache import kv_cache
from ..ch03_batching.sequence import Request
from ..ch04_paged.block_manager import blocks_needed
from ..ch05_sharing.caching_engine import CachingLLMEngine
from ..ch05_sharing.prefix_cache import PrefixCachingKVStore
from ..ch06_quantization import quant_kernels
from ..ch06_quantization.quantization import heldout_token_ids, quantize_model
from ..ch10_speculative import speculative
from ..ch10_speculative.acceptance import SpecStats, expected_speedup, expected_tokens_per_pass
from ..ch10_speculative.drafters import DraftModelDrafter, OracleDrafter, PromptLookupDrafter
from ..ch10_speculative.rollback import SpeculativeKVStore
from ..ch10_speculative.spec_engine import SpeculativeEngine
from ..errors import CheckpointError
from ..loading.config import preset
from ..loading.llama import load_gguf_model, smollm2_path
from ..loading.weights import GPT2Model, load_model, random_model
from .common import interleaved
from .replay import serve_one_by_one
from .workload import random_prompt

CONTEXT = 128  # cached tokens before a verify pass
ORACLE_ALPHA = 0.8  # the engine arms' synthetic drafter
NUM_SPECULATIVE = 4  # k of the engine and embedded arms
OPENINGS = ["It is a truth universally acknowledged", "Emma Woodhouse, handsome, clever, and rich",
            "The weather was", "Mr. Darcy said that he", "She had never seen", "My dear Harriet, said Emma,"]
HONEST = ("random weights: the oracle's alpha is set, not measured; prompt lookup's alpha on them measures the "
          "random model's own repetition; timings are real")


def embedded_new_tokens(quick: bool) -> int:
    """Tokens each prompt of the embedded model's workloads generates (here and in the capstone's replay)."""
    return 16 if quick else 60


def verify_costs(model: GPT2Model, ks, rounds: int, context: int = CONTEXT) -> dict:
    """k -> median seconds of one pass of k + 1 positions after ``context`` cached tokens, and that in decode steps."""
    runner = speculative.CacheRunner(model)
    runner.prefill(random_prompt(model.config.vocab_size, context, 1), capacity=context + max(ks) + 1)
    tokens = random_prompt(model.config.vocab_size, max(ks) + 1, 2)

    def one_pass(k):
        def run():
            runner.score(tokens[:k + 1])
            runner.truncate(context)  # rolled back: every pass starts from the same context
        return run
    readings = interleaved({k: one_pass(k) for k in ks}, rounds)
    step = float(np.median(readings[0]))
    return {k: {"positions": k + 1, "seconds": float(np.median(r)), "decode_steps": float(np.median(r)) / step}
            for k, r in readings.items()}


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def oracle_rows(model: GPT2Model, prompts, new_tokens: int, alphas, ks, cost: dict) -> list[dict]:
    """Batch-1 generation with the oracle drafter at each (alpha, k), beside plain greedy (timed before and after)."""
    def plain_run():
        return [kv_cache.generate(model, p, new_tokens, stop_at_eos=False) for p in prompts]
    plain, s1 = timed(plain_run)
    refs, V, rows = [p + o for p, o in zip(prompts, plain)], model.config.vocab_size, []
    total = sum(len(o) for o in plain)
    for alpha in alphas:
        for k in ks:
            stats, drafter = SpecStats(), OracleDrafter(refs, alpha, V, seed=0)
            outs, secs = timed(lambda: [speculative.generate(model, p, new_tokens, stop_at_eos=False,
                                                             drafter=drafter, k=k, stats=stats) for p in prompts])
            rows.append({"method": "oracle", "batch": 1, "alpha": alpha, "k": k, "tokens_per_s": total / secs,
                         "tokens_per_pass": stats.tokens_per_pass, "formula": expected_tokens_per_pass(alpha, k),
                         "alpha_measured": stats.alpha, "speedup_seconds": secs, "identical_to_greedy": outs == plain,
                         "predicted_speedup": expected_speedup(alpha, k, cost[k]["decode_steps"])})
    _, s2 = timed(plain_run)
    plain_s = (s1 + s2) / 2
    for r in rows:
        r["speedup"] = plain_s / r.pop("speedup_seconds")
    return [{"method": "plain_greedy", "batch": 1, "tokens_per_s": total / plain_s}] + rows


def formula_rows(model: GPT2Model, prompts, new_tokens: int, alphas=(0.3, 0.6, 0.8, 0.95), ks=(1, 2, 4, 8)) -> list:
    """Tokens per pass of the oracle drafter against the formula, on many passes: a count, not a time, so the
    small embedded model measures it (greedy references of ``new_tokens`` per prompt)."""
    refs = [p + kv_cache.generate(model, p, new_tokens, stop_at_eos=False) for p in prompts]
    rows = []
    for alpha in alphas:
        for k in ks:
            stats, oracle = SpecStats(), OracleDrafter(refs, alpha, model.config.vocab_size, seed=k)
            for p in prompts:
                speculative.generate(model, p, new_tokens, stop_at_eos=False, drafter=oracle, k=k, stats=stats)
            rows.append({"alpha": alpha, "k": k, "num_passes": stats.num_passes, "alpha_measured": stats.alpha,
                         "tokens_per_pass": stats.tokens_per_pass, "formula": expected_tokens_per_pass(alpha, k)})
    return rows


def copy_workload(num: int, vocab_size: int, passage: int, new_tokens: int) -> list[Request]:
    """Copy-heavy prompts: a random passage, then its first 8 tokens again (a model that copies goes on with it)."""
    out = []
    for i in range(num):
        text = random_prompt(vocab_size, passage, 50 + i)
        out.append(Request(i, text + text[:8], max_new_tokens=new_tokens, stop_at_eos=False))
    return out


def engine_arm(model, requests, arm: str, batch: int, refs) -> tuple[dict, list]:
    """Serve ``requests`` offline with one arm: ``plain`` (chapter 5), ``oracle`` or ``ngram`` (speculative)."""
    fresh = [replace(r) for r in requests]
    need = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests) + NUM_SPECULATIVE + 1
    blocks = batch * blocks_needed(need, 16) + 4
    if arm == "plain":
        engine = CachingLLMEngine(model, PrefixCachingKVStore(model.config, blocks, 16), max_num_seqs=batch)
    else:
        drafter = (OracleDrafter(refs, ORACLE_ALPHA, model.config.vocab_size) if arm == "oracle"
                   else PromptLookupDrafter())
        engine = SpeculativeEngine(model, drafter, NUM_SPECULATIVE, SpeculativeKVStore(model.config, blocks, 16),
                                   max_num_seqs=batch)
    outs, secs = timed(lambda: engine.generate_many(fresh))
    tokens = sum(len(o.output_token_ids) for o in outs)
    row = {"method": f"engine_{arm}", "batch": batch, "tokens_per_s": tokens / secs, "seconds": secs,
           "num_steps": engine.num_steps}
    if arm != "plain":
        row.update({k: v for k, v in engine.spec_stats.as_dict().items() if k in ("alpha", "tokens_per_pass",
                                                                                  "acceptance_rate")})
    return row, [o.output_token_ids for o in outs]


def engine_rows(model: GPT2Model, batches, passage: int, new_tokens: int, rounds: int) -> list[dict]:
    """Plain, oracle and prompt-lookup engines at each batch size, interleaved rounds, the median round's row."""
    rows = []
    for batch in batches:
        requests = copy_workload(batch, model.config.vocab_size, passage, new_tokens)
        first, plain = engine_arm(model, requests, "plain", batch, None)  # also the oracle's references
        refs = [r.prompt_token_ids + o for r, o in zip(requests, plain)]
        runs = {arm: [] for arm in ("plain", "oracle", "ngram")}
        runs["plain"].append(first)
        identical = True
        for r in range(rounds):
            for arm in (["oracle", "ngram", "plain"] if r % 2 == 0 else ["ngram", "oracle", "plain"]):
                if arm == "plain" and r == 0:
                    continue
                row, outs = engine_arm(model, requests, arm, batch, refs)
                runs[arm].append(row)
                identical &= outs == plain
        medians = {arm: sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2] for arm, rs in runs.items()}
        for arm, row in medians.items():
            row["speedup"] = row["tokens_per_s"] / medians["plain"]["tokens_per_s"]
            row["identical_to_plain"] = identical
            rows.append(row)
    return rows


def decode_step_seconds(model: GPT2Model, context: int = 64, repeats: int = 15) -> float:
    """Median seconds of one batch-1 decode step after ``context`` cached tokens (rolled back each time)."""
    logits, cache = kv_cache.prefill(model, random_prompt(model.config.vocab_size, context, 3), context + 1)
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        kv_cache.decode_step(model, 5, cache)
        times.append(time.perf_counter() - t0)
        cache.length = context
    return float(np.median(times[1:]))


def draft_costs(base: GPT2Model, fast: GPT2Model, alpha: float, verify: dict) -> list[dict]:
    """The int8 draft's step against the fp32 target's, and the formula's speed-up at k = NUM_SPECULATIVE with
    ``alpha`` (measured on the embedded model: random weights give no meaningful alpha)."""
    drafts = {"int8_numpy": quantize_model(base, "int8")}
    if quant_kernels.numba_available():
        drafts["int8_numba"] = quantize_model(base, "int8", kernel="numba")
        decode_step_seconds(drafts["int8_numba"], repeats=1)  # compiles the kernel, untimed
    target = decode_step_seconds(fast)
    k, rows = NUM_SPECULATIVE, []
    for name, draft in drafts.items():
        c = decode_step_seconds(draft) / target
        rows.append({"draft": name, "draft_cost_in_target_steps": c, "alpha": alpha, "k": k,
                     "predicted_speedup": expected_speedup(alpha, k, verify[k]["decode_steps"], c)})
    return rows


def embedded_workloads(model: GPT2Model, quick: bool) -> dict:
    tok = model.tokenizer
    heldout = heldout_token_ids(tok)
    starts = range(0, 40 * 200, 200)[:2 if quick else 6]
    copies = [heldout[s:s + 60].tolist() + heldout[s:s + 10].tolist() for s in starts]
    return {"free_text": [tok.encode(t) for t in OPENINGS[:2 if quick else 6]], "copy_task": copies}


def embedded_rows(quick: bool, new_tokens: int) -> tuple[list[dict], float]:
    """Prompt lookup and the int8 draft on the embedded model, per workload; and the int8 draft's alpha."""
    model = load_model()
    int8 = quantize_model(model, "int8")
    rows, alpha_int8 = [], 0.0
    for name, prompts in embedded_workloads(model, quick).items():
        plain, plain_s = timed(lambda: [kv_cache.generate(model, p, new_tokens, stop_at_eos=False) for p in prompts])
        for drafter_name, make in (("ngram", PromptLookupDrafter), ("int8_draft", lambda: DraftModelDrafter(int8))):
            stats, drafter = SpecStats(), make()
            outs, secs = timed(lambda: [speculative.generate(model, p, new_tokens, stop_at_eos=False, drafter=drafter,
                                                             k=NUM_SPECULATIVE, stats=stats) for p in prompts])
            rows.append({"workload": name, "drafter": drafter_name, "k": NUM_SPECULATIVE, **stats.as_dict(),
                         "speedup": plain_s / secs, "identical_to_greedy": outs == plain})
            if drafter_name == "int8_draft":
                alpha_int8 = max(alpha_int8, stats.alpha)
    return rows, alpha_int8


PARAGRAPHS = [  # the editing workload: paragraphs with grammar mistakes, written for this benchmark
    "Their is many reason why peoples enjoys to travelling in the summer. Firstly, the weather are usually warm and "
    "sunny, which make it easy for go outside and explore new place. Secondly, most student has holiday from school, "
    "so familys can goes on trip together without worry about lessons.",
    "Yesterday me and my brother goes to the market for buying some vegetable. The seller were very friendly and he "
    "give us a discount because we was buying so much tomatos. When we arrived home, our mother have already cook "
    "the dinner, so we putted the vegetables in the fridge.",
    "The library in our town have been closed since three month because the roof were damaged by a storm. Many "
    "people is unhappy about this, because they can not borrow no books. The council say that the repairs will "
    "finishes before the end of the year, but nobody believe them.",
]
EDIT_INSTRUCTION = "Fix the grammar of this paragraph. Reply with the corrected paragraph only.\n\n"
QUESTIONS = ["Write a short story about a lighthouse keeper who finds a message in a bottle.",  # open chat
             "Explain why the sky is blue to a ten-year-old.",
             "Give three tips for learning to play the guitar."]
INSTRUCT_KS = (2, 4, 6)
SPEEDUP_TARGET = 1.5  # issue 44: prompt lookup on the editing workload, batch-1 decode


def instruct_workloads(tokenizer, quick: bool) -> dict[str, list[list[int]]]:
    """The real instruct model's workloads, each prompt a chat in the model's own template: ``editing`` (correct a
    paragraph: the answer copies most of the question) and ``open_chat`` (questions whose answers copy nothing)."""
    def chat(text):
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]))
    n = 1 if quick else 3
    return {"editing": [chat(EDIT_INSTRUCTION + p) for p in PARAGRAPHS[:n]], "open_chat": [chat(q) for q in QUESTIONS[:n]]}


def instruct_rows(quick: bool) -> tuple[list[dict], str | None]:
    """Prompt lookup at each k on the real instruct model's workloads, beside plain greedy (rows), or why not."""
    try:
        model = accelerate(load_gguf_model(smollm2_path()))
    except CheckpointError as e:
        return [], f"no editing or open-chat rows: {e}"
    new_tokens, ks, rounds = (24, (NUM_SPECULATIVE,), 1) if quick else (96, INSTRUCT_KS, 4)  # even: each order twice
    rows = []
    for workload, prompts in instruct_workloads(model.tokenizer, quick).items():
        requests = [Request(i, p, max_new_tokens=new_tokens) for i, p in enumerate(prompts)]

        def run(k=None, stats=None):  # the prompts one after another: (tokens, prefill s, decode s)
            stream = kv_cache.generate_stream if k is None else functools.partial(
                speculative.generate_stream, drafter=PromptLookupDrafter(), k=k, stats=stats)
            outputs, _ = serve_one_by_one(model, requests, stream)
            first = [o.metrics.token_times[0] for o in outputs]  # each request has a first token (96 allowed)
            return ([o.output_token_ids for o in outputs],
                    sum(f - o.metrics.first_scheduled_time for f, o in zip(first, outputs)),  # to the first token
                    sum(o.metrics.token_times[-1] - f for f, o in zip(first, outputs)))  # the decode phase
        plain = run()[0]
        stats = {k: SpecStats() for k in ks}
        identical = {k: run(k, stats[k])[0] == plain for k in ks}  # and the warm-up: tiles are made on first use
        readings = interleaved({"plain": run, **{k: (lambda k=k: run(k)) for k in ks}}, rounds,
                               measure=lambda fn, r: fn()[1:])  # (prefill s, decode s) of each round
        tokens = sum(len(o) for o in plain)
        decoded = tokens - len(plain)  # the tokens after each prompt's first
        for k in ks:
            whole = [sum(p) / sum(q) for p, q in zip(readings["plain"], readings[k])]
            decode = [p[1] / q[1] for p, q in zip(readings["plain"], readings[k])]
            st = stats[k]
            rows.append({"workload": workload, "model": "SmolLM2-135M-Instruct (accelerated)", "drafter": "ngram",
                         "k": k, "batch": 1, **st.as_dict(), "formula": expected_tokens_per_pass(st.alpha, k),
                         "plain_decode_tokens_per_s": decoded / float(np.median([q[1] for q in readings["plain"]])),
                         "decode_tokens_per_s": decoded / float(np.median([q[1] for q in readings[k]])),
                         "speedup": float(np.median(decode)), "speedup_with_prefill": float(np.median(whole)),
                         "identical_to_greedy": identical[k], "prompts": len(prompts), "max_new_tokens": new_tokens,
                         "tokens_generated": tokens, "rounds": rounds})
    return rows, None


def bench_spec(quick: bool = False) -> dict:
    t0 = time.perf_counter()
    config = replace(preset("gpt2"), n_layer=2) if quick else preset("gpt2")
    base = random_model(config, seed=0)
    model = accelerate(base)
    ks = (0, 1, 2, 4) if quick else (0, 1, 2, 3, 4, 6, 8)
    cost = verify_costs(model, ks, rounds=1 if quick else 5)
    prompts = [random_prompt(config.vocab_size, 32, 10 + i) for i in range(1 if quick else 2)]
    oracle = oracle_rows(model, prompts, 12 if quick else 64, (0.5, 0.8) if quick else (0.5, 0.8, 0.95),
                         ks[1:], cost)
    engine = engine_rows(model, (1, 4) if quick else (1, 4, 16), 24 if quick else 48, 8 if quick else 64,
                         1 if quick else 3)
    embedded, alpha_int8 = embedded_rows(quick, embedded_new_tokens(quick))
    instruct, instruct_note = instruct_rows(quick)
    draft = draft_costs(base, model, alpha_int8, cost)
    small = load_model()
    formula = formula_rows(small, [small.tokenizer.encode(t) for t in OPENINGS[:2 if quick else 6]],
                           60 if quick else 200)
    spread = [abs(r["tokens_per_pass"] / r["formula"] - 1) for r in formula]
    return {"benchmark": "spec", "model": f"random {config.n_layer}-layer GPT-2 124M shape (accelerated)",
            "quick": quick, "kernels": "cpu_kernels.accelerate", "note": HONEST,
            "verify_cost": [{"k": k, **v} for k, v in cost.items()], "results": oracle + engine,
            "draft_cost": draft, "embedded": embedded, "formula": formula, "instruct": instruct,
            "skipped": {"instruct": instruct_note} if instruct_note else {},
            "ratios": {"verify pass of 5 positions, in decode steps": cost[4]["decode_steps"],
                       "largest |tokens per pass / formula - 1| (oracle, embedded model)": max(spread)},
            "targets_met": {"tokens per pass within 10% of the formula": max(spread) <= 0.10,
                            "greedy identical everywhere": all(r.get("identical_to_greedy", True) and
                                                               r.get("identical_to_plain", True)
                                                               for r in oracle + engine + embedded + instruct),
                            **({f"prompt lookup (k = {NUM_SPECULATIVE}) >= {SPEEDUP_TARGET}x batch-1 decode on the "
                                "editing workload": next(r["speedup"] for r in instruct if r["workload"] == "editing"
                                                         and r["k"] == NUM_SPECULATIVE) >= SPEEDUP_TARGET}
                               if instruct else {})},
            "duration_s": time.perf_counter() - t0}
