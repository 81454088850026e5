"""Figures show wherever a user is: IPython renders them as PNG under any backend (a headless
server's Agg included) without pyplot, they save headless, and plotting never switches the
process's matplotlib backend."""
from __future__ import annotations

import pickle

import matplotlib
import pytest
from IPython.core.formatters import DisplayFormatter

from autoplan import MeshSpec, autoplan
from autoplan.presets import build_preset
from autoplan.review import new_figure, plot_communication, plot_memory, plot_timeline, save_figure

PNG = b"\x89PNG\r\n\x1a\n"


def _own_plot():
    fig = new_figure(figsize=(4, 3))
    fig.add_subplot().plot([1, 2, 3], [2, 1, 3], marker="o")
    return fig


@pytest.fixture(scope="module")
def plan():
    model = build_preset("titan-llama3-70b", num_layers=2)
    return autoplan(model, MeshSpec((8, 8), ("dp", "tp"), "h100_sxm"), batch=(64, 8192))


@pytest.mark.parametrize("make", [lambda p: plot_memory([p, p], ["a", "b"]), plot_communication, plot_timeline,
                                  lambda p: plot_timeline([p, p], names=["a", "b"]),
                                  lambda p: _own_plot()],
                         ids=["memory", "communication", "timeline", "timelines", "new_figure"])
def test_ipython_displays_every_figure_as_png(plan, make, tmp_path):
    backend = matplotlib.get_backend()
    fig = make(plan)
    data, _ = DisplayFormatter().format(fig)   # what Jupyter / VS Code receive for a cell's result
    assert data["image/png"].startswith(PNG) and len(data["image/png"]) > 1000
    assert matplotlib.get_backend() == backend   # a library does not switch the user's backend
    assert save_figure(fig, tmp_path / "f.png").read_bytes().startswith(PNG)
    assert save_figure(fig, tmp_path / "f.svg").read_text().lstrip().startswith("<?xml")
    assert fig.svg().startswith("<svg")
    assert type(pickle.loads(pickle.dumps(fig))).__name__ == "PlanFigure"


def test_timelines_share_one_time_axis(plan):
    fig = plot_timeline([plan, plan], names=["first", "second"])
    a, b = fig.axes[:2]
    assert a.get_shared_x_axes().joined(a, b)
    assert "first" in a.get_title() and "second" in b.get_title()
