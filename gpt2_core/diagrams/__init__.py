"""Pictures drawn by code, so that they can be regenerated: the course's roadmap and the chapters' concept diagrams.

``roadmap("05")`` draws the course as a row of chapters with the current one marked ("you are here"); each chapter
notebook shows it in its first cell. The concept diagrams (the request lifecycle, the online-softmax merge,
attention over two workers, the pipeline schedule) live in this package's other modules, one per picture.
"""

from __future__ import annotations

COURSE = [("01", "naive\nforward"), ("02", "KV\ncache"), ("03", "batching"), ("04", "paged\nKV cache"),
          ("05", "sharing\nthe cache"), ("06", "quanti-\nzation"), ("07", "serving"), ("08", "parallelism"),
          ("09", "a modern\nmodel"), ("10", "speculative\ndecoding"), ("11", "capstone"), ("A1", "CPU\nkernels")]
MIN_FONT = 9  # points: no text in a figure smaller than this


def roadmap(current: str, ax=None):
    """The course as boxes in order, chapters before ``current`` filled, ``current`` marked; returns the axes."""
    import matplotlib.pyplot as plt

    ids = [number for number, _ in COURSE]
    if current not in ids:
        raise ValueError(f"unknown chapter {current!r}: one of {', '.join(ids)}")
    if ax is None:
        _, ax = plt.subplots(figsize=(11, 1.7))
    here = ids.index(current)
    for i, (number, title) in enumerate(COURSE):
        x = i + (0.4 if number.startswith("A") else 0)  # the appendix stands a little apart
        face = "#ffd27f" if i == here else ("#dbe8f5" if i < here and not number.startswith("A") else "white")
        ax.add_patch(plt.Rectangle((x + 0.04, 0), 0.92, 1, facecolor=face, edgecolor="#33475b",
                                   linewidth=2.2 if i == here else 1))
        ax.text(x + 0.5, 0.72, number, ha="center", va="center", fontsize=11, fontweight="bold")
        ax.text(x + 0.5, 0.32, title, ha="center", va="center", fontsize=MIN_FONT, linespacing=1.0)
        if i == here:
            ax.annotate("you are here", (x + 0.5, 1.02), (x + 0.5, 1.45), ha="center", fontsize=10,
                        arrowprops={"arrowstyle": "->"})
    ax.set_xlim(-0.05, len(COURSE) + 0.45)
    ax.set_ylim(-0.05, 1.6)
    ax.axis("off")
    return ax
