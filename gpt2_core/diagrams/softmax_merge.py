"""Chapter 5's concept diagram: decode attention over a block table, one run of blocks at a time (online softmax).

A sequence's blocks lie in two runs of the pool. Each run gives a partial result (its maximum score ``m``, the sum
``l`` of its exponentials, its weighted values ``acc``); the two merge exactly after rescaling both to the larger
maximum, and the output is ``acc / l``. ``softmax_merge()`` draws it.
"""

from __future__ import annotations

from . import MIN_FONT


def softmax_merge(ax=None):
    """The pool, the two runs a block table points to, their partial results, the merge; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(14, 4))
    colors = {1: "#9ecae1", 2: "#fdae6b"}
    table = [(2, 1), (3, 1), (6, 2), (7, 2)]  # logical block -> (physical block, run)
    for b in range(9):  # the pool of physical blocks
        run = next((r for p, r in table if p == b), None)
        ax.add_patch(plt.Rectangle((b, 0), 0.85, 0.6, facecolor=colors.get(run, "white"), edgecolor="#33475b"))
        ax.text(b + 0.42, 0.3, str(b), ha="center", va="center", fontsize=MIN_FONT)
    ax.text(4.4, -0.35, "the pool of physical blocks (K and V of every sequence)", ha="center", fontsize=MIN_FONT)
    for i, (p, run) in enumerate(table):  # the block table, and an arrow from each entry to its block
        ax.add_patch(plt.Rectangle((1.5 + i, 2.2), 0.85, 0.5, facecolor=colors[run], edgecolor="#33475b"))
        ax.text(1.92 + i, 2.45, str(p), ha="center", va="center", fontsize=MIN_FONT)
        ax.annotate("", (p + 0.42, 0.62), (1.92 + i, 2.18), arrowprops={"arrowstyle": "->", "color": "gray"})
    ax.text(3.4, 2.95, "one sequence's block table (positions in order)", ha="center", fontsize=MIN_FONT)
    for run, y in ((1, 2.0), (2, 0.2)):  # each run's partial result
        ax.add_patch(plt.Rectangle((10.0, y), 4.6, 1.1, facecolor=colors[run], edgecolor="#33475b"))
        ax.text(12.3, y + 0.55, f"run {run} (blocks {' and '.join(str(p) for p, r in table if r == run)}):\n"
                f"m{run} = max s,  l{run} = Σ exp(s - m{run}),\nacc{run} = Σ exp(s - m{run}) v",
                ha="center", va="center", fontsize=MIN_FONT)
        ax.annotate("", (15.2, 1.6), (14.6, y + 0.55), arrowprops={"arrowstyle": "->"})
    ax.add_patch(plt.Rectangle((15.2, 0.85), 6.6, 1.5, facecolor="#c7e9c0", edgecolor="#33475b"))
    ax.text(18.5, 1.6, "merge, rescaled to m = max(m1, m2):\nl = l1·exp(m1 - m) + l2·exp(m2 - m)\n"
            "acc = acc1·exp(m1 - m) + acc2·exp(m2 - m)\noutput = acc / l", ha="center", va="center",
            fontsize=MIN_FONT)
    ax.annotate("", (10.0, 2.55), (3.9, 0.62), arrowprops={"arrowstyle": "->", "color": "tab:blue", "alpha": 0.6})
    ax.annotate("", (10.0, 0.75), (7.9, 0.3), arrowprops={"arrowstyle": "->", "color": "tab:orange", "alpha": 0.8})
    ax.set_xlim(-0.2, 22.0)
    ax.set_ylim(-0.6, 3.2)
    ax.axis("off")
    ax.set_title("Paged attention in place: each run of blocks gives a partial softmax; two partials merge exactly",
                 fontsize=11)
    return ax
