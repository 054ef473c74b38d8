"""The pictures drawn by code: the roadmap and the request lifecycle render, name what they should, and use no text
smaller than ``gpt2_core.diagrams.MIN_FONT`` points."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from gpt2_core.ch03_batching.sequence import SequenceStatus  # noqa: E402
from gpt2_core.diagrams import MIN_FONT, roadmap  # noqa: E402
from gpt2_core.diagrams.lifecycle import lifecycle  # noqa: E402


def texts(ax) -> list:
    return [t for t in ax.findobj(matplotlib.text.Text) if t.get_text().strip()]


def test_lifecycle_draws_every_state_and_every_transition():
    ax = lifecycle()
    words = " ".join(t.get_text() for t in texts(ax)).lower()
    for state in [s.value for s in SequenceStatus] + ["preempted"]:
        assert state in words, state
    for check in ("max_num_seqs", "token budget", "room in the store", "one more token", "recomputed", "max_new_tokens"):
        assert check in words, check
    assert min(t.get_fontsize() for t in texts(ax)) >= MIN_FONT
    plt.close(ax.figure)


@pytest.mark.parametrize("chapter", ["01", "04", "A1"])
def test_roadmap_marks_the_chapter_and_uses_no_small_text(chapter):
    ax = roadmap(chapter)
    assert "you are here" in [t.get_text() for t in texts(ax)]
    assert min(t.get_fontsize() for t in texts(ax)) >= MIN_FONT
    ax.figure.canvas.draw()
    boxes = [patch.get_window_extent() for patch in ax.patches]
    for t in texts(ax):  # every chapter's number and title inside its own box
        if t.get_text() != "you are here":
            b = t.get_window_extent()
            assert any(r.x0 <= b.x0 and b.x1 <= r.x1 for r in boxes), t.get_text()
    plt.close(ax.figure)


def test_roadmap_refuses_an_unknown_chapter():
    with pytest.raises(ValueError, match="unknown chapter '99'"):
        roadmap("99")


def test_lifecycle_fits_its_figure():
    """No label runs off the figure: every text's box lies inside the canvas once drawn."""
    ax = lifecycle()
    fig = ax.figure
    fig.canvas.draw()
    canvas = fig.bbox
    for t in texts(ax):
        box = t.get_window_extent()
        assert box.x0 >= canvas.x0 - 1 and box.x1 <= canvas.x1 + 1 and box.y0 >= canvas.y0 - 1 \
            and box.y1 <= canvas.y1 + 1, t.get_text()
    plt.close(fig)
