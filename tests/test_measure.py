"""The measuring knobs: GPT2_QUICK shrinks benchmark sizes; nbgrader's NBGRADER_EXECUTION makes a graded run time
everything once on a 2-layer model of GPT-2's width (grades never depend on timings)."""

import json
import os
import subprocess
import sys

from helpers import ROOT

PROBE = """
import json
from gpt2_core import measure
calls = []
measure.median_time(lambda: calls.append(1), repeats=5, warmup=2)
shape = measure.timing_model_shape()
print(json.dumps({"grading": measure.GRADING, "quick": measure.QUICK, "calls": len(calls),
                  "shape": shape if isinstance(shape, str) else [shape.n_layer, shape.n_embd, shape.n_head,
                                                                 shape.vocab_size, shape.n_positions]}))
"""


def probe(**env):
    base = {k: v for k, v in os.environ.items() if k not in ("NBGRADER_EXECUTION", "GPT2_QUICK")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)


def test_default_times_every_repeat_on_gpt2_small():
    assert probe() == {"grading": False, "quick": False, "calls": 7, "shape": "gpt2"}


def test_quick_mode_changes_sizes_not_timing():
    assert probe(GPT2_QUICK="1") == {"grading": False, "quick": True, "calls": 7, "shape": "gpt2"}
    assert probe(GPT2_QUICK="0")["quick"] is False


def test_nbgrader_grading_times_once_on_a_shallow_gpt2():
    for value in ("autograde", "validate"):
        got = probe(NBGRADER_EXECUTION=value)
        assert got == {"grading": True, "quick": True, "calls": 1, "shape": [2, 768, 12, 50257, 1024]}
