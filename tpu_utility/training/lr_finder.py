"""find_lr(): an exponential learning-rate sweep that leaves the model as it was
(weights, device, train/eval mode) and the global random state untouched.

It is one_cycle_fit's loop (``trainer.py``) with a sweep in place of its schedule: a
``LearningRates`` callback whose curve rises exponentially, leaves momentum as the
optimizer has it, and ends the run (``StopFit``) when the loss diverges. Its suggestion
is a peak for any ``schedule=`` of one_cycle_fit."""

from __future__ import annotations

import math
import random
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch
from torch import nn

from .. import backend
from ..compiler import Compile
from ..data.loaders import unpack_loader
from ..files import check_file_path
from .builtins import LearningRates
from .events import Loop, StopFit, TrainerLoop
from .fit import check_number, check_seed, resolve_optimizer
from .history import closed_figure
from .metrics import CrossEntropy, check_loss_fn
from .runner import Placement
from .strategies import FSDP, Strategy, choose
from .trainer import FitPlan, Steps, train


@dataclass
class LRFinderResult:
    """The sweep: learning rates, smoothed losses and a suggested ``max_lr``."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    suggested_lr: float = math.nan
    diverged: bool = False

    def plot(self, path: str | None = None) -> Any:
        """The smoothed loss against the learning rate, the diverged tail left out so the dip shows.

        Saved to ``path`` if given. Returns the matplotlib Figure (a notebook shows it once).

        Example:
            >>> result = find_lr(model, train_ds)   # doctest: +SKIP
            >>> result.plot()                        # doctest: +SKIP
        """
        if path is not None:  # before drawing; matplotlib would write a folder "x" as "x.png" beside it
            check_file_path(path, "plot path")
        fig = closed_figure(figsize=(5, 3.5))  # a notebook shows the returned figure once
        ax = fig.subplots()
        shown = readable_points(self.losses)
        ax.plot(self.lrs[:shown], self.losses[:shown], label="smoothed loss")
        finite = [x for x in self.losses[:shown] if math.isfinite(x)]
        if finite:  # from the dip's floor to the loss before it: the turn upwards leaves at the top
            low = min(finite)
            high = max(finite[: finite.index(low) + 1])
            margin = 0.08 * (high - low) or 0.1 * abs(low) or 0.1
            ax.set_ylim(low - margin, high + margin)
        ax.axvline(self.suggested_lr, color="tab:red", linestyle="--", label=f"suggested {self.suggested_lr:.1e}")
        left_out = len(self.losses) - shown
        title = f"LR finder ({left_out} diverged point{'s' if left_out != 1 else ''} not shown)" if left_out else "LR finder"
        ax.set(xscale="log", xlabel="learning rate", ylabel="smoothed loss", title=title)
        ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def readable_points(losses: list[float]) -> int:
    """How many sweep points to plot: up to the first one, after the minimum, above the starting loss.

    Past it the loss has diverged; its values (often 100x the start) would squash the
    dip that matters into a few pixels.

    Example:
        >>> readable_points([2.3, 2.2, 1.0, 0.6, 1.5, 2.5, 40.0, 900.0])
        6
    """
    finite = [x if math.isfinite(x) else math.inf for x in losses]
    if not finite:
        return 0
    best = min(range(len(finite)), key=finite.__getitem__)
    for i in range(best + 1, len(finite)):
        if finite[i] > finite[0]:
            return i + 1  # the first point above the start shows where it turns
    return len(finite)


def suggest_lr(lrs: list[float], losses: list[float]) -> float:
    """A tenth of the learning rate at the smoothed loss's minimum (a safe max_lr)."""
    if not losses:
        raise ValueError("the sweep recorded no loss; give more data or a larger num_steps")
    best = min(range(len(losses)), key=losses.__getitem__)
    return lrs[best] / 10


def _check_sweep(start_lr: Any, end_lr: Any, num_steps: Any, smooth: Any, diverge_factor: Any) -> None:
    check_number("start_lr", start_lr, 0, math.inf)
    check_number("end_lr", end_lr, 0, math.inf)
    if not start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr, but given start_lr={start_lr}, end_lr={end_lr}")
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 2:
        raise ValueError(f"num_steps must be an int of at least 2, but given {num_steps!r}")
    check_number("smooth", smooth, 0, 1, closed="[)")
    check_number("diverge_factor", diverge_factor, 1, math.inf)


def find_lr(
    model: nn.Module,
    train_data: Any,
    *,
    loss_fn: Callable | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    batch_size: int | None = None,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smooth: float = 0.98,
    diverge_factor: float = 4.0,
    read_every: int = 10,
    seed: int = 0,
    strategy: str | FSDP = "auto",
    compile: bool | Literal["auto"] | Compile = "auto",
) -> LRFinderResult:
    """Sweeps the learning rate from ``start_lr`` to ``end_lr`` exponentially.

    Losses stay on the device and are read every ``read_every`` steps in one
    transfer; the sweep stops once the smoothed loss exceeds ``diverge_factor``
    times its minimum. Afterwards the model has its weights, device and
    train/eval mode as before, and the global random state is as it was
    (``seed`` orders the data and seeds the sweep's own random ops, as in
    ``one_cycle_fit``, whose loop the sweep runs).

    ``strategy``: "auto" sweeps on one core; "spmd", "fsdp" or ``FSDP(...)`` (as ``one_cycle_fit`` takes
    them) on all cores, "fsdp" with the parameters sharded, for a model that one chip cannot hold.

    ``compile``: as ``one_cycle_fit`` takes it; "auto" compiles a sweep of ``num_steps`` steps where a run that
    long would compile (never on the CPU).

    Returns:
        LRFinderResult with ``lrs``, smoothed ``losses``, ``suggested_lr`` and ``plot()``.

    Raises:
        ValueError, TypeError: a bad argument, named with what is allowed.
        ValueError: the loss is nan or inf from the first step (bad data, not a learning rate).

    Example:
        >>> # was: an lr_finder from another library, or guessing
        >>> result = find_lr(model, train_ds)                 # doctest: +SKIP
        >>> one_cycle_fit(model, train_ds, epochs=5, max_lr=result.suggested_lr)  # doctest: +SKIP
        >>> result = find_lr(llm, train_ds, strategy="fsdp")  # doctest: +SKIP
    """
    # "auto": one core, as always; "spmd" and "fsdp": all cores, in this process
    chosen = choose("all", strategy, allowed=("auto", "spmd", "fsdp"), auto_alone=True)
    _check_sweep(start_lr, end_lr, num_steps, smooth, diverge_factor)
    check_loss_fn(loss_fn)
    if isinstance(read_every, bool) or not isinstance(read_every, int) or read_every < 1:
        raise ValueError(f"read_every must be a positive int, but given {read_every!r}")
    make_opt, name = resolve_optimizer(optimizer)
    compile_setting = Compile.of(compile).settled(num_steps)  # the plan counts num_steps epochs: the sweep's length decides
    sweep = _Sweep(_SweepArgs(start_lr, end_lr, num_steps, smooth, diverge_factor, read_every))
    # the one_cycle_fit loop with the sweep as its schedule; a dict batch with labels and the default
    # loss trains on a Hugging Face model's own output.loss
    plan = FitPlan(
        epochs=num_steps, train=unpack_loader(train_data, batch_size, "train_data"), valid=None,
        steps=Steps(loss_fn or CrossEntropy(), default_loss=loss_fn is None), optimizer=make_opt,
        optimizer_name=name, optimizer_args={}, metrics={}, seed=check_seed(seed), progress=False, builtins=[sweep],
        cores=chosen.cores, strategy=chosen, compile=compile_setting,
    )  # fmt: skip
    # the strategy runs the sweep: here, or (natively sharded) in the processes holding the shards
    swept = chosen.run(_swept, (model, plan, sweep), what="find_lr", pack=dataclasses.asdict,
                       unpack=lambda fields: _Swept(**fields))  # fmt: skip
    if not swept.lrs and swept.not_finite is not None:
        lr, loss = swept.not_finite
        raise ValueError(
            f"the loss was {loss} from the sweep's first step (lr {lr:.2e}, too small to be the cause), so there is no "
            f"curve to read: the data or the model gives a non-finite loss at any learning rate. Look for nan or inf "
            f"in the inputs (torch.isfinite(x).all()) and for targets the loss cannot take, then run find_lr again"
        )
    return LRFinderResult(swept.lrs, swept.losses, suggest_lr(swept.lrs, swept.losses), swept.diverged)


@dataclass
class _Swept:
    """What one sweep found (the master's, where the strategy launched processes): plain values."""

    lrs: list[float]
    losses: list[float]
    diverged: bool
    not_finite: tuple[float, float] | None


def _swept(chosen: Strategy, model: nn.Module, plan: FitPlan, sweep: _Sweep) -> _Swept:
    """The sweep, as one_cycle_fit's loop with ``sweep`` as its schedule, under ``chosen``; the model, the random
    state and the device's left as they were found."""
    plan = dataclasses.replace(plan, strategy=chosen, builtins=[sweep])
    found, saved = Placement.of(model), {k: v.detach().clone() for k, v in model.state_dict().items()}
    python_state, xla_state = random.getstate(), backend.current().devices.rng_state() if backend.current().lazy else None
    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=cuda):  # the loop seeds torch (every device) with `seed`
        try:
            train(model, plan)
        finally:
            # the sweep stops inside a step, so its last update is still a pending graph; run it whole now,
            # or moving each parameter back compiles a graph of its own (about one per parameter: 40 for BERT)
            backend.current().devices.sync()
            found.restore(model)
            model.load_state_dict(saved)
            random.setstate(python_state)
            if xla_state is not None:
                backend.current().devices.set_rng_state(xla_state)
    result = sweep.result
    return _Swept(result.lrs, result.losses, result.diverged, sweep.smoother.not_finite)


@dataclass
class _SweepArgs:
    start_lr: float
    end_lr: float
    num_steps: int
    smooth: float
    diverge_factor: float
    read_every: int


class _Sweep(LearningRates):
    """find_lr's schedule: learning rates rising exponentially, the losses read every ``read_every`` steps,
    and ``StopFit`` after ``num_steps`` steps or once the loss diverges."""

    def __init__(self, args: _SweepArgs) -> None:
        self.args = args

    name = "find_lr's sweep"

    def curve(self, loop: Loop) -> tuple[list[float], None]:
        a = self.args
        ratio = (a.end_lr / a.start_lr) ** (1 / (a.num_steps - 1))
        return [a.start_lr * ratio**k for k in range(a.num_steps)], None  # momentum: the optimizer's own

    def on_fit_start(self, loop: Loop) -> None:
        super().on_fit_start(loop)
        self.result, self.pending = LRFinderResult(), []
        self.smoother = _Smoother(self.args.smooth, self.args.diverge_factor)

    def on_step_end(self, loop: TrainerLoop) -> None:
        super().on_step_end(loop)
        self.pending.append((loop.lr, loop.loss))
        done = loop.step >= self.args.num_steps
        if len(self.pending) == self.args.read_every or done:
            values = backend.current().devices.to_cpu([torch.stack([loss for _, loss in self.pending])])[0].tolist()
            self.result.diverged = self.smoother.add(self.result, [lr for lr, _ in self.pending], values)
            self.pending.clear()
        if self.result.diverged:
            raise StopFit(f"the loss diverged at lr {self.result.lrs[-1] if self.result.lrs else loop.lr:.2e}")
        if done:
            raise StopFit(f"swept {self.args.num_steps} learning rates")


class _Smoother:
    """The bias-corrected exponential moving average of the loss, and the divergence test."""

    def __init__(self, smooth: float, diverge_factor: float) -> None:
        self.smooth, self.factor, self.avg, self.best = smooth, diverge_factor, 0.0, math.inf
        self.not_finite: tuple[float, float] | None = None  # (lr, loss) of the first nan or inf loss

    def add(self, result: LRFinderResult, lrs: list[float], values: list[float]) -> bool:
        """Appends to ``result``; True once the loss is non-finite or diverged."""
        for lr, value in zip(lrs, values):
            if not math.isfinite(value):
                self.not_finite = (lr, value)
                return True
            self.avg = self.smooth * self.avg + (1 - self.smooth) * value
            smoothed = self.avg / (1 - self.smooth ** (len(result.losses) + 1))
            result.lrs.append(lr)
            result.losses.append(smoothed)
            self.best = min(self.best, smoothed)
            if smoothed > self.factor * self.best:
                return True
        return False
