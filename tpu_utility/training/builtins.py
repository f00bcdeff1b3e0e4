"""The callbacks a one_cycle_fit run is made of: what its keyword arguments ask for.

``one_cycle_fit`` builds them from its arguments (``fit.builtin_callbacks``); the loop
(``trainer.py``) knows none of them and only fires events. Each has an ``order``, so
at every event they act in this sequence, your callbacks (order 0) in between:

========================  =====  ==========================================================
callback                  order  from
========================  =====  ==========================================================
``LearningRates``          -40   ``schedule``, ``max_lr``, ``warmup``, ``pct_start``, ...
                                 (``OneCycleSchedule``, ``MultiplierSchedule``; ``find_lr``'s
                                 sweep is another curve); ``OwnLearningRates`` for
                                 ``schedule=None``
``StopOnNaN``              -30   always: a non-finite training loss ends the run
``BestEpoch``              -20   ``monitor``, ``mode``, ``early_stopping``
(yours)                      0
``Checkpoints``             10   ``checkpoint_dir``, ``resume``: ``last.pt``, ``best.pt``,
                                 ``history.csv``, and the resume checks
``ReplicaAgreement``        15   always (``agreement.py``): with several replicas, one
                                 all-gather before the first step compares what each was given
``TimeLimit``               20   ``time_limit``
``RecompileNotice``         25   always: a graph compiled after the first epoch, with its cause
``ProgressLine``            30   ``progress``: the summary, a line per epoch, why it stopped
``RestoreBest``             50   ``restore_best``: keeps the best weights (where no checkpoint
                                 does), loads them after every other ``on_fit_end``
========================  =====  ==========================================================
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import re
import secrets
import warnings
from typing import Any

import torch

from .. import backend
from ..checkpoint import (CHECKPOINT_NAME, DamagedCheckpointError, class_name, load_checkpoint, load_state_into,
                         save_atomic, to_cpu)  # fmt: skip
from ..files import WriteError, exists, join
from ..progress import format_duration, run_eta, write_line
from .events import Callback, Loop, TrainerLoop, does
from .history import History
from .monitor import StopRule, Watch, out_of_time
from .schedule import LrSchedule, OneCycle, unround, warmup_steps

BEST_NAME = "best.pt"
HISTORY_NAME = "history.csv"


# ------------------------------------------------------------ the schedule
_ZERO_LR = 1e-30  # what a device-held lr of 0 is written as (see _Driver)


class _Driver:
    """Writes a curve of learning rates (and momenta, if given) into the optimizer before every step.

    The named optimizers "adam" and "adamw" are torch_xla's fused sync-free ones
    on XLA and take Python floats. A user's own torch Adam-family optimizer gets
    ``lr`` (and ``betas``) as device tensors (``capturable=True``) copied from a
    table of the whole curve, uploaded once: Python-float hyperparameters would
    change the graph whenever a value rounds to a special constant
    (``1 - lr * wd == 1.0`` in float32 late in the schedule), because torch_xla
    uploads scalars by value. Other optimizers (SGD) take Python floats, the only
    form their step accepts without a host sync. On XLA such a float is written
    ``unround``: torch_xla shares a scalar upload with every equal scalar of the
    step's graph, and one-cycle's momentum passing exactly 0.9 met dropout's 0.9,
    merged with it into one input and compiled a graph of its own mid-run.

    Each parameter group gets the curve's learning rate times its ``ratios`` entry
    (``schedule.peak_ratios``); momentum is the same in every group. Without momenta
    (``moms=None``) the optimizer's betas and momentum are left as they are.

    torch's capturable Adam divides by the lr (``eps / step_size``), so an lr of exactly
    0 (a warm-up's first step) turns a parameter whose gradient is 0 into NaN
    (pytorch/pytorch#126514); in the device table a 0 is written as ``_ZERO_LR``
    (1e-30: a step of about 1e-22 at most, none in float32). ``lrs`` keeps the 0.

    ``changed`` says, on the host, whether a group's lr is no longer what was last
    written: a float of another value, another object, or a tensor written in place
    (its version counter moved); no device value is read.
    """

    def __init__(self, loop: TrainerLoop, lrs: list[float], moms: list[float] | None) -> None:
        opt, device = loop.optimizer, loop.device
        self.lrs, self.moms = lrs, moms
        self.ratios = loop.lr_ratios
        self.total, self.step_index = len(self.lrs), loop.step
        self.written: list[tuple[Any, int]] | None = None  # each group's lr as last written, and its version
        chosen = backend.current()
        self.floats = unround if chosen.devices.is_lazy(device) else float
        self.on_device = (
            chosen.devices.is_lazy(device)
            and not chosen.compute.is_fused_optimizer(opt)  # they take Python floats without syncing or recompiling
            and all("betas" in g and "capturable" in g for g in opt.param_groups)
        )
        if self.on_device:
            columns = [[lr or _ZERO_LR for lr in self.lrs]] + ([] if moms is None else [moms])
            self.table = torch.tensor(columns, dtype=torch.float32).T.contiguous().to(device)
            self.device_index = torch.tensor([min(loop.step, self.total - 1)], device=device)
            first = self.lrs[0] or _ZERO_LR
            self.lr = torch.tensor(first, device=device)
            self.group_lrs = [self.lr if r == 1 else torch.tensor(first * r, device=device) for r in self.ratios]
            if moms is not None:
                self.beta1 = torch.tensor(moms[0], device=device)
            for group, lr in zip(opt.param_groups, self.group_lrs):
                group["capturable"] = True
                group["lr"] = lr
                if moms is not None:
                    # beta2 stays constant; as a device tensor, Adam's addcmul_(value=1 - beta2) would
                    # .item() it every step, so it is a CPU tensor (torch requires both betas tensors).
                    group["betas"] = (self.beta1, torch.tensor(float(group["betas"][1])))

    def before_step(self, opt: torch.optim.Optimizer) -> float:
        i = min(self.step_index, self.total - 1)
        self.step_index += 1
        if self.on_device:
            row = self.table.index_select(0, self.device_index).squeeze(0)
            self.lr.copy_(row[0])
            if self.moms is not None:
                self.beta1.copy_(row[1])
            for lr, ratio in zip(self.group_lrs, self.ratios):
                if ratio != 1:
                    lr.copy_(row[0] * ratio)
            self.device_index.add_(1).clamp_(max=self.total - 1)
        else:
            value = self.floats  # on XLA, kept apart from the graph's round scalars (unround)
            for group, ratio in zip(opt.param_groups, self.ratios):
                group["lr"] = value(self.lrs[i] * ratio)
                if self.moms is None:
                    continue
                if "betas" in group:
                    group["betas"] = (value(self.moms[i]), group["betas"][1])
                elif group.get("momentum", 0) > 0:
                    group["momentum"] = value(self.moms[i])
        # each group's lr as written, with its tensor's version (None for a float): what changed() compares
        lrs = [g["lr"] for g in opt.param_groups]
        self.written = [(lr, lr._version if isinstance(lr, torch.Tensor) else None) for lr in lrs]
        return self.lrs[i]

    def changed(self, opt: torch.optim.Optimizer) -> tuple[int, str] | None:
        """The first param group whose lr someone else wrote since ``before_step``, and how; None if none did."""
        for k, (group, (mine, version)) in enumerate(zip(opt.param_groups, self.written or [])):
            now = group["lr"]
            if now is mine and (version is None or now._version == version):
                continue  # the very value written (every step's case: one identity test)
            if version is not None:
                return k, "its lr tensor written in place" if now is mine else "its lr tensor replaced"
            if isinstance(now, torch.Tensor):
                return k, "its lr replaced by a tensor"
            if now != mine:
                return k, f"{mine:.4g} -> {now:.4g}"
        return None


# The events between one step's write and the next step's (the ones the loop fires after on_before_step).
_BETWEEN_STEPS = ("on_step_end", "on_train_epoch_end", "on_epoch_end", "on_train_epoch_start")


def _writers(loop: TrainerLoop, schedule: Any, within_step: bool) -> list[str]:
    """``Class.hook`` of each of the user's own callbacks that ran a hook since the schedule's last write.

    ``within_step``: between the schedule's ``on_before_step`` and the optimizer step
    (the ``on_before_step`` of callbacks after it in order); else between one step's
    end and the next step's write.
    """
    ordered = loop.events.callbacks
    mine = next(k for k, c in enumerate(ordered) if c is schedule)
    found = []
    for position, callback in enumerate(ordered):
        shipped = type(callback).__module__.startswith(f"{__package__}.")  # EMA, the loggers: never the lr
        if shipped or not any(callback is given for given in loop.plan.callbacks):
            continue
        if within_step:
            hooks = ("on_before_step",) if position > mine else ()
        else:
            hooks = _BETWEEN_STEPS + (("on_before_step",) if position < mine else ())
        found += [f"{type(callback).__name__}.{hook}" for hook in hooks if does(callback, hook)]
    return found


class LearningRates(Callback):
    """Sets each optimizer step's learning rate (and momentum) from a curve (``curve(loop)``).

    The schedules of one_cycle_fit and ``find_lr``'s sweep are this with their own
    curve; the values reach the optimizer without a host sync or a new graph. A
    curve without momenta (None) leaves the optimizer's betas and momentum alone.

    A learning rate that another callback writes is never undone silently: the first
    time a group's lr differs from what the schedule wrote, a warning names the
    callback's hook (checked on the host, before each write and after the
    ``on_before_step`` hooks that follow the schedule's).
    """

    order = -40
    name = "the schedule"  # for the warning: "while schedule='linear' sets it"

    def curve(self, loop: Loop) -> tuple[list[float], list[float] | None]:
        raise NotImplementedError

    def on_fit_start(self, loop: Loop) -> None:
        self.lrs, self.moms = self.curve(loop)
        self.driver: _Driver | None = None  # built at the first epoch, from the step a resume restored
        self.reported = False

    def on_train_epoch_start(self, loop: TrainerLoop, epoch: int) -> None:
        if self.driver is None:
            self.driver = _Driver(loop, self.lrs, self.moms)
        loop.lr = self.lrs[min(loop.step, len(self.lrs) - 1)]

    def on_before_step(self, loop: TrainerLoop) -> None:
        self._report(loop, within_step=False)
        loop.lr = self.driver.before_step(loop.optimizer)

    def on_step_end(self, loop: TrainerLoop) -> None:
        self._report(loop, within_step=True)  # first of the on_step_end hooks: what the on_before_step ones did

    def _report(self, loop: TrainerLoop, within_step: bool) -> None:
        change = None if self.reported else self.driver.changed(loop.optimizer)
        if change is None:
            return
        self.reported = True
        if not loop.master:
            return
        group, how = change
        names = _writers(loop, self, within_step)
        who = " or ".join(names) if names else "something outside the callbacks (a train_step?)"
        then = ("the optimizer stepped with that value, not the schedule's (history.step_lrs is the schedule's)"
                if within_step else "the schedule writes its own value again before the next step, undoing it")
        warnings.warn(
            f"{who} changed the learning rate of param group {group} ({how}; seen after optimizer step "
            f"{loop.step}) while {self.name} sets it before every step: {then}. To set the lr yourself (your "
            f"callback, or a torch, Hugging Face or timm scheduler you step) give one_cycle_fit schedule=None; to shape it, "
            f"schedule=a function (step, total_steps) -> multiplier of max_lr. Said once per run.",
            stacklevel=2,
        )

    def on_fit_end(self, loop: Loop) -> None:
        opt, history, done = loop.optimizer, loop.history, loop.step
        momentum = all("betas" in g or g.get("momentum", 0) > 0 for g in opt.param_groups)
        history.step_lrs = self.lrs[:done]
        history.step_momenta = self.moms[:done] if momentum and self.moms is not None else []
        history.momentum_name = "beta1" if "betas" in opt.param_groups[0] else "momentum"


def _scaled(loop: Loop, max_lr: float, by_cores: bool) -> tuple[float, str]:
    """The peak lr of this run, and the summary's words for it."""
    peak = max_lr * (loop.cores if by_cores else 1)
    return peak, f"max_lr {peak:.2e} ({f'scaled x{loop.cores} by cores' if by_cores else 'not scaled by cores'})"


class OneCycleSchedule(LearningRates):
    """The one-cycle policy over the run's optimizer steps (``max_lr``, ``pct_start``, ... of one_cycle_fit)."""

    name = "schedule='one_cycle'"

    def __init__(self, cycle: OneCycle) -> None:
        self.cycle = cycle

    def max_lr(self, loop: Loop) -> float:
        return _scaled(loop, self.cycle.max_lr, self.cycle.scale_lr_by_cores)[0]

    def curve(self, loop: Loop) -> tuple[list[float], list[float]]:
        return dataclasses.replace(self.cycle, max_lr=self.max_lr(loop)).curve(loop.total_steps)

    def describe(self, loop: Loop) -> str:
        """The summary line's part: the peak and whether it was scaled."""
        return _scaled(loop, self.cycle.max_lr, self.cycle.scale_lr_by_cores)[1]


class MultiplierSchedule(LearningRates):
    """``schedule="linear"``, ``"cosine"``, ``"constant"`` (with ``warmup``) or a function: ``max_lr`` x its multiplier.

    Momentum is left as the optimizer has it.
    """

    def __init__(self, schedule: LrSchedule) -> None:
        self.schedule = schedule
        self.name = f"schedule={schedule.shape!r}" if isinstance(schedule.shape, str) else f"schedule={schedule.name}"

    def curve(self, loop: Loop) -> tuple[list[float], None]:
        peak = _scaled(loop, self.schedule.max_lr, self.schedule.scale_lr_by_cores)[0]
        return [peak * m for m in self.schedule.multipliers(loop.total_steps)], None

    def describe(self, loop: Loop) -> str:
        """The summary line's part: the shape, its warm-up in steps, the peak."""
        shape = self.name.removeprefix("schedule=")
        if isinstance(self.schedule.shape, str) and self.schedule.warmup:
            shape += f" (warm-up {warmup_steps(self.schedule.warmup, loop.total_steps)} steps)"
        return f"schedule {shape}, {_scaled(loop, self.schedule.max_lr, self.schedule.scale_lr_by_cores)[1]}"


class OwnLearningRates(Callback):
    """``schedule=None``: the lr is the optimizer's own, moved by your callbacks or a scheduler you step.

    Before anything else (order -40, ahead of the user's ``on_fit_start`` where a
    scheduler is built on the optimizer) every group starts at ``max_lr`` times its
    ratio (``schedule.peak_ratios``); a resume then restores the optimizer's saved lrs.
    Each step's lr is recorded at the first ``on_step_end`` hook, after every
    ``on_before_step`` and before a scheduler stepped in ``on_step_end`` moves it:
    a Python float costs nothing to read; a device tensor is not read (nan).
    """

    order = -40

    def __init__(self, schedule: LrSchedule) -> None:
        self.schedule = schedule
        self.lrs: list[float] = []

    def on_fit_start(self, loop: TrainerLoop) -> None:
        peak = _scaled(loop, self.schedule.max_lr, self.schedule.scale_lr_by_cores)[0]
        for group, ratio in zip(loop.optimizer.param_groups, loop.lr_ratios):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(peak * ratio)
            else:
                group["lr"] = peak * ratio
        loop.lr = peak

    def on_step_end(self, loop: TrainerLoop) -> None:
        lr, ratio = loop.optimizer.param_groups[0]["lr"], loop.lr_ratios[0]
        on_host = not isinstance(lr, torch.Tensor) or lr.device.type == "cpu"
        loop.lr = float(lr) / ratio if on_host else math.nan
        self.lrs.append(loop.lr)

    def on_fit_end(self, loop: Loop) -> None:
        loop.history.step_lrs = list(self.lrs) if all(math.isfinite(x) for x in self.lrs) else []

    def describe(self, loop: Loop) -> str:
        """The summary line's part."""
        peak = _scaled(loop, self.schedule.max_lr, self.schedule.scale_lr_by_cores)[1]
        return f"schedule None (the lr is yours: your callbacks or scheduler), starting at {peak}"

    def state_dict(self) -> dict[str, Any]:
        return {"lrs": list(self.lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lrs = list(state["lrs"])


# ------------------------------------------------------- stop rules, best epoch
class StopOnNaN(Callback):
    """A NaN or inf training loss ends the run with ``FloatingPointError``, naming the epoch and step."""

    order = -30

    def on_epoch_end(self, loop: TrainerLoop, record: Any) -> None:
        if loop.first_bad_step is None and math.isfinite(record.train_loss):
            return
        where = f"step {loop.first_bad_step}" if loop.first_bad_step is not None else "a step"
        raise FloatingPointError(
            f"the training loss became NaN or inf in epoch {record.epoch} at {where} of {loop.batches}; "
            f"stopped. The last good checkpoint (if any) is {loop.last_path or 'not kept (no checkpoint_dir)'}. "
            f"Try a lower max_lr, max_grad_norm=1.0 or precision='fp32'."
        )


def figures(record: Any) -> dict[str, float]:
    """The figures a monitor may watch: losses and metrics."""
    found = {"train_loss": record.train_loss, **record.metrics}
    if record.valid_loss is not None:
        found["valid_loss"] = record.valid_loss
    return found


class BestEpoch(Callback):
    """Watches ``rule.monitor``: the best epoch so far, and ``early_stopping``'s patience.

    ``improved`` says whether the latest epoch was the best. For ``restore_best``,
    ``best_state`` holds the best epoch's weights on the CPU (epoch ``state_epoch``):
    ``Checkpoints``' copy where it writes one, else ``RestoreBest``'s own; both
    are taken after the user's ``on_epoch_end``.
    """

    order = -20

    def __init__(self, rule: StopRule) -> None:
        self.rule = rule
        self.watch, self.improved = Watch(), False
        self.best_state: dict[str, torch.Tensor] | None = None
        self.state_epoch = 0

    def on_epoch_end(self, loop: Loop, record: Any) -> None:
        self.improved = self.watch.update(self.rule, record.epoch, figures(record))
        loop.history.best_epoch = self.watch.best_epoch or None
        reason = self.watch.early_stop(self.rule)
        if reason:
            loop.stop(reason)


class RestoreBest(Callback):
    """``restore_best=True``: the best epoch's weights go into the model at the end, after every other callback.

    The snapshot's names are checked against the model's own before the first epoch
    (``check_snapshot_names``); a restore that still fails at the end is a warning naming what
    failed and where the best weights are (``folder``'s ``best.pt``, if a ``checkpoint_dir``
    was given): the run's ``History`` always comes back.
    """

    order = 50

    def __init__(self, best: BestEpoch, folder: str | None = None) -> None:
        self.best, self.folder = best, folder

    def on_fit_start(self, loop: Loop) -> None:
        check_snapshot_names(loop.model, "restore_best=True")

    def on_epoch_end(self, loop: Loop, record: Any) -> None:
        if self.best.improved and self.best.state_epoch != record.epoch:  # no checkpoint's copy to share
            self.best.best_state, self.best.state_epoch = to_cpu(loop.model.state_dict()), record.epoch

    def on_fit_end(self, loop: Loop) -> None:
        history, watch = loop.history, self.best.watch
        if not watch.best_epoch:
            never = f"no epoch had a finite {self.best.rule.monitor}"
            why = "" if never in history.stop_reason else f"{never}, so "
            history.stop_reason += f"; {why}no best weights were restored (the model holds the last epoch's)"
            return
        try:
            loop.model.load_state_dict(self.best.best_state)
        except Exception as error:  # the run is over: its history comes back, with what failed
            where = (f"; they are in {join(self.folder, BEST_NAME)} (the last epoch's in "
                     f"{join(self.folder, CHECKPOINT_NAME)})" if self.folder is not None else "")  # fmt: skip
            said = f"restore_best could not load the best weights (epoch {watch.best_epoch}) into the model: " \
                   f"{type(error).__name__}: {str(error).strip()[:500]}"
            history.stop_reason += f"; the best weights were not restored (the model holds the last epoch's){where}"
            if loop.master:
                warnings.warn(f"{said}. The model holds the last epoch's weights{where}", stacklevel=2)
            return
        history.stop_reason += f"; restored the best weights (epoch {watch.best_epoch})"


def _overridden(model: torch.nn.Module, name: str) -> str | None:
    """Where ``model``'s method ``name`` is not ``nn.Module``'s own: "model.NAME (assigned to the instance)" or the
    class that overrides it; None where it is torch's."""
    if name in vars(model):
        return f"model.{name} (assigned to the {type(model).__name__} instance)"
    owner = next(c for c in type(model).__mro__ if name in vars(c))
    return None if owner is torch.nn.Module else f"{owner.__qualname__}.{name}"


def check_snapshot_names(model: torch.nn.Module, asked: str) -> None:
    """Refuses, before the first epoch, a ``state_dict`` override whose snapshots could not be loaded back.

    ``restore_best`` and ``checkpoint_dir`` snapshot the model with ``model.state_dict()`` and load the snapshot
    with ``model.load_state_dict``. A program that overrides ``state_dict`` alone (tloen/alpaca-lora does, to save
    the adapter) makes snapshots under other names than the model's own, and the strict load at the end would
    fail after every epoch had trained. The override's names are compared with ``nn.Module.state_dict``'s (names
    only, no copy); a class that overrides both methods is trusted to pair them.

    Raises:
        ValueError: the names differ, naming the override and the first names missing and unexpected.
    """
    override = _overridden(model, "state_dict")
    if override is None or _overridden(model, "load_state_dict") is not None:
        return
    own, given = list(torch.nn.Module.state_dict(model, keep_vars=True)), list(model.state_dict())
    missing, unexpected = [k for k in own if k not in set(given)], [k for k in given if k not in set(own)]
    if not (missing or unexpected):
        return
    shown = "; ".join(f"{len(names)} {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
                      for names, what in ((missing, "of the model's own left out"), (unexpected, "not the model's"))
                      if names)  # fmt: skip
    raise ValueError(
        f"{asked} snapshots the model with model.state_dict() and loads the snapshot back with load_state_dict, "
        f"but {override} is overridden and returns {len(given)} names where the model has {len(own)}: {shown}. "
        f"The best weights could not be loaded back at the end. Override state_dict after one_cycle_fit returns "
        f"(save an adapter alone with export_pretrained or model.save_pretrained), or run without {asked}"
    )


class TimeLimit(Callback):
    """``time_limit``: no epoch starts that would not end in time (from the all-reduced time, alike on every replica)."""

    order = 20

    def __init__(self, seconds: float) -> None:
        self.seconds, self.previous = seconds, 0.0

    def on_epoch_end(self, loop: TrainerLoop, record: Any) -> None:
        if loop.stop_request or record.epoch >= loop.epochs:
            return
        reason = out_of_time(self.seconds, loop.elapsed, record.epoch - loop.start_epoch, loop.elapsed - self.previous)
        self.previous = loop.elapsed
        if reason:
            if loop.last_path:
                reason += f"; resume with the same call and resume=True (checkpoint {loop.last_path})"
            else:
                reason += "; no checkpoint_dir was given, so this run cannot be resumed"
            loop.stop(reason)


# ------------------------------------------------------------- recompiles
class RecompileNotice(Callback):
    """A graph compiled after the run's first epoch, said with the compiler's own reason (torch.compile's failed
    guard: a shape, a dtype, a Python value) where it gives one, once per new reason (the master only).

    Epoch 1 compiles the training and evaluation graphs; every later epoch should reuse them, so a new graph
    there is a recompile that comes back whenever its cause does. XLA's compiler gives no reason: there the
    cause is the one ``History.graphs`` gives each graph (new input shapes, or the same shapes with a changed
    graph), and ``doctor`` names the line.
    """

    order = 25

    def on_fit_start(self, loop: TrainerLoop) -> None:
        self.seen = set(backend.current().diagnosis.recompile_causes())
        self.compiles: int | None = None

    def on_epoch_end(self, loop: TrainerLoop, record: Any) -> None:
        before, self.compiles = self.compiles, record.compiles
        if before is None or record.compiles <= before:
            return
        causes = backend.current().diagnosis.recompile_causes()
        new = [cause for key, cause in causes.items() if key not in self.seen]
        self.seen.update(causes)
        if not new:  # XLA: the graph log's cause of each graph this epoch compiled
            new = [f"{g.graph} {g.shapes}: {g.cause}" for g in loop.history.graphs if g.epoch == record.epoch]
        if new and loop.master:
            reasons = "; ".join(dict.fromkeys(re.sub(r"^\d+/\d+: ", "", " ".join(cause.split())) for cause in new))
            warnings.warn(
                f"one_cycle_fit: epoch {record.epoch} compiled {record.compiles - before} new graph(s) after the "
                f"first epoch: the compiled step recompiled because {reasons}. Each new shape or Python value "
                f"compiles again: keep batches one shape (drop_last, BucketCollate for lengths) and pass changing "
                f"values as tensors",
                stacklevel=2,
            )


# ------------------------------------------------------------------ the line
class ProgressLine(Callback):
    """The run's summary, a line per epoch (figures, compile time, ETA, ``*best``), and why it stopped (master only)."""

    order = 30

    def __init__(self, best: BestEpoch) -> None:
        self.best, self.paces = best, []  # paces: each epoch's seconds, compile left out
        self.said_why = False

    def on_fit_start(self, loop: Loop) -> None:
        if loop.master:
            print(loop.history.summary)
            if loop.start_epoch:
                print(f"resumed from {loop.last_path} after epoch {loop.start_epoch}")

    def on_epoch_end(self, loop: TrainerLoop, record: Any) -> None:
        self.paces.append(max(record.seconds - loop.compile_seconds, 1e-9))
        if not loop.master:
            return
        rule, value = self.best.rule, figures(record)[self.best.rule.monitor]
        note = "  *best" if self.best.improved and rule.patience is not None else ""
        if not math.isfinite(value):
            note = f"  ({rule.monitor} is {value}: never the best epoch)"
        timing = f"  (compiling {format_duration(loop.compile_seconds)})" if loop.compile_seconds >= 0.5 else ""
        left = loop.epochs - record.epoch
        timing += f"  ETA {format_duration(run_eta(self.paces, left))}" if left else ""
        write_line(record.line(loop.epochs) + timing + note)
        if loop.stop_request:
            print(f"stopped: {loop.stop_request}")
            self.said_why = True

    def on_fit_end(self, loop: Loop) -> None:
        reason = loop.history.stop_reason
        if loop.master and not self.said_why and not reason.startswith("completed"):  # a StopFit: no epoch end said it
            print(f"stopped: {reason}")


# ------------------------------------------------------------- checkpoints
class Checkpoints(Callback):
    """``checkpoint_dir`` and ``resume``: ``last.pt``, ``best.pt`` and ``history.csv`` after every epoch.

    Written by the master. A resume loads ``last.pt`` (weights, optimizer, the
    GradScaler's state under fp16, the callbacks' state, history, best epoch, the
    random state) after the user's ``on_fit_start``, and checks ``best.pt`` before any
    epoch. A resume in another precision than ``last.pt``'s is said in a warning (under
    fp16 a fresh GradScaler, or the checkpoint's left unused).

    Args:
        folder: ``checkpoint_dir``.
        best: The run's ``BestEpoch``, whose watch is saved and restored.
        resume: Continue from ``last.pt`` if it exists.
        identity: What makes a run the same run: ``{"fingerprint": {...}, "config": {...}}``.
    """

    order = 10

    def __init__(self, folder: str, best: BestEpoch, resume: bool, identity: dict[str, Any]) -> None:
        self.folder, self.best, self.resume = folder, best, resume
        self.paths = {"last": join(folder, CHECKPOINT_NAME), "best": join(folder, BEST_NAME)}
        self.config = dict(identity["config"])
        self.fingerprint = dict(identity["fingerprint"])
        self.run_id = secrets.token_hex(8)  # this run's files carry it; a resume takes last.pt's

    def on_fit_start(self, loop: TrainerLoop) -> None:
        check_snapshot_names(loop.model, "checkpoint_dir")
        self.fingerprint["parameters"] = _parameter_digest(loop.model)
        if not (self.resume and exists(self.paths["last"])):
            return
        state = load_checkpoint(self.paths["last"])
        self._restore(loop, state)
        self._check_best(loop, state)  # before the first epoch: never found wrong at the end
        if loop.master:  # a kill between last.pt and history.csv left it an epoch behind
            loop.history.to_csv(join(self.folder, HISTORY_NAME))

    def on_epoch_end(self, loop: TrainerLoop, record: Any) -> None:
        # a sharded model's whole state is gathered by every process together (one tensor at a time); the master writes
        if not (loop.master or backend.current().sharding.sharded(loop.model.parameters())):
            return
        state = self._state(loop, record.epoch)
        if self.best.improved and self.best.rule.restore_best:
            self.best.best_state, self.best.state_epoch = state["model"], record.epoch
        if not loop.master:
            return
        try:
            save_atomic(state, self.paths["last"])  # first: it records the new best epoch and holds its weights,
            loop.saved_epoch = record.epoch  # so a kill before best.pt is written leaves what resume repairs it from
            if self.best.improved:
                save_atomic(state, self.paths["best"])
            loop.history.to_csv(join(self.folder, HISTORY_NAME))
        except WriteError as error:
            then = "then continue this run with the same call and resume=True"
            message = error.strerror.replace("then run again", then)
            raise WriteError(error.errno, message if then in message else f"{message}; {then}") from error

    def _state(self, loop: TrainerLoop, epoch: int) -> dict[str, Any]:
        rule, devices = self.best.rule, backend.current().devices
        state = {
            "format": 1, "epoch": epoch, "step": loop.step, "total_steps": loop.total_steps,
            "model": loop.model.state_dict(), "optimizer": loop.optimizer.state_dict(),
            "optimizer_class": class_name(loop.optimizer), **loop.runner.precision.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                    "xla": devices.rng_state() if devices.is_lazy(loop.device) else 0},
            "history": loop.history.to_dicts(),
            "monitor": {**self.best.watch.as_dict(), "name": rule.monitor, "mode": rule.mode},
            "run": self.run_id, "callbacks": loop.events.state_dict(), "versions": _versions(),
            "config": {**self.config, "fingerprint": self.fingerprint},
        }  # fmt: skip
        return to_cpu(state)

    def _restore(self, loop: TrainerLoop, state: dict[str, Any]) -> None:
        path = self.paths["last"]
        self._check_fingerprint(loop, state)
        watched = state.get("monitor", {})
        _check_monitor(path, watched, self.best.rule)
        load_state_into(state, path, loop.model, loop.optimizer)
        changed = loop.runner.precision.load_state_dict(state, path)  # the GradScaler's scale under fp16
        if changed and loop.master:
            warnings.warn(changed, stacklevel=2)
        loop.events.load_state_dict(state.get("callbacks", {}), path)
        devices = backend.current().devices
        if devices.is_lazy(loop.device):  # the restored tensors become device data, not part of epoch 1's first graph;
            devices.sync()  # before the random state is restored: a sync advances torch_xla's seed
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        version, internal, gauss = rng["python"]
        random.setstate((version, tuple(internal), gauss))
        if backend.current().devices.is_lazy(loop.device):
            backend.current().devices.set_rng_state(int(rng["xla"]))
        loop.start_epoch = loop.saved_epoch = int(state["epoch"])
        loop.step = int(state["step"])
        loop.history.records = History.from_dicts(state["history"]).records
        self.best.watch = Watch(**{k: watched[k] for k in ("best", "best_epoch", "waited") if k in watched})
        loop.history.best_epoch = self.best.watch.best_epoch or None
        self.run_id = state.get("run", self.run_id)

    def _check_fingerprint(self, loop: Loop, state: dict[str, Any]) -> None:
        """Refuses a checkpoint written by a different run, naming every difference."""
        saved = state.get("config", {}).get("fingerprint", {})
        mine = self.fingerprint if saved else {}  # a checkpoint from before fingerprints: steps only
        differences = [
            f"{key}: checkpoint {saved.get(key)!r}, this run {mine.get(key)!r}"
            for key in sorted(set(saved) | set(mine))
            if saved.get(key) != mine.get(key)
        ]
        if state.get("total_steps") != loop.total_steps:
            differences.append(f"optimizer steps: checkpoint {state.get('total_steps')}, this run {loop.total_steps}")
        if differences:
            raise ValueError(
                f"{self.paths['last']} was written by a different run, so resume=True refuses it:\n  "
                + "\n  ".join(differences)
                + "\nResume with the same arguments (changing epochs changes the one-cycle schedule too, "
                "so it cannot extend a run), or give another checkpoint_dir to start afresh."
            )

    def _best_problem(self, epoch: int) -> tuple[str | None, dict[str, Any] | None]:
        """What is wrong with best.pt as this run's copy of epoch ``epoch`` (None if nothing), and its state."""
        path = self.paths["best"]
        if not exists(path):
            return "is missing", None
        try:
            state = load_checkpoint(path)
        except DamagedCheckpointError as error:
            return f"is damaged ({error.why})", None
        if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
            return "is not a one_cycle_fit checkpoint", None
        saved = state.get("config", {}).get("fingerprint", {})
        if saved and saved != self.fingerprint:
            keys = sorted(k for k in set(saved) | set(self.fingerprint) if saved.get(k) != self.fingerprint.get(k))
            return f"was written by a run with other arguments (they differ in {', '.join(keys)})", None
        if state.get("run", self.run_id) != self.run_id:
            return f"was written by another run (run {state.get('run')}, this run {self.run_id})", None
        if int(state["epoch"]) != epoch:
            return f"holds epoch {int(state['epoch'])}, not epoch {epoch}", None
        return None, state

    def _check_best(self, loop: Loop, last_state: dict[str, Any]) -> None:
        """On resume, best.pt must be this run's copy of the best epoch that last.pt records.

        If last.pt holds the best epoch itself (a kill between the two writes), best.pt
        is rewritten from it; otherwise a wrong best.pt is an error with the choices.
        The best weights are kept for ``restore_best``.
        """
        best, last, rule = self.best.watch.best_epoch, int(last_state["epoch"]), self.best.rule
        paths, figure = self.paths, f"{rule.monitor} {self.best.watch.best or 0:.4g}"
        if not best:
            if exists(paths["best"]):
                raise ValueError(
                    f"{paths['best']} exists but {paths['last']} records no best epoch (no epoch had a finite "
                    f"{rule.monitor}), so it is not this run's. Move it away and resume, or start afresh in another "
                    f"checkpoint_dir"
                )
            return
        problem, state = self._best_problem(best)
        if problem is not None and best == last:
            if loop.master:
                save_atomic(last_state, paths["best"])
                warnings.warn(f"repaired {paths['best']}: it {problem}; rewritten from {paths['last']}, which "
                              f"holds the best epoch ({best})", stacklevel=2)  # fmt: skip
            problem, state = None, last_state
        if problem is None:
            if rule.restore_best:
                self.best.best_state, self.best.state_epoch = state["model"], best
            return
        if problem == "is missing" and not rule.restore_best:
            if loop.master:
                warnings.warn(f"{paths['best']} is missing, so epoch {best}'s weights are lost; it is written again "
                              f"when an epoch beats {figure}", stacklevel=2)  # fmt: skip
            return
        raise ValueError(
            f"{paths['best']} {problem}, but {paths['last']} records epoch {best} as the best ({figure}); "
            f"resume=True stops now rather than restore wrong weights at the end. Either put back this run's "
            f"best.pt (epoch {best}); or move best.pt away and resume with restore_best=False (epoch {best}'s "
            f"weights are then lost; best.pt is written again when an epoch beats it); or start afresh in another "
            f"checkpoint_dir"
        )


def _check_monitor(path: str, watched: dict[str, Any], rule: StopRule) -> None:
    """Refuses to resume watching another figure: its best would be compared against the old one's."""
    saved = (watched.get("name"), watched.get("mode"))
    if saved[0] is None or saved == (rule.monitor, rule.mode):
        return  # a checkpoint from before the name was recorded: nothing to compare
    raise ValueError(
        f"{path} was written watching monitor={saved[0]!r} (mode={saved[1]!r}), but this call watches "
        f"monitor={rule.monitor!r} (mode={rule.mode!r}); its best epoch and best.pt were chosen by the old "
        f"figure. Resume with monitor={saved[0]!r}, mode={saved[1]!r}, or start afresh in another checkpoint_dir"
    )


def _parameter_digest(model: torch.nn.Module) -> str:
    """Parameter names and shapes, as a short digest (the same model class gives the same)."""
    text = ";".join(f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items())
    return f"{len(model.state_dict())} tensors, {hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _versions() -> dict[str, str]:
    return {
        "torch": str(torch.__version__),
        "torch_xla": backend.installed_version("torch_xla") or "",
        "tpu_utility": backend.installed_version("tpu_utility") or "",
    }
