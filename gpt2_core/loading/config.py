"""GPT-2 hyper-parameters: the handful of numbers in an HF ``config.json`` that fix every tensor's shape."""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from ..errors import BAD_JSON, CheckpointError, InvalidInputError, check_sampling, is_integer, is_real


# transformers' names for GPT-2's tanh approximation of GELU: the same formula, 0.5 x (1 + tanh(sqrt(2/pi) (x +
# 0.044715 x^3))), written in different ways (``transformers.activations``); "gelu" (the exact erf form) is not it.
TANH_GELU_NAMES = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_accurate", "gelu_python_tanh")


@dataclass(frozen=True)
class GPT2Config:
    architecture: ClassVar[str] = "gpt2"  # which model step runs it (chapter 3's ``MODEL_STEPS``)
    vocab_size: int = 50257  # rows of the token embedding (and of the tied LM head)
    n_positions: int = 1024  # context length n_ctx: rows of the position embedding
    n_embd: int = 768  # width of the residual stream
    n_head: int = 12  # attention heads; head_dim = n_embd // n_head
    n_layer: int = 12  # transformer blocks
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = None  # <|endoftext|> (50256 in GPT-2); generation stops here

    def __post_init__(self):
        for name in ("vocab_size", "n_positions", "n_embd", "n_head", "n_layer"):
            value = getattr(self, name)
            if not is_integer(value, 1):
                raise CheckpointError(f"config: {name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # np.int64 -> int: the config is written back as JSON
        if self.n_embd % self.n_head:
            raise CheckpointError(f"config: n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        eps = self.layer_norm_epsilon
        if not is_real(eps) or eps <= 0:
            raise CheckpointError(f"config: layer_norm_epsilon must be a finite number > 0, got {eps!r}")
        object.__setattr__(self, "layer_norm_epsilon", float(eps))
        eos = self.eos_token_id
        if eos is not None and not is_integer(eos, 0, self.vocab_size - 1):
            raise CheckpointError(f"config: eos_token_id must be a token id in [0, vocab_size={self.vocab_size}), "
                                  f"got {eos!r}")
        if eos is not None:
            object.__setattr__(self, "eos_token_id", int(eos))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_kv_head(self) -> int:
        """Heads that keep K and V: all of them in GPT-2 (multi-head attention). The KV stores size themselves by
        it; a model with grouped-query attention (chapter 9) keeps fewer."""
        return self.n_head

    @property
    def n_ctx(self) -> int:
        return self.n_positions

    def num_parameters(self) -> int:
        """Parameters with the LM head tied to ``wte`` (counted once), as HF reports them."""
        E, V, P, L = self.n_embd, self.vocab_size, self.n_positions, self.n_layer
        per_block = 2 * 2 * E + (E * 3 * E + 3 * E) + (E * E + E) + (E * 4 * E + 4 * E) + (4 * E * E + E)
        return V * E + P * E + L * per_block + 2 * E

    @classmethod
    def from_dict(cls, d: dict) -> "GPT2Config":
        """Read the GPT-2 fields of an HF config dict. Fields that would change the forward pass (another activation,
        MLP width or attention scaling) are refused with their name; other keys are ignored."""
        missing = [k for k in ("vocab_size", "n_embd", "n_head", "n_layer") if k not in d]
        if missing:
            raise CheckpointError(f"config.json: missing {', '.join(missing)}")
        if d.get("model_type", "gpt2") != "gpt2":
            raise CheckpointError(f"config.json: model_type is {d['model_type']!r}, expected 'gpt2'")
        if d.get("activation_function", "gelu_new") not in TANH_GELU_NAMES:
            raise CheckpointError(
                f"config.json: activation_function {d['activation_function']!r} is not GPT-2's tanh GELU")
        # variants of GPT-2's attention this package does not implement: refused, never silently ignored
        for key, gpt2_value in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if d.get(key, gpt2_value) != gpt2_value:
                raise CheckpointError(f"config.json: {key}={d[key]!r} is not supported (GPT-2 uses {gpt2_value})")
        vocab_size = d["vocab_size"]
        eos = d.get("eos_token_id")
        if eos is None and isinstance(vocab_size, int) and vocab_size > 50256:
            eos = 50256  # GPT-2's <|endoftext|>
        if isinstance(eos, list):  # HF allows several end-of-sequence ids; generation stops at the first that is
            inside = [e for e in eos if is_integer(e) and is_integer(vocab_size, 1) and 0 <= e < vocab_size]  # a token
            eos = inside[0] if inside else (eos[0] if eos else None)
        if eos is not None and is_integer(vocab_size, 1) and is_integer(eos) and not 0 <= eos < vocab_size:
            # transformers' GPT2Config() sets eos_token_id = 50256 whatever the vocabulary: a small GPT-2 saved with
            # it has an end-of-text id that can never be sampled. It loads; generation just has no token to stop at.
            warnings.warn(f"config.json: eos_token_id={eos} is outside the vocabulary (vocab_size={vocab_size}): no "
                          f"token can end generation early; max_new_tokens decides the length", stacklevel=3)
            eos = None
        config = cls(
            vocab_size=vocab_size,
            n_positions=d.get("n_positions", d.get("n_ctx", 1024)),
            n_embd=d["n_embd"],
            n_head=d["n_head"],
            n_layer=d["n_layer"],
            layer_norm_epsilon=d.get("layer_norm_epsilon", 1e-5),
            eos_token_id=eos,
        )
        # the MLP's hidden width: null means 4 * n_embd, the only width this package builds (checked once n_embd is)
        n_inner = d.get("n_inner")
        if n_inner is not None and not (is_integer(n_inner) and n_inner == 4 * config.n_embd):
            raise CheckpointError(f"config.json: n_inner={n_inner!r} is not supported (GPT-2's MLP is "
                                  f"4 * n_embd = {4 * config.n_embd} wide)")
        return config

    @classmethod
    def from_json(cls, path: str | Path) -> "GPT2Config":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: config.json not found") from None
        except OSError as e:  # a directory, no permission
            raise CheckpointError(f"{path}: cannot read config.json ({type(e).__name__}: {e})") from None
        except BAD_JSON as e:
            raise CheckpointError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_dict(d)

    def to_dict(self) -> dict:
        return asdict(self)


# The released checkpoints (https://huggingface.co/openai-community/*, distilbert/distilgpt2).
PRESETS: dict[str, GPT2Config] = {
    "gpt2": GPT2Config(n_embd=768, n_head=12, n_layer=12, eos_token_id=50256),
    "gpt2-medium": GPT2Config(n_embd=1024, n_head=16, n_layer=24, eos_token_id=50256),
    "gpt2-large": GPT2Config(n_embd=1280, n_head=20, n_layer=36, eos_token_id=50256),
    "gpt2-xl": GPT2Config(n_embd=1600, n_head=25, n_layer=48, eos_token_id=50256),
    "distilgpt2": GPT2Config(n_embd=768, n_head=12, n_layer=6, eos_token_id=50256),
}

# Hub repository of each preset (the short names are aliases on the hub too).
HUB_REPOS: dict[str, str] = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}


def preset(name: str) -> GPT2Config:
    key = name.split("/")[-1]
    if key not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return PRESETS[key]


HF_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50, "top_p": 1.0}  # transformers' GenerationConfig


def sampling_defaults(generation_config: dict) -> dict:
    """``generate``'s ``temperature``, ``top_k`` and ``top_p`` from HF generation settings (a model's
    ``generation_config.json``): greedy unless ``do_sample`` is true; then the settings given, and HF's defaults
    (temperature 1, top_k 50, top_p 1) for those not given or null. Checked as ``SamplingParams`` checks them."""
    do_sample = generation_config.get("do_sample")
    if not (do_sample is None or isinstance(do_sample, bool)):
        raise InvalidInputError(f"do_sample must be true or false, got {do_sample!r}")
    if not do_sample:
        return {"temperature": 0.0, "top_k": None, "top_p": None}
    given = {name: value for name, value in generation_config.items() if value is not None}  # null: not set
    chosen = {name: given.get(name, default) for name, default in HF_SAMPLING_DEFAULTS.items()}
    temperature, top_k, top_p, _ = check_sampling(chosen["temperature"], chosen["top_k"], chosen["top_p"])
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p}


def read_json_object(file: Path) -> dict:
    """The JSON object in ``file``, an optional file of a checkpoint folder (``tokenizer_config.json``,
    ``generation_config.json``): ``{}`` when the folder has none, a ``CheckpointError`` naming the file when it is
    not a JSON object."""
    if not file.is_file():
        return {}
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, *BAD_JSON) as e:
        raise CheckpointError(f"{file}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value
