"""The appendix's layout benchmark: ``python -m gpt2_core bench layout [--json PATH]``."""

from __future__ import annotations

import numpy as np

from ..ch02_kv_cache import kv_cache
from ..loading.config import GPT2Config
from ..a1_cpu_kernels import accelerate
from ..loading.weights import random_model
from .batching import decode_step_runner
from .common import QUICK, interleaved, median_time


def bench_layout(quick: bool = QUICK, context: int = 128, shape: str | GPT2Config = "gpt2") -> dict:
    """Whole decode steps with the checkpoint's row-major output projections vs column-major ones (both through
    ``cpu_kernels.accelerate``), side by side (each round times both): chapter 2's ``decode_step`` at batch 1,
    chapter 3's ragged step without tiles (``tiled=False``: the kernels that see the memory order) for larger
    batches; and chapter 2's ``prefill`` of prompts of several lengths.
    ``shape``: the model's preset or config (GPT-2 124M; tests pass a small one)."""
    base = random_model(shape, seed=0)
    models = {"row_major": accelerate(base, tiled=False, column_major=False),
              "column_major_projections": accelerate(base, tiled=False, column_major=True)}
    rounds = 5 if quick else 15

    def side_by_side(runs: dict) -> dict:  # name -> function -> name -> [seconds per round]
        for run in runs.values():
            run()  # warm-up
        return interleaved(runs, rounds, measure=lambda run, r: median_time(run, repeats=1, warmup=0))

    def batch_one(model):
        _, cache = kv_cache.prefill(model, np.arange(context), capacity=context + 1, last_only=True)

        def step():
            kv_cache.decode_step(model, 0, cache)
            cache.length = context  # the same position every time
        return step

    def speed_ratio(times) -> float:  # column-major speed over row-major, from the medians
        return float(np.median(times["row_major"])) / float(np.median(times["column_major_projections"]))

    results, ratios = [], {}
    for batch in ([1, 4, 32] if quick else [1, 2, 4, 8, 16, 32]):
        times = side_by_side({name: batch_one(m) if batch == 1  # untiled: tiles are the same in either order
                              else decode_step_runner(m, batch, context) for name, m in models.items()})
        for name, t in times.items():
            seconds = float(np.median(t))
            results.append({"method": name, "batch": batch, "context": context, "seconds_per_step": seconds,
                            "tokens_per_s": batch / seconds})
        ratios[f"column_major_speed_over_row_major_batch_{batch}"] = speed_ratio(times)
    for prompt_len in ([16, 64] if quick else [16, 64, 256, 512]):
        ids = np.arange(prompt_len) % base.config.vocab_size
        times = side_by_side({name: (lambda m=m: kv_cache.prefill(m, ids, last_only=True))
                              for name, m in models.items()})
        for name, t in times.items():
            seconds = float(np.median(t))
            results.append({"method": name, "phase": "prefill", "batch": 1, "prompt_len": prompt_len,
                            "seconds": seconds, "tokens_per_s": prompt_len / seconds})
        ratios[f"column_major_speed_over_row_major_prefill_{prompt_len}"] = speed_ratio(times)
    model_name = "random GPT-2 124M shape, float32" if shape == "gpt2" else f"random {shape} shape, float32"
    return {"benchmark": "layout", "model": model_name, "quick": quick, "kernels": "cpu_kernels.accelerate",
            "results": results, "ratios": ratios}


