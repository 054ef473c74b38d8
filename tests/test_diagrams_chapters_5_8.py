"""The concept diagrams of chapters 5 and 8 (``gpt2_core.diagrams``): each draws, and no text in it is under 9 pt."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from gpt2_core.ch08_parallel.pipeline_parallel import bubble_fraction, gpipe_schedule, ideal_bubble  # noqa: E402
from gpt2_core.diagrams import MIN_FONT  # noqa: E402
from gpt2_core.diagrams.pipeline import pipeline_schedule  # noqa: E402
from gpt2_core.diagrams.softmax_merge import softmax_merge  # noqa: E402
from gpt2_core.diagrams.tensor_parallel import attention_split  # noqa: E402


def texts(ax):
    return [t for t in ax.figure.findobj(matplotlib.text.Text) if t.get_text().strip()]


@pytest.mark.parametrize("draw", [softmax_merge, attention_split, pipeline_schedule,
                                  lambda: pipeline_schedule((1.0, 2.5, 0.5), 3)])
def test_a_diagram_draws_with_no_text_under_9_points(draw):
    ax = draw()
    try:
        found = texts(ax)
        assert len(found) > 5
        small = [(t.get_text(), t.get_fontsize()) for t in found if t.get_fontsize() < MIN_FONT]
        assert not small, small
    finally:
        plt.close(ax.figure)


def test_the_pipeline_diagram_states_the_schedules_bubble():
    ax = pipeline_schedule((1.0, 1.0), 4)
    try:
        assert f"{ideal_bubble(2, 4):.0%}" in ax.get_title()
        measured = gpipe_schedule([0.2, 0.3], 3)  # a "measured" timeline is drawn as given
        ax2 = pipeline_schedule(busy=measured)
        assert f"{bubble_fraction(measured):.0%}" in ax2.get_title()
    finally:
        plt.close("all")
