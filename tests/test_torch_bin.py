"""Tests of gpt2_core.loading.torch_bin: reading pytorch_model.bin without torch.

    python -m pytest tests/test_torch_bin.py -q

The fixtures in tests/fixtures/ were written by real torch (tests/fixtures/make_torch_bin_fixtures.py), so these
tests need no torch. Odd or broken files are made here: by editing those fixtures, or by `write_zip` /
`write_legacy`, which pickle a state dict exactly as torch.save does, with stand-in `torch` modules.
"""

from __future__ import annotations

import io
import os
import pickle
import sys
import types
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpt2_core.errors import CheckpointError
from gpt2_core.loading.torch_bin import LEGACY_MAGIC, load_torch_bin

FIXTURES = Path(__file__).parent / "fixtures"
ZIP, LEGACY = FIXTURES / "tiny_zip.bin", FIXTURES / "tiny_legacy.bin"
EXPECTED = dict(np.load(FIXTURES / "tiny_expected.npz"))


def assert_same(got: dict, want: dict):
    assert list(got) == list(want)
    for k, w in want.items():
        g = got[k]
        assert isinstance(g, np.ndarray), k
        assert (g.dtype, g.shape) == (w.dtype, w.shape), k
        assert g.flags.c_contiguous, k
        assert g.tobytes() == w.tobytes(), k  # bit-exact, so -0.0, inf and subnormals count too


# ---------------------------------------------------------------------------------------------------------------
# Real torch files, both formats


@pytest.mark.parametrize("path", [ZIP, LEGACY], ids=["zip", "legacy"])
def test_loads_files_written_by_torch(path):
    sd = load_torch_bin(path)
    assert_same(sd, EXPECTED)
    # views share one storage in the file: same numbers as slicing the base tensor
    base = sd["wte.weight"]
    np.testing.assert_array_equal(sd["row"], base[2])
    np.testing.assert_array_equal(sd["transposed"], base.T)
    np.testing.assert_array_equal(sd["window"], base[1:3, 2:5])
    assert sd["half"].dtype == np.float16 and sd["i64"].dtype == np.int64 and sd["mask"].dtype == np.bool_
    assert sd["param"].shape == (2, 2) and sd["scalar"].shape == () and sd["empty"].shape == (0, 3)


@pytest.mark.parametrize("path", [ZIP, LEGACY], ids=["zip", "legacy"])
def test_bfloat16_becomes_float32_exactly(path):
    bf = load_torch_bin(path)["bf16"]
    assert bf.dtype == np.float32
    assert not np.any(bf.view(np.uint32) & 0xFFFF)  # a bfloat16 is the top 16 bits of a float32
    assert bf[0] == 1.0 and bf[1] == -2.5 and bf[2] == np.float32(0.333984375) and np.isinf(bf[5])
    assert np.signbit(bf[4]) and bf[4] == 0  # -0.0 survives


def test_zip_archive_folder_can_have_any_name(tmp_path):
    out = tmp_path / "renamed.bin"
    with zipfile.ZipFile(ZIP) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr("some-other-name/" + info.filename.split("/", 1)[1], src.read(info))
    assert_same(load_torch_bin(out), EXPECTED)


# ---------------------------------------------------------------------------------------------------------------
# Writing torch-format files without torch: stand-in modules named like torch's, so pickle records the same names.


class FakeStorage:
    def __init__(self, type_name: str, key: str, data: np.ndarray, view=None):
        self.type_name, self.key, self.data, self.view = type_name, key, np.ascontiguousarray(data), view


class FakeTensor:
    def __init__(self, storage: FakeStorage, offset: int, size: tuple, stride: tuple):
        self.args = (storage, offset, size, stride, False, OrderedDict())

    def __reduce__(self):
        return sys.modules["torch._utils"]._rebuild_tensor_v2, self.args


@pytest.fixture
def fake_torch(monkeypatch):
    torch, utils = types.ModuleType("torch"), types.ModuleType("torch._utils")

    def _rebuild_tensor_v2(*args):
        raise AssertionError("only pickled here, never called")

    _rebuild_tensor_v2.__module__, _rebuild_tensor_v2.__qualname__ = "torch._utils", "_rebuild_tensor_v2"
    torch._utils = utils
    utils._rebuild_tensor_v2 = _rebuild_tensor_v2
    for name in ["FloatStorage", "HalfStorage", "LongStorage", "ComplexFloatStorage"]:
        setattr(torch, name, type(name, (), {"__module__": "torch"}))
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "torch._utils", utils)
    return torch


def _pickle(obj, legacy: bool) -> tuple[bytes, dict]:
    storages = {}

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            if not isinstance(obj, FakeStorage):
                return None
            storages[obj.key] = obj
            pid = ("storage", getattr(sys.modules["torch"], obj.type_name), obj.key, "cpu", obj.data.size)
            return pid + (obj.view,) if legacy else pid

    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(obj)
    return buf.getvalue(), storages


def write_zip(path, sd, prefix="archive", records=None, byteorder=b"little", data_pkl=None):
    pkl, storages = _pickle(sd, legacy=False)
    records = {k: s.data.tobytes() for k, s in storages.items()} if records is None else records
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{prefix}/data.pkl", pkl if data_pkl is None else data_pkl)
        if byteorder is not None:
            zf.writestr(f"{prefix}/byteorder", byteorder)
        for key, raw in records.items():
            zf.writestr(f"{prefix}/data/{key}", raw)
    return path


def write_legacy(path, sd, sys_info=None, main_pickle=None, counts=None):
    pkl, storages = _pickle(sd, legacy=True)
    keys = sorted(storages)
    with open(path, "wb") as f:
        for header in (LEGACY_MAGIC, 1001, sys_info or {"protocol_version": 1001, "little_endian": True}):
            pickle.dump(header, f, protocol=2)
        f.write(pkl if main_pickle is None else main_pickle)
        pickle.dump(keys, f, protocol=2)
        for key in keys:
            data = storages[key].data
            f.write(((counts or {}).get(key, data.size)).to_bytes(8, "little") + data.tobytes())
    return path


def test_legacy_storage_views(tmp_path, fake_torch):
    """Very old files pickle a storage *view*: (view_key, offset, numel) of a root storage."""
    root = np.arange(10, dtype=np.float32)
    view = FakeStorage("FloatStorage", "root", root, view=("v1", 4, 6))  # elements 4..9 of "root"
    sd = {"whole": FakeTensor(FakeStorage("FloatStorage", "root", root), 0, (10,), (1,)),
          "tail": FakeTensor(view, 1, (2, 2), (1, 2))}  # view elements [1,3],[2,4] -> root 5,7 / 6,8
    out = load_torch_bin(write_legacy(tmp_path / "old.bin", sd))
    np.testing.assert_array_equal(out["whole"], root)
    np.testing.assert_array_equal(out["tail"], [[5, 7], [6, 8]])


def test_writer_round_trip(tmp_path, fake_torch):
    data = np.arange(6, dtype=np.int64)
    sd = OrderedDict(a=FakeTensor(FakeStorage("LongStorage", "0", data), 2, (2, 2), (2, 1)), meta=3)
    for path in (write_zip(tmp_path / "z.bin", sd), write_legacy(tmp_path / "l.bin", sd)):
        out = load_torch_bin(path)
        assert list(out) == ["a"]  # the non-tensor entry is skipped
        np.testing.assert_array_equal(out["a"], [[2, 3], [4, 5]])


@pytest.mark.parametrize("path", [ZIP, LEGACY], ids=["zip", "legacy"])
def test_arrays_are_writable(path):
    """Like a .safetensors file's, so a learner can edit a weight in place (they view bytearrays, never a copy)."""
    sd = load_torch_bin(path)
    for name, a in sd.items():
        assert a.flags.writeable, name
    sd["half"][...] = 7
    assert (sd["half"] == 7).all()
    np.testing.assert_array_equal(load_torch_bin(path)["half"], EXPECTED["half"])  # the file is untouched


def test_a_model_loaded_from_pytorch_model_bin_can_be_edited_in_place(tmp_path, fake_torch):
    import json

    from helpers import config_json, tiny_model

    import gpt2_core

    model = tiny_model()
    sd = {"transformer." + k: FakeTensor(FakeStorage("FloatStorage", str(i), a), 0, a.shape,
                                         tuple(n // 4 for n in np.ascontiguousarray(a).strides))
          for i, (k, a) in enumerate(model.state_dict().items())}
    (tmp_path / "config.json").write_text(json.dumps(config_json(model.config)))
    for write in (write_zip, write_legacy):
        write(tmp_path / "pytorch_model.bin", sd)
        loaded = gpt2_core.load_model(tmp_path)
        np.testing.assert_array_equal(gpt2_core.forward(loaded, [1, 2]), gpt2_core.forward(model, [1, 2]))
        loaded.params["wte"][0] = 0
        loaded.params["h"][0]["ln_1"]["weight"] += 1
        assert not loaded.params["wte"][0].any()


# ---------------------------------------------------------------------------------------------------------------
# Errors: always CheckpointError, always naming the file


def raises_for(path, *words):
    with pytest.raises(CheckpointError) as info:
        load_torch_bin(path)
    msg = str(info.value)
    assert Path(path).name in msg, msg
    for w in words:
        assert w in msg, msg
    return msg


def test_missing_and_empty_files(tmp_path):
    raises_for(tmp_path / "nope.bin", "no such file")
    (tmp_path / "empty.bin").write_bytes(b"")
    raises_for(tmp_path / "empty.bin", "empty")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.bin").write_text("hello, this is text\n")
    raises_for(tmp_path / "notes.bin", "not a PyTorch checkpoint", "hello, this")
    (tmp_path / "int.bin").write_bytes(pickle.dumps(12345, protocol=2))
    raises_for(tmp_path / "int.bin", "not a PyTorch checkpoint")
    (tmp_path / "broken.bin").write_bytes(b"\x80\x02\xff\xff garbage")  # a pickle opcode, then nonsense
    raises_for(tmp_path / "broken.bin", "not a PyTorch checkpoint", "does not load as a pickle")


def test_a_legacy_file_saved_with_pickle_protocol_1_loads(tmp_path):
    """torch.save(..., pickle_protocol=1, _use_new_zipfile_serialization=False) is legal: its first byte is not
    protocol 2's 0x80, and it is still a checkpoint."""
    from gpt2_core.loading.torch_bin import LEGACY_MAGIC

    data = (FIXTURES / "tiny_legacy.bin").read_bytes()
    first = pickle.dumps(LEGACY_MAGIC, protocol=2)
    assert data.startswith(first)
    (tmp_path / "p1.bin").write_bytes(pickle.dumps(LEGACY_MAGIC, protocol=1) + data[len(first):])
    got, want = load_torch_bin(tmp_path / "p1.bin"), load_torch_bin(FIXTURES / "tiny_legacy.bin")
    assert list(got) == list(want) and all(np.array_equal(got[k], want[k]) for k in want)


def test_truncated_zip(tmp_path):
    data = ZIP.read_bytes()
    (tmp_path / "half.bin").write_bytes(data[: len(data) // 2])
    raises_for(tmp_path / "half.bin", "truncated or corrupt zip")


def test_truncated_legacy_names_the_storage_and_tensor(tmp_path):
    data = LEGACY.read_bytes()
    (tmp_path / "cut.bin").write_bytes(data[:-3])
    msg = raises_for(tmp_path / "cut.bin", "truncated")
    assert "'param'" in msg  # torch writes storages sorted by key: the last is the Parameter's


def test_zip_without_data_pkl(tmp_path):
    with zipfile.ZipFile(ZIP) as src, zipfile.ZipFile(tmp_path / "nopkl.bin", "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("data.pkl"):
                dst.writestr(info.filename, src.read(info))
    raises_for(tmp_path / "nopkl.bin", "data.pkl")


def test_zip_big_endian_is_refused(tmp_path, fake_torch):
    sd = {"w": FakeTensor(FakeStorage("FloatStorage", "0", np.ones(2, np.float32)), 0, (2,), (1,))}
    raises_for(write_zip(tmp_path / "be.bin", sd, byteorder=b"big"), "big-endian")
    assert load_torch_bin(write_zip(tmp_path / "nobyteorder.bin", sd, byteorder=None))["w"].tolist() == [1, 1]


def test_legacy_big_endian_is_refused(tmp_path, fake_torch):
    sd = {"w": FakeTensor(FakeStorage("FloatStorage", "0", np.ones(2, np.float32)), 0, (2,), (1,))}
    raises_for(write_legacy(tmp_path / "be.bin", sd, sys_info={"little_endian": False}), "big-endian")


def test_storage_record_missing_or_short(tmp_path, fake_torch):
    st = FakeStorage("FloatStorage", "7", np.arange(4, dtype=np.float32))
    sd = {"h.0.mlp.c_fc.weight": FakeTensor(st, 0, (2, 2), (2, 1))}
    raises_for(write_zip(tmp_path / "missing.bin", sd, records={}), "'h.0.mlp.c_fc.weight'", "archive/data/7",
               "missing")
    short = {"7": st.data.tobytes()[:12]}  # 3 of the 4 float32s
    raises_for(write_zip(tmp_path / "short.bin", sd, records=short), "'h.0.mlp.c_fc.weight'", "'7'", "needs 4")
    raises_for(write_legacy(tmp_path / "short_legacy.bin", sd, counts={"7": 3}), "'h.0.mlp.c_fc.weight'", "needs 4")


def test_tensor_reaching_outside_its_storage(tmp_path, fake_torch):
    st = FakeStorage("FloatStorage", "0", np.zeros(6, np.float32))
    for size, stride, offset in [((2, 4), (4, 1), 0), ((3,), (1,), 4), ((2, 3), (1, 3), 1), ((100,), (0,), 0)]:
        sd = {"wpe.weight": FakeTensor(st, offset, size, stride)}
        raises_for(write_zip(tmp_path / "oob.bin", sd), "'wpe.weight'", "does not fit")


def test_unsupported_storage_type(tmp_path, fake_torch):
    sd = {"w": FakeTensor(FakeStorage("ComplexFloatStorage", "0", np.zeros(2, np.complex64)), 0, (2,), (1,))}
    raises_for(write_zip(tmp_path / "complex.bin", sd), "unsupported storage type torch.ComplexFloatStorage")


def test_corrupt_pickle(tmp_path):
    with zipfile.ZipFile(ZIP) as src, zipfile.ZipFile(tmp_path / "bad.bin", "w") as dst:
        for info in src.infolist():
            raw = src.read(info)
            dst.writestr(info, raw[: len(raw) // 2] if info.filename.endswith("data.pkl") else raw)
    raises_for(tmp_path / "bad.bin", "corrupt", "data.pkl")


# A pickle that runs a shell command when loaded: GLOBAL os.system, then call it with one argument.
def payloads(marker: Path) -> dict[str, bytes]:
    m = str(marker).encode()
    return {
        "os.system": b"cos\nsystem\n(S'touch " + m + b"'\ntR.",
        "builtins.eval": b"cbuiltins\neval\n(S'open(" + repr(str(marker)).encode() + b", \"w\").close()'\ntR.",
        "subprocess.Popen": b"csubprocess\nPopen\n((S'touch'\nS'" + m + b"'\nltR.",
    }


def test_the_malicious_payload_is_real(tmp_path):
    """pickle.loads really runs it: this is why torch.load(weights_only=False) on a stranger's file is unsafe."""
    marker = tmp_path / "pwned"
    pickle.loads(payloads(marker)["os.system"])
    assert marker.exists()


@pytest.mark.parametrize("name", ["os.system", "builtins.eval", "subprocess.Popen"])
@pytest.mark.parametrize("container", ["zip", "legacy"])
def test_malicious_pickle_is_refused_and_not_run(tmp_path, name, container):
    marker = tmp_path / "pwned"
    evil = payloads(marker)[name]
    path = tmp_path / "pytorch_model.bin"
    if container == "zip":
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr("archive/data.pkl", evil)
    else:
        path.write_bytes(b"".join(pickle.dumps(x, protocol=2) for x in (LEGACY_MAGIC, 1001, {})) + evil)
    raises_for(path, f"refusing to unpickle global '{name}'")
    assert not marker.exists()


def test_malicious_reduce_with_modern_protocol(tmp_path):
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    path = tmp_path / "pytorch_model.bin"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"w": Evil()}, protocol=5))  # STACK_GLOBAL opcode
    raises_for(path, "refusing to unpickle global", "system")
    assert not marker.exists()


# Small hostile pickles that once cost hours or changed the loader itself.


def tuple_tree(depth: int) -> tuple[bytes, bytes]:
    """Opcodes that store t_0 = () and t_i = (t_{i-1}, t_{i-1}) in the memo, leaving the stack empty, and the opcode
    that pushes t_depth. Each level reuses the one below, so ~10 bytes a level build a tree of 2**depth leaves."""
    out = b"\x80\x02)q\x000"  # PROTO 2, EMPTY_TUPLE, BINPUT 0, POP
    for i in range(1, depth + 1):
        out += b"h%ch%c\x86q%c0" % (i - 1, i - 1, i)  # BINGET, BINGET, TUPLE2, BINPUT, POP
    return out, b"h%c" % depth


def zip_with_pickle(path, pkl: bytes):
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pkl)
    return path


def test_a_tuple_tree_is_neither_printed_nor_hashed(tmp_path):
    """2**40 leaves: printing them in the persistent-id message, or hashing them as a dict key, never ends."""
    memo, t = tuple_tree(40)
    cases = {"persid": (t + b"\x85Q.", "unexpected persistent id"),  # BINPERSID on (t,)
             "setitem": (b"}" + t + b"K\x01s.", "key that is not a string"),  # {t: 1}
             "setitems": (b"}(" + t + b"K\x01u.", "key that is not a string"),
             "dict": (b"(" + t + b"K\x01d.", "key that is not a string"),
             "OrderedDict": (b"ccollections\nOrderedDict\n(" + t + b"K\x01\x86\x85R.", "corrupt"),  # ((t, 1),)
             "set": (b"\x8f(" + t + b"\x90.", "builds a set"),  # EMPTY_SET, ADDITEMS
             "frozenset": (b"(" + t + b"\x91.", "builds a set")}
    for name, (ops, words) in cases.items():
        msg = raises_for(zip_with_pickle(tmp_path / f"{name}.bin", memo + ops), words)
        assert len(msg) < 400, msg


def test_build_cannot_change_the_loaders_own_functions(tmp_path):
    from gpt2_core.loading import torch_bin

    evil = {  # BUILD on an allowed function: state (None, {"__defaults__": (7, 8)}) is setattr, {"pwnd": 1} __dict__
        "defaults": b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n"
                    b"N}X\x0c\x00\x00\x00__defaults__K\x07K\x08\x86s\x86b0}.",
        "dict": b"\x80\x02ctorch._utils\n_rebuild_parameter\n}X\x04\x00\x00\x00pwndK\x01sb0}.",
    }
    for name, pkl in evil.items():
        raises_for(zip_with_pickle(tmp_path / f"{name}.bin", pkl), "sets the state of a function")
    assert torch_bin._rebuild_tensor.__defaults__ is None and not vars(torch_bin._rebuild_parameter)
    assert_same(load_torch_bin(ZIP), EXPECTED)  # and the next file loads as before


def test_an_empty_tensor_with_huge_dimensions_is_named(tmp_path, fake_torch):
    storage = FakeStorage("FloatStorage", "0", np.zeros(1, np.float32))
    write_zip(tmp_path / "huge.bin", {"w": FakeTensor(storage, 0, (0, 2**47, 2**47), (1, 1, 1))})
    raises_for(tmp_path / "huge.bin", "tensor 'w' has size (0, 140737488355328, 140737488355328)")
    write_zip(tmp_path / "empty.bin", {"w": FakeTensor(storage, 0, (0, 3), (3, 1))})
    assert load_torch_bin(tmp_path / "empty.bin")["w"].shape == (0, 3)  # an ordinary empty tensor still loads


def test_compressed_records_are_refused_before_they_are_read(tmp_path):
    """torch.save stores records; a compressed one (a 4 KB file can hold a 200 MB BZIP2 record) is refused."""
    for method in (zipfile.ZIP_DEFLATED, zipfile.ZIP_BZIP2, zipfile.ZIP_LZMA):
        out = tmp_path / f"packed{method}.bin"
        with zipfile.ZipFile(ZIP) as src, zipfile.ZipFile(out, "w") as dst:
            for info in src.infolist():
                packed = info.filename.endswith("/data/0")  # one storage record only: the pickle is read first
                dst.writestr(info.filename, src.read(info), method if packed else zipfile.ZIP_STORED)
        raises_for(out, "data/0' is compressed", f"method {method}")


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: damaged files either still load (a flipped bit in raw float data cannot be noticed in the legacy
# format) or raise CheckpointError; never another exception, never a hang (hypothesis' deadline).

FUZZ = settings(max_examples=150, deadline=2000, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def _load_or_checkpoint_error(data: bytes, tmp_path: Path) -> bool:
    path = tmp_path / "fuzz.bin"
    path.write_bytes(data)
    try:
        out = load_torch_bin(path)
    except CheckpointError:
        return False
    assert all(isinstance(v, np.ndarray) for v in out.values())
    return True


@pytest.mark.parametrize("path", [ZIP, LEGACY], ids=["zip", "legacy"])
def test_fuzz_byte_flips(path, tmp_path_factory):
    data, tmp = path.read_bytes(), tmp_path_factory.mktemp("flip")

    @FUZZ
    @given(st.lists(st.tuples(st.integers(0, len(data) - 1), st.integers(1, 255)), min_size=1, max_size=4))
    def check(flips):
        damaged = bytearray(data)
        for pos, xor in flips:
            damaged[pos] ^= xor
        _load_or_checkpoint_error(bytes(damaged), tmp)

    check()


@pytest.mark.parametrize("path", [ZIP, LEGACY], ids=["zip", "legacy"])
def test_fuzz_truncations_always_fail(path, tmp_path_factory):
    data, tmp = path.read_bytes(), tmp_path_factory.mktemp("cut")

    @FUZZ
    @given(st.integers(0, len(data) - 1))
    def check(n):
        assert not _load_or_checkpoint_error(data[:n], tmp)

    check()


# ---------------------------------------------------------------------------------------------------------------
# Extra check against torch itself, only where torch is installed (CI has no torch).


def test_matches_torch_load(tmp_path):
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    wte = torch.randn(50, 16, generator=g)
    sd = {"wte.weight": wte, "lm_head.weight": wte,  # tied: one storage, as in GPT2LMHeadModel.state_dict()
          "c_attn.weight": torch.randn(16, 48, generator=g), "c_attn.bias": torch.zeros(48),
          "q": torch.randn(16, 48, generator=g)[:, :16], "wte_t": wte.t(), "half": wte.half(), "bf16": wte.bfloat16(),
          "attn.bias": torch.tril(torch.ones(8, 8, dtype=torch.bool)), "steps": torch.tensor(7)}
    for legacy in (False, True):
        path = tmp_path / f"pytorch_model_{legacy}.bin"
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        ours, theirs = load_torch_bin(path), torch.load(path, weights_only=True)
        assert list(ours) == list(theirs)
        for k, t in theirs.items():
            want = (t.float() if t.dtype == torch.bfloat16 else t).contiguous().numpy()
            assert ours[k].dtype == want.dtype and ours[k].tobytes() == want.tobytes(), k


def test_a_module_state_dict_with_its_metadata_loads(tmp_path):
    """module.state_dict() is an OrderedDict carrying `_metadata`, which torch pickles with BUILD."""
    torch = pytest.importorskip("torch")
    sd = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)).state_dict()
    assert hasattr(sd, "_metadata")
    for legacy in (False, True):
        path = tmp_path / f"module_{legacy}.bin"
        torch.save(sd, path, _use_new_zipfile_serialization=not legacy)
        ours = load_torch_bin(path)
        assert list(ours) == list(sd) and all(np.array_equal(ours[k], sd[k].numpy()) for k in sd)
