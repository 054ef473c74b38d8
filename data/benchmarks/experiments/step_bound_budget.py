"""Can the capstone's final engine reach 80% of its per-step bound (issue #42, item 6)? Where its time goes.

    python data/benchmarks/experiments/step_bound_budget.py [--rounds N] [OUT.json]

The capstone prices every step an engine ran at the GEMM rate of its own row count, each product timed alone on
one weight (warm in the cache), or at its bytes over the bandwidth, whichever is longer (``per_step_bound``). This
runs the final engine (``continuous`` on the appendix's kernels, in its slot store) offline on two workloads, the
standard one and a trace of longer prompts read through ``load_trace`` (what ``bench capstone --trace`` reads),
``N`` rounds each, the machine read between them (the best readings price every round, as the capstone does). Then
it takes a 32-row decode step apart (``step_anatomy``) and adds what no kernel of any library avoids:

- ``serial_bound``: the per-step bound with attention (the longer of its FLOP and K/V-byte times) added to the
  matmuls instead of hidden under them (attention runs between the product that makes its queries and the one that
  takes its output, so in a layer-by-layer forward they add);
- ``attention_floor_s``: the 32-row step's cached K/V bytes over the measured bandwidth;
- ``step_matmuls_s``, ``torch_matmuls_s``: the step's 49 products alone, in its order, each weight read once, with
  the package's kernels and in PyTorch (if installed: the other library at hand), timed beside every reading of
  the machine; the best reading (as the bound keeps its best readings) and, ``*_median_s``, the median;
- ``reachable`` (and ``reachable_median``): the bound's price of the step's products (``matmul_s``: the block
  products and the head at the bound's rates) over (the faster library's products + the attention floor): about
  the most of its per-step bound a 32-row step can reach with layer norms, GELU, residuals and Python at zero
  (attention's own FLOPs, a few percent of the step's, left out of both).

Needs numba (the slot store); about 5 minutes on 2 cores. Run it alone on the machine.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from gpt2_core.a1_cpu_kernels.fast_model import accelerate
from gpt2_core.bench import capstone as C
from gpt2_core.bench.batching import warm_up
from gpt2_core.bench.common import machine_info, median_time
from gpt2_core.bench.kv_cache import step_weights
from gpt2_core.bench.workload import poisson_workload, save_trace
from gpt2_core.ch11_capstone.roofline import step_seconds
from gpt2_core.loading.weights import random_model

LONG_PROMPTS = {"num_requests": 32, "request_rate": 4.0, "seed": 1, "prompt_len": (320, 0.5, 64, 768),
                "output_len": (96, 0.8, 16, 256)}  # the trace: prefill-heavier than the standard workload


def serial_seconds(config, steps, weight_bytes: int, rates: dict, bytes_per_s: float) -> float:
    """``per_step_bound``'s total with each step's attention taken out from under its matmuls: the matmuls at the
    longer of their FLOP and weight-byte times, then attention at the longer of its FLOP and cached-K/V-byte times."""
    kv = 2 * config.n_layer * config.n_embd * 4
    total = 0.0
    for chunks in steps:
        flop_s, byte_s = step_seconds(config, chunks, weight_bytes, rates, bytes_per_s)
        attention_flop_s = 4 * config.n_embd * config.n_layer * sum(q * k for q, k, _ in chunks) / max(rates["blocks"])
        kv_s = kv * sum(k - q for q, k, _ in chunks) / bytes_per_s
        total += max(flop_s - attention_flop_s, byte_s - kv_s) + max(attention_flop_s, kv_s)
    return total


def priced(row: dict, limits: dict, rates: dict, config) -> dict:
    """A run of the engine at the best readings: its fraction of the per-step bound, by rows, and the serial bound."""
    out = C.with_bound(row, limits, rates, config)
    steps, _ = row["_steps"]
    serial = serial_seconds(config, steps, row["weight_bytes_per_step"], rates, limits["bytes_per_s"])
    return {"tokens_per_s": out["tokens_per_s"], "step_bound_tokens_per_s": out["step_bound_tokens_per_s"],
            "fraction_of_step_bound": out["fraction_of_step_bound"],
            "serial_bound_tokens_per_s": out["output_tokens"] / serial,
            "outside_forward_s": out["step_time"]["outside_forward_s"],
            "by_rows": [{**b, "fraction": b["bound_s"] / b["forward_s"]} for b in out["step_time"]["by_rows"]]}


def torch_matmuls(model, rows: int):
    """A function making the 49 products of a ``rows``-row step in PyTorch, in order, each weight once
    (``step_matmuls``'s work), or None without PyTorch."""
    try:
        import torch
    except ImportError:
        return None
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    weights = [torch.from_numpy(np.ascontiguousarray(w)) for w in step_weights(model)]
    rng = np.random.default_rng(0)
    inputs = {n: torch.from_numpy(rng.standard_normal((rows, n), dtype=np.float32))
              for n in {w.shape[0] for w in weights}}

    def run():
        with torch.inference_mode():
            for w in weights:
                inputs[w.shape[0]] @ w
    return run


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    t_start, load, machine_at_start = time.perf_counter(), os.getloadavg()[0], machine_info()
    base = random_model("gpt2", seed=0)
    model = accelerate(base)
    warm_up(model)
    standard, _ = C.capstone_requests(model.config, None, False, model.tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "long_prompts.jsonl")
        save_trace(poisson_workload(vocab_size=model.config.vocab_size, **LONG_PROMPTS), path)
        long_prompts, _ = C.capstone_requests(model.config, path, False, model.tokenizer)
    workloads = {"standard_workload": standard, "long_prompts_trace": long_prompts}
    machine = C.MachineReadings(model, None, C.RATE_ROWS)
    ours, theirs = C.step_matmuls(model, C.MAX_BATCH), torch_matmuls(model, C.MAX_BATCH)
    matmuls = {"numpy": [], "torch": []}  # a 32-row step's products alone, read with the machine's limits

    def read():
        machine.read()
        matmuls["numpy"].append(median_time(ours, repeats=5))
        if theirs is not None:
            matmuls["torch"].append(median_time(theirs, repeats=5))
    read()
    runs = {name: [] for name in workloads}
    for r in range(args.rounds):
        for name in (list(workloads) if r % 2 == 0 else list(workloads)[::-1]):
            row, _ = C.batched_row(model, "continuous", workloads[name], weights=base, arrivals=False)
            runs[name].append(row)
            print(f"round {r + 1} {name}: {row['tokens_per_s']:.1f} tok/s", file=sys.stderr)
        read()
    limits, rates, _ = machine.best()
    anatomy = C.step_anatomy(model, rates, standard)
    # The products alone, read beside each reading of the machine: at their best reading (as the bound takes the best
    # of its readings) and at their median; step_anatomy's own reading, at the end, is kept as step_matmuls_end_s.
    anatomy["step_matmuls_end_s"] = anatomy.pop("step_matmuls_s")
    kv = 2 * model.config.n_layer * model.config.n_embd * 4 * anatomy["batch"] * anatomy["context"]
    anatomy["attention_floor_s"] = kv / limits["bytes_per_s"]
    for label, pick in (("", min), ("_median", lambda v: float(np.median(v)))):
        numpy_s, torch_s = pick(matmuls["numpy"]), pick(matmuls["torch"]) if matmuls["torch"] else None
        anatomy[f"step_matmuls{label}_s"], anatomy[f"torch_matmuls{label}_s"] = numpy_s, torch_s
        anatomy[f"matmul_ceiling{label}"] = anatomy["matmul_s"] / numpy_s
        fastest = min(t for t in (numpy_s, torch_s) if t is not None)
        anatomy[f"reachable{label}"] = anatomy["matmul_s"] / (fastest + anatomy["attention_floor_s"])
    git = ["git", "-C", os.path.dirname(os.path.abspath(__file__))]
    commit = subprocess.run(git + ["rev-parse", "--short=12", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    out = {"machine": machine_at_start, "load_1min_start": load, "rounds": args.rounds,
           "command": " ".join(["python"] + sys.argv), "commit": commit + ("+dirty" if dirty.stdout.strip() else ""),
           "limits": limits, "limits_readings": machine.limits, "gemm_rates_by_rows": rates,
           "step_matmuls_readings_s": matmuls, "torch": torch_version(), "long_prompts_trace": LONG_PROMPTS,
           "workloads": {}}
    for name, rows in runs.items():
        each = [priced(row, limits, rates, model.config) for row in rows]
        out["workloads"][name] = {
            "num_requests": len(workloads[name]),
            "prompt_tokens": sum(len(q.prompt_token_ids) for q in workloads[name]),
            "output_tokens": rows[0]["output_tokens"],
            "median_fraction_of_step_bound": float(np.median([e["fraction_of_step_bound"] for e in each])),
            "median_fraction_of_serial_bound": float(np.median([e["tokens_per_s"] / e["serial_bound_tokens_per_s"]
                                                                for e in each])),
            "by_rows_median": [{"rows": b["rows"], "steps": b["steps"], "mean_rows": b["mean_rows"],
                                "bound_s": b["bound_s"],
                                "forward_s": float(np.median([e["by_rows"][i]["forward_s"] for e in each])),
                                "fraction": float(np.median([e["by_rows"][i]["fraction"] for e in each]))}
                               for i, b in enumerate(each[0]["by_rows"])],
            "rounds": each}
    out["step_anatomy"] = anatomy
    out["duration_s"] = time.perf_counter() - t_start
    for name, w in out["workloads"].items():
        print(f"{name}: {w['median_fraction_of_step_bound']:.0%} of the per-step bound, "
              f"{w['median_fraction_of_serial_bound']:.0%} of the serial bound (median of {args.rounds})")
        for b in w["by_rows_median"]:
            print(f"  rows {b['rows']:>7s}: {b['steps']:3d} steps, bound {b['bound_s']:.2f} s, "
                  f"model {b['forward_s']:.2f} s ({b['fraction']:.0%}; medians of the rounds)")
    ms = {k: round(v * 1e3, 1) for k, v in anatomy.items() if k.endswith("_s") and v is not None}
    print(f"32-row step (ms): {ms}; matmul_ceiling {anatomy['matmul_ceiling']:.0%} (median reading "
          f"{anatomy['matmul_ceiling_median']:.0%}), reachable {anatomy['reachable']:.0%} (median reading "
          f"{anatomy['reachable_median']:.0%})")
    print(f"limits: {limits['bytes_per_s'] / 1e9:.1f} GB/s, {limits['gemm_flops_per_s'] / 1e9:.0f} GFLOP/s; "
          f"load at start {load:.2f}; {out['duration_s'] / 60:.1f} min")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
