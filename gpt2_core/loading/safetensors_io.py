"""Reading ``.safetensors`` files: an 8-byte header length, a JSON header, then raw tensor bytes.

The JSON header maps every tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
byte buffer after the header). Reading the header alone is cheap, so it is the quickest way to see what is in a
checkpoint. Tensors are read with the safetensors library's NumPy API; NumPy has no bfloat16, so BF16 tensors are
read from their bytes here and widened to float32 exactly (a bfloat16 is the top 16 bits of a float32).
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
from pathlib import Path

import numpy as np

from ..errors import BAD_JSON, CheckpointError, is_integer

MAX_HEADER_BYTES = 100_000_000  # the format's own limit on the JSON header
MAX_DIMS = 64  # NumPy's limit on an array's dimensions
# Bytes per element of the dtypes this package reads (GPT-2 checkpoints are F32, F16 or BF16; integer tensors,
# such as an old checkpoint's attention-mask buffers, are read and then reported by the loader by name).
ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_safetensors_header(path: str | Path) -> dict[str, dict]:
    """Return ``{name: {"dtype", "shape", "data_offsets"}}`` for every tensor in the file (metadata dropped)."""
    return _read_header(Path(path))[0]


def _read_header(path: Path) -> tuple[dict[str, dict], int]:
    """The header and the file offset where tensor bytes start (8 + header length)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: corrupt safetensors header (claims {n} bytes, file has {size})")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except OSError as e:  # a directory, no permission
        raise CheckpointError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    except BAD_JSON as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        short = _short(name)  # a hostile file's name or entry may be megabytes long: messages show the start
        try:
            begin, end = info["data_offsets"]
            shape, dtype = info["shape"], info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {short}: {_short(info)}") from None
        if not all(is_integer(o, 0) for o in (begin, end)):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {short} (data_offsets must be two whole "
                                  f"numbers >= 0): {_short(info)}")
        # each dimension a whole number (not 1e300, Infinity or true); the size is then exact, in Python ints
        if not (isinstance(shape, list) and len(shape) <= MAX_DIMS and all(is_integer(n, 0) for n in shape)):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {short} (shape must be a list of at most "
                                  f"{MAX_DIMS} whole numbers >= 0): {_short(info)}")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {short} has dtype {_short(dtype)}, which this package does not "
                                  f"read (it reads {', '.join(ITEMSIZE)})")
        if not begin <= end <= data_bytes:
            raise CheckpointError(
                f"{path}: tensor {short} needs bytes [{_short(begin)}, {_short(end)}) but the file holds "
                f"{data_bytes} (truncated?)")
        needed = ITEMSIZE[dtype] * math.prod(shape)
        if end - begin != needed:
            raise CheckpointError(f"{path}: tensor {short} has {end - begin} bytes, but shape {_short(shape)} in "
                                  f"{dtype} needs {_short(needed)}")
        info["shape"] = shape
        info["dtype"] = dtype
    return header, 8 + n


_repr = reprlib.Repr()
_repr.maxstring = _repr.maxother = 200  # tensor names are shorter; maxlist (6) and maxlong (40) stay as they are


def _short(value) -> str:
    """``repr(value)`` cut to a few hundred characters at most (reprlib shortens long strings, lists and ints)."""
    return _repr.repr(value)


def load_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a ``.safetensors`` file as a NumPy array (BF16 widened to float32)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    header, data_start = _read_header(path)
    tensors: dict[str, np.ndarray] = {}
    try:
        with safe_open(str(path), framework="np") as f:
            for name, info in header.items():
                if info["dtype"] == "BF16":
                    tensors[name] = _read_bf16(path, data_start, name, info)
                else:
                    tensors[name] = f.get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{path}: cannot read safetensors file ({e})") from None
    except TypeError as e:  # a dtype NumPy cannot represent
        raise CheckpointError(f"{path}: unsupported dtype in safetensors file ({e})") from None
    return tensors


def _read_bf16(path: Path, data_start: int, name: str, info: dict) -> np.ndarray:
    begin, _ = info["data_offsets"]  # the size was checked against the shape in _read_header
    count = math.prod(info["shape"])
    raw = np.fromfile(path, dtype="<u2", count=count, offset=data_start + begin)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
