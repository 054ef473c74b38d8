"""The code a notebook shows is the code the package runs.

A notebook cell whose first line is ``# gpt2_core/<module>.py`` shows package code: every function, class and
top-level assignment in it must appear, character for character, in that module. Edit one without the other and
this test names the cell and the definition that drifted.

A class may be shown in part (an excerpt: the core methods of a class whose other methods are plumbing): its
``class`` line must be the package's, and every method, assignment and docstring it shows must be the package's,
character for character.
"""

import ast
import json
import re

import pytest
from helpers import ROOT

MARKER = re.compile(r"^# (gpt2_core/[\w/]+\.py)\b")
NOTEBOOKS = sorted([*(ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"), *(ROOT / "notebooks").glob("A[0-9]_*.ipynb")])


def definitions(source: str, body=None) -> dict[str, str]:
    """Top-level ``def`` / ``class`` / assignment name -> its exact source text (of ``body``'s statements: a class's,
    say; its docstring then under ``"__doc__"``)."""
    out = {}
    for node in ast.parse(source).body if body is None else body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out[node.name] = ast.get_source_segment(source, node, padded=False)
            if node.decorator_list:  # include decorators, they are part of the definition
                first = node.decorator_list[0]
                lines = source.splitlines()[first.lineno - 1: node.end_lineno]
                out[node.name] = "\n".join(lines).strip()
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    out[t.id] = ast.get_source_segment(source, node)
        elif body is not None and isinstance(node, ast.Expr) and isinstance(getattr(node, "value", None), ast.Constant):
            out["__doc__"] = ast.get_source_segment(source, node)
    return out


def class_parts(source: str, name: str) -> tuple[str, dict[str, str]]:
    """(the ``class`` line with its decorators, {member: exact source text}) of top-level class ``name``."""
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)
    first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
    header = "\n".join(source.splitlines()[first - 1: node.lineno]).strip()
    return header, definitions(source, node.body)


def differences(shown_source: str, package_source: str, name: str) -> list[str]:
    """What makes the shown definition ``name`` differ from the package's: [] if it is identical, or if it is a
    class excerpt whose ``class`` line and every shown member are the package's."""
    shown, package = definitions(shown_source)[name], definitions(package_source)[name]
    if shown == package:
        return []
    try:
        header, members = class_parts(shown_source, name)
        package_header, package_members = class_parts(package_source, name)
    except StopIteration:  # one of them is not a class
        return [name]
    wrong = [] if header == package_header else [f"{name} (its class line)"]
    return wrong + [f"{name}.{m}" for m, text in members.items() if package_members.get(m) != text]


def exported_cells(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    for index, cell in enumerate(cells):
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        match = MARKER.match(source)
        if cell["cell_type"] == "code" and match:
            yield index, match.group(1), source


CASES = [(nb, i, mod, src) for nb in NOTEBOOKS for i, mod, src in exported_cells(nb)]


def test_every_chapter_notebook_shows_package_code():
    for nb in NOTEBOOKS:
        assert any(True for _ in exported_cells(nb)), f"{nb.name} has no cell marked '# gpt2_core/...py'"


@pytest.mark.parametrize("notebook,index,module,source", CASES,
                         ids=[f"{c[0].stem}-cell{c[1]}" for c in CASES])
def test_notebook_cell_is_identical_to_the_package(notebook, index, module, source):
    package_source = (ROOT / module).read_text()
    package = definitions(package_source)
    shown = definitions(source)
    assert shown, f"{notebook.name} cell {index} is marked {module} but defines nothing"
    for name in shown:
        assert name in package, f"{notebook.name} cell {index}: {name!r} is not defined in {module}"
        drifted = differences(source, package_source, name)
        assert not drifted, f"{notebook.name} cell {index}: {', '.join(drifted)} differs from {module}"


def test_a_class_excerpt_must_match_member_by_member():
    package = "class A(B):\n    \"\"\"Doc.\"\"\"\n\n    x = 1\n\n    def f(self):\n        return 1\n\n    def g(self):\n        return 2\n"
    assert differences(package, package, "A") == []
    assert differences("class A(B):\n    def g(self):\n        return 2\n", package, "A") == []  # an excerpt
    assert differences("class A(B):\n    def g(self):\n        return 3\n", package, "A") == ["A.g"]
    assert differences("class A(B):\n    def h(self):\n        return 2\n", package, "A") == ["A.h"]
    assert differences("class A:\n    def g(self):\n        return 2\n", package, "A") == ["A (its class line)"]
    assert differences("class A(B):\n    \"\"\"Other.\"\"\"\n    x = 1\n", package, "A") == ["A.__doc__"]
    assert differences("def A():\n    return 2\n", package, "A") == ["A"]
