"""The request lifecycle of chapters 3-4, drawn by code: waiting, running, preempted, finished.

The states are chapter 3's ``SequenceStatus`` (waiting, running, finished) plus the transition chapter 4 makes
possible: a running sequence *preempted* by recompute (its KV freed, back at the front of the queue). Each arrow
is labelled with what the scheduler or the engine checks before it takes it.
"""

from __future__ import annotations

from . import MIN_FONT
from ..ch03_batching.sequence import SequenceStatus

STATES = {  # name -> (x, y, colour, what holds in this state)
    SequenceStatus.WAITING.value: (1.5, 2.0, "#dbe8f5", "in the queue, FCFS\nno KV memory"),
    SequenceStatus.RUNNING.value: (7.0, 2.0, "#ffd27f", "one chunk every step\nholds KV room"),
    "preempted": (4.25, 0.0, "#f4c7c3", "KV freed; to the front\nof the queue"),
    SequenceStatus.FINISHED.value: (12.0, 2.0, "#cfe8cf", "stop / length /\nerror / abort"),
}
TRANSITIONS = [  # (from, to, label, arc: 0 straight, else the curvature of the arrow)
    ("waiting", "running", "admitted: a place free\n(max_num_seqs), prompt\nwithin the token budget,\n"
                           "room in the store", 0.0),
    ("running", "finished", "stop token or\nmax_new_tokens:\nKV freed at once", 0.0),
    ("running", "preempted", "the store cannot give\none more token", -0.25),
    ("preempted", "waiting", "prompt + output\nrecomputed later", -0.25),
]
BOX_W, BOX_H = 2.4, 1.2


def lifecycle(ax=None):
    """Draw the request lifecycle; returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    if ax is None:
        _, ax = plt.subplots(figsize=(11.5, 4.4))
    for name, (x, y, colour, note) in STATES.items():
        ax.add_patch(FancyBboxPatch((x - BOX_W / 2, y - BOX_H / 2), BOX_W, BOX_H, boxstyle="round,pad=0.05",
                                    facecolor=colour, edgecolor="#33475b", linewidth=1.5))
        ax.text(x, y + 0.25, name.upper(), ha="center", va="center", fontsize=12, fontweight="bold")
        ax.text(x, y - 0.22, note, ha="center", va="center", fontsize=MIN_FONT, linespacing=1.1)
    for source, target, label, arc in TRANSITIONS:
        _arrow(ax, source, target, label, arc)
    ax.annotate("", (STATES["running"][0] + 0.5, 2.0 + BOX_H / 2 + 0.05),  # a decode step: running stays running
                (STATES["running"][0] - 0.5, 2.0 + BOX_H / 2 + 0.05),
                arrowprops={"arrowstyle": "->", "connectionstyle": "arc3,rad=-1.6", "color": "#33475b"})
    ax.text(STATES["running"][0], 3.55, "decode: one more token", ha="center", fontsize=MIN_FONT)
    ax.annotate("arrives", (STATES["waiting"][0] - BOX_W / 2 - 0.05, 2.0), (-0.85, 2.0), va="center",
                fontsize=MIN_FONT + 1, arrowprops={"arrowstyle": "->", "color": "#33475b"})
    ax.set_xlim(-0.9, 13.6)
    ax.set_ylim(-0.8, 3.9)
    ax.axis("off")
    return ax


def _arrow(ax, source: str, target: str, label: str, arc: float) -> None:
    (x0, y0, *_), (x1, y1, *_) = STATES[source], STATES[target]
    if y0 == y1:  # side by side: from the right edge to the left edge
        start, end = (x0 + BOX_W / 2 + 0.05, y0), (x1 - BOX_W / 2 - 0.05, y1)
        text_at, align = ((x0 + x1) / 2, y0 + 0.12), "bottom"
    else:  # on another level: from the edge facing the target, a little to its side
        sx, sy = (1 if x1 > x0 else -1), (1 if y1 > y0 else -1)
        start = (x0 + 0.4 * sx, y0 + sy * (BOX_H / 2 + 0.03))
        end = (x1 - 0.4 * sx, y1 - sy * (BOX_H / 2 + 0.03))
        text_at = ((x0 + x1) / 2 + (1.45 if y1 < y0 else -1.45), (y0 + y1) / 2)  # beside the arrow, outside the loop
        align = "center"
    ax.annotate("", end, start, arrowprops={"arrowstyle": "->", "lw": 1.5, "color": "#33475b",
                                             "connectionstyle": f"arc3,rad={arc}"})
    ax.text(*text_at, label, ha="center", va=align, fontsize=MIN_FONT, linespacing=1.1)
