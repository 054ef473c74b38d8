"""Read a PyTorch ``pytorch_model.bin`` with NumPy alone: no torch, and no code from the file is ever run.

``torch.save(state_dict, f)`` writes a *pickle* of the dict. Pickle is a small stack language that may call any
importable function (``os.system`` included), so loading an untrusted pickle normally means running the file's
code. The tensor bytes are not inside the pickle. Each tensor is pickled as a call
``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks)``, and its
``storage`` argument is a *persistent id*: a tuple the pickler leaves for the loader to resolve::

    ('storage', torch.FloatStorage, '0', 'cpu', 6)     # (tag, element type, storage key, device, numel)

Several tensors may share one storage (views, tied weights), each with its own offset, size and stride.
The bytes of storage ``'0'`` live outside the pickle, in one of two containers:

* **zip** (torch >= 1.6): ``<archive>/data.pkl`` is the pickle, ``<archive>/data/<key>`` holds each storage's raw
  bytes, ``<archive>/byteorder`` says ``little`` (files without it are little-endian). ``<archive>`` is any name.
* **legacy** (torch < 1.6, e.g. the 2019 ``openai-community/gpt2`` file): one stream of a pickled magic number,
  a pickled protocol version (1001), a pickled ``sys_info`` dict, the main pickle, a pickled list of storage
  keys, then for each key in that order an 8-byte little-endian element count followed by the raw bytes.
  Legacy persistent ids have a sixth item, ``view_metadata``: ``None`` or ``(view_key, offset, numel)``.

Why this is safe: the unpickler looks up every global the pickle names through ``find_class``. Ours knows only
the few names a state dict uses and maps each to a tiny function of our own that just records its arguments,
so nothing from the file (and nothing from torch) ever runs; any other global stops the load. Bytes become
arrays only after checking that offset, size and stride stay inside their storage. Nor can a tiny hostile file
make the loader work or allocate for hours: dict keys must be strings (no hashing a nested object of 2**40
parts), sets are refused, and so are compressed zip records (torch.save never compresses; a 4 KB record can
inflate to gigabytes).
"""

from __future__ import annotations

import collections
import io
import math
import os
import pickle
import reprlib
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import CheckpointError

__all__ = ["load_torch_bin"]

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001

# torch storage class -> little-endian numpy dtype of one element (bfloat16 is read as raw uint16 bits).
STORAGE_DTYPES = {
    "DoubleStorage": "<f8", "FloatStorage": "<f4", "HalfStorage": "<f2", "BFloat16Storage": "<u2",
    "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?",
}


@dataclass(frozen=True, slots=True)  # no __dict__: a pickle's BUILD cannot change it
class _StorageType:  # stands in for torch.FloatStorage & co. inside the pickle
    name: str


@dataclass(frozen=True, slots=True)
class _Storage:  # a resolved persistent id: `numel` elements of storage `key`, starting at element `offset`
    key: str
    type: _StorageType
    numel: int
    offset: int = 0


@dataclass(frozen=True, slots=True)
class _TensorRef:  # what _rebuild_tensor_v2 would build, kept lazy: in legacy files the bytes come after the pickle
    storage: _Storage
    offset: int
    size: tuple
    stride: tuple


def _rebuild_tensor(storage, storage_offset, size, stride, *_requires_grad_hooks_metadata):
    return _TensorRef(storage, storage_offset, size, stride)


def _rebuild_parameter(data, *_requires_grad_hooks):
    return data  # an nn.Parameter is its tensor plus flags we don't need


def _ordered_dict():  # torch pickles `OrderedDict()` then adds the items with SETITEMS, where their keys are checked
    return collections.OrderedDict()  # (OrderedDict(items) would hash whatever keys the file gives it)


_ALLOWED = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("collections", "OrderedDict"): _ordered_dict,
}


# pickle._Unpickler is the pure-Python unpickler: slower than the C one, but its memo is a dict, so a corrupt
# memo index cannot make it allocate gigabytes. State-dict pickles are small (~30 KB for GPT-2), so speed is moot.
# Being Python, its opcodes can be replaced one by one (`dispatch`: opcode byte -> method), and a few are. A pickle
# may reuse an object many times (a memo reference), so 300 bytes can nest a tuple (t, t) thirty levels deep:
# 2**30 leaves to hash as a dict key, or to print. So dict keys must be strings, as a state dict's are; sets (which
# hash their items) are refused; BUILD may only touch an OrderedDict; error messages print through reprlib.
class _RestrictedUnpickler(pickle._Unpickler):
    dispatch = pickle._Unpickler.dispatch.copy()  # our own table: the overrides below leave pickle's untouched

    def __init__(self, file, path: Path, storage_types: dict):
        super().__init__(file)
        self.path, self.storage_types = path, storage_types  # storage key -> _StorageType, shared across pickles

    def _set_items(self, target, items: list):  # every opcode that puts items in a dict ends here
        if not isinstance(target, dict):
            raise CheckpointError(f"{self.path}: pickle sets items on a {type(target).__name__}, not a dict "
                                  "(corrupt file?)")
        if len(items) % 2:
            raise pickle.UnpicklingError("a key without a value")
        for key in items[::2]:
            if not isinstance(key, str):
                raise CheckpointError(f"{self.path}: pickled dict has a key that is not a string "
                                      f"({type(key).__name__}); a state dict's keys are names (corrupt file?)")
        target.update(zip(items[::2], items[1::2]))

    def load_setitem(self):  # SETITEM: stack [.., dict, key, value]
        value, key = self.stack.pop(), self.stack.pop()
        self._set_items(self.stack[-1], [key, value])
    dispatch[pickle.SETITEM[0]] = load_setitem

    def load_setitems(self):  # SETITEMS: stack [.., dict, MARK, key, value, key, value, ...]
        items = self.pop_mark()
        self._set_items(self.stack[-1], items)
    dispatch[pickle.SETITEMS[0]] = load_setitems

    def load_dict(self):  # DICT (protocols 0-1): a new dict from [MARK, key, value, ...]
        items, d = self.pop_mark(), {}
        self._set_items(d, items)
        self.append(d)
    dispatch[pickle.DICT[0]] = load_dict

    def load_set(self):  # EMPTY_SET, ADDITEMS, FROZENSET: a state dict holds no sets
        raise CheckpointError(f"{self.path}: pickle builds a set, which a state dict never holds (corrupt file?)")
    dispatch.update(dict.fromkeys([pickle.EMPTY_SET[0], pickle.ADDITEMS[0], pickle.FROZENSET[0]], load_set))

    def load_build(self):  # BUILD: set the state of the object below it on the stack
        state, inst = self.stack.pop(), self.stack[-1]
        # torch uses it for one thing: the `_metadata` (module versions) of a state dict, a plain dict we do not
        # need, so it is dropped. Anything else (an allowed function's __defaults__, say) is refused: pickle's
        # own BUILD would set it for the rest of the process.
        if not (type(inst) is collections.OrderedDict and isinstance(state, dict)):
            raise CheckpointError(f"{self.path}: pickle sets the state of a {type(inst).__name__}; a state dict "
                                  "only ever sets an OrderedDict's (corrupt or malicious file?)")
    dispatch[pickle.BUILD[0]] = load_build

    def find_class(self, module, name):
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return _StorageType(name)  # a fresh object each time, so a hostile pickle cannot alter a shared one
        if not all(part.isidentifier() for part in f"{module}.{name}".split(".")):  # e.g. cut off mid-name
            raise pickle.UnpicklingError(f"garbled global name {module[:40]!r} {name[:40]!r}")
        if module == "torch" and name.endswith("Storage"):
            raise CheckpointError(f"{self.path}: unsupported storage type torch.{name} "
                                  f"(supported: {', '.join(STORAGE_DTYPES)})")
        raise CheckpointError(f"{self.path}: refusing to unpickle global '{module}.{name}': a state dict only needs "
                              "PyTorch's tensor-rebuild functions (the file may be malicious, or a whole pickled "
                              "model: save model.state_dict() instead)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and _is_count(pid[4])):
            raise CheckpointError(f"{self.path}: unexpected persistent id {reprlib.repr(pid)[:200]} (corrupt file?)")
        _, stype, key, _location, numel, *view = pid
        if self.storage_types.setdefault(key, stype) != stype:
            raise CheckpointError(f"{self.path}: storage {key!r} is used with two element types (corrupt file?)")
        offset = 0
        if view and view[0] is not None:  # legacy view: a slice of the root storage
            _view_key, offset, numel = view[0]
            if not (_is_count(offset) and _is_count(numel)):
                raise CheckpointError(f"{self.path}: corrupt view of storage {key!r}")
        return _Storage(key, stype, numel, offset)


def _is_count(x) -> bool:  # a plausible size/offset/stride (the bound keeps numpy's index arithmetic in range)
    return isinstance(x, int) and 0 <= x < 2**48


def _unpickle(stream, path: Path, storage_types: dict, what: str):
    try:
        return _RestrictedUnpickler(stream, path, storage_types).load()
    except CheckpointError:
        raise
    except Exception as e:  # a damaged pickle can fail in any way: EOFError, UnpicklingError, TypeError, ...
        raise CheckpointError(f"{path}: corrupt {what} ({type(e).__name__}: {e})") from e


def _tensor_refs(obj, path: Path) -> dict[str, _TensorRef]:
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: expected a state dict (name -> tensor), found {type(obj).__name__}")
    if not all(isinstance(k, str) for k in obj):
        raise CheckpointError(f"{path}: state dict has a key that is not a string (corrupt file?)")
    return {k: v for k, v in obj.items() if isinstance(v, _TensorRef)}  # non-tensor entries are skipped


def _to_array(path: Path, name: str, ref: _TensorRef, flat: np.ndarray) -> np.ndarray:
    """Cut tensor `name` out of its storage's elements `flat`, checking every index stays inside."""
    st, offset, size, stride = ref.storage, ref.offset, ref.size, ref.stride
    if not (isinstance(st, _Storage) and _is_count(offset) and isinstance(size, tuple) and isinstance(stride, tuple)
            and len(size) == len(stride) <= 32 and all(_is_count(n) for n in size + stride)):
        raise CheckpointError(f"{path}: tensor {name!r} has a corrupt offset/size/stride")
    if len(flat) < st.offset + st.numel:
        raise CheckpointError(f"{path}: tensor {name!r}: storage {st.key!r} holds {len(flat)} elements but needs "
                              f"{st.offset + st.numel} (file truncated or corrupt)")
    flat = flat[st.offset: st.offset + st.numel]
    n = math.prod(size)
    if n == 0:
        if math.prod(n_i for n_i in size if n_i) * flat.itemsize >= 2**63:  # NumPy refuses such a shape, even empty
            raise CheckpointError(f"{path}: tensor {name!r} has size {size}: no array has dimensions that large")
        arr = np.zeros(size, flat.dtype)
    else:
        last = offset + sum((n_i - 1) * s_i for n_i, s_i in zip(size, stride))
        if last >= len(flat) or n > len(flat):  # n > len: an expanded (stride 0) tensor; a state dict has none
            raise CheckpointError(f"{path}: tensor {name!r} (offset {offset}, size {size}, stride {stride}) "
                                  f"does not fit in its storage of {len(flat)} elements")
        contiguous, expect = True, 1
        for n_i, s_i in zip(reversed(size), reversed(stride)):
            contiguous &= n_i == 1 or s_i == expect
            expect *= n_i
        if contiguous:
            arr = flat[offset: offset + n].reshape(size)
        else:
            strides = [s_i * flat.itemsize if n_i > 1 else 0 for n_i, s_i in zip(size, stride)]
            arr = np.ascontiguousarray(np.lib.stride_tricks.as_strided(flat[offset:], size, strides, writeable=False))
    if st.type.name == "BFloat16Storage":  # bfloat16 is the top half of a float32: shift the bits back up
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


def _read_record(zf: zipfile.ZipFile, path: Path, name: str) -> bytearray:
    """Record `name` of the archive, read into a bytearray: NumPy arrays viewing it are then writable, with no copy.

    torch.save stores every record uncompressed, so a compressed one is refused before it is read: a few KB of
    BZIP2 can inflate to gigabytes. A stored record is never larger than the file that holds it.
    """
    info = zf.getinfo(name)
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: record {name!r} is compressed (zip method {info.compress_type}); torch.save "
                              "stores records uncompressed, and a compressed one could inflate to any size")
    if info.file_size > path.stat().st_size:
        raise CheckpointError(f"{path}: record {name!r} claims {info.file_size} bytes, more than the whole file")
    raw, done = bytearray(info.file_size), 0
    with zf.open(info) as f, memoryview(raw) as view:
        while done < len(raw):  # in pieces: zipfile reads into a new bytes object first, so at most 16 MB at once
            n = f.readinto(view[done: done + (16 << 20)])
            if not n:
                raise CheckpointError(f"{path}: record {name!r} is truncated ({done} of {len(raw)} bytes)")
            done += n
    return raw


def _read_zip(path: Path):
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            pkl = [n for n in names if n.count("/") == 1 and n.endswith("/data.pkl")]
            if not pkl:
                raise CheckpointError(f"{path}: zip archive has no '<archive>/data.pkl': not a torch.save file")
            prefix = pkl[0][: -len("/data.pkl")]
            if f"{prefix}/byteorder" in names:
                byteorder = bytes(_read_record(zf, path, f"{prefix}/byteorder"))
                if byteorder != b"little":
                    raise CheckpointError(f"{path}: big-endian checkpoint (byteorder {byteorder[:10]!r}); only "
                                          "little-endian is supported")
            storage_types: dict = {}
            pickled = _read_record(zf, path, pkl[0])
            refs = _tensor_refs(_unpickle(io.BytesIO(pickled), path, storage_types, pkl[0]), path)
            cache, out = {}, {}
            for name, ref in refs.items():
                key = ref.storage.key if isinstance(ref.storage, _Storage) else None
                if key is not None and key not in cache:
                    record = f"{prefix}/data/{key}"
                    if record not in names:
                        raise CheckpointError(f"{path}: tensor {name!r}: storage record {record!r} is missing")
                    raw = _read_record(zf, path, record)
                    dtype = np.dtype(STORAGE_DTYPES[ref.storage.type.name])
                    cache[key] = np.frombuffer(raw, dtype, len(raw) // dtype.itemsize)
                out[name] = _to_array(path, name, ref, cache.get(key))
            return out
    except CheckpointError:
        raise
    except Exception as e:  # BadZipFile, a bad CRC, an unknown compression method, ...
        raise CheckpointError(f"{path}: truncated or corrupt zip archive ({type(e).__name__}: {e})") from e


def _read_legacy(path: Path, stream, size: int):
    """The legacy format, read from the open file `stream`: the pickles, then each storage into its own bytearray
    (so the arrays viewing it are writable, and no byte of the file is held twice)."""
    storage_types = {}
    start = stream.read(16)
    stream.seek(0)
    not_torch = f"{path}: not a PyTorch checkpoint (neither a zip archive nor torch's legacy format)"
    try:  # a legacy file opens with a pickled magic number (any pickle protocol)
        magic = _unpickle(stream, path, storage_types, "header")
    except CheckpointError as e:
        raise CheckpointError(f"{not_torch}: it starts with {start!r}, which does not load as a pickle "
                              f"({e.__cause__ or e})") from e
    if magic != LEGACY_MAGIC:
        raise CheckpointError(not_torch)
    header = [magic] + [_unpickle(stream, path, storage_types, "header") for _ in range(2)]
    if header[1] != LEGACY_PROTOCOL:
        raise CheckpointError(f"{path}: unsupported legacy protocol version (expected 1001)")
    if not isinstance(header[2], dict) or not header[2].get("little_endian", True):
        raise CheckpointError(f"{path}: big-endian legacy checkpoint; only little-endian is supported")
    refs = _tensor_refs(_unpickle(stream, path, storage_types, "state-dict pickle"), path)
    keys = _unpickle(stream, path, storage_types, "storage key list")
    if not (isinstance(keys, list) and all(isinstance(k, str) and k in storage_types for k in keys)):
        raise CheckpointError(f"{path}: corrupt storage key list")
    flats = {}
    for key in keys:  # each storage: 8-byte little-endian element count, then the raw bytes
        dtype = np.dtype(STORAGE_DTYPES[storage_types[key].name])
        count_bytes = stream.read(8)
        count = int.from_bytes(count_bytes, "little")
        raw = None
        if len(count_bytes) == 8 and stream.tell() + count * dtype.itemsize <= size:  # checked before allocating
            raw = bytearray(count * dtype.itemsize)
        if raw is None or stream.readinto(raw) != len(raw):
            users = [n for n, r in refs.items() if getattr(r.storage, "key", None) == key]
            raise CheckpointError(f"{path}: storage {key!r} (tensor {', '.join(map(repr, users[:3])) or 'unused'}) "
                                  f"is truncated: the file ends before its {count} elements")
        flats[key] = np.frombuffer(raw, dtype)
    out = {}
    for name, ref in refs.items():
        key = getattr(ref.storage, "key", None)
        if key not in flats:
            raise CheckpointError(f"{path}: tensor {name!r}: storage {key!r} is missing from the file")
        out[name] = _to_array(path, name, ref, flats[key])
    return out


def load_torch_bin(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Load a ``torch.save``d state dict (zip or legacy format) as ``{name: numpy array}``, without torch.

    float32/float16/int/bool tensors keep their dtype; bfloat16 becomes float32 (exactly). Arrays are
    C-contiguous and writable, like those of a .safetensors file (tensors that shared a storage in the file, such
    as tied weights or contiguous views, still share memory). Raises ``CheckpointError``.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if not magic:
                raise CheckpointError(f"{path}: file is empty (0 bytes): an interrupted download or copy?")
            if magic == b"PK\x03\x04":
                return _read_zip(path)
            f.seek(0)
            return _read_legacy(path, f, os.fstat(f.fileno()).st_size)
    except CheckpointError:
        raise
    except Exception as e:  # belt and braces: e.g. PermissionError, MemoryError
        raise CheckpointError(f"{path}: cannot read checkpoint ({type(e).__name__}: {e})") from e
