"""Classroom use: release the chapters as nbgrader assignments, autograde submissions, and print a grade table.

This module is a thin wrapper around nbgrader's own commands; it does no grading of its own. It

1. creates an nbgrader *course directory* on the fly (in a temporary directory, or one you name), with one
   assignment per chapter: ``source/01_naive_forward/01_naive_forward.ipynb``, ...;
2. runs ``nbgrader generate_assignment`` (student versions in ``release/``: solutions replaced by
   ``raise NotImplementedError()``, hidden tests removed, outputs cleared);
3. copies submissions into ``submitted/<student>/<chapter>/`` and runs ``nbgrader autograde`` (nbgrader puts the
   locked test cells, hidden tests included, back from its gradebook, executes every notebook top to bottom and
   records the points of each test cell);
4. runs ``nbgrader export`` (nbgrader's grades.csv: one row per student and assignment) and reads the per-exercise
   scores out of nbgrader's gradebook for the grade table.

Command line: ``python -m gpt2_core classroom release --out DIR``,
``python -m gpt2_core classroom autograde SUBMISSIONS_DIR --out grades.csv`` and, for a learner on their own,
``python -m gpt2_core classroom student DIR`` (the same student versions in one folder; see ``notebooks/TEACHING.md``).
Needs the ``classroom`` extra: ``pip install -e '.[classroom]'`` (nbgrader).
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import GPT2Error, is_writable_file

PACKAGE_ROOT = Path(__file__).resolve().parent.parent  # the repository, when gpt2_core runs from a checkout
NOTEBOOKS_DIR = PACKAGE_ROOT / "notebooks"
CHAPTER_GLOB = "[0-9][0-9]_*.ipynb"  # every chapter notebook: 01_naive_forward.ipynb, 02_kv_cache.ipynb, ...
COURSE_ID = "gpt2-numpy"
CELL_TIMEOUT = 600  # seconds a single cell may run while grading (nbgrader's default of 30 s is too short)
STUDENT_ID = r"[A-Za-z0-9_.@-]+"  # what ``Course.submit`` and nbgrader's folder names accept

SOLUTION_BEGIN, SOLUTION_END = "### BEGIN SOLUTION", "### END SOLUTION"
HIDDEN_BEGIN, HIDDEN_END = "### BEGIN HIDDEN TESTS", "### END HIDDEN TESTS"


class ClassroomError(GPT2Error):
    """nbgrader is missing, a command of it failed, or a submission folder cannot be understood."""


# --- hidden tests: the package's own answer out of reach -----------------------------------------------------------

@contextmanager
def out_of_reach(*targets: tuple):
    """Hidden tests run a learner's function inside ``with out_of_reach((owner, "name"), ...):``, where each owner
    is a module, a class or a notebook's ``globals()``. While the block runs, ``owner.name`` (or ``owner["name"]``)
    is a function that fails the test when called, so an exercise cannot be passed by calling the package's version
    of the very function it asks for (chapters show that code, and import it for their own use). Everything is put
    back afterwards, even when the test fails. A name an owner does not have is skipped."""
    saved = []
    for owner, name in targets:
        if isinstance(owner, dict):
            if name in owner:
                saved.append((owner, name, owner[name]))
        elif name in vars(owner):
            saved.append((owner, name, vars(owner)[name]))
    try:
        for owner, name, _ in saved:
            _put(owner, name, _unreachable(name))
        yield
    finally:
        for owner, name, value in reversed(saved):
            _put(owner, name, value)


def _unreachable(name: str):
    def call(*args, **kwargs):
        raise AssertionError(f"write this exercise yourself: it may not call the package's own {name}()")
    return call


def _put(owner, name: str, value) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


# --- reading exercises out of a notebook (nbgrader's cell metadata) -------------------------------------------------

@dataclass(frozen=True)
class Cell:
    """One cell that carries nbgrader metadata."""
    index: int           # position in the notebook
    grade_id: str
    kind: str            # "solution" (student writes code), "tests" (autograded), "manual" (graded by hand), "task"
    points: float        # 0 for solution cells
    source: str
    cell_type: str       # "code" or "markdown"


def read_notebook(path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def nbgrader_cells(nb: dict) -> list[Cell]:
    """The cells of a notebook (as a dict from ``read_notebook``) that nbgrader treats specially."""
    cells = []
    for i, cell in enumerate(nb["cells"]):
        meta = cell.get("metadata", {}).get("nbgrader")
        if not meta:
            continue
        grade, solution, task = meta.get("grade", False), meta.get("solution", False), meta.get("task", False)
        kind = ("task" if task else "manual" if grade and solution else "tests" if grade else
                "solution" if solution else "locked")
        cells.append(Cell(i, meta.get("grade_id", ""), kind, float(meta.get("points", 0) or 0),
                          cell_source(cell), cell["cell_type"]))
    return cells


def exercise_points(path) -> dict[str, float]:
    """grade_id -> points of every autograded test cell of a notebook, in notebook order."""
    return {c.grade_id: c.points for c in nbgrader_cells(read_notebook(path)) if c.kind == "tests"}


def strip_solution_markers(source: str) -> str:
    """A solution cell's reference source without the ``### BEGIN/END SOLUTION`` lines (what a learner would type)."""
    return "\n".join(line for line in source.split("\n")
                     if line.strip() not in (SOLUTION_BEGIN, SOLUTION_END))


def stored_results(notebook) -> list[Path]:
    """The stored full-size benchmark runs a notebook reads (``results/NAME.json`` beside it) that exist."""
    notebook = Path(notebook)
    names = sorted(set(re.findall(r"results/([A-Za-z0-9_.-]+\.json)", notebook.read_text(encoding="utf-8"))))
    return [notebook.parent / "results" / n for n in names if (notebook.parent / "results" / n).is_file()]


def chapter_notebooks(notebooks_dir=None) -> list[Path]:
    """Every chapter notebook (``NN_name.ipynb``) in ``notebooks_dir`` (default: the repository's notebooks/)."""
    directory = Path(notebooks_dir) if notebooks_dir is not None else NOTEBOOKS_DIR
    found = sorted(p for p in directory.glob(CHAPTER_GLOB) if p.is_file())
    if not found:
        raise ClassroomError(f"{directory}: no chapter notebooks ({CHAPTER_GLOB})")
    return found


# --- running nbgrader ---------------------------------------------------------------------------------------------

def nbgrader_version() -> str:
    try:
        import nbgrader
    except ImportError as e:
        raise ClassroomError("nbgrader is not installed: pip install -e '.[classroom]'") from e
    return nbgrader.__version__


_CONFIG = '''\
# Written by gpt2_core.classroom. A normal nbgrader course directory: every nbgrader command works here.
c = get_config()  # noqa: F821
c.CourseDirectory.course_id = {course_id!r}
c.Execute.timeout = {timeout}  # seconds per cell while autograding
c.ClearSolutions.enforce_metadata = True  # solution markers only count inside cells with nbgrader metadata
'''


@dataclass
class Course:
    """An nbgrader course directory with one assignment per chapter."""
    root: Path

    @classmethod
    def create(cls, root, notebooks, timeout: int = CELL_TIMEOUT) -> "Course":
        """Make (or refresh) a course directory at ``root`` with each notebook as the source of one assignment."""
        nbgrader_version()
        root = Path(root).resolve()
        root.mkdir(parents=True, exist_ok=True)
        (root / "nbgrader_config.py").write_text(_CONFIG.format(course_id=COURSE_ID, timeout=int(timeout)))
        for nb in notebooks:
            nb = Path(nb)
            dest = root / "source" / nb.stem
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(nb, dest / nb.name)
            for stored in stored_results(nb):  # released with the notebook: its figures need no checkout
                (dest / "results").mkdir(exist_ok=True)
                shutil.copyfile(stored, dest / "results" / stored.name)
        return cls(root)

    @property
    def assignments(self) -> list[str]:
        return sorted(p.name for p in (self.root / "source").iterdir() if p.is_dir())

    def run(self, *args: str) -> subprocess.CompletedProcess:
        """``nbgrader ARGS`` in this course directory, with its log captured; raises ClassroomError on failure."""
        cmd = [sys.executable, "-m", "nbgrader", *args, f"--CourseDirectory.root={self.root}"]
        env = os.environ.copy()
        # nbgrader runs the `alembic` executable by name when it creates a gradebook: put this interpreter's
        # scripts first on PATH, so an unactivated virtual environment (.venv/bin/python -m ...) works too.
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # nbgrader sets NBGRADER_EXECUTION in the kernels it grades with; gpt2_core.bench.common.GRADING then times every
        # benchmark cell once on a 2-layer model: no exercise depends on timings, and a class of 30 x 4 chapters at
        # full size would take hours.
        if (PACKAGE_ROOT / "pyproject.toml").exists():  # a source checkout: the kernels import this gpt2_core
            env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PACKAGE_ROOT), env.get("PYTHONPATH", "")] if p)
        proc = subprocess.run(cmd, cwd=self.root, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise ClassroomError(f"`nbgrader {' '.join(args)}` failed (exit {proc.returncode}):\n"
                                 f"{proc.stdout[-4000:]}{proc.stderr[-8000:]}")
        return proc

    def release(self, assignment: str = "*") -> dict[str, Path]:
        """``nbgrader generate_assignment``: the student version of each chapter, in ``release/``."""
        self.run("generate_assignment", assignment, "--force")
        return self.released()

    def released(self) -> dict[str, Path]:
        return {a: self.root / "release" / a / f"{a}.ipynb" for a in self.assignments
                if (self.root / "release" / a / f"{a}.ipynb").exists()}

    def submit(self, student: str, notebook, assignment: str | None = None) -> Path:
        """Place one student's notebook where nbgrader looks: ``submitted/<student>/<assignment>/<assignment>.ipynb``."""
        notebook = Path(notebook)
        assignment = assignment or notebook.stem
        if assignment not in self.assignments:
            raise ClassroomError(f"{notebook}: no chapter called {assignment!r} (chapters: {', '.join(self.assignments)})")
        if not re.fullmatch(STUDENT_ID, student):
            raise ClassroomError(f"student id {student!r}: use letters, digits and _ . @ - only")
        dest = self.root / "submitted" / student / assignment / f"{assignment}.ipynb"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(notebook, dest)
        return dest

    def autograde(self, assignment: str = "*", student: str | None = None) -> subprocess.CompletedProcess:
        """``nbgrader autograde``: execute every submission (all students) of ``assignment`` (a glob) and score it."""
        args = ["autograde", assignment, "--force"]
        if student:
            args.append(f"--student={student}")
        return self.run(*args)

    def autograded(self, student: str, assignment: str) -> Path:
        return self.root / "autograded" / student / assignment / f"{assignment}.ipynb"

    def export(self, csv_path=None) -> Path:
        """``nbgrader export``: nbgrader's own grades.csv (one row per student and assignment)."""
        csv_path = Path(csv_path).resolve() if csv_path else self.root / "grades.csv"
        self.run("export", f"--to={csv_path}")
        return csv_path

    def grades(self) -> list["Grade"]:
        """Every autograded score in nbgrader's gradebook, one row per (student, chapter, graded cell)."""
        from nbgrader.api import Gradebook

        rows = []
        with Gradebook(f"sqlite:///{self.root / 'gradebook.db'}", COURSE_ID) as gb:
            for assignment in gb.assignments:
                for submission in assignment.submissions:
                    for notebook in submission.notebooks:
                        for g in notebook.grades:
                            rows.append(Grade(submission.student.id, assignment.name, g.name,
                                              None if g.score is None else float(g.score), float(g.max_score),
                                              bool(g.needs_manual_grade), g.cell.cell_type))
        order = {a: i for i, a in enumerate(self.assignments)}
        cell_order = {}
        for a in self.assignments:
            for c in nbgrader_cells(read_notebook(self.root / "source" / a / f"{a}.ipynb")):
                cell_order[a, c.grade_id] = c.index
        rows.sort(key=lambda r: (r.student, order.get(r.chapter, 1e9), cell_order.get((r.chapter, r.exercise), 1e9)))
        return rows


@dataclass(frozen=True)
class Grade:
    student: str
    chapter: str
    exercise: str        # grade_id of the graded cell
    score: float | None  # None: waits for manual grading
    max_score: float
    needs_manual_grade: bool
    cell_type: str

    @staticmethod
    def fields() -> list[str]:
        return ["student", "chapter", "exercise", "score", "max_score", "needs_manual_grade"]


def write_grades_csv(grades: list[Grade], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(Grade.fields())
        for g in grades:
            w.writerow([g.student, g.chapter, g.exercise, "" if g.score is None else f"{g.score:g}",
                        f"{g.max_score:g}", int(g.needs_manual_grade)])
    return path


def grade_table(grades: list[Grade]) -> str:
    """A text table: one row per student and chapter, a column per exercise, and the total."""
    by = {}
    for g in grades:
        by.setdefault((g.student, g.chapter), []).append(g)
    lines = []
    header = f"{'student':14s} {'chapter':22s} {'exercises (score/max)':60s} total"
    lines += [header, "-" * len(header)]
    for (student, chapter), gs in by.items():
        cells = " ".join(f"{g.exercise.removesuffix('_tests')} "
                         f"{'?' if g.score is None else f'{g.score:g}'}/{g.max_score:g}" for g in gs)
        got = sum(g.score or 0 for g in gs)
        total = sum(g.max_score for g in gs)
        manual = " (+ manual grading)" if any(g.needs_manual_grade for g in gs) else ""
        lines.append(f"{student:14s} {chapter:22s} {cells:60s} {got:g}/{total:g}{manual}")
    return "\n".join(lines)


# --- the two workflows -----------------------------------------------------------------------------------------------

def release(out=None, notebooks_dir=None, timeout: int = CELL_TIMEOUT) -> Course:
    """Make the course directory ``out`` (default: a new temporary directory) and the student version of every
    chapter in ``out/release/<chapter>/<chapter>.ipynb``."""
    root = Path(out) if out else Path(tempfile.mkdtemp(prefix="gpt2-course-"))
    course = Course.create(root, chapter_notebooks(notebooks_dir), timeout=timeout)
    course.release()
    return course


def student_versions(out, notebooks_dir=None, course: Course | None = None, timeout: int = CELL_TIMEOUT) -> list[Path]:
    """A self-learner's working folder: the student version of every chapter, exactly what ``release`` hands out to
    a class (solutions and hidden tests removed, outputs cleared), side by side in ``out``, with the stored runs
    the chapters read in ``out/results``. Made by a release into a temporary course directory (or taken from
    ``course``, already released). A folder that already holds chapter notebooks is refused: a learner's work is
    never overwritten. Returns the notebooks written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ClassroomError(f"{out}: exists and is not a folder; name a new folder for the student versions")
    if out.is_dir() and any(out.glob(CHAPTER_GLOB)):
        raise ClassroomError(f"{out}: already holds chapter notebooks ({CHAPTER_GLOB}); name a new folder (your "
                             "work there is left as it is)")
    with tempfile.TemporaryDirectory(prefix="gpt2-course-") as tmp:
        if course is None:
            course = release(tmp, notebooks_dir, timeout=timeout)
        out.mkdir(parents=True, exist_ok=True)
        for notebook in course.released().values():
            shutil.copytree(notebook.parent, out, dirs_exist_ok=True)  # the notebook, and results/ beside it
    return sorted(out.glob(CHAPTER_GLOB))


def find_submissions(submissions_dir, chapters: list[str]) -> list[tuple[str, str, Path]]:
    """(student, chapter, notebook) for every submitted chapter notebook in a folder laid out as
    ``<student>/<chapter>.ipynb`` or nbgrader's ``<student>/<chapter>/<chapter>.ipynb``.

    Checked before anything is graded: a student folder whose name nbgrader cannot take, and two copies of the same
    chapter from one student (``alice/01.ipynb`` and ``alice/old/01.ipynb``: which one should count?), are errors
    that name the files; notebooks outside any student folder, or not named after a chapter, are skipped with a
    warning."""
    root = Path(submissions_dir)
    if not root.is_dir():
        raise ClassroomError(f"{root}: not a directory of submissions (<student>/<chapter>.ipynb)")
    for nb in sorted(root.glob("*.ipynb")):
        print(f"warning: {nb}: not inside a student folder (<student>/<chapter>.ipynb); skipped", file=sys.stderr)
    found: dict[tuple[str, str], list[Path]] = {}
    for student_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for nb in sorted(student_dir.rglob("*.ipynb")):
            if ".ipynb_checkpoints" in nb.parts:
                continue
            if not nb.is_file():
                raise ClassroomError(f"{nb}: not a notebook file (a folder, or a link to nothing)")
            if nb.stem not in chapters:
                print(f"warning: {nb}: not named after a chapter ({', '.join(chapters)}); skipped", file=sys.stderr)
                continue
            if not re.fullmatch(STUDENT_ID, student_dir.name):
                raise ClassroomError(f"{student_dir}: student folder name {student_dir.name!r} cannot be a student "
                                     "id; rename it using letters, digits and _ . @ - only")
            found.setdefault((student_dir.name, nb.stem), []).append(nb)
    copies = {key: paths for key, paths in found.items() if len(paths) > 1}
    if copies:
        lines = [f"  {student} / {chapter}: {', '.join(str(p) for p in paths)}"
                 for (student, chapter), paths in copies.items()]
        raise ClassroomError("more than one notebook of the same chapter from one student; keep only the one to "
                             "grade:\n" + "\n".join(lines))
    if not found:
        raise ClassroomError(f"{root}: no submissions found; expected <student>/<chapter>.ipynb with chapter one of "
                             f"{', '.join(chapters)}")
    return [(student, chapter, paths[0]) for (student, chapter), paths in found.items()]


def autograde(submissions_dir, out_csv=None, course_dir=None, notebooks_dir=None,
              timeout: int = CELL_TIMEOUT) -> tuple[Course, list[Grade], list[str]]:
    """Autograde a folder of submissions. ``course_dir``: the course made by ``release`` (its gradebook holds the
    hidden tests as released); without it a fresh course is made from the current chapters in a temporary
    directory. Writes the per-exercise table to ``out_csv`` and nbgrader's own export beside it. Returns the course,
    the grades and the chapters for which nbgrader reported an error (their other submissions are still graded)."""
    if not Path(submissions_dir).is_dir():
        raise ClassroomError(f"{submissions_dir}: not a directory of submissions (<student>/<chapter>.ipynb)")
    if out_csv and not is_writable_file(out_csv):
        raise ClassroomError(f"--out {out_csv}: cannot write the grade table there (a folder, a missing folder, or "
                             f"no permission); found now, not after grading")
    if course_dir and (Path(course_dir) / "gradebook.db").exists():
        course = Course(Path(course_dir).resolve())
        subs = find_submissions(submissions_dir, course.assignments)
    else:  # the submissions are checked before the (slow) release
        subs = find_submissions(submissions_dir, [p.stem for p in chapter_notebooks(notebooks_dir)])
        course = release(course_dir, notebooks_dir, timeout=timeout)
    for student, chapter, nb in subs:
        course.submit(student, nb, chapter)
    failed = []
    for chapter in sorted({c for _, c, _ in subs}):
        try:
            course.autograde(chapter)
        except ClassroomError as e:  # e.g. one unreadable notebook: nbgrader grades the others and exits 1
            failed.append(chapter)
            print(f"warning: {e}", file=sys.stderr)
    grades = [g for g in course.grades() if (g.student, g.chapter) in {(s, c) for s, c, _ in subs}]
    if out_csv:
        out_csv = write_grades_csv(grades, out_csv)
        course.export(Path(out_csv).with_name(Path(out_csv).stem + "_nbgrader.csv"))
    else:
        course.export()
    if failed:
        print(f"warning: nbgrader reported errors while grading {', '.join(failed)} (log above); "
              "the table shows what it could grade", file=sys.stderr)
    return course, grades, failed


# --- command line: python -m gpt2_core classroom release|autograde|grades -------------------------------------------

def cli(args) -> int:
    if args.action == "release":
        course = release(args.out, args.notebooks, timeout=args.timeout)
        print(f"nbgrader {nbgrader_version()} course directory: {course.root}")
        print("student versions (solutions and hidden tests removed):")
        for chapter, path in course.released().items():
            points = sum(exercise_points(course.root / "source" / chapter / f"{chapter}.ipynb").values())
            print(f"  {chapter:24s} {points:g} points  {path}")
        return 0
    if args.action == "student":
        written = student_versions(args.out, args.notebooks, timeout=args.timeout)
        print(f"student versions of {len(written)} chapters (solutions and hidden tests removed) in "
              f"{Path(args.out).resolve()}:")
        for path in written:
            print(f"  {path.name}")
        print("open them with `jupyter lab`; check an exercise by running its test cell (see notebooks/TEACHING.md, "
              "\"The learner's self-check\")")
        return 0
    failed = []
    if args.action == "autograde":
        course, grades, failed = autograde(args.submissions, args.out, course_dir=args.course, notebooks_dir=args.notebooks,
                                   timeout=args.timeout)
    else:
        course = Course(Path(args.course).resolve())
        if not (course.root / "gradebook.db").exists():
            raise ClassroomError(f"{course.root}: no gradebook.db here; is it a course directory made by `release`?")
        grades = course.grades()
        if args.out:
            write_grades_csv(grades, args.out)
    print(grade_table(grades))
    print(f"\ncourse directory: {course.root} (autograded notebooks in autograded/<student>/<chapter>/)")
    if args.out:
        print(f"grade table: {Path(args.out).resolve()}")
    return 1 if failed else 0
