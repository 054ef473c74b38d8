"""Loading checkpoints: every layout GPT-2 files come in, and a clear error for every way they can be wrong."""

import json

import numpy as np
import pytest
from helpers import TINY, config_json, tiny_model, write_checkpoint, write_safetensors

import gpt2_core
from gpt2_core import CheckpointError, GPT2Config, PRESETS
from gpt2_core.loading.safetensors_io import read_safetensors_header
from gpt2_core.loading.weights import expected_shapes


@pytest.fixture
def model():
    return tiny_model()


def hf_keys(sd, prefix="transformer."):
    return {prefix + k: v for k, v in sd.items()}


def same_logits(a, b, atol=0.0):
    ids = [3, 1, 4, 1, 5]
    np.testing.assert_allclose(gpt2_core.forward(a, ids), gpt2_core.forward(b, ids), atol=atol)


def test_round_trip_through_safetensors(tmp_path, model):
    loaded = gpt2_core.load_model(write_checkpoint(tmp_path, model))
    assert loaded.config == model.config
    same_logits(model, loaded)


@pytest.mark.parametrize("variant", ["prefix", "prefix+lm_head+buffers", "no-prefix+buffers"])
def test_key_layouts_of_real_checkpoints_all_load(tmp_path, model, variant):
    sd = model.state_dict()
    if "buffers" in variant:
        P = TINY.n_positions
        for i in range(TINY.n_layer):
            sd[f"h.{i}.attn.bias"] = np.tril(np.ones((1, 1, P, P), np.float32))
            sd[f"h.{i}.attn.masked_bias"] = np.array(-1e4, np.float32)
    if variant.startswith("prefix"):
        sd = hf_keys(sd)
    if "lm_head" in variant:
        sd["lm_head.weight"] = model.params["wte"].copy()
    same_logits(model, gpt2_core.load_model(write_checkpoint(tmp_path, model, sd)))


def test_fp16_and_bf16_are_computed_in_float32(tmp_path, model):
    half = {k: v.astype(np.float16) for k, v in model.state_dict().items()}
    m16 = gpt2_core.load_model(write_checkpoint(tmp_path / "fp16", model, half))
    assert all(a.dtype == np.float32 for a in m16.state_dict().values())
    np.testing.assert_array_equal(m16.params["wte"], half["wte.weight"].astype(np.float32))
    mbf = gpt2_core.load_model(write_checkpoint(tmp_path / "bf16", model, bf16=True))
    assert read_safetensors_header(tmp_path / "bf16" / "model.safetensors")["wte.weight"]["dtype"] == "BF16"
    truncated = (model.params["wte"].view(np.uint32) & 0xFFFF0000).view(np.float32)  # what bf16 keeps
    np.testing.assert_array_equal(mbf.params["wte"], truncated)
    same_logits(model, mbf, atol=0.5)  # bf16 keeps 8 bits of mantissa: close, not equal


def test_safetensors_header_lists_every_tensor(tmp_path, model):
    write_checkpoint(tmp_path, model)
    header = read_safetensors_header(tmp_path / "model.safetensors")
    assert {k: tuple(v["shape"]) for k, v in header.items()} == expected_shapes(TINY)


def test_a_single_weights_file_can_be_given(tmp_path, model):
    write_checkpoint(tmp_path, model)
    same_logits(model, gpt2_core.load_model(tmp_path / "model.safetensors"))


def test_sharded_safetensors_with_index(tmp_path, model):
    sd = model.state_dict()
    keys = list(sd)
    (tmp_path / "config.json").write_text(json.dumps(config_json(TINY)))
    write_safetensors(tmp_path / "model-00001-of-00002.safetensors", {k: sd[k] for k in keys[:5]})
    write_safetensors(tmp_path / "model-00002-of-00002.safetensors", {k: sd[k] for k in keys[5:]})
    weight_map = {k: f"model-0000{1 + (i >= 5)}-of-00002.safetensors" for i, k in enumerate(keys)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    same_logits(model, gpt2_core.load_model(tmp_path))


def test_random_model_has_every_preset_shape():
    assert gpt2_core.random_model("gpt2").num_parameters() == 124_439_808  # GPT-2 small, as HF counts it
    for name, cfg in PRESETS.items():
        assert cfg.num_parameters() == sum(int(np.prod(s)) for s in expected_shapes(cfg).values()), name
    assert PRESETS["gpt2-xl"].num_parameters() == 1_557_611_200
    m = gpt2_core.random_model(TINY, seed=3)
    np.testing.assert_array_equal(m.params["wte"], gpt2_core.random_model(TINY, seed=3).params["wte"])
    assert not np.array_equal(m.params["wte"], gpt2_core.random_model(TINY, seed=4).params["wte"])


def test_config_reads_hf_config_json(tmp_path):
    d = {**config_json(PRESETS["gpt2"]), "n_ctx": 1024, "summary_type": "cls_index", "architectures": ["X"]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert GPT2Config.from_json(tmp_path / "config.json") == PRESETS["gpt2"]


# ---------------------------------------------------------------------------------------------------------------
# Bad input: each one a CheckpointError whose message names the file / tensor / shape / dtype


def expect_error(match, path):
    with pytest.raises(CheckpointError, match=match):
        gpt2_core.load_model(path)


def test_missing_directory_and_missing_files(tmp_path, model):
    expect_error("no such file or directory", tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    expect_error("config.json not found", tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text(json.dumps(config_json(TINY)))
    expect_error("no weights found", tmp_path / "empty")


def test_truncated_safetensors(tmp_path, model):
    path = write_checkpoint(tmp_path, model) / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    expect_error(r"model.safetensors.*truncated", tmp_path)
    path.write_bytes(data[:5])
    expect_error(r"model.safetensors.*truncated", tmp_path)


def test_corrupt_safetensors_header(tmp_path, model):
    path = write_checkpoint(tmp_path, model) / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8:12] = b"\xff\xfe{{"
    path.write_bytes(bytes(data))
    expect_error(r"model.safetensors: corrupt safetensors header", tmp_path)
    path.write_bytes(b"\xff" * 8 + data[8:])
    expect_error(r"corrupt safetensors header", tmp_path)


def test_missing_tensor_is_named(tmp_path, model):
    sd = model.state_dict()
    del sd["h.1.mlp.c_fc.bias"]
    expect_error(r"missing tensor 'h.1.mlp.c_fc.bias'", write_checkpoint(tmp_path, model, sd))


def test_wrong_shape_is_named_with_both_shapes(tmp_path, model):
    sd = model.state_dict()
    sd["h.0.attn.c_attn.weight"] = sd["h.0.attn.c_attn.weight"].T.copy()  # [out, in]: a Linear, not a Conv1D
    expect_error(r"'h.0.attn.c_attn.weight' has shape \[72, 24\], expected \[24, 72\]",
                 write_checkpoint(tmp_path, model, sd))


def test_unsupported_dtype_is_named(tmp_path, model):
    sd = model.state_dict()
    sd["wpe.weight"] = sd["wpe.weight"].astype(np.int32)
    expect_error(r"'wpe.weight' has unsupported dtype int32", write_checkpoint(tmp_path, model, sd))


def test_unexpected_tensor_and_untied_head(tmp_path, model):
    sd = model.state_dict()
    sd["h.2.ln_1.weight"] = np.ones(24, np.float32)  # a third layer the config does not have
    expect_error(r"unexpected tensor 'h.2.ln_1.weight'", write_checkpoint(tmp_path / "a", model, sd))
    sd = model.state_dict()
    sd["lm_head.weight"] = sd["wte.weight"] + 1
    expect_error(r"'lm_head.weight' is not tied", write_checkpoint(tmp_path / "b", model, sd))


def test_non_finite_weights_are_refused(tmp_path, model):
    sd = model.state_dict()
    sd["ln_f.bias"] = sd["ln_f.bias"].copy()
    sd["ln_f.bias"][3] = np.nan
    expect_error(r"'ln_f.bias' contains NaN", write_checkpoint(tmp_path, model, sd))


def test_bad_config_json(tmp_path, model):
    write_checkpoint(tmp_path, model)
    (tmp_path / "config.json").write_text("{not json")
    expect_error(r"config.json: not valid JSON", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config_json(TINY), "n_head": 5}))
    expect_error(r"n_embd=24 is not divisible by n_head=5", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 1, "n_embd": 1,
                                                      "n_head": 1, "n_layer": 1}))
    expect_error(r"model_type is 'llama'", tmp_path)


def test_weights_keep_the_files_values_row_major_float32(tmp_path, model):
    """Every tensor keeps the file's shape and values, float32 and row-major as HF stores it (the appendix's
    ``cpu_kernels.accelerate`` changes memory orders, the loader never does). Random models are laid out alike."""
    write_checkpoint(tmp_path, model)
    loaded = gpt2_core.load_model(tmp_path)
    for m in (loaded, gpt2_core.random_model(model.config)):
        for key, a in m.state_dict().items():
            assert a.dtype == np.float32 and a.flags.c_contiguous, key
    for key, a in loaded.state_dict().items():
        np.testing.assert_array_equal(a, model.state_dict()[key])


def rewrite_header(path, edit):
    """Rewrite a .safetensors file's JSON header with ``edit(header)`` (tensor bytes kept)."""
    import struct

    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data[8 + n:])


def test_safetensors_header_entries_are_checked_against_their_bytes(tmp_path, model):
    path = write_checkpoint(tmp_path, model) / "model.safetensors"
    original = path.read_bytes()
    rewrite_header(path, lambda h: h["wpe.weight"].update(dtype="F8_E4M3"))
    expect_error(r"tensor 'wpe.weight' has dtype 'F8_E4M3', which this package does not read", tmp_path)
    path.write_bytes(original)
    rewrite_header(path, lambda h: h["wpe.weight"].update(data_offsets=["a", "b"]))
    expect_error(r"corrupt header entry for tensor 'wpe.weight'", tmp_path)
    path.write_bytes(original)
    rewrite_header(path, lambda h: h["ln_f.bias"].update(shape=[2]))
    expect_error(r"tensor 'ln_f.bias' has 96 bytes, but shape \[2\] in F32 needs 8", tmp_path)


def test_attention_variants_and_bad_fields_in_config_json_are_refused(tmp_path, model):
    write_checkpoint(tmp_path, model)
    good = config_json(TINY)
    for extra, match in [({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True is not "
                                                                       "supported"),
                         ({"scale_attn_weights": False}, "scale_attn_weights=False is not supported"),
                         ({"layer_norm_epsilon": float("nan")}, "layer_norm_epsilon must be a finite number > 0"),
                         ({"layer_norm_epsilon": -1e-5}, "layer_norm_epsilon must be a finite number > 0"),
                         ({"vocab_size": "101"}, "vocab_size must be a positive integer, got '101'"),
                         ({"eos_token_id": "100"}, "eos_token_id must be a token id")]:
        (tmp_path / "config.json").write_text(json.dumps({**good, **extra}))
        expect_error(match, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**good, "eos_token_id": [100, 3]}))  # HF allows a list
    assert gpt2_core.load_model(tmp_path).config.eos_token_id == 100


def test_malformed_shard_index_and_tokenizer_files_are_named(tmp_path, model):
    d = write_checkpoint(tmp_path / "a", model)
    (d / "model.safetensors").rename(d / "shard.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["shard.safetensors"]}))
    expect_error(r"index.json: weight_map must map tensor names to shard file names", d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"wte.weight": 5}}))
    expect_error(r"index.json: weight_map must map tensor names to shard file names", d)
    from gpt2_core.loading.tokenizer import Tokenizer

    (tmp_path / "vocab.json").write_text('{"a": 0, "b"')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(CheckpointError, match=r"vocab.json \+ .*merges.txt: not a valid vocab/merges pair"):
        Tokenizer.from_vocab_merges(tmp_path / "vocab.json", tmp_path / "merges.txt")


def test_a_tensor_given_twice_is_refused(tmp_path, model):
    sd = model.state_dict()
    sd["transformer.wte.weight"] = sd["wte.weight"] + 1
    expect_error(r"tensor 'wte.weight' appears twice", write_checkpoint(tmp_path, model, sd))


def test_a_config_claiming_more_blocks_than_the_file_holds_is_refused_before_any_table_is_built(tmp_path, model):
    directory = write_checkpoint(tmp_path, model)
    config = json.loads((directory / "config.json").read_text())
    config["n_layer"] = 10**9  # a table of 10**9 blocks' tensor names would not fit in memory
    (directory / "config.json").write_text(json.dumps(config))
    expect_error(rf"n_layer=1000000000, but the file holds {model.config.n_layer} blocks", directory)


def test_json_nested_thousands_deep_or_with_a_5000_digit_number_is_a_checkpoint_error(tmp_path, model):
    """json.loads raises RecursionError for '[' * 100000, and ValueError (not JSONDecodeError) for a huge int."""
    import struct

    for bad in ("[" * 100_000, '{"n_embd": 1' + "0" * 5000 + "}"):
        d = write_checkpoint(tmp_path / "config", model)
        (d / "config.json").write_text(bad)
        expect_error(r"config.json: not valid JSON", d)
        d = write_checkpoint(tmp_path / "header", model)
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad.encode())
        expect_error(r"model.safetensors: corrupt safetensors header", d)
        d = write_checkpoint(tmp_path / "index", model)
        (d / "model.safetensors").unlink()
        (d / "model.safetensors.index.json").write_text(bad)
        expect_error(r"index.json: not a valid safetensors index", d)


def test_safetensors_shapes_must_be_lists_of_whole_numbers_and_messages_stay_short(tmp_path, model):
    path = write_checkpoint(tmp_path, model) / "model.safetensors"
    original = path.read_bytes()
    for shape in ([float("inf")], [1e300], [2.0], [True], ["2"], "2", [-1], [1] * 65, [-1] + [1] * 100_000):
        path.write_bytes(original)
        rewrite_header(path, lambda h: h["ln_f.bias"].update(shape=shape))
        with pytest.raises(CheckpointError, match=r"corrupt header entry for tensor 'ln_f.bias' \(shape must be") as e:
            gpt2_core.load_model(tmp_path)
        assert len(str(e.value)) < 500  # not a megabyte of "1, 1, 1, ..."
    path.write_bytes(original)  # sizes are exact Python ints: no int64 wrap-around to a negative or zero size
    rewrite_header(path, lambda h: h["ln_f.bias"].update(shape=[2**32, 2**32]))
    expect_error(r"'ln_f.bias' has 96 bytes, but shape \[4294967296, 4294967296\] in F32 needs 73786976294838206464",
                 tmp_path)
    path.write_bytes(original)
    rewrite_header(path, lambda h: h.update({"x" * 10**6: h.pop("ln_f.bias")}))  # a megabyte-long tensor name
    with pytest.raises(CheckpointError) as e:
        gpt2_core.load_model(tmp_path)
    assert len(str(e.value)) < 500


def test_shards_stay_in_the_directory_and_hold_exactly_what_the_index_says(tmp_path, model):
    sd = model.state_dict()
    keys = list(sd)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config_json(TINY)))
    write_safetensors(d / "a.safetensors", {k: sd[k] for k in keys[:5]})
    write_safetensors(d / "b.safetensors", {k: sd[k] for k in keys[5:]})
    weight_map = {k: "a.safetensors" if i < 5 else "b.safetensors" for i, k in enumerate(keys)}

    def index(**changes):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {**weight_map, **changes}}))
        return d

    same_logits(model, gpt2_core.load_model(index()))
    write_checkpoint(tmp_path / "other", model)
    for outside in ("../other/model.safetensors", str(tmp_path / "other" / "model.safetensors"), ""):
        expect_error(rf"shard '{outside}' is not a file inside", index(**{"wte.weight": outside}))
    # a tensor in two shards: the second copy would silently replace the first
    write_safetensors(d / "c.safetensors", {"ln_f.bias": sd["ln_f.bias"] + 5})
    expect_error(r"tensor 'ln_f.bias' is in two shards, b.safetensors and c.safetensors",
                 index(extra="c.safetensors"))
    expect_error(r"weight_map puts tensor 'ln_f.bias' in a.safetensors, but b.safetensors holds it",
                 index(**{"ln_f.bias": "a.safetensors"}))
    expect_error(r"weight_map puts tensor 'x' in a.safetensors, but that shard does not hold it",
                 index(x="a.safetensors"))
    del weight_map["wpe.weight"]
    expect_error(r"weight_map does not list 'wpe.weight', but a.safetensors holds it", index())


def test_n_inner_other_than_4_n_embd_is_refused(tmp_path, model):
    write_checkpoint(tmp_path, model)
    good = config_json(TINY)
    for n_inner in (None, 4 * TINY.n_embd):
        (tmp_path / "config.json").write_text(json.dumps({**good, "n_inner": n_inner}))
        same_logits(model, gpt2_core.load_model(tmp_path))
    for n_inner in (50, 4 * TINY.n_embd + 1, "96", True):
        (tmp_path / "config.json").write_text(json.dumps({**good, "n_inner": n_inner}))
        expect_error(rf"n_inner={n_inner!r} is not supported \(GPT-2's MLP is 4 \* n_embd = 96 wide\)", tmp_path)
