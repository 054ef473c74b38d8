"""Reading ``.safetensors`` files: an 8-byte header length, a JSON header, then raw tensor bytes.

The JSON header maps every tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets into the
byte buffer after the header). Reading the header alone is cheap, so it is the quickest way to see what is in a
checkpoint. Tensors are read with the safetensors library's NumPy API; NumPy has no bfloat16, so BF16 tensors are
read from their bytes here and widened to float32 exactly (a bfloat16 is the top 16 bits of a float32).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from .errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the format's own limit on the JSON header
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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        try:
            begin, end = info["data_offsets"]
            shape = [int(s) for s in info["shape"]]
            dtype = info["dtype"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}") from None
        if not all(isinstance(o, int) and not isinstance(o, bool) for o in (begin, end)) or min(shape, default=0) < 0:
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: {info!r}")
        if not isinstance(dtype, str) or dtype not in ITEMSIZE:
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r}, which this package does not read "
                                  f"(it reads {', '.join(ITEMSIZE)})")
        if not 0 <= begin <= end <= data_bytes:
            raise CheckpointError(
                f"{path}: tensor {name!r} needs bytes [{begin}, {end}) but the file holds {data_bytes} "
                f"(truncated?)")
        needed = ITEMSIZE[dtype] * int(np.prod(shape, dtype=np.int64))
        if end - begin != needed:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes, but shape {shape} in {dtype} "
                                  f"needs {needed}")
        info["shape"] = shape
        info["dtype"] = dtype
    return header, 8 + n


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
    count = int(np.prod(info["shape"], dtype=np.int64))
    raw = np.fromfile(path, dtype="<u2", count=count, offset=data_start + begin)
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
