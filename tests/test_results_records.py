"""The stored benchmark results the notebooks plot (``notebooks/results/*.json``) are full-size runs on a quiet
machine, like the notebooks that show them. Each records the load it started at (``machine.load_average_1min``);
runs made with ``data/run_benchmarks.py`` also record how (``recorded``: command, commit, the machine's bandwidth and
GEMM rate measured just before)."""

import json
import re
import subprocess
from functools import cache

import pytest
from helpers import ROOT

RESULTS = sorted((ROOT / "notebooks" / "results").glob("*.json"))
assert RESULTS, "no stored results found"


@cache
def notebook_texts() -> dict[str, str]:
    """Each notebook's text, by its name without the suffix."""
    return {p.stem: p.read_text() for p in sorted((ROOT / "notebooks").glob("*.ipynb"))}


def notebooks_text() -> str:
    return "".join(notebook_texts().values())


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_a_stored_result_is_a_quiet_full_size_run(path):
    result = json.loads(path.read_text())
    assert result.get("quick") is False, f"{path.name}: quick is {result.get('quick')!r}: a quick-mode run"
    load = result.get("machine", {}).get("load_average_1min")
    assert isinstance(load, (int, float)) and 0 <= load < 1, f"{path.name}: made at load {load!r}: rerun it alone " \
        f"with data/run_benchmarks.py {path.stem}"
    recorded = result.get("recorded")
    if recorded is not None:
        assert recorded["load_1min_start"] < 1 and recorded["command"].startswith("python -m gpt2_core bench ")
        assert recorded["bytes_per_s"] > 0 and recorded["gemm_flops_per_s"] > 0 and recorded["commit"]


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_a_stored_result_is_plotted_or_quoted_by_a_notebook(path):
    """One file per benchmark that a chapter shows; lab history stays in git."""
    assert f"results/{path.name}" in notebooks_text(), f"{path.name} is shown by no notebook"


@cache
def stored_runs_table() -> dict[str, list[str]]:
    """``data/benchmarks/README.md``'s table of the stored runs, by file: its cells after the file's."""
    text = (ROOT / "data" / "benchmarks" / "README.md").read_text()
    table = text.split("<!-- stored-runs -->\n", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    return {row[0].strip("`"): row[1:] for row in rows}


def host_of(machine: dict) -> str:
    """How the table names a run's host: the CPU's name without trademarks, and OpenBLAS's kernel family."""
    cpu = re.sub(r"\((R|TM)\)| Processor| CPU.*", "", machine.get("cpu") or "").strip() or "not recorded"
    return f"{cpu} ({(machine.get('blas') or [{}])[0].get('architecture')})"


def last_commit(path) -> tuple[str, str] | None:
    """(abbreviated hash, date) of the last commit that wrote ``path``, or None outside a git checkout with its
    history (a shallow clone knows only its newest commits)."""
    try:
        shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                                 text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return None
        out = subprocess.run(["git", "log", "-1", "--abbrev=7", "--format=%h %ad", "--date=short", "--", str(path)],
                             cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    fields = out.stdout.split()
    return (fields[0], fields[1]) if out.returncode == 0 and len(fields) == 2 else None


def minutes(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 60} min {whole % 60} s"


@pytest.mark.parametrize("path", RESULTS, ids=[p.stem for p in RESULTS])
def test_the_benchmarks_readme_table_is_the_stored_runs_own_record(path):
    """The table a reader meets in data/benchmarks/README.md says when, where and how quietly each stored run was
    made as the file itself records it: remaking a file without its row fails here."""
    table = stored_runs_table()
    assert path.name in table, f"data/benchmarks/README.md: no row for {path.name}"
    made, host, load, run_time, readers = table[path.name]
    notebooks = [name for name, text in notebook_texts().items() if f"results/{path.name}" in text]
    assert readers == ", ".join(f"`{n}`" for n in notebooks), f"{path.name}: read by {readers!r}, not {notebooks}"
    result = json.loads(path.read_text())
    recorded = result.get("recorded")
    assert host == host_of(result.get("machine", {})), f"{path.name}: host {host!r}"
    if recorded is None:  # made before runs were recorded: the machine record's load, the commit that last wrote it
        assert load == f"{result['machine']['load_average_1min']:.2f}", f"{path.name}: load {load!r}"
        assert run_time == "not recorded", f"{path.name}: run time {run_time!r} is in no record"
        last = last_commit(path)
        if last is not None:
            assert made == f"{last[1]} (last written in `{last[0]}`)", f"{path.name}: made {made!r}, git says {last}"
        return
    assert made == f"{recorded['executed'][:10]} (`{recorded['commit'][:7]}`)", f"{path.name}: made {made!r}"
    assert load == f"{recorded['load_1min_start']:.2f}", f"{path.name}: load {load!r}"
    assert run_time == minutes(recorded["duration_s"]), f"{path.name}: run time {run_time!r}"


def test_the_benchmarks_readme_table_names_only_stored_runs():
    assert sorted(stored_runs_table()) == [p.name for p in RESULTS]
