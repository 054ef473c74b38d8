"""Execute the chapter notebooks for commit: full size, alone on a quiet machine, with the execution recorded.

    .venv/bin/python data/execute_notebooks.py                       # every chapter notebook and the appendix
    .venv/bin/python data/execute_notebooks.py notebooks/03_batching.ipynb

What a learner reads in a committed notebook must be a measurement they can trust, so this script refuses to run
when the machine is busy (1-minute load at or above ``--max-load``, 0.5 by default) or in quick mode
(``GPT2_QUICK``), and writes into each notebook's ``metadata["gpt2_core"]`` how it was made:

* ``quick`` (always false here), ``load_1min_start`` (the load when its execution started), ``executed`` (UTC),
  ``commit`` (the checkout's HEAD, ``+dirty`` when the code had changes: notebooks and stored results written by these
  scripts don't count), ``duration_s``;
* ``bytes_per_s`` and ``gemm_flops_per_s``: the machine's two limits measured just before (chapter 2's GEMV
  bandwidth on the LM head's shape and chapter 3's GEMM rate on GPT-2 124M's matrices at 256 rows, the best of 3
  readings). The load alone does not show a slow host: the same machine streamed 20.7 GB/s one hour and 42.9 GB/s
  the day before, both at load near 0. Compare them with the earlier executions' before committing.

``tests/test_notebook_metadata.py`` fails when a committed chapter notebook says quick, has no record, or started
at load 1 or more. CI executes the same notebooks in quick mode and compares only the outputs that do not depend on
the machine (nbval); the metadata is not compared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"


def chapter_notebooks() -> list[Path]:
    return sorted([*NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb"), *NOTEBOOKS.glob("A[0-9]_*.ipynb")])


def load_1min() -> float:
    return round(os.getloadavg()[0], 2)


def wait_for_quiet(max_load: float, patience_s: float) -> float:
    """The 1-minute load once it is below ``max_load``, polling for up to ``patience_s`` (a notebook that just ran
    leaves the load near 2, which takes a minute or two to decay); the load last read if it never got there."""
    deadline = time.monotonic() + patience_s
    while (load := load_1min()) >= max_load and time.monotonic() < deadline:
        time.sleep(10)
    return load


def commit() -> str:
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!notebooks/*.ipynb",
                            ":!notebooks/results/*.json"],
                           cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()  # not the outputs written
    return head + ("+dirty" if dirty else "")


def machine_limits(readings: int = 3) -> dict:
    """The bandwidth and GEMM rate of this machine now (the best of ``readings``), as the capstone measures them."""
    from gpt2_core import random_model
    from gpt2_core.bench.capstone import best_limits, measure_limits

    model = random_model("gpt2", seed=0)
    return best_limits([measure_limits(model) for _ in range(readings)])


def execute(path: Path, load: float, limits: dict) -> dict:
    """Run ``path`` top to bottom at full size and store its outputs and the record of the execution."""
    import nbformat
    from nbconvert.preprocessors import ExecutePreprocessor

    nb = nbformat.read(path, as_version=4)
    t0 = time.perf_counter()
    ExecutePreprocessor(timeout=None, kernel_name="python3").preprocess(nb, {"metadata": {"path": str(NOTEBOOKS)}})
    record = {"quick": False, "load_1min_start": load,
              "executed": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "commit": commit(), "duration_s": round(time.perf_counter() - t0, 1),
              "bytes_per_s": round(limits["bytes_per_s"]), "gemm_flops_per_s": round(limits["gemm_flops_per_s"]),
              "command": f"python data/execute_notebooks.py notebooks/{path.name}"}
    nb.metadata["gpt2_core"] = record
    nbformat.write(nb, path)
    return record


def quiet_arguments(parser: argparse.ArgumentParser, what: str, argv=None) -> argparse.Namespace:
    """``parser``'s arguments with ``--max-load`` and ``--patience``; refuses quick mode (``GPT2_QUICK``)."""
    parser.add_argument("--max-load", type=float, default=0.5, help=f"refuse to start {what} at this load or more")
    parser.add_argument("--patience", type=float, default=300.0,
                        help="seconds to wait for the load to fall below --max-load before refusing (default 300)")
    args = parser.parse_args(argv)
    if os.environ.get("GPT2_QUICK", "") not in ("", "0"):
        raise SystemExit("GPT2_QUICK is set: what gets committed is measured at full size (unset it)")
    return args


def quiet_start(label: str, args: argparse.Namespace) -> tuple[float, dict]:
    """The load once the machine is quiet (``SystemExit`` if it never gets there) and the machine's limits then."""
    load = wait_for_quiet(args.max_load, args.patience)  # read before the limits: measuring them loads the cores
    if load >= args.max_load:
        raise SystemExit(f"{label}: the 1-minute load is {load} (>= {args.max_load}): the machine is not quiet; "
                         f"stop what else runs and try again")
    limits = machine_limits()
    print(f"{label}: load {load}, {limits['bytes_per_s'] / 1e9:.1f} GB/s, "
          f"{limits['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s ...", file=sys.stderr, flush=True)
    return load, limits


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every chapter notebook and the appendix")
    args = quiet_arguments(parser, "a notebook", argv)
    paths = [p.resolve() for p in args.notebooks] or chapter_notebooks()
    for path in paths:
        load, limits = quiet_start(path.name, args)
        record = execute(path, load, limits)
        print(f"{path.name}: {json.dumps(record)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
