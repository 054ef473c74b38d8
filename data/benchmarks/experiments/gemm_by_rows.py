"""BLAS on the products a continuous-batching step runs: M rows against GPT-2 124M's matrices (the 12 layers'
c_attn, attn.c_proj, c_fc, mlp.c_proj, then the tied head), float32, the BLAS threads the process has.

    python data/benchmarks/experiments/gemm_by_rows.py [OUT.json]

Prints GFLOP/s for M = 1 ... 1024 and for one 1024^3 product. The question it answers: what fraction of the
large-GEMM rate (the capstone's ``compute_bound``) can any engine reach when a step multiplies at most 32 rows?
"""

import json
import sys
import time

import numpy as np

MATS = {"c_attn": (768, 2304), "attn.c_proj": (768, 768), "c_fc": (768, 3072), "mlp.c_proj": (3072, 768)}


def rate(M: int, weights: dict, head: np.ndarray, rng, reps: int = 30) -> float:
    x = {k: rng.standard_normal((M, s[0]), dtype=np.float32) for k, s in MATS.items()}
    xh = rng.standard_normal((M, 768), dtype=np.float32)

    def step():
        for _ in range(12):
            for k in MATS:
                x[k] @ weights[k]
        xh @ head.T

    for _ in range(3):
        step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    flops = 2 * M * (12 * sum(a * b for a, b in MATS.values()) + 768 * 50257)
    return flops / float(np.median(times))


def main() -> None:
    rng = np.random.default_rng(0)
    weights = {k: rng.standard_normal(s, dtype=np.float32) for k, s in MATS.items()}
    head = rng.standard_normal((50257, 768), dtype=np.float32)
    out = {f"rows_{M}": rate(M, weights, head, rng) / 1e9 for M in (1, 8, 16, 32, 64, 256, 1024)}
    big = rng.standard_normal((1024, 1024), dtype=np.float32)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        big @ big
        times.append(time.perf_counter() - t)
    out["square_1024"] = 2 * 1024 ** 3 / float(np.median(times)) / 1e9
    for k, v in out.items():
        print(f"{k:12s} {v:6.1f} GFLOP/s")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"gflop_per_s": out, "note": "median of 30 steps (10 for the square product)"}, f, indent=1)


if __name__ == "__main__":
    main()
