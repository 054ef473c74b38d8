"""Chapter 8's concept diagram: a pipeline's schedule (GPipe), micro-batch by micro-batch, and its bubble.

``pipeline_schedule((1, 1), 4)`` draws the schedule ``gpipe_schedule`` computes for stages of the given times:
one row per stage, a box per micro-batch, the idle time (the bubble) hatched. The same function draws a measured
timeline (``busy`` as ``bubble_fraction`` takes it) when one is passed instead.
"""

from __future__ import annotations

from . import MIN_FONT


def pipeline_schedule(stage_seconds=(1.0, 1.0), micro_batches: int = 4, busy=None, ax=None):
    """The schedule of ``micro_batches`` over stages taking ``stage_seconds`` each (or the measured ``busy``
    intervals), idle time hatched; returns the axes."""
    import matplotlib.pyplot as plt

    from ..ch08_parallel.pipeline_parallel import bubble_fraction, gpipe_schedule

    equal = busy is None and len(set(stage_seconds)) == 1  # the textbook case: (p-1)/(m+p-1)
    busy = gpipe_schedule(list(stage_seconds), micro_batches) if busy is None else busy
    t0 = min(a for stage in busy for a, _ in stage)
    t1 = max(b for stage in busy for _, b in stage)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.9 + 0.7 * len(busy)))
    for s, stage in enumerate(busy):
        ax.barh(s, t1 - t0, left=0, color="white", hatch="//", edgecolor="#bbbbbb")  # idle unless covered
        for i, (a, b) in enumerate(stage):
            ax.barh(s, b - a, left=a - t0, color=plt.cm.tab10(i % 10), edgecolor="black")
            ax.text((a + b) / 2 - t0, s, f"mb {i}", ha="center", va="center", fontsize=MIN_FONT)
    ax.set_yticks(range(len(busy)), [f"stage {s}" for s in range(len(busy))], fontsize=MIN_FONT + 1)
    ax.invert_yaxis()
    ax.set_xlabel("time (one stage, one micro-batch = 1)" if equal else "time")
    p, m = len(busy), len(busy[0])
    ax.set_title(f"{p} stages, {m} micro-batches: idle (hatched) {bubble_fraction(busy):.0%} of the stages' time"
                 + (" = (p-1)/(m+p-1)" if equal else ""), fontsize=11)
    return ax
