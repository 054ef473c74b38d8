"""The package's layout is the course's table of contents, and the tests derive the chapter map from it.

``gpt2_core/`` holds ``loading/`` (files -> model, no chapter's code), one folder per chapter in course order
(``ch01_forward/``, ``ch02_kv_cache/``, ... : ``ch<N>_<name>``), the appendix's ``a1_cpu_kernels/``, the benchmarks in
``bench/`` and the CLI on top. The rules, checked on every module by walking its imports:

* a chapter imports only earlier chapters, ``loading`` and ``errors`` (never a later chapter, the appendix, the
  benchmarks, the classroom tooling or the CLI);
* ``loading`` imports no chapter; the appendix imports no benchmark;
* no module imports a private name (``_x``) of another module; there are no import circles;
* a chapter's functions stay short (50 lines at most).
"""

import ast
import json
import re
from pathlib import Path

import pytest
from helpers import ROOT

PACKAGE = ROOT / "gpt2_core"
CHAPTER = re.compile(r"^ch(\d{2})_[a-z0-9_]+$")  # two digits, so that `ls` lists them in course order
CHAPTERS = sorted((p.name for p in PACKAGE.iterdir() if CHAPTER.match(p.name)), key=lambda n: int(CHAPTER.match(n)[1]))
FLOOR = ["errors", "loading"]  # what any chapter may import besides earlier chapters
TOOLING = ["bench", "a1_cpu_kernels", "classroom", "diagrams", "__main__", "__init__"]  # above the chapters
TOP_LEVEL = sorted(["__init__.py", "__main__.py", "errors.py", "classroom.py", "data", "loading", "bench",
                    "a1_cpu_kernels", "diagrams", *CHAPTERS])


def part_of(module: str) -> str | None:
    """'gpt2_core.ch03_batching.engine' -> 'ch03_batching'; names outside the package -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "gpt2_core" and len(parts) > 1 else ("__init__" if module == "gpt2_core" else None)


def chapter_number(part: str) -> int | None:
    match = CHAPTER.match(part or "")
    return int(match[1]) if match else None


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str | None = None):
    """(module imported, names taken from it) for every import in ``path``, at any depth, relative imports resolved
    from ``module`` (the dotted name of ``path``; a package's ``__init__`` is the package)."""
    module = module or module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
                base = ".".join(base)
            else:
                base = node.module or ""
            if node.module is None:  # from . import a, b: each name is a module
                for a in node.names:
                    yield f"{base}.{a.name}", []
            else:
                yield base, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, []


def imported_modules(path: Path, module: str | None = None):
    return [m for m, _ in imported_names(path, module)]


MODULES = sorted(PACKAGE.rglob("*.py"))
IDS = [str(p.relative_to(PACKAGE)) for p in MODULES]


def test_the_folders_are_the_table_of_contents():
    """``ls gpt2_core`` reads as the README's chapter table: chapter folders numbered 1, 2, 3, ... without a gap."""
    assert sorted(p.name for p in PACKAGE.iterdir() if p.name != "__pycache__") == TOP_LEVEL
    assert [chapter_number(c) for c in CHAPTERS] == list(range(1, len(CHAPTERS) + 1))
    for folder in [*CHAPTERS, "loading", "bench", "a1_cpu_kernels"]:
        assert (PACKAGE / folder / "__init__.py").exists(), f"{folder} is not a package"


def test_the_readme_table_lists_every_chapter_folder():
    readme = (ROOT / "README.md").read_text()
    for chapter in CHAPTERS:
        assert f"`{chapter}/`" in readme, f"README.md's chapter table does not name gpt2_core/{chapter}/"


def forbidden_imports(path: Path, module: str | None = None) -> list[str]:
    """The imports of ``path`` that break the layering rules of this file's docstring."""
    module = module or module_name(path)
    here = part_of(module)
    n = chapter_number(here)
    bad = []
    for target, names in imported_names(path, module):
        there = part_of(target)
        if there is None or there == here:
            continue
        if n is not None:  # a chapter: earlier chapters and the floor only
            m = chapter_number(there)
            if not (there in FLOOR or (m is not None and m < n)):
                bad.append(target)
        elif here == "loading" and there not in ("errors",):
            bad.append(target)
        elif here == "a1_cpu_kernels" and there in ("bench", "classroom", "__main__"):
            bad.append(target)
    return bad


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_a_module_imports_only_what_its_place_allows(path):
    bad = forbidden_imports(path)
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: see the rules in tests/test_layout.py's docstring"


@pytest.mark.parametrize("path", MODULES, ids=IDS)
def test_no_module_imports_a_private_name_of_another(path):
    module = module_name(path)
    private = [f"{m}.{n}" for m, names in imported_names(path) for n in names
               if n.startswith("_") and not n.startswith("__") and m != module]
    assert not private, f"{path.relative_to(ROOT)} imports private names {private}"


def test_there_are_no_import_circles():
    """Module-level and function-level imports alike: a circle means two modules are one idea split in two."""
    graph = {}
    known = {module_name(p) for p in MODULES}
    for p in MODULES:
        me = module_name(p)
        targets = set()
        for target, names in imported_names(p):
            for candidate in [f"{target}.{n}" for n in names] + [target]:
                if candidate in known and candidate != me:
                    targets.add(candidate)
                    break
        graph[me] = {t for t in targets if not me.startswith(t + ".") and t != "gpt2_core"}
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = 1
        for t in graph.get(node, ()):
            if state.get(t) == 1:
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])
    assert not cycles, f"import circles: {cycles}"


CHAPTER_MODULES = [p for p in MODULES if chapter_number(part_of(module_name(p)))]


@pytest.mark.parametrize("path", CHAPTER_MODULES, ids=[str(p.relative_to(PACKAGE)) for p in CHAPTER_MODULES])
def test_no_function_in_a_chapter_module_is_longer_than_50_lines(path):
    tree = ast.parse(path.read_text())
    long = [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > 50]
    assert not long, f"{path.relative_to(ROOT)}: {long}"


def test_the_checks_see_a_forward_import_and_a_private_one(tmp_path):
    """The rules are checked, not assumed: a chapter 3 module that imports chapter 5, the appendix or the benchmarks
    (relative or absolute, at any depth) is caught, and so is loading importing chapter 1."""
    p = tmp_path / "m.py"
    p.write_text("from ..ch05_sharing.prefix_cache import X\nfrom ..ch01_forward import model\n"
                 "def f():\n    from ..a1_cpu_kernels import accelerate\n    import gpt2_core.bench.common\n")
    assert forbidden_imports(p, "gpt2_core.ch03_batching.m") == [
        "gpt2_core.ch05_sharing.prefix_cache", "gpt2_core.a1_cpu_kernels", "gpt2_core.bench.common"]
    assert forbidden_imports(p, "gpt2_core.loading.m") == [
        "gpt2_core.ch05_sharing.prefix_cache", "gpt2_core.ch01_forward", "gpt2_core.a1_cpu_kernels",
        "gpt2_core.bench.common"]
    p.write_text("from ..ch01_forward.model import _private, public\n")
    assert [n for m, ns in imported_names(p, "gpt2_core.ch03_batching.m") for n in ns if n.startswith("_")] == ["_private"]


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
