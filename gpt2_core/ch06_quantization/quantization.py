"""Chapter 6: quantization. The same model in fewer bytes: weights in fp16, int8 or int4, and what it costs in quality.

Batch-1 decode reads every weight once per token (chapter 2), so its speed is bytes read / memory bandwidth. A
quantized weight keeps the numbers in fewer bytes and a few float32 *scales* to bring them back:

* ``fp16``: each weight rounded to half precision, 2 bytes;
* ``int8``: per output channel, ``scale = max|w| / 127``, ``q = round(w / scale)`` in [-127, 127], 1 byte a weight
  plus one float32 scale per output (LLM.int8()'s "vector-wise" weights, without its outlier split);
* ``int4``: per output channel *and* per group of ``group_size`` inputs, ``scale = max|w| / 7``, ``q`` in [-8, 7],
  two values packed in a byte (``pack_int4``), plus a float32 scale a group (as GPTQ and AWQ store theirs,
  without their clever rounding).

Every format keeps its matrix **output-major**, ``[out, in]`` (PyTorch's ``nn.Linear`` layout, and the embedding
``wte``'s own [V, E]): one output channel's weights are contiguous, the order a kernel reads them in, and the
tied LM head needs no second copy. ``rows(index)`` turns output channels back into float32; ``dequantize()`` gives
the whole ``[in, out]`` matrix chapter 1 multiplies by.

The seam: a quantized weight sets ``__array_ufunc__ = None``, so NumPy hands chapter 1's ``x @ weight`` to its
``__rmatmul__``. Every chapter's code then runs unchanged on a quantized model (``quantize_model``): the
forward pass, the KV cache, the engine and the paged store. ``__rmatmul__`` with ``kernel="numpy"`` is the
definition and the oracle: dequantize, then BLAS — correct, and slower than fp32, because it reads the small
weights *and* writes and reads a float32 copy. ``kernel="numba"`` reads the small weights directly
(``quant_kernels``, the optional ``kernels`` extra): that is what turns fewer bytes into speed.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..errors import BAD_JSON, CheckpointError, InvalidInputError, is_integer
from ..loading.config import sampling_defaults
from ..loading.tokenizer import Tokenizer, tokenizer_for_directory
from ..loading.weights import DATA_DIR, GPT2Model, expected_shapes

FORMATS = ("fp32", "fp16", "int8", "int4")
KERNELS = ("numpy", "numba", "auto")
DEFAULT_GROUP_SIZE = 64
MATRICES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # each block's four matmul weights
HELDOUT_TEXT = DATA_DIR / "heldout" / "austen_validation.txt"  # built by data/build_heldout_text.py
HELDOUT_SEPARATOR = "\n<|endoftext|>\n"


# ----------------------------------------------------------------------------------------------------------------
# The formats: quantize one matrix, and bring its rows back


def quantize_int8(w):  # w [in, out] float32 -> q [out, in] int8, scale [out] float32
    """Symmetric per-output-channel int8: each output channel (a column of ``w``) gets the scale that maps its
    largest |weight| to 127."""
    wt = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)  # [out, in]: one output channel per row, in memory
    scale = np.abs(wt).max(axis=1) / np.float32(127)  # [out]
    scale[scale == 0] = 1  # an all-zero channel: any scale gives q = 0
    q = np.rint(wt / scale[:, None]).clip(-127, 127).astype(np.int8)  # [out, in]
    return q, scale.astype(np.float32)


def quantize_int4(w, group_size: int = DEFAULT_GROUP_SIZE):  # w [in, out] -> packed [out, in/2] uint8, scales [out, in/g]
    """Symmetric int4 per output channel and group of ``group_size`` consecutive inputs, two values a byte."""
    wt = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T)  # [out, in], output-major in memory
    out_features, in_features = wt.shape
    check_group_size(group_size, in_features)
    groups = wt.reshape(out_features, in_features // group_size, group_size)  # [out, G, g]
    scales = np.abs(groups).max(axis=2) / np.float32(7)  # [out, G]
    scales[scales == 0] = 1
    q = np.rint(groups / scales[:, :, None]).clip(-8, 7).astype(np.int8).reshape(out_features, in_features)
    return pack_int4(q, group_size), scales.astype(np.float32)


def pack_int4(q, group_size: int):  # q [out, in] int8 in [-8, 7] -> [out, in/2] uint8
    """Two values a byte, as llama.cpp's q4_0 packs them: in each group, byte t holds input t (low nibble) and
    input t + group_size/2 (high nibble), both stored as q + 8 in 0..15. Unpacking a group is then two contiguous
    runs of values, which a kernel's loop reads without shuffling."""
    out_features, in_features = q.shape
    u = (q + 8).astype(np.uint8).reshape(out_features, in_features // group_size, 2, group_size // 2)  # [out, G, 2, g/2]
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(out_features, in_features // 2)


def unpack_int4(packed, group_size: int):  # packed [n, in/2] uint8 -> q [n, in] int8 in [-8, 7]
    n, half = packed.shape
    p = packed.reshape(n, half * 2 // group_size, 1, group_size // 2)  # [n, G, 1, g/2]
    q = np.concatenate([p & 0x0F, p >> 4], axis=2).astype(np.int8)  # [n, G, 2, g/2]: low halves, then high halves
    return q.reshape(n, half * 2) - np.int8(8)


def check_group_size(group_size, in_features: int) -> None:
    if not is_integer(group_size, 2) or group_size % 2 or in_features % group_size:
        raise InvalidInputError(f"group_size must be an even integer >= 2 that divides the {in_features} inputs of "
                                f"the matrix, got {group_size!r}")


class QuantizedWeight:
    """A weight [in, out] kept output-major in fewer bytes. ``x @ weight`` runs ``__rmatmul__``."""

    __array_ufunc__ = None  # NumPy hands x @ self to self.__rmatmul__
    fmt: str
    shape: tuple[int, int]  # (in, out), as chapter 1 sees the weight
    kernel: str = "numpy"

    def rows(self, index) -> np.ndarray:  # output channels ``index`` -> float32 [n, in]
        raise NotImplementedError

    def dequantize(self) -> np.ndarray:  # -> [in, out] float32 (a transposed view of an [out, in] array)
        return self.rows(slice(None)).T

    def __rmatmul__(self, x):  # x [..., in] -> [..., out]
        x = np.asarray(x)
        if x.shape[-1:] != self.shape[:1]:
            raise InvalidInputError(f"x @ weight: x has shape {list(x.shape)}, the {self.fmt} weight is "
                                    f"{list(self.shape)} (in, out)")
        if self.kernel == "numba":
            from . import quant_kernels

            rows = np.ascontiguousarray(x.reshape(-1, self.shape[0]), dtype=np.float32)  # [N, in]
            return quant_kernels.matmul(rows, self).reshape(*x.shape[:-1], self.shape[1])
        return x @ self.dequantize()  # the definition: float32 weights back, then BLAS

    def __array__(self, dtype=None, copy=None):  # np.asarray(weight): the float32 values it stands for
        return np.asarray(self.dequantize(), dtype=dtype)

    def with_kernel(self, kernel: str) -> "QuantizedWeight":
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__, kernel=kernel)
        return other

    ndim = 2
    dtype = np.dtype(np.float32)  # what x @ weight computes in
    size = property(lambda self: self.shape[0] * self.shape[1])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.tensors().values())

    def tensors(self) -> dict[str, np.ndarray]:  # what a checkpoint stores: {suffix: array}
        raise NotImplementedError

    def __repr__(self):
        return f"{type(self).__name__}(shape={self.shape}, {self.nbytes:,} bytes, kernel={self.kernel!r})"


class Fp16Weight(QuantizedWeight):
    fmt = "fp16"

    def __init__(self, w):  # w [in, out]
        self.weight = np.ascontiguousarray(np.asarray(w, dtype=np.float32).T, dtype=np.float16)  # [out, in]
        self.shape = self.weight.shape[::-1]

    def rows(self, index):
        return self.weight[index].astype(np.float32)

    def tensors(self):
        return {"qweight": self.weight}


class Int8Weight(QuantizedWeight):
    fmt = "int8"

    def __init__(self, w):  # w [in, out]
        self.q, self.scale = quantize_int8(w)  # [out, in] int8, [out] float32
        self.shape = self.q.shape[::-1]

    def rows(self, index):
        return self.q[index] * self.scale[index, None]  # [n, in] float32

    def tensors(self):
        return {"qweight": self.q, "scales": self.scale}


class Int4Weight(QuantizedWeight):
    fmt = "int4"

    def __init__(self, w, group_size: int = DEFAULT_GROUP_SIZE):  # w [in, out]
        self.packed, self.scales = quantize_int4(w, group_size)  # [out, in/2] uint8, [out, in/group_size] float32
        self.group_size = int(group_size)
        self.shape = (self.packed.shape[1] * 2, self.packed.shape[0])

    def rows(self, index):
        packed, scales = self.packed[index], self.scales[index]  # [n, in/2], [n, G]
        q = unpack_int4(packed.reshape(-1, packed.shape[-1]), self.group_size)  # [n, in]
        n, G = len(q), scales.reshape(-1, scales.shape[-1]).shape[1]
        w = q.reshape(n, G, self.group_size) * scales.reshape(n, G, 1)  # [n, G, g] float32
        return w.reshape(packed.shape[:-1] + (self.shape[0],))  # [n, in] (or [in] for one row)

    def tensors(self):
        return {"qweight": self.packed, "scales": self.scales}


WEIGHT_CLASSES = {"fp16": Fp16Weight, "int8": Int8Weight, "int4": Int4Weight}


def quantize_weight(w, fmt: str, group_size: int = DEFAULT_GROUP_SIZE):
    """``w`` [in, out] in format ``fmt``; ``"fp32"`` returns it as it is."""
    check_format(fmt)
    if fmt == "fp32":
        return w
    return Int4Weight(w, group_size) if fmt == "int4" else WEIGHT_CLASSES[fmt](w)


class QuantizedEmbedding:
    """``wte`` [V, E] kept in a quantized format: rows by token id for the embedding, ``.T`` the tied LM head.

    One array serves both, because the format is output-major: wte's row ``v`` is the head's output channel ``v``.
    """

    __array_ufunc__ = None

    def __init__(self, head: QuantizedWeight):
        self.T = head  # the LM head [E, V]
        self.shape = head.shape[::-1]  # [V, E]

    def __getitem__(self, token_ids):  # [T] -> [T, E] float32
        return self.T.rows(token_ids)

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.T.rows(slice(None)), dtype=dtype)

    ndim, dtype = 2, np.dtype(np.float32)
    size = property(lambda self: self.T.size)
    nbytes = property(lambda self: self.T.nbytes)


def check_format(fmt) -> None:
    if fmt not in FORMATS:
        raise InvalidInputError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")


def resolve_kernel(kernel, fmt: str) -> str:
    """``"numpy"`` or ``"numba"`` for ``fmt``; ``"auto"`` takes numba where it is installed and has a kernel."""
    if kernel not in KERNELS:
        raise InvalidInputError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    from . import quant_kernels

    if kernel == "auto":
        return "numba" if fmt in quant_kernels.FORMATS and quant_kernels.numba_available() else "numpy"
    if kernel == "numba":
        if fmt not in quant_kernels.FORMATS:
            raise InvalidInputError(f"kernel='numba' has kernels for {', '.join(quant_kernels.FORMATS)}, not {fmt}; "
                                    f"use kernel='numpy'")
        quant_kernels.require_numba()
    return kernel


# ----------------------------------------------------------------------------------------------------------------
# A quantized model: chapter 1's GPT2Model whose params hold quantized weights


def quantize_model(model: GPT2Model, fmt: str = "int8", group_size: int = DEFAULT_GROUP_SIZE,
                   kernel: str = "numpy", embeddings: bool = False) -> GPT2Model:
    """``model`` with each block's four matmul weights in ``fmt``; biases, layer norms and ``wpe`` stay float32.

    ``embeddings``: quantize ``wte`` too (the embedding and the tied LM head, one array; for GPT-2 124M, 31% of
    the weights a decode step reads). ``kernel``: ``"numpy"`` (dequantize, then BLAS: the definition),
    ``"numba"`` (``quant_kernels``; needs the ``kernels`` extra) or ``"auto"`` (numba when it is installed).
    """
    check_format(fmt)
    if not isinstance(model, GPT2Model):
        raise InvalidInputError(f"quantize_model takes a GPT2Model, got {type(model).__name__}")
    if not isinstance(embeddings, bool):
        raise InvalidInputError(f"embeddings must be True or False, got {embeddings!r}")
    if fmt == "int4":
        E = model.config.n_embd
        check_group_size(group_size, E)  # every matrix's inputs are E or 4E
    kernel = resolve_kernel(kernel, fmt) if fmt != "fp32" else "numpy"

    def q(w):
        w = np.asarray(w, dtype=np.float32)  # a quantized weight given here is requantized from its values
        return quantize_weight(w, fmt, group_size).with_kernel(kernel) if fmt != "fp32" else w

    params = dict(model.params)
    if embeddings and fmt != "fp32":
        params["wte"] = QuantizedEmbedding(q(np.asarray(model.params["wte"], dtype=np.float32).T))
    params["h"] = []
    for p in model.params["h"]:
        p = {**p, "attn": dict(p["attn"]), "mlp": dict(p["mlp"])}
        for key in MATRICES:
            module, name = key.split(".")
            p[module][name] = {**p[module][name], "weight": q(p[module][name]["weight"])}
        params["h"].append(p)
    return replace(model, params=params, source=f"{model.source} ({fmt}{' + wte' if embeddings else ''})")


def with_kernel(model: GPT2Model, kernel: str) -> GPT2Model:
    """The same quantized weights (shared, not copied) multiplied by another kernel."""
    def swap(w):
        return w.with_kernel(resolve_kernel(kernel, w.fmt)) if isinstance(w, QuantizedWeight) else w

    params = dict(model.params)
    if isinstance(params["wte"], QuantizedEmbedding):
        params["wte"] = QuantizedEmbedding(swap(params["wte"].T))
    params["h"] = [{**p, **{m: {n: {**layer, "weight": swap(layer["weight"])} for n, layer in p[m].items()}
                            for m in ("attn", "mlp")}} for p in model.params["h"]]
    return replace(model, params=params)


def model_format(model: GPT2Model) -> dict:
    """``{"format", "group_size", "embeddings", "kernel"}`` of a model ``quantize_model`` made (fp32 for others)."""
    w = model.params["h"][0]["attn"]["c_attn"]["weight"]
    if not isinstance(w, QuantizedWeight):
        return {"format": "fp32", "group_size": None, "embeddings": False, "kernel": "numpy"}
    return {"format": w.fmt, "group_size": getattr(w, "group_size", None),
            "embeddings": isinstance(model.params["wte"], QuantizedEmbedding), "kernel": w.kernel}


def weight_bytes(model: GPT2Model) -> int:
    """Bytes of every parameter, as stored (quantized ones with their scales)."""
    return model.nbytes()


def bytes_per_token(model: GPT2Model) -> int:
    """Bytes of weights one batch-1 decode step reads: every block's matrices and biases, the layer norms, the
    whole LM head (``wte``), and one row of ``wte`` and of ``wpe``."""
    c = model.config
    wte, wpe = model.params["wte"], model.params["wpe"]
    return model.nbytes() - wpe.nbytes + wpe.nbytes // c.n_positions + wte.nbytes // c.vocab_size


# ----------------------------------------------------------------------------------------------------------------
# Quantized checkpoints: config.json, quantization_config.json, quantized.safetensors (+ the tokenizer files)

QUANTIZED_FILE = "quantized.safetensors"
QUANT_CONFIG_FILE = "quantization_config.json"


def save_quantized(model: GPT2Model, directory) -> Path:
    """Write ``model`` (made by ``quantize_model``) to ``directory``; ``load_quantized`` reads it back.

    Each quantized matrix ``K`` is stored as ``K.qweight`` (its [out, in] integers or halves) and ``K.scales``.
    """
    from safetensors.numpy import save_file

    fmt = model_format(model)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for key, value in model.state_dict().items():
        w = value.T if isinstance(value, QuantizedEmbedding) else value
        if isinstance(w, QuantizedWeight):
            tensors.update({f"{key}.{suffix}": np.ascontiguousarray(a) for suffix, a in w.tensors().items()})
        else:
            tensors[key] = np.ascontiguousarray(value)
    save_file(tensors, str(directory / QUANTIZED_FILE))
    (directory / "config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    (directory / QUANT_CONFIG_FILE).write_text(json.dumps(
        {"format": fmt["format"], "group_size": fmt["group_size"], "embeddings": fmt["embeddings"],
         "generation_config": {"do_sample": model.sampling_defaults["temperature"] > 0, **model.sampling_defaults}},
        indent=2))
    if isinstance(model.tokenizer, Tokenizer):
        model.tokenizer.hf.save(str(directory / "tokenizer.json"))
    return directory


def load_quantized(directory, kernel: str = "numpy") -> GPT2Model:
    """A model ``save_quantized`` wrote. A missing or misshapen tensor, a missing scale, a group size that does
    not fit the matrices: a ``CheckpointError`` naming the file and tensor."""
    from ..loading.config import GPT2Config
    from ..loading.safetensors_io import load_safetensors
    from ..loading.weights import nest_params

    directory = Path(directory)
    config = GPT2Config.from_json(directory / "config.json")
    fmt, group_size, embeddings, sampling = _read_quant_config(directory / QUANT_CONFIG_FILE, config)
    kernel = resolve_kernel(kernel, fmt)
    path = directory / QUANTIZED_FILE
    tensors = load_safetensors(path)
    shapes = expected_shapes(config)
    quantized = {k for k in shapes if k.endswith(".weight") and any(f".{m}." in k for m in MATRICES)}
    if embeddings:
        quantized.add("wte.weight")
    flat = {}
    for key, shape in shapes.items():
        if key in quantized:
            flat[key] = _read_quantized(tensors, key, shape, fmt, group_size, path).with_kernel(kernel)
        else:
            a = _take(tensors, key, path)
            if a.dtype != np.float32 or a.shape != shape:
                raise CheckpointError(f"{path}: tensor {key!r} is {a.dtype} {list(a.shape)}, expected float32 "
                                      f"{list(shape)}")
            flat[key] = a
    if tensors:
        raise CheckpointError(f"{path}: unexpected tensor {sorted(tensors)[0]!r} (not part of a {fmt} GPT-2 with "
                              f"n_layer={config.n_layer})")
    if embeddings:
        flat["wte.weight"] = QuantizedEmbedding(flat["wte.weight"])
    return GPT2Model(config, nest_params(flat, config.n_layer), tokenizer_for_directory(directory), source=str(path),
                     sampling_defaults=sampling)


def _read_quant_config(qfile: Path, config) -> tuple:
    """(format, group_size, embeddings, sampling defaults) from ``quantization_config.json``, checked."""
    try:
        qconfig = json.loads(qfile.read_text())
        fmt, group_size, embeddings = qconfig["format"], qconfig.get("group_size"), qconfig.get("embeddings", False)
        sampling = sampling_defaults(qconfig.get("generation_config") or {})
    except FileNotFoundError:
        raise CheckpointError(f"{qfile}: not found (a quantized checkpoint needs it)") from None
    except (*BAD_JSON, OSError, KeyError, TypeError, AttributeError, InvalidInputError) as e:
        raise CheckpointError(f"{qfile}: not a valid quantization config ({type(e).__name__}: {e})") from None
    if fmt not in FORMATS[1:]:
        raise CheckpointError(f"{qfile}: format must be one of {', '.join(FORMATS[1:])}, got {fmt!r}")
    if not isinstance(embeddings, bool):
        raise CheckpointError(f"{qfile}: embeddings must be true or false, got {embeddings!r}")
    if fmt == "int4":
        try:
            check_group_size(group_size, config.n_embd)
        except InvalidInputError:
            raise CheckpointError(f"{qfile}: group_size {group_size!r} does not fit n_embd={config.n_embd} (an even "
                                  f"integer that divides it)") from None
    return fmt, group_size, embeddings, sampling


def _take(tensors, name, path):
    if name not in tensors:
        raise CheckpointError(f"{path}: missing tensor {name!r}")
    return tensors.pop(name)


def _read_quantized(tensors, key, shape, fmt, group_size, path) -> QuantizedWeight:
    """One quantized matrix of logical shape ``shape`` ([in, out]; wte's [V, E] is the head's [E, V])."""
    in_f, out_f = (shape[1], shape[0]) if key == "wte.weight" else shape
    qname, sname = f"{key}.qweight", f"{key}.scales"
    want = {"fp16": ((out_f, in_f), np.float16, None), "int8": ((out_f, in_f), np.int8, (out_f,)),
            "int4": ((out_f, in_f // 2), np.uint8, (out_f, in_f // (group_size or 1)))}[fmt]
    q = _take(tensors, qname, path)
    if q.dtype != want[1] or q.shape != want[0]:
        raise CheckpointError(f"{path}: tensor {qname!r} is {q.dtype} {list(q.shape)}, expected "
                              f"{np.dtype(want[1])} {list(want[0])} for {fmt}")
    w = object.__new__(WEIGHT_CLASSES[fmt])
    w.shape = (in_f, out_f)
    if fmt == "fp16":
        w.weight = q
        return w
    if sname not in tensors:
        raise CheckpointError(f"{path}: missing scales {sname!r} of the {fmt} weight {key!r}")
    s = tensors.pop(sname)
    if s.dtype != np.float32 or s.shape != want[2]:
        extra = f" (group_size {group_size} in {QUANT_CONFIG_FILE})" if fmt == "int4" else ""
        raise CheckpointError(f"{path}: scales {sname!r} are {s.dtype} {list(s.shape)}, expected float32 "
                              f"{list(want[2])}{extra}")
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise CheckpointError(f"{path}: scales {sname!r} must be finite and positive")
    if fmt == "int8":
        w.q, w.scale = q, s
    else:
        w.packed, w.scales, w.group_size = q, s, int(group_size)
    return w


# ----------------------------------------------------------------------------------------------------------------
# Quality, measured


def heldout_token_ids(tokenizer, path=HELDOUT_TEXT) -> np.ndarray:
    """The held-out chapters as one token stream, each chapter followed by ``<|endoftext|>``: the stream
    ``data/build_embedded_model.py`` validated the embedded model on (it never trained on these chapters)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read the held-out text ({type(e).__name__}); rebuild it with "
                              f"data/build_heldout_text.py") from None
    eot = tokenizer.eos_token_id
    ids = []
    for doc in text.split(HELDOUT_SEPARATOR):
        ids.extend(tokenizer.encode(doc))
        ids.append(eot)
    return np.asarray(ids, dtype=np.int64)


def perplexity(model: GPT2Model, token_ids, max_windows: int | None = None) -> dict:
    """exp(mean next-token cross-entropy) over non-overlapping windows of ``n_positions`` tokens (each predicting
    the token after each of its positions), as the embedded model's training script evaluated it.
    ``max_windows``: only the first windows (quick runs)."""
    from ..ch01_forward.model import forward

    ids = np.asarray(token_ids, dtype=np.int64)
    T = model.config.n_positions
    starts = list(range(0, len(ids) - T - 1, T))[:max_windows]
    if not starts:
        raise InvalidInputError(f"perplexity needs more than {T + 1} tokens, got {len(ids)}")
    total = 0.0
    for s in starts:
        logits = forward(model, ids[s:s + T]).astype(np.float64)  # [T, V]
        targets = ids[s + 1:s + 1 + T]  # [T]
        m = logits.max(axis=1, keepdims=True)
        logsumexp = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))  # [T]
        total += float((logsumexp - logits[np.arange(T), targets]).sum())
    loss = total / (len(starts) * T)
    return {"loss": loss, "perplexity": float(np.exp(loss)), "tokens": len(starts) * T, "windows": len(starts)}


def logit_error(reference: GPT2Model, model: GPT2Model, token_ids) -> dict:
    """Logits of ``model`` against ``reference`` on the same tokens: max and mean |difference|, the reference's
    logit spread (std) for scale, and how often the top-1 token agrees."""
    from ..ch01_forward.model import forward

    a, b = forward(reference, token_ids), forward(model, token_ids)  # [T, V] each
    diff = np.abs(a - b)
    return {"max_abs_diff": float(diff.max()), "mean_abs_diff": float(diff.mean()),
            "reference_logit_std": float(a.std()),
            "top1_agreement": float((a.argmax(axis=1) == b.argmax(axis=1)).mean())}


def greedy_agreement(reference_tokens, tokens) -> dict:
    """Two greedy continuations compared: tokens equal before the first divergence, and equal positions overall."""
    a, b = list(reference_tokens), list(tokens)
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return {"tokens": n, "same_before_divergence": first,
            "same_positions": sum(x == y for x, y in zip(a, b)) / max(1, n)}


__all__ = ["FORMATS", "QuantizedWeight", "Fp16Weight", "Int8Weight", "Int4Weight", "QuantizedEmbedding",
           "quantize_int8", "quantize_int4", "pack_int4", "unpack_int4", "quantize_weight", "quantize_model",
           "with_kernel", "model_format", "weight_bytes", "bytes_per_token", "save_quantized", "load_quantized",
           "heldout_token_ids", "perplexity", "logit_error", "greedy_agreement"]
