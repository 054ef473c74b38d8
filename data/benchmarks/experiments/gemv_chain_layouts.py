"""Experiment (not kept in the package): does a different memory layout of the small weights speed up chapter 2's
GEMV chain? The chain is one decode step's 49 matrix-vector products, back to back (``bench.decode_gemvs``).

Variants, all with the same values (each is checked equal to the package's layout):

* ``package``: as the package keeps the weights (``c_attn``, ``c_fc`` row-major [in, out]; the output projections
  column-major);
* ``c_attn stride S``: each ``c_attn`` [768, 2304] a view into a row-major [768, S] buffer (rows padded);
* ``attn.c_proj row-major`` and ``c_fc stride 4096``, ``mlp.c_proj stride 4096`` (column-major, padded).

Each round times every variant's chain once (in a rotating order) and then the cold bandwidth bound
(``bench.gemv_bandwidth``). The memory's speed drifts from minute to minute, so rounds are split by the bound
into fast ones (at least SPLIT GB/s, default 40) and slow ones, and each variant's chain is compared with the
package's in the same rounds.

    python data/benchmarks/experiments/gemv_chain_layouts.py SECONDS OUT.json [SPLIT]

Result of 2026-12-05 (``gemv_chain_layouts-2026-12-05.json``): see the README beside this file.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from gpt2_core import bench
from gpt2_core.measure import machine_info
from gpt2_core.loading.weights import random_model

KINDS = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")  # each block's, in the chain's order


def row_stride(w: np.ndarray, stride: int) -> np.ndarray:  # [in, out] row-major, rows `stride` floats apart
    buf = np.zeros((w.shape[0], stride), np.float32)
    buf[:, :w.shape[1]] = w
    return buf[:, :w.shape[1]]


def column_stride(w: np.ndarray, stride: int) -> np.ndarray:  # [in, out] column-major, columns `stride` apart
    buf = np.zeros((w.shape[1], stride), np.float32)
    buf[:, :w.shape[0]] = w.T
    return buf[:, :w.shape[0]].T


def main(seconds: float, out_path: str, split_gb_per_s: float = 40.0) -> None:
    model = random_model("gpt2", seed=0)
    weights = bench.step_weights(model)  # 48 block matrices, then the head

    def changed(kind: str, make) -> list[np.ndarray]:
        k = KINDS.index(kind)
        return [make(w) if i < 48 and i % 4 == k else w for i, w in enumerate(weights)]

    variants = {
        "package": weights,
        "c_attn stride 2560": changed("attn.c_attn", lambda w: row_stride(w, 2560)),
        "c_attn stride 3072": changed("attn.c_attn", lambda w: row_stride(w, 3072)),
        "c_attn stride 4096": changed("attn.c_attn", lambda w: row_stride(w, 4096)),
        "attn.c_proj row-major": changed("attn.c_proj", np.ascontiguousarray),
        "c_fc stride 4096": changed("mlp.c_fc", lambda w: row_stride(w, 4096)),
        "mlp.c_proj stride 4096": changed("mlp.c_proj", lambda w: column_stride(w, 4096)),
    }
    for ws in variants.values():
        assert all(np.array_equal(a, b) for a, b in zip(ws, weights))
    rng = np.random.default_rng(3)
    inputs = {n: rng.standard_normal((1, n), dtype=np.float32) for n in (768, 3072)}

    def chain(ws) -> list[float]:
        times = []
        for w in ws:
            x = inputs[w.shape[0]]
            t0 = time.perf_counter()
            x @ w
            times.append(time.perf_counter() - t0)
        return times

    names = list(variants)
    rounds: list[dict] = []
    end = time.time() + seconds
    while time.time() < end:
        r = len(rounds)
        order = names[r % len(names):] + names[:r % len(names)]
        rounds.append({"chain_s": {name: chain(variants[name]) for name in order},
                       "bound_bytes_per_s": bench.gemv_bandwidth(repeats=3)})
    bounds = np.array([r["bound_bytes_per_s"] for r in rounds])
    split = split_gb_per_s * 1e9
    nbytes = np.array([w.nbytes for w in weights])
    summary = {}
    for label, chosen in (("fast", bounds >= split), ("slow", bounds < split)):
        picked = [r for r, keep in zip(rounds, chosen) if keep]
        if not picked:
            continue
        base = np.array([sum(r["chain_s"]["package"]) for r in picked])
        summary[label] = {"rounds": len(picked), "bound_GB_per_s": float(np.median(bounds[chosen])) / 1e9}
        for name in names:
            per_call = np.median(np.array([r["chain_s"][name] for r in picked]), axis=0)  # [49]
            summary[label][name] = {
                "chain_ms": 1e3 * float(per_call.sum()),
                "speed_over_package": float(np.median(base / np.array([sum(r["chain_s"][name]) for r in picked]))),
                "GB_per_s": {kind: float(nbytes[k:48:4].sum() / per_call[k:48:4].sum()) / 1e9
                             for k, kind in enumerate(KINDS)} | {"lm_head": float(nbytes[48] / per_call[48]) / 1e9},
            }
    with open(out_path, "w") as f:
        json.dump({"machine": machine_info(), "seconds": seconds, "split_GB_per_s": split / 1e9,
                   "summary": summary}, f, indent=1)
    for label, s in summary.items():
        print(f"{label}: {s['rounds']} rounds, bound {s['bound_GB_per_s']:.1f} GB/s")
        for name in names:
            v = s[name]
            kinds = " ".join(f"{k} {g:.1f}" for k, g in v["GB_per_s"].items())
            print(f"  {name:24s} {v['chain_ms']:6.2f} ms  {v['speed_over_package']:.3f}x  GB/s: {kinds}")


if __name__ == "__main__":
    main(float(sys.argv[1]), sys.argv[2], *(float(a) for a in sys.argv[3:4]))
