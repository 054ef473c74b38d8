"""The stored benchmark results the notebooks plot (``notebooks/results/*.json``) are full-size runs on a quiet
machine, like the notebooks that show them. Each records the load it started at (``machine.load_average_1min``);
runs made with ``data/run_benchmarks.py`` also record how (``recorded``: command, commit, the machine's bandwidth and
GEMM rate measured just before)."""

import json
from functools import cache

import pytest
from helpers import ROOT

RESULTS = sorted((ROOT / "notebooks" / "results").glob("*.json"))
assert RESULTS, "no stored results found"


@cache
def notebooks_text() -> str:
    return "".join(p.read_text() for p in (ROOT / "notebooks").glob("*.ipynb"))


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
