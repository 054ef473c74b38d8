"""Run the benchmarks whose results the notebooks plot, for commit: full size, alone on a quiet machine, recorded.

    .venv/bin/python data/run_benchmarks.py batching prefix        # -> notebooks/results/batching.json, prefix.json

The same rules as ``data/execute_notebooks.py`` (whose helpers this script uses): it refuses to start a benchmark
while the 1-minute load is at or above ``--max-load`` (0.5) or in quick mode, measures the machine's bandwidth and
GEMM rate just before, and writes how the run was made into the result's ``recorded`` field: ``command``,
``commit``, ``load_1min_start``, ``executed`` (UTC), ``duration_s``, ``bytes_per_s``, ``gemm_flops_per_s``.
``tests/test_results_records.py`` checks every stored result.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from execute_notebooks import ROOT, commit, quiet_arguments, quiet_start, wait_for_quiet  # noqa: E402

RESULTS = ROOT / "notebooks" / "results"


def run(name: str, load: float, limits: dict) -> dict:
    """``python -m gpt2_core bench NAME --json notebooks/results/NAME.json``, then its record added to that file."""
    out = RESULTS / f"{name}.json"
    command = [sys.executable, "-m", "gpt2_core", "bench", name, "--json", str(out)]
    t0 = time.perf_counter()
    subprocess.run(command, cwd=ROOT, check=True)
    result = json.loads(out.read_text())
    result["recorded"] = {
        "command": f"python -m gpt2_core bench {name} --json notebooks/results/{name}.json",
        "commit": commit(), "load_1min_start": load,
        "executed": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": round(time.perf_counter() - t0, 1),
        "bytes_per_s": round(limits["bytes_per_s"]), "gemm_flops_per_s": round(limits["gemm_flops_per_s"])}
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result["recorded"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmarks", nargs="+", help="names as `python -m gpt2_core bench` takes them")
    args = quiet_arguments(parser, "a benchmark", argv)
    for name in args.benchmarks:
        load, limits = quiet_start(f"bench {name}", args)
        wait_for_quiet(args.max_load, args.patience)  # the limits load both cores for a few seconds: let it decay
        print(f"bench {name}: {json.dumps(run(name, load, limits))}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
