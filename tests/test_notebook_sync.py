"""The code a notebook shows is the code the package runs.

A notebook cell whose first line is ``# gpt2_core/<module>.py`` shows package code: every function, class and
top-level assignment in it must appear, character for character, in that module. Edit one without the other and
this test names the cell and the definition that drifted.
"""

import ast
import json
import re

import pytest
from helpers import ROOT

MARKER = re.compile(r"^# (gpt2_core/[\w/]+\.py)\b")
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def definitions(source: str) -> dict[str, str]:
    """Top-level ``def`` / ``class`` / assignment name -> its exact source text."""
    tree = ast.parse(source)
    out = {}
    for node in tree.body:
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
    return out


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
    package = definitions((ROOT / module).read_text())
    shown = definitions(source)
    assert shown, f"{notebook.name} cell {index} is marked {module} but defines nothing"
    for name, text in shown.items():
        assert name in package, f"{notebook.name} cell {index}: {name!r} is not defined in {module}"
        assert text == package[name], f"{notebook.name} cell {index}: {name!r} differs from {module}"
