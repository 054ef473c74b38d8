"""Writing GGUF files with NumPy and ``struct`` only (the format of ``gpt2_core.loading.gguf``'s docstring), and a
tiny random Llama written as llama.cpp would write it (Q and K rows permuted, matrices [out, in])."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path

import numpy as np

from gpt2_core.loading.llama import LlamaConfig, random_llama

TYPE_IDS = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "BF16": 30}
TINY_LLAMA = LlamaConfig(vocab_size=260, n_positions=64, n_embd=48, n_head=6, n_kv_head=2, n_layer=2,
                         intermediate_size=80, rope_theta=10000.0, rms_norm_eps=2.0**-16,  # exact in float32
                         bos_token_id=258, eos_token_id=259)


def gguf_string(s: str) -> bytes:
    raw = s.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf_value(value) -> bytes:
    """type id + payload of a metadata value (bool, int, float, str, or a list of one of those)."""
    if isinstance(value, bool):
        return struct.pack("<IB", 7, value)
    if isinstance(value, int):
        return struct.pack("<Ii", 5, value) if -2**31 <= value < 2**31 else struct.pack("<Iq", 11, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + gguf_string(value)
    if isinstance(value, list):
        if value and isinstance(value[0], str):
            return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(gguf_string(s) for s in value)
        if value and isinstance(value[0], float):
            return struct.pack("<IIQ", 9, 6, len(value)) + np.asarray(value, "<f4").tobytes()
        return struct.pack("<IIQ", 9, 5, len(value)) + np.asarray(value, "<i4").tobytes()
    raise TypeError(value)


def gguf_bytes(metadata: dict, tensors: dict, alignment: int = 32, version: int = 3) -> bytes:
    """A whole file. ``tensors``: name -> float32 array (stored F32), or (raw bytes, NumPy shape, type name)."""
    head = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(metadata)))
    for key, value in metadata.items():
        head += gguf_string(key) + gguf_value(value)
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw, shape, kind = (np.ascontiguousarray(t, "<f4").tobytes(), t.shape, "F32") if isinstance(t, np.ndarray) \
            else t
        head += gguf_string(name) + struct.pack("<I", len(shape)) + struct.pack(f"<{len(shape)}Q", *shape[::-1])
        head += struct.pack("<IQ", TYPE_IDS[kind], offset)
        padded = raw + b"\0" * (-len(raw) % alignment)
        blobs.append(padded)
        offset += len(padded)
    head += b"\0" * (-len(head) % alignment)
    return bytes(head) + b"".join(blobs)


def byte_level_vocab() -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, two merges, two control tokens (ids 258, 259): tokens, merges, token types."""
    from tokenizers import pre_tokenizers

    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "<|im_start|>", "<|im_end|>"]
    return tokens, ["Ġ t", "h e"], [1] * 258 + [3, 3]


CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def llama_metadata(config: LlamaConfig = TINY_LLAMA, **changes) -> dict:
    tokens, merges, types = byte_level_vocab()
    md = {"general.architecture": "llama", "general.alignment": 32, "llama.block_count": config.n_layer,
          "llama.context_length": config.n_positions, "llama.embedding_length": config.n_embd,
          "llama.feed_forward_length": config.intermediate_size, "llama.attention.head_count": config.n_head,
          "llama.attention.head_count_kv": config.n_kv_head, "llama.rope.freq_base": config.rope_theta,
          "llama.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
          "llama.rope.dimension_count": config.head_dim, "llama.vocab_size": config.vocab_size,
          "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.merges": merges, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.bos_token_id": 258, "tokenizer.ggml.eos_token_id": 259,
          "tokenizer.chat_template": CHAT_TEMPLATE}
    md.update(changes)
    return {k: v for k, v in md.items() if v is not None}


def permute_qk(w, n_heads: int):  # HF rows [n_heads * D, in] -> llama.cpp's (convert_hf_to_gguf.py's permute)
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def llama_tensors(model) -> dict[str, np.ndarray]:
    """``model``'s parameters as llama.cpp stores them: [out, in], Q and K rows permuted."""
    cfg, p = model.config, model.params
    out = {"token_embd.weight": p["token_embd"], "output_norm.weight": p["output_norm"]}
    for i, b in enumerate(p["blk"]):
        for name, w in b.items():
            if w.ndim == 2:
                w = w.T
                if name in ("attn_q", "attn_k"):
                    w = permute_qk(w, cfg.n_head if name == "attn_q" else cfg.n_kv_head)
            out[f"blk.{i}.{name}.weight"] = np.ascontiguousarray(w)
    return out


def tiny_llama(seed: int = 0, config: LlamaConfig = TINY_LLAMA):
    """A random Llama whose weights are large enough that logits differ clearly between tokens."""
    model = random_llama(config, seed=seed, scale=0.3)
    rng = np.random.default_rng(seed + 1)
    for key, a in model.state_dict().items():
        if a.ndim == 1:  # norms around 1
            a[...] = 1 + rng.standard_normal(a.shape, dtype=np.float32) * np.float32(0.1)
    return model


def write_tiny_gguf(path: Path, model=None, **metadata_changes) -> Path:
    model = model or tiny_llama()
    path.write_bytes(gguf_bytes(llama_metadata(model.config, **metadata_changes), llama_tensors(model)))
    return path


def mha(config: LlamaConfig) -> LlamaConfig:
    return replace(config, n_kv_head=config.n_head)
