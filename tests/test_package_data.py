"""Where the package finds its run-time files (inside itself, with importlib.resources; GPT2_CORE_DATA overrides),
and what a model without a tokenizer does: a CheckpointError that says why, never an AttributeError on None.
tests/test_wheel.py checks the same from an installed wheel."""

import json
import os
import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np
import pytest

import gpt2_core
from gpt2_core import GPT2Config; from gpt2_core.loading import weights
from gpt2_core.errors import CheckpointError, GPT2Error
from gpt2_core.loading.tokenizer import MissingTokenizer
from helpers import PACKAGE_DATA, ROOT, TINY, tiny_model, write_checkpoint

GPT2_VOCAB_TINY = GPT2Config(vocab_size=50257, n_positions=16, n_embd=8, n_head=2, n_layer=1, eos_token_id=50256)


def python(code: str, **env):
    """Run ``code`` in a fresh interpreter (DATA_DIR is read at import) outside the checkout."""
    environ = {k: v for k, v in os.environ.items() if k != "GPT2_CORE_DATA"} | env
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=environ,
                          cwd=Path(os.sep))


def test_the_run_time_files_are_found_inside_the_package():
    assert "GPT2_CORE_DATA" not in os.environ
    assert weights.DATA_DIR == Path(files("gpt2_core") / "data") == PACKAGE_DATA  # this checkout: editable install
    assert weights.EMBEDDED_MODEL_DIR == PACKAGE_DATA / "embedded"
    assert gpt2_core.load_model().source == str(PACKAGE_DATA / "embedded" / "model.safetensors")
    assert (weights.DATA_DIR / "reference" / "embedded.npz").is_file()  # what chapter 1 reads
    assert gpt2_core.random_model("gpt2").tokenizer.encode("Hello world") == [15496, 995]  # GPT-2's ids


def test_gpt2_core_data_names_another_folder_of_the_same_layout(tmp_path):
    other = tmp_path / "data"
    shutil.copytree(PACKAGE_DATA / "embedded", other / "embedded")
    shutil.copytree(PACKAGE_DATA / "gpt2_tokenizer", other / "gpt2_tokenizer")
    code = ("import gpt2_core; from gpt2_core.loading.config import GPT2Config; from gpt2_core.loading import weights\n"
            "print(weights.DATA_DIR, gpt2_core.load_model().source)\n"
            f"print(gpt2_core.random_model(GPT2Config(**{vars(GPT2_VOCAB_TINY)!r})).tokenizer.source)")
    r = python(code, GPT2_CORE_DATA=str(other))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(other), str(other / "embedded" / "model.safetensors"),
                                str(other / "gpt2_tokenizer" / "tokenizer.json")]


def test_a_gpt2_core_data_folder_without_the_files_says_so(tmp_path):
    code = ("import gpt2_core; from gpt2_core.loading.config import GPT2Config\n"
            f"model = gpt2_core.random_model(GPT2Config(**{vars(GPT2_VOCAB_TINY)!r}))\n"
            "print(gpt2_core.generate(model, [464, 318], 2))\n"  # token ids need no tokenizer
            "for call in (lambda: model.tokenizer.encode('Hello'), lambda: model.tokenizer.decode([1]),\n"
            "             lambda: gpt2_core.load_model()):\n"
            "    try:\n"
            "        call()\n"
            "    except gpt2_core.GPT2Error as e:\n"
            "        print(type(e).__name__, '|', e)\n")
    r = python(code, GPT2_CORE_DATA=str(tmp_path))
    assert r.returncode == 0, r.stderr
    ids, encode, decode, load = r.stdout.splitlines()
    assert len(eval(ids)) == 2
    missing = tmp_path / "gpt2_tokenizer" / "tokenizer.json"
    for line in (encode, decode):
        assert line.startswith("CheckpointError | ") and f"GPT-2's own tokenizer is missing: {missing}" in line
        assert "GPT2_CORE_DATA names a folder without it" in line
    assert load == (f"CheckpointError | {tmp_path / 'embedded'}: the embedded model is missing (GPT2_CORE_DATA names "
                    "a folder without it)")


def test_random_gpt2_without_gpt2s_tokenizer_fails_clearly_when_text_is_encoded(monkeypatch, tmp_path):
    monkeypatch.setattr(weights, "GPT2_TOKENIZER_FILE", tmp_path / "gone" / "tokenizer.json")
    model = gpt2_core.random_model("gpt2")
    assert isinstance(model.tokenizer, MissingTokenizer) and not model.tokenizer
    for use in (lambda: model.tokenizer.encode("Hello world"), lambda: model.tokenizer.decode([15496]),
                lambda: list(model.tokenizer.decode_stream([15496])), lambda: model.tokenizer.vocab_size):
        with pytest.raises(CheckpointError) as info:
            use()
        assert str(info.value) == (f"random(gpt2) has no tokenizer of its own; its vocabulary is GPT-2's, but GPT-2's "
                                   f"own tokenizer is missing: {tmp_path / 'gone' / 'tokenizer.json'} (reinstall "
                                   "gpt2-numpy, or rebuild it with data/build_gpt2_tokenizer.py)")


def test_models_without_a_tokenizer_take_ids_and_refuse_text_with_a_reason(tmp_path):
    folder = write_checkpoint(tmp_path, tiny_model())
    made = (gpt2_core.load_model(folder), gpt2_core.random_model(TINY), gpt2_core.GPT2Model(TINY, tiny_model().params))
    reasons = (f"no tokenizer found beside the checkpoint in {folder} (tokenizer.json, or vocab.json + merges.txt)",
               "random(custom config) has vocab_size=101, not GPT-2's 50,257, and no tokenizer",
               "this model was made without a tokenizer")
    for model, reason in zip(made, reasons):
        assert isinstance(model.tokenizer, MissingTokenizer) and not model.tokenizer
        assert model.tokenizer.eos_token_id is None
        with pytest.raises(GPT2Error, match="^" + reason.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
            model.tokenizer.encode("Emma")
        with pytest.raises(CheckpointError):
            model.tokenizer.decode([1, 2])
        assert len(gpt2_core.generate(model, np.array([1, 2, 3]), 3, stop_at_eos=False)) == 3  # ids need none


def test_a_checkpoint_with_gpt2s_vocabulary_and_no_tokenizer_files_gets_gpt2s_tokenizer(tmp_path):
    folder = write_checkpoint(tmp_path, gpt2_core.random_model(GPT2_VOCAB_TINY))
    assert not (folder / "tokenizer.json").exists()
    model = gpt2_core.load_model(folder)
    assert model.tokenizer.source == str(PACKAGE_DATA / "gpt2_tokenizer" / "tokenizer.json")
    assert model.tokenizer.encode("Hello world") == [15496, 995]


def test_the_wheel_takes_the_run_time_files_and_leaves_the_rest():
    """pyproject.toml's package-data lists exactly the files the package reads at run time, and they exist."""
    import tomllib

    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gpt2_core"]
    assert sorted(listed) == sorted([f"data/embedded/{name}" for name in (
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")] + [
        "data/gpt2_tokenizer/tokenizer.json", "data/gpt2_tokenizer/tokenizer_config.json",
        "data/reference/embedded.npz", "data/heldout/austen_validation.txt"])
    for name in listed:
        assert (ROOT / "gpt2_core" / name).is_file(), name
    assert json.loads((PACKAGE_DATA / "embedded" / "config.json").read_text())["vocab_size"] == 4096
