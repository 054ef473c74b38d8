"""pyproject.toml and environment.yml list the same dependencies; the README's commands are what CI runs."""

import ast
import functools
import re
import tomllib
from pathlib import Path

import yaml
from helpers import ROOT
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def conda_specs():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    specs, pip = {}, None
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            pip = dep["pip"]
            continue
        name, spec = re.match(r"^([A-Za-z0-9_.\-]+)\s*(.*)$", dep).groups()
        specs[normalise(name)] = SpecifierSet(spec.replace(" ", ""))
    return env, specs, pip


def test_environment_yml_parses_and_installs_the_project_editable():
    env, specs, pip = conda_specs()
    assert env["name"] and "conda-forge" in env["channels"]
    assert pip == ["-e ."]
    assert "python" in specs and "pip" in specs


def test_core_and_test_dependencies_agree_with_environment_yml():
    project = pyproject()
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]]
    _, specs, _ = conda_specs()
    for req in wanted:
        assert normalise(req.name) in specs, f"{req.name} is in pyproject.toml but not in environment.yml"
        assert specs[normalise(req.name)] == req.specifier, f"{req.name}: {req.specifier} vs {specs[normalise(req.name)]}"
    extra = set(specs) - {normalise(r.name) for r in wanted} - {"python", "pip"}
    assert not extra, f"environment.yml has dependencies pyproject.toml lacks: {extra}"


def test_ci_runs_the_readme_commands():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_cmd = re.search(r"<!-- test-command -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1).strip()
    assert test_cmd in ci, "the README's test command must be what .ci/run executes"
    run_cmd = re.search(r"<!-- run-command -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1).strip()
    assert "python -m gpt2_core generate" in run_cmd


def floors() -> dict[str, str]:
    """.ci/floors.txt as {normalised name: version}."""
    lines = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "floors.txt").read_text().splitlines()]
    pins = [re.fullmatch(r"([A-Za-z0-9_.\-]+)==([0-9.]+)", line) for line in lines if line]
    assert all(pins), lines
    return {normalise(m.group(1)): m.group(2) for m in pins}


def test_floors_file_pins_every_direct_dependency_at_its_declared_lower_bound():
    """Every requirement of the package, its hub extra and its test extra has one lower bound (>=), and
    .ci/floors.txt pins exactly that version: CI installs these and runs the unit tests, so a floor is never a guess.
    (The reference extra is for rebuilding data/ and is not part of it: it pins torch exactly.)"""
    project = pyproject()
    direct = {}
    for text in project["dependencies"] + project["optional-dependencies"]["hub"] + \
            project["optional-dependencies"]["test"] + project["optional-dependencies"]["classroom"]:
        req = Requirement(text)
        (spec,) = req.specifier  # one clause: the floor
        assert spec.operator == ">=", f"{text}: give a lower bound (>=) and nothing else"
        assert direct.setdefault(normalise(req.name), spec.version) == spec.version, f"{req.name}: two floors"
    assert floors() == direct


def test_ci_installs_the_floors_and_runs_the_unit_tests_and_the_cli_with_them():
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install -q -c .ci/floors.txt -e '.[test]'" in ci
    floors_part = ci[ci.index("-c .ci/floors.txt"):]
    assert "-m gpt2_core generate" in floors_part and "-m pytest" in floors_part and "floors_tests.txt" in floors_part


# --- the floors step runs the tests that exercise a floor (.ci/floors_tests.txt) --------------------------------------

NOTEBOOK_TOOLS = {"jupyter", "nbval", "nbgrader"}  # they run the notebooks and the round trip: step 1 only
IMPORT_NAMES = {"pyyaml": "yaml"}  # distributions whose module has another name


def floors_tests() -> dict[str, set[str]]:
    """.ci/floors_tests.txt as {test file: the floored distributions its line names}."""
    rows = {}
    for line in (ROOT / ".ci" / "floors_tests.txt").read_text().splitlines():
        path, *dists = line.split("#")[0].split() or [None]
        if path:
            assert path not in rows, f".ci/floors_tests.txt names {path} twice"
            rows[path] = {normalise(d) for d in dists}
    return rows


def module_file(name: str) -> Path | None:
    """The file of a gpt2_core module, or of a module beside the tests (helpers), by dotted name."""
    base = ROOT if name.startswith("gpt2_core") else ROOT / "tests"
    for candidate in (base / (name.replace(".", "/") + ".py"), base / name.replace(".", "/") / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def direct_imports(path: Path) -> frozenset[str]:
    """Dotted names a module imports, anywhere in it (relative imports resolved; ``from a import b`` gives ``a`` and
    ``a.b``, which may be a module; ``pytest.importorskip("a")`` gives ``a``)."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            parts = list(package[:len(package) - node.level + 1]) if node.level else []
            base = ".".join(parts + ([node.module] if node.module else []))
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip" and node.args and \
                isinstance(node.args[0], ast.Constant):  # pytest.importorskip("gguf")
            names.add(node.args[0].value)
    return frozenset(names)


def imported_packages(path: Path) -> set[str]:
    """Top-level packages a test module imports, itself or through the gpt2_core and helper modules it imports."""
    found, todo, seen = set(), [path], set()
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for name in direct_imports(file):
            found.add(name.split(".")[0])
            if (module := module_file(name)) is not None:
                todo.append(module)
    return found


def test_floors_step_runs_a_test_of_every_floor():
    rows = floors_tests()
    declared = set(floors())
    for path, dists in rows.items():
        assert (ROOT / path).is_file() and Path(path).name.startswith("test_"), f"{path}: no such test file"
        assert dists, f"{path}: name the floored distributions it exercises"
        assert dists <= declared, f"{path}: {sorted(dists - declared)} have no floor in .ci/floors.txt"
        missing = {d for d in dists if IMPORT_NAMES.get(d, d).replace("-", "_") not in imported_packages(ROOT / path)}
        assert not missing, f"{path} does not import {sorted(missing)}, directly or through what it imports"
    untested = declared - NOTEBOOK_TOOLS - {"pytest"} - set().union(*rows.values())
    assert not untested, f"no test in .ci/floors_tests.txt exercises the floor of {sorted(untested)}"
