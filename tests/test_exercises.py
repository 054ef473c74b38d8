"""Lint of every chapter's exercises (nbgrader format), without running anything.

Each chapter notebook ``notebooks/NN_*.ipynb`` carries at least two autograded exercises: a solution cell
(``### BEGIN SOLUTION`` / ``### END SOLUTION``, nbgrader metadata ``solution: true``) followed by a locked test cell
(``grade: true``, points > 0) whose visible asserts a learner can run and whose ``### BEGIN HIDDEN TESTS`` block
checks more. ``tests/test_classroom.py`` proves that nbgrader releases and grades them.
"""

import re

import pytest

from gpt2_core.classroom import (HIDDEN_BEGIN, HIDDEN_END, SOLUTION_BEGIN, SOLUTION_END, cell_source,
                                 chapter_notebooks, nbgrader_cells, read_notebook)

CHAPTERS = chapter_notebooks()
MARKERS = (SOLUTION_BEGIN, SOLUTION_END, HIDDEN_BEGIN, HIDDEN_END)


def region_lines(source: str, begin: str, end: str) -> tuple[list[str], list[str]]:
    """(lines inside begin/end regions, lines outside) of a cell's source; asserts the markers pair up."""
    inside, outside, depth = [], [], 0
    for line in source.split("\n"):
        s = line.strip()
        if s == begin:
            assert depth == 0, f"nested {begin!r}"
            depth = 1
        elif s == end:
            assert depth == 1, f"{end!r} without {begin!r}"
            depth = 0
        else:
            (inside if depth else outside).append(line)
    assert depth == 0, f"{begin!r} without {end!r}"
    return inside, outside


def code_lines(lines):
    return [line for line in lines if line.strip() and not line.strip().startswith("#")]


@pytest.fixture(params=CHAPTERS, ids=[p.stem for p in CHAPTERS])
def notebook(request):
    return request.param, read_notebook(request.param)


def test_there_are_chapters():
    assert [p.name for p in CHAPTERS][:2] == ["01_naive_forward.ipynb", "02_kv_cache.ipynb"]


def test_at_least_two_graded_exercises_with_points(notebook):
    path, nb = notebook
    tests = [c for c in nbgrader_cells(nb) if c.kind == "tests"]
    assert len(tests) >= 2, f"{path.name}: {len(tests)} autograded test cell(s); every chapter needs >= 2"
    for c in tests:
        assert c.points > 0, f"{path.name}: test cell {c.grade_id!r} has no points"
        assert c.cell_type == "code"


def test_grade_ids_are_unique_and_well_formed(notebook):
    path, nb = notebook
    ids = [c.grade_id for c in nbgrader_cells(nb)]
    assert all(ids), f"{path.name}: an nbgrader cell without grade_id"
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    assert not dupes, f"{path.name}: duplicate grade_id(s) {dupes}"
    for i in ids:  # nbgrader uses grade ids in file names and URLs of its formgrader
        assert re.fullmatch(r"[A-Za-z0-9_-]+", i), f"{path.name}: grade_id {i!r}: letters, digits, _ and - only"


def test_nbgrader_metadata_is_complete(notebook):
    path, nb = notebook
    for cell in nb["cells"]:
        meta = cell.get("metadata", {}).get("nbgrader")
        if meta is None:
            continue
        where = f"{path.name}: cell {meta.get('grade_id')!r}"
        assert meta.get("schema_version") == 3, where
        for key in ("grade", "solution", "locked", "grade_id"):
            assert key in meta, f"{where}: nbgrader metadata lacks {key!r}"
        if meta["grade"] and not meta["solution"]:
            assert meta["locked"], f"{where}: a test cell must be locked (students cannot edit the tests)"
        if meta["solution"]:
            assert not meta["locked"], f"{where}: a solution cell must not be locked"


def test_every_solution_cell_has_markers_and_a_solution(notebook):
    path, nb = notebook
    solutions = [c for c in nbgrader_cells(nb) if c.kind == "solution" and c.cell_type == "code"]
    assert solutions, f"{path.name}: no solution cells"
    for c in solutions:
        assert SOLUTION_BEGIN in c.source and SOLUTION_END in c.source, \
            f"{path.name}: solution cell {c.grade_id!r} lacks {SOLUTION_BEGIN!r} / {SOLUTION_END!r}"
        inside, _ = region_lines(c.source, SOLUTION_BEGIN, SOLUTION_END)
        assert code_lines(inside), f"{path.name}: solution cell {c.grade_id!r} has an empty solution"
        assert HIDDEN_BEGIN not in c.source, f"{path.name}: hidden tests inside solution cell {c.grade_id!r}"


def test_every_test_cell_has_visible_and_hidden_tests(notebook):
    path, nb = notebook
    for c in nbgrader_cells(nb):
        if c.kind != "tests":
            continue
        assert HIDDEN_BEGIN in c.source and HIDDEN_END in c.source, \
            f"{path.name}: test cell {c.grade_id!r} has no {HIDDEN_BEGIN!r} ... {HIDDEN_END!r} block"
        hidden, visible = region_lines(c.source, HIDDEN_BEGIN, HIDDEN_END)
        assert code_lines(visible), f"{path.name}: test cell {c.grade_id!r}: no visible tests for the learner"
        assert code_lines(hidden), f"{path.name}: test cell {c.grade_id!r}: the hidden block is empty"
        assert SOLUTION_BEGIN not in c.source, f"{path.name}: solution markers in test cell {c.grade_id!r}"


def test_every_test_cell_follows_its_own_solution_cell(notebook):
    """Each exercise is 'write this, then these tests check it': a test cell with no solution cell between it and
    the previous test cell would test nothing the learner wrote (and could not be solved on its own)."""
    path, nb = notebook
    since_last_test = 0
    for c in nbgrader_cells(nb):
        if c.kind in ("solution", "manual"):
            since_last_test += 1
        elif c.kind == "tests":
            assert since_last_test, f"{path.name}: test cell {c.grade_id!r} has no solution cell before it"
            since_last_test = 0


def test_markers_only_in_nbgrader_cells(notebook):
    """nbgrader (enforce_metadata) only strips solutions and hidden tests from cells that carry its metadata;
    markers anywhere else would be shipped to learners, or make generate_assignment fail."""
    path, nb = notebook
    for i, cell in enumerate(nb["cells"]):
        if cell.get("metadata", {}).get("nbgrader"):
            continue
        src = cell_source(cell)
        for marker in MARKERS:
            assert marker not in src, f"{path.name}: cell {i} has {marker!r} but no nbgrader metadata"


def test_solution_cells_come_with_a_stubbed_signature(notebook):
    """A solution cell that defines a function keeps its ``def`` line outside the solution block, so the student
    version still defines the name (raising NotImplementedError) and the tests fail cleanly, not with NameError."""
    path, nb = notebook
    for c in nbgrader_cells(nb):
        if c.kind != "solution" or c.cell_type != "code":
            continue
        inside, outside = region_lines(c.source, SOLUTION_BEGIN, SOLUTION_END)
        defined_inside = {m.group(1) for m in (re.match(r"def (\w+)\(", line) for line in inside) if m}
        assert not defined_inside, f"{path.name}: {c.grade_id!r}: keep `def {sorted(defined_inside)[0]}(...)` " \
                                   "outside the solution block"
