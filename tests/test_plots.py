"""The plots show what a user looks for: the LR finder's dip, readable; the schedule's curves,
named as the optimizer names them. Checked on the plotted data, not on pixels."""

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from tpu_utility import one_cycle_fit
from tpu_utility.training.history import History
from tpu_utility.training.lr_finder import LRFinderResult, readable_points


def _sweep():
    """A typical sweep: flat, a dip, then divergence to 100x the starting loss."""
    lrs = [1e-7 * 1.25**i for i in range(60)]
    losses = [2.3] * 20 + [2.3 - 0.09 * i for i in range(1, 21)] + [0.5 * 1.35**i for i in range(1, 21)]
    return lrs, losses


def test_the_lr_finder_plot_leaves_out_the_diverged_tail_so_the_dip_fills_it():
    lrs, losses = _sweep()
    result = LRFinderResult(lrs=lrs, losses=losses, suggested_lr=lrs[39] / 10, diverged=True)
    ax = result.plot().axes[0]
    x, y = ax.lines[0].get_xdata(), ax.lines[0].get_ydata()
    assert list(x) == lrs[: len(y)] and min(y) == min(losses)  # the dip and its lowest point are shown
    assert max(y) < 3.1 and max(losses) > 200  # the tail at 100x is not; the turn upwards is
    low, high = ax.get_ylim()
    assert (2.3 - min(losses)) / (high - low) > 0.8  # the dip spans most of the height
    left_out = len(losses) - len(y)
    assert ax.get_title() == f"LR finder ({left_out} diverged points not shown)"  # said, not dropped silently


def test_readable_points():
    assert readable_points([2.3, 2.2, 1.0, 0.6, 1.5, 2.5, 40.0, 900.0]) == 6  # up to the first point above the start
    assert readable_points([2.3, 2.0, 1.0, 0.8]) == 4  # never diverged: everything
    assert readable_points([2.3, 1.0, math.nan, math.inf]) == 3
    assert readable_points([]) == 0


def _history(momentum_name):
    steps = [i / 99 for i in range(100)]
    return History(step_lrs=[1e-3 * math.sin(math.pi * s) + 1e-5 for s in steps],
                   step_momenta=[0.95 - 0.1 * math.sin(math.pi * s) for s in steps],
                   momentum_name=momentum_name, steps_per_epoch=20)  # fmt: skip


@pytest.mark.parametrize("name", ["momentum", "beta1"])
def test_the_schedule_panel_has_a_legend_naming_the_optimizers_parameter(name):
    fig = _history(name).plot()
    schedule = fig.axes[1]
    legend = schedule.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == ["learning rate", name]
    twin = [ax for ax in fig.axes if ax is not schedule and ax.get_shared_x_axes().joined(ax, schedule)]
    assert [ax.get_ylabel() for ax in twin] == [name]


@pytest.mark.parametrize("optimizer, name", [("sgd", "momentum"), ("adamw", "beta1")])
def test_one_cycle_fit_names_momentum_as_its_optimizer_does(optimizer, name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long())
    model = torch.nn.Linear(8, 2)
    history = one_cycle_fit(model, data, epochs=1, max_lr=1e-2, batch_size=32, optimizer=optimizer, progress=False)
    assert history.momentum_name == name and history.step_momenta
    assert history.plot().axes[1].get_legend().get_texts()[1].get_text() == name
