"""pyproject.toml and environment.yml list the same dependencies; the README's commands are what CI runs."""

import re
import tomllib

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
    assert "-m gpt2_core generate" in floors_part and "-m pytest" in floors_part and " tests/" in floors_part
