"""Chapter 8's concept diagram: one attention layer split over two workers by heads (Megatron-LM).

Each worker holds the columns of ``c_attn`` that make its heads' Q, K and V, attends with its heads only (each
keeps its heads' K/V cache), and multiplies by its rows of ``c_proj``: a partial sum of the layer's output. One
all-reduce adds the partials on both workers, then the bias is added once. ``attention_split()`` draws it.
"""

from __future__ import annotations

from . import MIN_FONT


def attention_split(n_head: int = 12, ax=None):
    """Attention over two workers: x -> each worker's Q, K, V columns -> its heads -> its c_proj rows -> the
    all-reduce; returns the axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.8))
    half = n_head // 2
    colors = ("#9ecae1", "#fdae6b")

    def box(x, y, w, h, text, color):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="black"))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=MIN_FONT)

    def arrow(a, b):
        ax.annotate("", b, a, arrowprops={"arrowstyle": "->"})

    box(0, 1.3, 1.6, 1.2, "x [N, E]\nthe same on\nboth workers", "#eeeeee")
    for r, y in ((0, 2.3), (1, 0.3)):
        heads = f"heads {r * half}-{(r + 1) * half - 1}"
        box(2.2, y, 2.2, 1.1, f"c_attn columns of\n{heads}: Q, K, V\n[E, 3E/2]", colors[r])
        box(5.0, y, 2.3, 1.1, f"attention, {heads}\n(its own K/V cache)\n[N, E/2]", colors[r])
        box(7.9, y, 2.0, 1.1, f"c_proj rows of\n{heads}\npartial y_{r} [N, E]", colors[r])
        arrow((1.6, 1.9), (2.2, y + 0.55))
        arrow((4.4, y + 0.55), (5.0, y + 0.55))
        arrow((7.3, y + 0.55), (7.9, y + 0.55))
        arrow((9.9, y + 0.55), (10.5, 1.9))
    box(10.5, 1.3, 1.9, 1.2, "all-reduce\ny = y_0 + y_1\nthen + bias", "#c7e9c0")
    ax.text(3.3, 3.6, "columns: no communication", ha="center", fontsize=MIN_FONT + 1)
    ax.text(8.9, 3.6, "rows: partial sums", ha="center", fontsize=MIN_FONT + 1)
    ax.set_xlim(-0.1, 12.6)
    ax.set_ylim(0, 3.9)
    ax.axis("off")
    ax.set_title("Attention over two workers: split by heads, one all-reduce after c_proj "
                 "(blue: worker 0, orange: worker 1)", fontsize=11)
    return ax
