"""GGUF, llama.cpp's one-file checkpoint, read with NumPy: metadata, tensor table, and tensors as float32.

A GGUF file (version 2 or 3, little-endian) is, in order:

* ``b"GGUF"``, ``uint32`` version, ``uint64`` tensor count, ``uint64`` metadata count;
* the metadata, each ``string key, uint32 type, value``: the config (``llama.block_count``, ...), the tokenizer
  (``tokenizer.ggml.tokens``, ``.merges``) and the chat template. A string is a ``uint64`` length and UTF-8 bytes;
  an array is a ``uint32`` element type, a ``uint64`` count and the elements;
* the tensor table, each ``string name, uint32 n_dims, uint64 dims[n_dims], uint32 ggml type, uint64 offset``;
* padding to ``general.alignment`` (32), then the tensor data, each tensor at its offset from there.

``dims`` are ggml's ``ne``: ``dims[0]`` varies fastest, so a matrix of ``out`` rows of ``in`` numbers has dims
``(in, out)`` and NumPy shape ``(out, in)`` (PyTorch's ``nn.Linear`` layout). Quantized types store each row in
blocks of 32 numbers: Q8_0 is chapter 6's int8 with one fp16 scale per block of 32 (not per row); Q4_1 is its
int4 with a scale *and a minimum* per block (``w = d * q + m``, q in 0..15), Q4_0 without the minimum
(``w = d * (q - 8)``). ``dequantize`` turns them into float32.

A hostile file gets what a hostile safetensors file gets: every length, count and shape is checked against the
bytes that remain before anything is allocated or looped over, so a bad file costs at most a pass over its own
bytes, and fails with a ``CheckpointError`` naming the file and the tensor or key.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from .memory import available_memory_bytes

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16  # llama.cpp's keys are short names; a longer one is a broken file
STRING, ARRAY = 8, 9
SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8",
           12: "<f8"}  # metadata value type -> NumPy dtype (7 is a bool, one byte)
BOOL = 7

# ggml tensor types this reader knows: id -> (name, numbers per block, bytes per block)
TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
         30: ("BF16", 1, 2)}


@dataclass(frozen=True)
class TensorInfo:
    """One row of the tensor table: ``shape`` in NumPy order (``dims`` reversed), where its bytes lie in the file."""

    name: str
    shape: tuple[int, ...]
    type_name: str
    start: int  # absolute file offset of its first byte
    nbytes: int

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class _Cursor:
    """Reads the header of ``buf`` front to back; running out of bytes is a ``CheckpointError`` naming ``what``."""

    def __init__(self, buf, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def left(self) -> int:
        return len(self.buf) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.left():
            raise CheckpointError(f"{self.path}: the file ends inside {what} (it needs {n:,} more bytes, "
                                  f"{self.left():,} remain): truncated or corrupt")
        self.pos += n
        return self.buf[self.pos - n:self.pos]

    def number(self, dtype: str, what: str):
        size = np.dtype(dtype).itemsize
        return np.frombuffer(self.take(size, what), dtype=dtype)[0].item()

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.number("<u8", f"the length of {what}")
        if limit is not None and n > limit:
            raise CheckpointError(f"{self.path}: {what} is {n:,} bytes long (at most {limit:,} expected): corrupt")
        try:
            return bytes(self.take(n, what)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise CheckpointError(f"{self.path}: {what} is not UTF-8 text ({e.reason})") from None


def read_value(cur: _Cursor, vtype: int, key: str):
    """One metadata value of type ``vtype``: a number, a bool, a string, or a list of one of those."""
    if vtype in SCALARS:
        value = cur.number(SCALARS[vtype], f"the value of {key!r}")
        return bool(value) if vtype == BOOL else value
    if vtype == STRING:
        return cur.string(f"the value of {key!r}")
    if vtype != ARRAY:
        raise CheckpointError(f"{cur.path}: metadata {key!r} has unknown value type {vtype}")
    etype = cur.number("<u4", f"the element type of {key!r}")
    count = cur.number("<u8", f"the length of {key!r}")
    if etype in SCALARS:  # one read and one frombuffer, whatever the count
        raw = cur.take(count * np.dtype(SCALARS[etype]).itemsize, f"the {count:,} elements of {key!r}")
        values = np.frombuffer(raw, dtype=SCALARS[etype])
        return (values != 0).tolist() if etype == BOOL else values.tolist()
    if etype != STRING:
        raise CheckpointError(f"{cur.path}: metadata {key!r} is an array of type {etype} (nested arrays are not "
                              f"supported)")
    if count * 8 > cur.left():  # each string takes at least its 8-byte length: checked before the loop
        raise CheckpointError(f"{cur.path}: metadata {key!r} claims {count:,} strings, more than the "
                              f"{cur.left():,} bytes left can hold: truncated or corrupt")
    return [cur.string(f"string {i} of {key!r}") for i in range(count)]


def read_header(cur: _Cursor) -> tuple[int, int, int]:
    """(version, tensor count, metadata count), each checked."""
    magic = bytes(cur.take(4, "the magic number"))
    if magic != MAGIC:
        raise CheckpointError(f"{cur.path}: not a GGUF file (it starts with {magic!r}, not {MAGIC!r})")
    version = cur.number("<u4", "the version")
    if version not in VERSIONS:
        raise CheckpointError(f"{cur.path}: GGUF version {version} is not supported (versions {VERSIONS})")
    n_tensors, n_kv = cur.number("<u8", "the tensor count"), cur.number("<u8", "the metadata count")
    # the smallest possible entries: a tensor row is >= 8 + 4 + 8 + 4 + 8 bytes, a metadata entry >= 8 + 4 + 1
    if n_tensors * 32 + n_kv * 13 > cur.left():
        raise CheckpointError(f"{cur.path}: the header claims {n_tensors:,} tensors and {n_kv:,} metadata entries, "
                              f"more than the file's {len(cur.buf):,} bytes can hold: truncated or corrupt")
    return version, n_tensors, n_kv


def read_tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], int, int]:
    """(name, NumPy shape, ggml type id, offset in the data section) of the next tensor table row."""
    name = cur.string("a tensor name", limit=MAX_KEY_BYTES)
    n_dims = cur.number("<u4", f"the number of dimensions of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise CheckpointError(f"{cur.path}: tensor {name!r} has {n_dims} dimensions (1 to {MAX_DIMS} allowed)")
    dims = np.frombuffer(cur.take(8 * n_dims, f"the shape of tensor {name!r}"), dtype="<u8")
    type_id = cur.number("<u4", f"the type of tensor {name!r}")
    offset = cur.number("<u8", f"the offset of tensor {name!r}")
    return name, tuple(int(d) for d in dims[::-1]), type_id, offset


def check_tensor(path: Path, name: str, shape, type_id: int, start: int, file_size: int) -> TensorInfo:
    """The tensor's place in the file, after checking its type, its shape against the type's blocks, and that its
    bytes lie inside the file (which bounds its size before anything is allocated)."""
    if type_id not in TYPES:
        known = ", ".join(n for n, _, _ in TYPES.values())
        raise CheckpointError(f"{path}: tensor {name!r} has ggml type {type_id}, which this reader does not "
                              f"dequantize (it reads {known})")
    type_name, block, block_bytes = TYPES[type_id]
    if min(shape) < 1:
        raise CheckpointError(f"{path}: tensor {name!r} has impossible shape {list(shape)}")
    if shape[-1] % block:
        raise CheckpointError(f"{path}: tensor {name!r} ({type_name}) has rows of {shape[-1]} numbers, not a "
                              f"multiple of its block of {block}")
    size = int(np.prod(shape, dtype=object))  # Python ints: no overflow for a hostile shape
    nbytes = size // block * block_bytes
    if start + nbytes > file_size:
        raise CheckpointError(f"{path}: tensor {name!r} ({list(shape)}, {type_name}) needs bytes {start:,} to "
                              f"{start + nbytes:,}, past the end of the file ({file_size:,} bytes): truncated?")
    return TensorInfo(name, tuple(shape), type_name, start, nbytes)


class GGUFFile:
    """An open GGUF file: ``metadata`` (dict), ``tensors`` (name -> ``TensorInfo``), and ``read(name)`` -> float32.

    The file is memory-mapped: reading the header touches only the header's pages, and a tensor's bytes are read
    when it is dequantized. Use it as a context manager, or call ``close()``.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                if size < 24:
                    raise CheckpointError(f"{self.path}: {size} bytes is too short for a GGUF header: truncated")
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot read ({type(e).__name__}: {e})") from None
        try:
            self._read(memoryview(self._map))
        except BaseException:
            self.close()
            raise

    def _read(self, buf) -> None:
        cur = _Cursor(buf, self.path)
        self.version, n_tensors, n_kv = read_header(cur)
        self.metadata: dict = {}
        for _ in range(n_kv):
            key = cur.string("a metadata key", limit=MAX_KEY_BYTES)
            if key in self.metadata:
                raise CheckpointError(f"{self.path}: metadata key {key!r} appears twice")
            self.metadata[key] = read_value(cur, cur.number("<u4", f"the type of {key!r}"), key)
        rows = [read_tensor_info(cur) for _ in range(n_tensors)]
        alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or not 1 <= alignment <= 1 << 16 or alignment & (alignment - 1):
            raise CheckpointError(f"{self.path}: general.alignment must be a power of two, got {alignment!r}")
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, offset in rows:
            if name in self.tensors:
                raise CheckpointError(f"{self.path}: tensor {name!r} appears twice")
            if offset % alignment:
                raise CheckpointError(f"{self.path}: tensor {name!r} starts at offset {offset}, not a multiple of "
                                      f"the alignment {alignment}")
            self.tensors[name] = check_tensor(self.path, name, shape, type_id, data_start + offset, len(buf))

    def raw(self, name: str) -> np.ndarray:
        """The bytes of tensor ``name`` as stored, [rows, bytes per row] uint8 (a view of the mapped file)."""
        info = self.tensors[name]
        rows = info.size // info.shape[-1]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start).reshape(rows, -1)

    def read(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a float32 array of its shape (a new array: the file can be closed afterwards)."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        info = self.tensors[name]
        out = dequantize(self.raw(name), info.type_name).reshape(info.shape)
        if not np.isfinite(out).all():
            raise CheckpointError(f"{self.path}: tensor {name!r} contains NaN or infinity")
        return out

    def float32_bytes(self) -> int:
        """What every tensor takes once dequantized to float32."""
        return sum(4 * info.size for info in self.tensors.values())

    def check_memory(self) -> None:
        """Refuse, before dequantizing, a file whose float32 tensors would not fit in the memory available."""
        need, available = self.float32_bytes(), available_memory_bytes()
        if available is not None and need > available:
            raise CheckpointError(f"{self.path}: its tensors take {need / 2**20:,.0f} MiB as float32, but only "
                                  f"{available / 2**20:,.0f} MiB of memory is available")

    def close(self) -> None:
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:  # a tensor view still points into it; the map closes when that is gone
                pass
            self._map = None

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ----------------------------------------------------------------------------------------------------------------
# The block formats, each a few lines of NumPy (one row of ``blocks`` is one block of 32 numbers)


def fp16_column(blocks, start: int) -> np.ndarray:  # blocks [n, bytes] uint8 -> [n, 1] float32
    """The fp16 number in bytes ``start, start+1`` of every block."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def dequantize_q8_0(blocks):  # blocks [n, 34] uint8 -> [n, 32] float32
    """Q8_0: an fp16 scale d, then 32 int8 numbers q; w = d * q (chapter 6's int8, one scale per 32 numbers)."""
    d = fp16_column(blocks, 0)  # [n, 1]
    q = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)  # [n, 32]
    return q * d  # [n, 32] float32


def dequantize_q4_1(blocks):  # blocks [n, 20] uint8 -> [n, 32] float32
    """Q4_1: fp16 scale d, fp16 minimum m, 16 bytes of 4-bit q in 0..15; w = d * q + m. Byte j holds number j in
    its low nibble and number j + 16 in its high nibble."""
    d, m = fp16_column(blocks, 0), fp16_column(blocks, 2)  # [n, 1] each
    qs = blocks[:, 4:]  # [n, 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # [n, 32]: numbers 0..15, then 16..31
    return q * d + m  # [n, 32] float32


def dequantize_q4_0(blocks):  # blocks [n, 18] uint8 -> [n, 32] float32
    """Q4_0: fp16 scale d, 16 bytes of 4-bit q (as Q4_1); w = d * (q - 8), symmetric (chapter 6's int4)."""
    d = fp16_column(blocks, 0)
    qs = blocks[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int8) - np.int8(8)  # [n, 32] in -8..7
    return q * d


def dequantize(raw, type_name: str) -> np.ndarray:  # raw [rows, bytes per row] uint8 -> [rows, numbers] float32
    """The numbers stored in ``raw`` as float32, whatever the format."""
    rows = raw.shape[0]
    if type_name == "F32":
        return raw.view("<f4").astype(np.float32)  # a copy, so the file may be closed
    if type_name == "F16":
        return raw.view("<f2").astype(np.float32)
    if type_name == "BF16":  # the top 16 bits of a float32
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    _, block, block_bytes = next(t for t in TYPES.values() if t[0] == type_name)
    blocks = raw.reshape(-1, block_bytes)  # [rows * blocks per row, bytes per block]
    kernel = {"Q8_0": dequantize_q8_0, "Q4_1": dequantize_q4_1, "Q4_0": dequantize_q4_0}[type_name]
    return kernel(blocks).reshape(rows, -1)


def read_metadata(path: str | Path) -> dict:
    """Just the metadata of a GGUF file (no tensor is read)."""
    with GGUFFile(path) as f:
        return dict(f.metadata)


__all__ = ["GGUFFile", "TensorInfo", "dequantize", "dequantize_q8_0", "dequantize_q4_1", "dequantize_q4_0",
           "read_metadata", "TYPES"]
