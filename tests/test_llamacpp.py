"""The capstone's llama.cpp rows: GPT-2 written as GGUF (read back with llama.cpp's own ``gguf`` package: every
tensor where llama.cpp's ``gpt2`` looks for it, in its orientation; q8_0 within its rounding; the tokenizer and the
hyperparameters), bad arguments refused; and where llama-cpp-python is installed, llama.cpp running the file gives
chapter 1's logits and greedy tokens, and the capstone's rows serve the workload with them."""

import numpy as np
import pytest

from gpt2_core.bench import capstone as C
from gpt2_core.bench import llamacpp as L
from gpt2_core.ch01_forward import generation
from gpt2_core.ch03_batching.engine import RequestOutput
from gpt2_core.ch03_batching.sequence import FinishReason, Request, SequenceMetrics
from gpt2_core.ch06_quantization.quantization import bytes_per_token
from gpt2_core.errors import InvalidInputError
from gpt2_core.loading.config import GPT2Config
from gpt2_core.loading.tokenizer import EOT
from helpers import tiny_model

gguf = pytest.importorskip("gguf")

CONFIG = GPT2Config(vocab_size=50257, n_positions=64, n_embd=64, n_head=4, n_layer=2)  # GPT-2's vocabulary


@pytest.fixture(scope="module")
def model():
    return tiny_model(config=CONFIG)


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    return {q: L.write_gpt2_gguf(model, folder / f"m-{q}.gguf", q) for q in L.GGUF_TYPES}


def tensors(path) -> dict:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
            for t in gguf.GGUFReader(str(path)).tensors}


def field(reader, key):
    f = reader.fields[key]
    if len(f.data) == 1:
        value = f.parts[f.data[0]]
        return bytes(value).decode() if value.dtype == np.uint8 else value.item()
    return [bytes(f.parts[i]).decode() for i in f.data]


def expected(model) -> dict:
    """Every tensor llama.cpp's gpt2 reads, as NumPy holds it in the file ([out, in] for the block matrices)."""
    p = model.params
    out = {"token_embd.weight": p["wte"], "position_embd.weight": p["wpe"], "output_norm.weight": p["ln_f"]["weight"],
           "output_norm.bias": p["ln_f"]["bias"]}
    for i, b in enumerate(p["h"]):
        for name, ln in L.NORMS.items():
            out[f"blk.{i}.{name}.weight"], out[f"blk.{i}.{name}.bias"] = b[ln]["weight"], b[ln]["bias"]
        for name, (module, layer) in L.MATRICES.items():
            out[f"blk.{i}.{name}.weight"] = np.asarray(b[module][layer]["weight"]).T
            out[f"blk.{i}.{name}.bias"] = b[module][layer]["bias"]
    return out


def test_f32_file_holds_every_tensor_in_llama_cpps_orientation(model, files):
    E, V, P = CONFIG.n_embd, CONFIG.vocab_size, CONFIG.n_positions
    shapes = {t.name: t.shape.tolist() for t in gguf.GGUFReader(str(files["f32"])).tensors}
    # the ggml shapes llama.cpp's gpt2 loader asks for (src/models/gpt2.cpp), written out, not rebuilt from the writer
    assert shapes["token_embd.weight"] == [E, V] and shapes["position_embd.weight"] == [E, P]
    assert shapes["blk.0.attn_qkv.weight"] == [E, 3 * E] and shapes["blk.0.attn_output.weight"] == [E, E]
    assert shapes["blk.1.ffn_up.weight"] == [E, 4 * E] and shapes["blk.1.ffn_down.weight"] == [4 * E, E]
    assert shapes["blk.1.ffn_up.bias"] == [4 * E] and shapes["output_norm.weight"] == [E]
    got, want = tensors(files["f32"]), expected(model)
    assert set(got) == set(want)
    for name, a in want.items():
        np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_q8_0_file_rounds_each_block_of_32_to_its_own_scale(model, files):
    got, want = tensors(files["q8_0"]), expected(model)
    assert set(got) == set(want)
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(files["q8_0"])).tensors}
    for name, a in want.items():
        a = np.asarray(a, dtype=np.float32)
        if a.ndim == 2 and name != "position_embd.weight":
            assert kinds[name] == "Q8_0", name
            blocks = a.reshape(-1, 32)
            step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # one int8 step of each block
            err = np.abs(got[name].reshape(-1, 32) - blocks)
            # half a step, plus 127 times the rounding of the block's fp16 scale
            assert (err <= step * (0.5 + 127 * 2.0 ** -11) + 1e-7).all(), name
        else:
            assert kinds[name] == "F32", name
            np.testing.assert_array_equal(got[name], a, err_msg=name)


def test_metadata_is_what_llama_cpps_gpt2_reads(files):
    r = gguf.GGUFReader(str(files["f32"]))
    assert field(r, "general.architecture") == "gpt2"
    assert field(r, "gpt2.block_count") == CONFIG.n_layer
    assert field(r, "gpt2.context_length") == CONFIG.n_positions
    assert field(r, "gpt2.embedding_length") == CONFIG.n_embd
    assert field(r, "gpt2.feed_forward_length") == 4 * CONFIG.n_embd
    assert field(r, "gpt2.attention.head_count") == CONFIG.n_head
    assert field(r, "gpt2.attention.layer_norm_epsilon") == pytest.approx(CONFIG.layer_norm_epsilon)
    assert field(r, "tokenizer.ggml.model") == "gpt2"
    tokens, merges = L.gpt2_vocabulary()
    assert len(r.fields["tokenizer.ggml.tokens"].data) == CONFIG.vocab_size == len(tokens)
    assert len(r.fields["tokenizer.ggml.merges"].data) == len(merges) == 50000
    assert field(r, "tokenizer.ggml.eos_token_id") == tokens.index(EOT) == 50256


def test_file_weights_count_what_the_file_stores(model, files):
    f32 = L.GGUFWeights(files["f32"], CONFIG)
    assert f32.nbytes() == model.nbytes() and bytes_per_token(f32) == bytes_per_token(model)
    q8 = L.GGUFWeights(files["q8_0"], CONFIG)
    matrices = model.params["wte"].size + sum(np.asarray(b[m][l]["weight"]).size for b in model.params["h"]
                                              for m, l in L.MATRICES.values())
    assert q8.nbytes() == model.nbytes() - 4 * matrices + matrices // 32 * 34  # 34 bytes per block of 32


def test_bad_arguments_are_refused(model, tmp_path):
    with pytest.raises(InvalidInputError, match="qtype"):
        L.write_gpt2_gguf(model, tmp_path / "x.gguf", "q4_0")
    small = tiny_model(config=GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_head=4, n_layer=1))
    with pytest.raises(InvalidInputError, match="vocabulary"):
        L.write_gpt2_gguf(small, tmp_path / "y.gguf")
    assert "multiple of 32" in L.gguf_unsupported(GPT2Config(vocab_size=50257, n_embd=48, n_head=4, n_layer=1))


def test_without_llama_cpp_the_capstone_says_how_to_get_it(monkeypatch, model):
    monkeypatch.setattr(C, "llama_cpp_available", lambda: False)
    rows, skipped = C.llamacpp_rows(model, [], 1)
    assert rows == [] and "pip install llama-cpp-python" in skipped[0]["reason"]


def test_llama_cpp_without_gguf_or_for_another_vocabulary_says_why(monkeypatch, model):
    monkeypatch.setattr(C, "llama_cpp_available", lambda: True)
    small = tiny_model(config=GPT2Config(vocab_size=96, n_positions=16, n_embd=32, n_head=4, n_layer=1))
    assert "vocabulary" in C.llamacpp_rows(small, [], 1)[1][0]["reason"]
    real = C.importlib.util.find_spec
    monkeypatch.setattr(C.importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    rows, skipped = C.llamacpp_rows(model, [], 1)
    assert rows == [] and "needs the gguf package" in skipped[0]["reason"]


def test_a_failing_llama_cpp_costs_its_row_only(monkeypatch, model):
    """One file that llama.cpp cannot serve: that row is skipped with the reason, the other is measured."""
    monkeypatch.setattr(C, "llama_cpp_available", lambda: True)
    requests = [Request(0, np.array([5, 6, 7]), 2, stop_at_eos=False)]

    def serve(path, n_ctx, requests, threads):
        if "q8_0" in str(path):
            raise RuntimeError("llama.cpp worker died (exit code -6)")
        m = SequenceMetrics(arrival_time=10.0, first_scheduled_time=10.0, token_times=[10.5, 10.75],
                            finished_time=10.75)
        return [RequestOutput(0, [5, 6, 7], [1, 2], FinishReason.LENGTH, None, m)], 1.0, "test"
    monkeypatch.setattr(C, "serve_gguf", serve)
    rows, skipped = C.llamacpp_rows(model, requests, 1)
    assert [r["method"] for r in rows] == ["llamacpp_f32"] and rows[0]["tokens_per_s"] == 2.0
    assert rows[0]["ttft_p50_s"] == pytest.approx(0.5) and rows[0]["itl_p50_s"] == pytest.approx(0.25)
    assert skipped == [{"method": "llamacpp_q8_0", "reason": "llama.cpp failed on the q8_0 file: RuntimeError: "
                                                           "llama.cpp worker died (exit code -6)"}]


# -- where llama.cpp is installed ----------------------------------------------------------------------------------


def test_llama_cpp_runs_the_file_as_chapter_1_does(model, files):
    pytest.importorskip("llama_cpp")
    ids = [464, 3290, 318, 257, 922, 1110, 13, 198, 40, 588]
    llm = L.open_llama_cpp(files["f32"], n_ctx=CONFIG.n_positions, threads=1)
    llm.reset()
    llm.eval(ids)
    theirs = L.last_logits(llm)
    ours = generation.next_token_logits(model, np.array(ids))
    assert np.abs(theirs - ours).max() <= 3e-3 * np.abs(ours).max()  # llama.cpp keeps K/V in float16
    tokens = list(L.greedy_stream(llm, ids, 8))
    assert tokens == generation.generate(model, ids, 8, stop_at_eos=False)


def test_capstone_llama_cpp_rows_serve_the_workload(model):
    pytest.importorskip("llama_cpp")
    from gpt2_core.bench.workload import poisson_workload

    requests = poisson_workload(3, 50.0, CONFIG.vocab_size, seed=0, prompt_len=(10, 0.5, 3, 20),
                                output_len=(5, 0.5, 2, 8))
    rows, skipped = C.llamacpp_rows(model, requests, 1)
    assert [r["method"] for r in rows] == ["llamacpp_f32", "llamacpp_q8_0"], skipped
    for r in rows:
        assert r["output_tokens"] == sum(q.max_new_tokens for q in requests) and r["tokens_per_s"] > 0
        assert r["ttft_p50_s"] > 0 and r["itl_p50_s"] > 0
        assert r["kv_bytes_per_position"] == 2 * CONFIG.n_layer * CONFIG.n_embd * 2  # float16 K/V
    assert rows[1]["weight_bytes"] < rows[0]["weight_bytes"] / 3
