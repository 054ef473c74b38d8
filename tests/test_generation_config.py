"""Sampling defaults from a checkpoint's generation_config.json: what the CLI (and HF's text-generation pipeline)
samples with unless told otherwise, and the README's first command, which prints varied text and the seed that
repeats it."""

import collections
import json
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import gpt2_core
from gpt2_core.errors import CheckpointError, InvalidInputError
from gpt2_core.loading.config import sampling_defaults
from gpt2_core.loading.weights import EMBEDDED_MODEL_DIR
from helpers import ROOT, tiny_model, write_checkpoint

GREEDY = {"temperature": 0.0, "top_k": None, "top_p": None}
PROMPT = "It is a truth universally acknowledged"


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gpt2_core", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def embedded_copy(tmp_path, generation_config: dict | None):
    """The embedded model in a folder of its own, with the given generation_config.json (None: without one)."""
    folder = shutil.copytree(EMBEDDED_MODEL_DIR, tmp_path / "model")
    (folder / "generation_config.json").unlink()
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_hf_rules_greedy_unless_do_sample_then_hf_defaults_for_what_is_not_set():
    assert sampling_defaults({}) == GREEDY
    assert sampling_defaults({"do_sample": False, "temperature": 0.5, "top_k": 3}) == GREEDY
    # transformers' GenerationConfig defaults when do_sample is on: temperature 1.0, top_k 50, top_p 1.0
    assert sampling_defaults({"do_sample": True}) == {"temperature": 1.0, "top_k": 50, "top_p": 1.0}
    assert sampling_defaults({"do_sample": True, "temperature": 0.9, "top_k": None, "top_p": 0.5, "max_length": 9}
                             ) == {"temperature": 0.9, "top_k": 50, "top_p": 0.5}  # null: not set
    assert sampling_defaults({"do_sample": True, "top_k": 0}) == {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    for bad in ({"do_sample": True, "temperature": -1}, {"do_sample": True, "top_p": 2},
                {"do_sample": True, "top_k": 1.5}, {"do_sample": "yes"}):
        with pytest.raises(InvalidInputError):
            sampling_defaults(bad)


def test_the_embedded_model_samples_with_the_settings_of_its_generation_config():
    model = gpt2_core.load_model()
    settings = json.loads((EMBEDDED_MODEL_DIR / "generation_config.json").read_text())
    assert settings["do_sample"] is True
    assert model.sampling_defaults == {name: settings[name] for name in ("temperature", "top_k", "top_p")}
    ids = model.tokenizer.encode(PROMPT)
    assert gpt2_core.generate(model, ids, 12) == gpt2_core.generate(model, ids, 12, temperature=0)  # API: greedy
    sampled = gpt2_core.generate(model, ids, 12, **model.sampling_defaults, seed=4)
    # the CLI samples with the same settings: same seed, same text
    r = cli("generate", PROMPT, "--max-new-tokens", "12", "--seed", "4")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout == PROMPT + model.tokenizer.decode(sampled, skip_special_tokens=True) + "\n"


def test_a_random_model_and_a_folder_without_generation_config_decode_greedily(tmp_path):
    assert gpt2_core.random_model(tiny_model().config).sampling_defaults == GREEDY
    folder = write_checkpoint(tmp_path, tiny_model())
    assert gpt2_core.load_model(folder).sampling_defaults == GREEDY


def test_config_json_task_specific_params_count_as_hf_pipeline_counts_them(tmp_path):
    """GPT-2's own config.json says task_specific_params: {"text-generation": {"do_sample": true, "max_length": 50}},
    which is why HF's text-generation pipeline samples it (temperature 1, top_k 50) although its
    generation_config.json sets nothing."""
    folder = write_checkpoint(tmp_path, tiny_model())
    config = json.loads((folder / "config.json").read_text())
    config["task_specific_params"] = {"text-generation": {"do_sample": True, "max_length": 50}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 100, "temperature": 0.6}))
    assert gpt2_core.load_model(folder).sampling_defaults == {"temperature": 0.6, "top_k": 50, "top_p": 1.0}


def test_a_bad_generation_config_is_named(tmp_path):
    folder = write_checkpoint(tmp_path, tiny_model())
    for text, message in (('{"do_sample": true, "temperature": -2}', "temperature must be"),
                          ("[1, 2]", "expected a JSON object"), ("{not json", "not valid JSON")):
        (folder / "generation_config.json").write_text(text)
        with pytest.raises(CheckpointError, match=message) as info:
            gpt2_core.load_model(folder)
        assert "generation_config.json" in str(info.value)


def test_cli_flags_override_the_models_settings_and_temperature_0_is_greedy(tmp_path):
    folder = embedded_copy(tmp_path, {"do_sample": True, "temperature": 1.3, "top_k": 7, "top_p": 0.8})
    args = ("generate", PROMPT, "--max-new-tokens", "15")
    from_config = cli(*args, "--model", str(folder), "--seed", "2")
    from_flags = cli(*args, "--temperature", "1.3", "--top-k", "7", "--top-p", "0.8", "--seed", "2")
    assert from_config.returncode == 0 and from_config.stdout == from_flags.stdout
    assert from_config.stdout != cli(*args, "--seed", "2").stdout  # the embedded model's own settings differ
    greedy = cli(*args, "--temperature", "0")
    assert cli(*args, "--model", str(folder), "--temperature", "0").stdout == greedy.stdout
    assert greedy.stderr == ""  # greedy: no seed to report
    # a folder whose generation_config.json does not sample, or that has none, decodes greedily
    for settings in ({"do_sample": False, "temperature": 1.3}, None):
        shutil.rmtree(folder)
        folder = embedded_copy(tmp_path, settings)
        r = cli(*args, "--model", str(folder))
        assert r.returncode == 0 and r.stdout == greedy.stdout and r.stderr == ""
    r = cli(*args, "--model", str(folder), "--top-k", "5")
    assert r.stdout == greedy.stdout and "note: --top-k only applies when sampling" in r.stderr


def readme_run_command() -> list[str]:
    """The arguments of `python -m gpt2_core` in the README's first command, as typed."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- run-command -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1).strip()
    words = shlex.split(block.split("&&")[-1])
    assert words[:3] == [".venv/bin/python", "-m", "gpt2_core"], words
    return words[3:]


def test_the_readme_first_command_prints_sampled_text_and_the_seed_that_repeats_it():
    args = readme_run_command()
    assert "--seed" not in args and "--temperature" not in args  # the model's own settings, a fresh seed
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    seed = re.fullmatch(r"\(sampled with seed (\d+): add --seed \1 to repeat this text, --temperature 0 for "
                        r"greedy\)\n", first.stderr).group(1)
    again = cli(*args, "--seed", seed)
    assert again.stdout == first.stdout and again.stderr == ""
    # The README shows the text of --seed 0, word for word (wrapped over lines in its quote)
    readme = (ROOT / "README.md").read_text()
    quoted = re.search(r"<!-- run-output seed=0 -->\n((?:>.*\n)+)", readme).group(1)
    shown = " ".join(line[1:] for line in quoted.splitlines()).split()
    assert shown == cli(*args, "--seed", "0").stdout.split()


def test_sampled_text_does_not_loop_as_greedy_text_does():
    """Greedy decoding of this small model repeats itself ('I am sure I am sure ...'); sampling with the
    model's settings does not. Measured as the most frequent run of three words in 60 new tokens."""
    model = gpt2_core.load_model()
    ids = model.tokenizer.encode(PROMPT)

    def most_repeated_trigram(new_ids) -> int:
        words = model.tokenizer.decode(new_ids).split()
        return collections.Counter(zip(words, words[1:], words[2:])).most_common(1)[0][1]

    assert most_repeated_trigram(gpt2_core.generate(model, ids, 60)) >= 5
    for seed in range(5):
        assert most_repeated_trigram(gpt2_core.generate(model, ids, 60, **model.sampling_defaults, seed=seed)) <= 2
