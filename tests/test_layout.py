"""The package's layout keeps the chapters readable: chapter modules import only earlier chapters and plumbing,
never the appendix's kernels (``cpu_kernels``) or the benchmarks (``bench``), and their functions stay short."""

import ast
import json
import re

import pytest
from helpers import ROOT

PACKAGE = ROOT / "gpt2_core"
CHAPTER_MODULES = ["model", "sampling", "generation", "kv_cache", "sequence", "scheduler", "kv_store", "model_runner",
                   "engine", "static_batching", "block_manager", "paged_kv_store", "paged_attention", "prefix_cache",
                   "chunked_prefill", "caching_engine", "quantization", "quant_kv_store", "quant_kernels",
                   "process_group", "tensor_parallel", "pipeline_parallel", "routing", "priority_scheduler"]
# Modules that are not a chapter's lesson: loading, errors, the CLI, the classroom tooling, machine facts.
PLUMBING = ["__init__", "__main__", "config", "errors", "hub", "safetensors_io", "torch_bin", "tokenizer", "weights",
            "memory", "classroom"]
OUT_OF_BOUNDS = ("cpu_kernels", "bench", "classroom", "serving")
# Subpackages, all plumbing: the appendix's kernels, the benchmarks, the HTTP server (the serve extra).
SUBPACKAGES = ["bench", "cpu_kernels", "serving"]


def test_every_module_is_either_a_chapter_module_or_plumbing():
    """A new module must be placed: a chapter's (and so under the rules below) or plumbing, never forgotten."""
    found = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert sorted(CHAPTER_MODULES + PLUMBING) == found


def test_every_subpackage_is_listed():
    found = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
    assert found == sorted(SUBPACKAGES)


def imported_modules(path):
    """Every module ``path`` imports (relative imports resolved to names under gpt2_core), at any depth."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # from .x import y / from . import x
                yield from ([f"gpt2_core.{base}"] if base else [f"gpt2_core.{a.name}" for a in node.names])
            else:
                yield base
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


@pytest.mark.parametrize("name", CHAPTER_MODULES)
def test_a_chapter_module_imports_no_kernels_and_no_benchmarks(name):
    found = [m for m in imported_modules(PACKAGE / f"{name}.py") if m.split(".")[:2][-1] in OUT_OF_BOUNDS]
    assert not found, f"gpt2_core/{name}.py imports {found}: chapters must not depend on the appendix or benchmarks"


@pytest.mark.parametrize("name", CHAPTER_MODULES)
def test_no_function_in_a_chapter_module_is_longer_than_50_lines(name):
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50]
    assert not long, f"gpt2_core/{name}.py: {long}"


def test_the_checks_see_a_forbidden_import():
    """The import walk resolves relative imports, so the test above would catch ``from .cpu_kernels import x``."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m.py"
        p.write_text("def f():\n    from .cpu_kernels import accelerate\n    from . import bench\n")
        assert list(imported_modules(p)) == ["gpt2_core.cpu_kernels", "gpt2_core.bench"]


# --- the chapter notebooks read as lessons ------------------------------------------------------------------------

NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
MAX_MARKDOWN_WORDS = 2500  # a chapter a learner reads in a sitting and a teacher covers in a 90-minute class
RUN_ID = re.compile(r"\b(runs? \d\d[a-z]\b|\d{4}-\d\d-\d\d[a-z]?\.json|data/benchmarks/)")


def markdown_of(notebook) -> str:
    cells = json.loads(notebook.read_text())["cells"]
    return "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_a_chapter_is_at_most_2500_words_of_prose(notebook):
    words = len(markdown_of(notebook).split())
    assert words <= MAX_MARKDOWN_WORDS, f"{notebook.name}: {words} markdown words (at most {MAX_MARKDOWN_WORDS})"


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[n.stem for n in NOTEBOOKS])
def test_a_chapter_cites_no_run_ids_or_dated_benchmark_files(notebook):
    """Prose quotes what the notebook's own cells print; a stored run is named by its place beside the notebook."""
    found = RUN_ID.findall(markdown_of(notebook))
    assert not found, f"{notebook.name} prose cites {found}"


def test_the_run_id_check_sees_one():
    assert RUN_ID.search("as run 04l showed") and RUN_ID.search("see kv-cache-2026-12-04l.json")
    assert not RUN_ID.search("results/kv-cache.json, 48 requests")
