"""Installed as a library, not from a clone: the README's commands for a class build the wheel from this checkout
and install it (not editable) into a fresh virtual environment; from a folder outside the checkout the package then
generates text with the embedded model, encodes with GPT-2's tokenizer, and runs chapter 1's notebook.

About a minute: the wheel is built with pip (setuptools from pip's cache), and its dependencies come from pip's
cache or the package index, as a learner's would.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT

IGNORED = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".ipynb_checkpoints",
                                 ".pytest_cache")


def readme_block(name: str) -> str:
    readme = (ROOT / "README.md").read_text()
    return re.search(rf"<!-- {name} -->\s*```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1).strip()


def sh(command: str, cwd: Path, env: dict, timeout=600) -> subprocess.CompletedProcess:
    r = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{command}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A copy of the checkout (so that the build leaves nothing behind in it), the README's two commands run there
    as typed (after `python3 -m venv .venv`, which the teacher's first command ran) with `python3` being this
    interpreter, and a folder outside both to work in."""
    base = tmp_path_factory.mktemp("wheel")
    clone = base / "clone"
    shutil.copytree(ROOT, clone, ignore=IGNORED)
    bin_dir = base / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = {k: v for k, v in os.environ.items() if k not in ("GPT2_CORE_DATA", "PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    sh("python3 -m venv .venv", clone, env)  # the teacher's clone has the first command's .venv
    sh(readme_block("wheel-command"), clone, env)
    install = sh(readme_block("wheel-install-command"), clone, env)
    outside = base / "elsewhere"
    outside.mkdir()
    return clone, clone / ".venv" / "bin" / "python", outside, env, install


def test_the_wheel_holds_the_package_and_its_run_time_files_only(installed):
    clone, *_ = installed
    (wheel,) = (clone / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    data = sorted(n for n in names if n.startswith("gpt2_core/data/"))
    assert data == ["gpt2_core/data/embedded/config.json", "gpt2_core/data/embedded/generation_config.json",
                    "gpt2_core/data/embedded/model.safetensors", "gpt2_core/data/embedded/tokenizer.json",
                    "gpt2_core/data/embedded/tokenizer_config.json", "gpt2_core/data/gpt2_tokenizer/tokenizer.json",
                    "gpt2_core/data/gpt2_tokenizer/tokenizer_config.json", "gpt2_core/data/heldout/austen_validation.txt",
                    "gpt2_core/data/reference/embedded.npz"]
    code = {n for n in names if n.endswith(".py")}
    assert code == {f"gpt2_core/{p.relative_to(ROOT / 'gpt2_core')}" for p in (ROOT / "gpt2_core").rglob("*.py")}
    assert all(n.startswith(("gpt2_core/", "gpt2_numpy-0.1.0.dist-info/")) for n in names)  # no top-level data/
    size = wheel.stat().st_size
    assert 10e6 < size < 13e6, size  # the model is 10.5 MB; benchmarks, traces and other references stay out


def test_the_installed_package_generates_the_same_text_as_the_checkout(installed):
    clone, python, outside, env, install = installed
    where = subprocess.run([str(python), "-c", "import gpt2_core; print(gpt2_core.__file__)"], cwd=outside, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(clone / ".venv" / "lib")  # the installed copy, not the checkout
    # the README's install command ends with the first command: sampled text and the seed that repeats it
    seed = re.search(r"sampled with seed (\d+)", install.stderr).group(1)
    args = shlex.split(readme_block("wheel-install-command").split("&&")[-1])[3:] + ["--seed", seed]
    there = subprocess.run([str(python), "-m", "gpt2_core", *args], cwd=outside, env=env, capture_output=True,
                           text=True, timeout=120)
    here = subprocess.run([sys.executable, "-m", "gpt2_core", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert there.returncode == 0, there.stderr
    assert there.stdout.startswith("It is a truth universally acknowledged")
    assert there.stdout == here.stdout and install.stdout.endswith("\n" + there.stdout)  # after pip's own output


def test_the_installed_package_has_gpt2s_tokenizer_and_says_where_its_files_are(installed):
    _, python, outside, env, _ = installed
    code = ("import gpt2_core\n"
            "from gpt2_core.loading.weights import DATA_DIR, EMBEDDED_MODEL_DIR, GPT2_TOKENIZER_FILE\n"
            "print(gpt2_core.random_model('gpt2').tokenizer.encode('Hello world'))\n"
            "print(DATA_DIR)\n"
            "print(all(p.is_file() for p in (EMBEDDED_MODEL_DIR / 'model.safetensors', GPT2_TOKENIZER_FILE,\n"
            "                                DATA_DIR / 'reference' / 'embedded.npz')))\n")
    r = subprocess.run([str(python), "-c", code], cwd=outside, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    ids, data_dir, present = r.stdout.splitlines()
    assert ids == "[15496, 995]"  # GPT-2's ids for "Hello world"
    assert "site-packages" in data_dir and data_dir.endswith(os.path.join("gpt2_core", "data"))
    assert present == "True"


def test_chapter_1_runs_unchanged_against_the_installed_package(installed):
    """nbval (a dependency of the package) runs the notebook in a folder that holds nothing else of the repository,
    comparing every output with the committed one."""
    clone, python, outside, env, _ = installed
    folder = outside / "chapter1"
    folder.mkdir()
    shutil.copy(clone / "notebooks" / "01_naive_forward.ipynb", folder)
    shutil.copy(clone / "tests" / "nbval_sanitize.cfg", folder)
    r = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "--nbval", "--nbval-current-env",
                        "--nbval-sanitize-with", "nbval_sanitize.cfg", "01_naive_forward.ipynb", "-q"],
                       cwd=folder, env=env | {"GPT2_QUICK": "1"}, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-5000:]
    assert re.search(r"\b\d+ passed\b", r.stdout) and "failed" not in r.stdout
