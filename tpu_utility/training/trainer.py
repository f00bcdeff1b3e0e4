"""The training loop one_cycle_fit runs in each process, on a Runner.

Per epoch: train (losses summed on the device), evaluate (metrics summed on
the device), then one read of every figure, all-reduced over replicas, from
which every replica takes the same decisions: NaN stop, best epoch, early
stop, time limit. Checkpoints (``last.pt``, ``best.pt``) and ``history.csv``
are written by the master.
"""

from __future__ import annotations

import contextlib
import math
import random
import secrets
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import backend
from ..checkpoint import (CHECKPOINT_NAME, DamagedCheckpointError, class_name, load_checkpoint, load_state_into,
                         save_atomic, to_cpu)
from ..data.loaders import LabelCheck, LoaderSpec, dropped_per_epoch, set_epoch
from ..files import WriteError, exists, folder_lock, join, remove, remove_stale_temporaries
from .events import Events
from .history import EpochRecord, History
from .metrics import MetricSet
from .monitor import StopRule, Watch, out_of_time
from ..optim import step_optimizer
from ..progress import CompileNotice, format_duration, progress_bar, run_eta, write_line
from .runner import CheckedEvalStep, LossStep, Runner, default_eval_step
from .schedule import one_cycle_curve, peak_ratios, total_optimizer_steps

BEST_NAME = "best.pt"
HISTORY_NAME = "history.csv"
_NO_BAD_STEP = float(2**24)  # "no non-finite loss yet"; exact in float32
_clock = time.monotonic  # the time-limit clock (tests replace it)


@dataclass
class OneCycle:
    """The schedule's arguments, as in ``torch.optim.lr_scheduler.OneCycleLR``."""

    max_lr: float
    pct_start: float = 0.25
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    base_momentum: float = 0.85
    max_momentum: float = 0.95
    scale_lr_by_cores: bool = False


@dataclass
class Steps:
    """How a batch becomes a loss and an evaluation."""

    loss_fn: Callable
    train_step: Callable | None = None
    eval_step: Callable | None = None
    accumulate_steps: int = 1
    max_grad_norm: float | None = None
    default_loss: bool = False  # nn.CrossEntropyLoss(): labels are checked on the host


@dataclass
class FitPlan:
    """Everything a training process needs; picklable for a spawned launch."""

    epochs: int
    train: LoaderSpec
    valid: LoaderSpec | None
    schedule: OneCycle
    steps: Steps
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_name: str
    optimizer_args: dict[str, Any]
    metrics: dict[str, Any]
    stop: StopRule
    checkpoint_dir: str | None = None
    resume: bool = False
    overwrite: bool = False
    precision: str = "fp32"
    seed: int = 0
    progress: bool = True
    cores: int = 1
    mode: str = "single"
    fingerprint: dict[str, Any] = field(default_factory=dict)
    callbacks: list[Any] = field(default_factory=list)


class OneCycleDriver:
    """Feeds the one-cycle schedule (or any curve of learning rates and momenta, as
    find_lr's sweep) to the optimizer before every step.

    The named optimizers "adam" and "adamw" are torch_xla's fused sync-free ones
    on XLA and take Python floats. A user's own torch Adam-family optimizer gets
    ``lr`` and ``betas`` as device tensors (``capturable=True``) copied from a
    table of the whole schedule, uploaded once: Python-float hyperparameters
    would change the graph whenever a value rounds to a special constant
    (``1 - lr * wd == 1.0`` in float32 late in the schedule), because torch_xla
    uploads scalars by value. Other optimizers (SGD) take Python floats, the only
    form their step accepts without a host sync.

    Each parameter group gets the curve's learning rate times its ``ratios`` entry
    (``schedule.peak_ratios``); momentum is the same in every group.
    """

    def __init__(self, opt: torch.optim.Optimizer, curve: tuple[list[float], list[float]], device: torch.device,
                 start_step: int, ratios: list[float] | None = None) -> None:  # fmt: skip
        self.lrs, self.moms = curve
        self.ratios = ratios or [1.0] * len(opt.param_groups)
        self.total, self.step_index = len(self.lrs), start_step
        self.on_device = (
            backend.is_lazy(device)
            and not backend.is_fused_optimizer(opt)  # they take Python floats without syncing or recompiling
            and all("betas" in g and "capturable" in g for g in opt.param_groups)
        )
        if self.on_device:
            self.table = torch.tensor([self.lrs, self.moms], dtype=torch.float32).T.contiguous().to(device)
            self.device_index = torch.tensor([min(start_step, self.total - 1)], device=device)
            self.lr = torch.tensor(self.lrs[0], device=device)
            self.beta1 = torch.tensor(self.moms[0], device=device)
            self.group_lrs = [self.lr if r == 1 else torch.tensor(self.lrs[0] * r, device=device) for r in self.ratios]
            for group, lr in zip(opt.param_groups, self.group_lrs):
                group["capturable"] = True
                group["lr"] = lr
                # beta2 stays constant; as a device tensor, Adam's addcmul_(value=1 - beta2) would
                # .item() it every step, so it is a CPU tensor (torch requires both betas tensors).
                group["betas"] = (self.beta1, torch.tensor(float(group["betas"][1])))

    def before_step(self, opt: torch.optim.Optimizer) -> float:
        i = min(self.step_index, self.total - 1)
        self.step_index += 1
        if self.on_device:
            row = self.table.index_select(0, self.device_index).squeeze(0)
            self.lr.copy_(row[0])
            self.beta1.copy_(row[1])
            for lr, ratio in zip(self.group_lrs, self.ratios):
                if ratio != 1:
                    lr.copy_(row[0] * ratio)
            self.device_index.add_(1).clamp_(max=self.total - 1)
            return self.lrs[i]
        for group, ratio in zip(opt.param_groups, self.ratios):
            group["lr"] = self.lrs[i] * ratio
            if "betas" in group:
                group["betas"] = (self.moms[i], group["betas"][1])
            elif group.get("momentum", 0) > 0:
                group["momentum"] = self.moms[i]
        return self.lrs[i]


def _device_values(device: torch.device, *values: Any) -> list[torch.Tensor]:
    """Accumulators materialised on the device, like the previous step's outputs they stand for.

    Left as pending constants (torch_xla keeps small uploads as scalars in the
    graph), they would merge into an epoch's first step and make it a graph of its
    own; run now, they are plain device data in every epoch.
    """
    tensors = [torch.tensor(v, dtype=torch.float32).to(device) for v in values]
    if backend.is_lazy(device):
        backend.sync()
    return tensors


# ------------------------------------------------------------ one process
class _Run:
    """One process's training state: the runner, optimizer, schedule, loaders, history."""

    def __init__(self, model: nn.Module, plan: FitPlan) -> None:
        self.plan = plan
        self.events = Events(plan.callbacks)
        torch.manual_seed(plan.seed)
        random.seed(plan.seed)
        self.runner = runner = Runner(model, plan.precision, plan.mode)
        if runner.lazy:
            backend.set_rng_state(plan.seed)
        self.master = runner.topology.master
        self._optimizer()
        self.train_loader = runner.train_loader(plan.train, plan.seed)
        self.valid_loader = runner.eval_loader(plan.valid) if plan.valid is not None else None
        self.metrics = MetricSet(plan.metrics, plan.steps.loss_fn, runner.device) if plan.valid is not None else None
        self.eval_step = plan.steps.eval_step or default_eval_step
        # the default loss's labels, checked on the host against the first real output's class count
        self.labels = LabelCheck() if plan.steps.default_loss and plan.steps.train_step is None else None
        if self.labels is not None:
            self.train_loader = self.labels.loader(self.train_loader)
            if self.valid_loader is not None and plan.steps.eval_step is None:
                self.valid_loader, self.eval_step = self.labels.loader(self.valid_loader, masked=True), CheckedEvalStep(self.labels)
        self.batches = len(self.train_loader)
        self._schedule()
        self.watch = Watch()
        self.best_state: dict[str, torch.Tensor] | None = None
        self.last_state: dict[str, Any] | None = None  # last.pt's state, while resuming
        self.start_epoch, self.opt_step = 0, 0
        self.saved_epoch = 0  # the epoch last.pt holds
        self.paces: list[float] = []  # each epoch's seconds, compile left out
        self.compile_seconds = 0.0  # the latest epoch's
        self.fingerprint = {**plan.fingerprint, "parameters": _parameter_digest(model)}
        self.run_id = secrets.token_hex(8)  # this run's files carry it; a resume takes last.pt's
        folder = plan.checkpoint_dir
        self.paths = {"last": join(folder, CHECKPOINT_NAME), "best": join(folder, BEST_NAME)} if folder else {}
        self.stop_request: str | None = None  # a callback's reason to end the run after this epoch

    # what callbacks see of the loop (events.py lists it)
    @property
    def model(self) -> nn.Module:
        return self.runner.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.opt

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def epochs(self) -> int:
        return self.plan.epochs

    def stop(self, reason: str) -> None:
        """Ends the run after the current epoch (which is saved first), with ``reason`` as its stop reason."""
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"loop.stop takes the reason as a non-empty string, but given {reason!r}")
        self.stop_request = self.stop_request or reason

    def _schedule(self) -> None:
        """The whole one-cycle curve: its length is what each core iterates."""
        plan, s = self.plan, self.plan.schedule
        per_epoch = self.batches // plan.steps.accumulate_steps
        if per_epoch < 1:
            raise ValueError(
                f"accumulate_steps={plan.steps.accumulate_steps} exceeds the {self.batches} batches per epoch on each core"
            )
        self.total = total_optimizer_steps(self.batches, plan.epochs, plan.steps.accumulate_steps)
        self.max_lr = s.max_lr * (self.runner.topology.cores if s.scale_lr_by_cores else 1)
        self.curve = one_cycle_curve(
            self.total, self.max_lr, pct_start=s.pct_start, div_factor=s.div_factor,
            final_div_factor=s.final_div_factor, base_momentum=s.base_momentum, max_momentum=s.max_momentum,
        )  # fmt: skip
        self.history = History(steps_per_epoch=per_epoch)
        self.history.summary = _summary(self)

    def _optimizer(self) -> None:
        plan, runner = self.plan, self.runner
        # torch_xla's fused Adam fails to compile for bf16 parameters: cast mode keeps torch's.
        use_fused = runner.lazy and plan.optimizer_name in ("adam", "adamw") and runner.precision.mode != "cast"
        fused = backend.fused_optimizer(plan.optimizer_name) if use_fused else None
        self.fused = fused is not None
        params = [p for p in runner.model.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters (all have requires_grad=False); unfreeze some layers")
        self.opt = fused(params, **plan.optimizer_args) if fused else build_optimizer(plan.optimizer, runner.model, plan.optimizer_args)
        self.lr_ratios = peak_ratios([float(g["lr"]) for g in self.opt.param_groups], lr_of(self.opt))
        # torch_xla's sync-free optimizers skip the step when found_inf is 1 (never, here)
        self.step_args = {"found_inf": _device_values(runner.device, 0.0)[0]} if fused else {}


# A factory whose first parameter has one of these names is given the model (it builds its own
# parameter groups): ours, and timm's create_optimizer_v2(model_or_params, ...), which leaves norms
# and biases out of weight decay only when it sees the model.
TAKES_MODEL = ("model", "model_or_params")


def build_optimizer(factory: Callable[..., torch.optim.Optimizer], model: nn.Module,
                    args: dict[str, Any]) -> torch.optim.Optimizer:  # fmt: skip
    """``factory(model)`` if its first parameter is named as in ``TAKES_MODEL`` (it builds its own parameter
    groups), else ``factory(trainable parameters)``; the result must be an optimizer over the model's parameters."""
    import inspect

    try:
        first = next(iter(inspect.signature(factory).parameters), None)
    except (TypeError, ValueError):  # a builtin or C callable: no signature, takes the parameters
        first = None
    opt = factory(model if first in TAKES_MODEL else [p for p in model.parameters() if p.requires_grad], **args)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the optimizer factory {getattr(factory, '__name__', factory)!r} returned "
                        f"{type(opt).__name__}, not a torch.optim.Optimizer")  # fmt: skip
    mine = {id(p) for p in model.parameters()}
    strangers = sum(id(p) not in mine for g in opt.param_groups for p in g["params"])
    if strangers:
        raise ValueError(f"the optimizer from {getattr(factory, '__name__', factory)!r} holds {strangers} tensor(s) "
                         f"that are not the model's parameters on its device; build the param groups from the "
                         f"model the factory is given")  # fmt: skip
    return opt


def lr_of(opt: torch.optim.Optimizer) -> float | None:
    lr = opt.defaults.get("lr")
    return float(lr) if isinstance(lr, (int, float, torch.Tensor)) else None


def train(model: nn.Module, plan: FitPlan) -> tuple[nn.Module, History]:
    """Trains ``model`` in this process; returns it and the History.

    The master holds ``checkpoint_dir``'s lock for the whole run, so a second fit
    writing the same folder is refused at once instead of overwriting this one's files.
    """
    if plan.checkpoint_dir is None:
        return _train(model, plan)
    if not backend.is_master():
        result = _train(model, plan)
    else:
        with folder_lock(plan.checkpoint_dir, "one_cycle_fit"):
            remove_stale_temporaries(plan.checkpoint_dir, old_suffixes=(".pt",))  # a killed run's, of any file
            if plan.overwrite:  # asked for: the earlier run's files go, none is left to mix with this run's
                for name in (CHECKPOINT_NAME, BEST_NAME, HISTORY_NAME):
                    with contextlib.suppress(FileNotFoundError):
                        remove(join(plan.checkpoint_dir, name))
            result = _train(model, plan)
    # the master's last writes are on disk before any replica returns: a resume that follows at once
    # (the next call, on every replica) must read the same last.pt everywhere
    backend.barrier("tpu_utility.train.saved")
    return result


def _train(model: nn.Module, plan: FitPlan) -> tuple[nn.Module, History]:
    run = _Run(model, plan)
    if run.valid_loader is not None:
        run.runner.check_eval(run.valid_loader, run.metrics, run.eval_step)
    run.events.fire("on_fit_start", run)
    if run.runner.lazy:
        backend.sync()  # set-up tensors become device data, not part of epoch 1's first graph
    if plan.resume and "last" in run.paths and exists(run.paths["last"]):
        _restore(run)
        _check_best(run)  # before the first epoch: never found wrong at the end
        if run.master:  # a kill between last.pt and history.csv left it an epoch behind
            run.history.to_csv(join(plan.checkpoint_dir, HISTORY_NAME))
    run.schedule = OneCycleDriver(run.opt, run.curve, run.runner.device, run.opt_step, run.lr_ratios)
    if run.master and plan.progress:
        print(run.history.summary)
        if run.start_epoch:
            print(f"resumed from {run.paths['last']} after epoch {run.start_epoch}")
    started, previous = _clock(), 0.0
    run.saved_epoch = run.start_epoch
    epoch = run.start_epoch
    try:
        for epoch in range(run.start_epoch, plan.epochs):
            record, elapsed = _epoch(run, epoch, started)  # elapsed: all-reduced, the same on every replica
            reason = _after_epoch(run, record)
            if not reason and epoch + 1 < plan.epochs:
                reason = out_of_time(plan.stop.time_limit, elapsed, epoch + 1 - run.start_epoch, elapsed - previous)
            if reason:
                _stop(run, reason)
                break
            previous = elapsed
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(run, epoch + 1)) from None  # one line: what is saved, how to go on
    _finish(run)
    return model, run.history


def _epoch(run: _Run, epoch: int, started: float) -> tuple[EpochRecord, float]:
    plan, runner = run.plan, run.runner
    syncs0, transfers0 = backend.host_sync_count(), backend.transfer_from_device_count()
    t0 = time.perf_counter()
    set_epoch(run.train_loader, epoch)  # its sampler's order, and a CachedDataset's augmented copy
    train_sums, lr, compile_seconds = _train_epoch(run, epoch)
    graphs, t1 = backend.compile_count(), time.perf_counter()
    sums, computed = run.runner.eval_sums(run.valid_loader, run.metrics, run.eval_step) if run.valid_loader else ([], [])
    values, synced, bad_step = _read_epoch(runner.device, train_sums, sums, [*computed, torch.tensor(_clock() - started)])
    if backend.compile_count() > graphs:  # the first validation pass and read compile their graphs: counted as compiling
        compile_seconds += time.perf_counter() - t1
    del train_sums, sums, computed  # lazy views kept alive would run as a graph of their own at the next sync
    loss_sum, n_batches = values[0], values[1]
    if bad_step < _NO_BAD_STEP or not math.isfinite(loss_sum):
        where = f"step {int(bad_step)}" if bad_step < _NO_BAD_STEP else "a step"
        raise FloatingPointError(
            f"the training loss became NaN or inf in epoch {epoch + 1} at {where} of {run.batches}; "
            f"stopped. The last good checkpoint (if any) is {run.paths.get('last', 'not kept (no checkpoint_dir)')}. "
            f"Try a lower max_lr, max_grad_norm=1.0 or precision='fp32'."
        )
    seconds = time.perf_counter() - t0
    run.compile_seconds, steady = compile_seconds, max(seconds - compile_seconds, 1e-9)
    run.paces.append(steady)  # what a later epoch takes: the run's ETA
    record = EpochRecord(
        epoch=epoch + 1, train_loss=loss_sum / n_batches, valid_loss=None, metrics={}, lr=lr, seconds=seconds,
        samples_per_s=run.batches * runner.topology.global_batch(plan.train.batch_size) / steady,
    )  # fmt: skip
    if run.metrics is not None:
        record.valid_loss, record.metrics = run.metrics.values(values[2:], synced[:-1])
    record.compiles = backend.compile_count()
    record.host_syncs = backend.host_sync_count() - syncs0
    record.transfers = backend.transfer_from_device_count() - transfers0
    return record, synced[-1]


def _train_epoch(run: _Run, epoch: int) -> tuple[list[torch.Tensor], float, float]:
    """The epoch's training pass: its device sums, its last lr, and the seconds its steps spent compiling."""
    plan, runner, steps = run.plan, run.runner, run.plan.steps
    run.events.fire("on_train_epoch_start", run, epoch)
    runner.model.train()
    run.opt.zero_grad(set_to_none=True)
    # bad_step: 1-based step of the first non-finite loss
    loss_sum, n_batches, bad_step = _device_values(runner.device, 0.0, 0.0, _NO_BAD_STEP)
    lr = run.schedule.lrs[min(run.opt_step, run.schedule.total - 1)]
    desc, speak = f"epoch {epoch + 1}/{plan.epochs}", plan.progress and run.master
    bar = progress_bar(run.batches, desc, enabled=speak)
    # the run's first epoch on XLA compiles: say so before the first batch's compile, not after
    notice = CompileNotice(bar, desc, backend.compile_count, expect=runner.lazy and epoch == run.start_epoch, speak=speak)
    step = steps.train_step or LossStep(steps.loss_fn, run.labels, model_loss=steps.default_loss)
    for i, batch in enumerate(runner.batches(run.train_loader)):
        loss = runner.run(step, batch, training=True)
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"train_step must return the loss as a tensor (so it can be backpropagated), but returned "
                f"{type(loss).__name__} {loss!r}"
            )
        loss = loss.float()
        (loss / steps.accumulate_steps if steps.accumulate_steps > 1 else loss).backward()
        n_batches = n_batches + 1
        bad_step = torch.where((bad_step == _NO_BAD_STEP) & ~torch.isfinite(loss), n_batches, bad_step)
        loss_sum = loss_sum + loss.detach()
        if (i + 1) % steps.accumulate_steps == 0:
            lr = run.schedule.before_step(run.opt)
            # MpDeviceLoader cuts the graph at every batch, so the step needs no barrier
            step_optimizer(run.opt, barrier=False, max_grad_norm=steps.max_grad_norm, optimizer_args=run.step_args)
            run.opt.zero_grad(set_to_none=True)
            run.opt_step += 1
            run.events.fire("on_step_end", run)
        bar.update(1)
        notice.after_step()
    notice.close()
    bar.close()
    run.opt.zero_grad(set_to_none=True)  # a partial accumulation at the epoch's end is dropped
    run.events.fire("on_train_epoch_end", run)
    return [loss_sum, bad_step, n_batches], lr, notice.compile_seconds


def _read_epoch(device: torch.device, train_sums: list[torch.Tensor], eval_sums: list[torch.Tensor],
                same: list[torch.Tensor]) -> tuple[list[float], list[float], float]:  # fmt: skip
    """The epoch's one device read, reduced over replicas: sums added, the first bad step
    the minimum, figures already equal on every replica (torchmetrics, elapsed time) the maximum."""
    loss_sum, bad_step, n_batches = train_sums
    summed = torch.stack([t.float().reshape(()).to(device) for t in [loss_sum, n_batches, *eval_sums]])
    synced = torch.stack([t.float().reshape(()).to(device) for t in same])
    summed, synced = backend.all_reduce([summed], "sum")[0], backend.all_reduce([synced], "max")[0]
    bad_step = backend.all_reduce([bad_step.reshape(1)], "min")[0]
    values, synced_values, (first_bad,) = (t.tolist() for t in backend.to_cpu([summed, synced, bad_step]))
    return values, synced_values, first_bad


# ---------------------------------------------------- decisions and files
def _figures(record: EpochRecord) -> dict[str, float]:
    figures = {"train_loss": record.train_loss, **record.metrics}
    if record.valid_loss is not None:
        figures["valid_loss"] = record.valid_loss
    return figures


def _after_epoch(run: _Run, record: EpochRecord) -> str | None:
    """Records the epoch, keeps the best, writes the files; why to stop, or None."""
    plan, history = run.plan, run.history
    history.records.append(record)
    figures = _figures(record)
    improved = run.watch.update(plan.stop, record.epoch, figures)
    history.best_epoch = run.watch.best_epoch or None
    run.events.fire("on_epoch_end", run, record)  # before the checkpoint, which holds the callbacks' state
    state = _state(run, record.epoch) if run.paths and run.master else None
    if improved and plan.stop.restore_best:  # the checkpoint's copy of the weights, else one of its own
        run.best_state = state["model"] if state is not None else to_cpu(run.runner.model.state_dict())
    if state is not None:
        _save_epoch(run, state, improved)
    if run.master and plan.progress:
        note = "  *best" if improved and plan.stop.patience is not None else ""
        if not math.isfinite(figures[plan.stop.monitor]):
            note = f"  ({plan.stop.monitor} is {figures[plan.stop.monitor]}: never the best epoch)"
        write_line(record.line(plan.epochs) + _timing(run, record) + note)
    return run.watch.early_stop(plan.stop) or run.stop_request


def _save_epoch(run: _Run, state: dict[str, Any], improved: bool) -> None:
    """last.pt, then best.pt, then history.csv.

    last.pt goes first and records the new best epoch while holding its weights,
    so a kill before best.pt is written leaves what resume needs to repair it
    (``_check_best`` copies last.pt). best.pt is never ahead of last.pt.
    """
    try:
        save_atomic(state, run.paths["last"])
        run.saved_epoch = int(state["epoch"])
        if improved:
            save_atomic(state, run.paths["best"])
        run.history.to_csv(join(run.plan.checkpoint_dir, HISTORY_NAME))
    except WriteError as error:
        then = "then continue this run with the same call and resume=True"
        message = error.strerror.replace("then run again", then)
        raise WriteError(error.errno, message if then in message else f"{message}; {then}") from error


def _interrupted(run: _Run, epoch: int) -> str:
    """What a Ctrl-C left: the epoch last.pt holds and the call that continues."""
    where = f"one_cycle_fit interrupted in epoch {epoch} of {run.plan.epochs}"
    if not run.paths:
        return f"{where}; nothing was saved (no checkpoint_dir), so it cannot be continued"
    if not run.saved_epoch:
        return f"{where}, before any epoch was saved; run the same call again to start afresh"
    return (
        f"{where}; {run.paths['last']} holds epoch {run.saved_epoch}: continue with the same call and resume=True"
    )


def _timing(run: _Run, record: EpochRecord) -> str:
    """The epoch line's tail: time spent compiling (samples/s leaves it out) and the run's ETA."""
    text = f"  (compiling {format_duration(run.compile_seconds)})" if run.compile_seconds >= 0.5 else ""
    left = run.plan.epochs - record.epoch
    return text + (f"  ETA {format_duration(run_eta(run.paces, left))}" if left else "")


def _stop(run: _Run, reason: str) -> None:
    run.history.stop_reason = reason
    if reason.startswith("time limit"):
        if run.paths:
            reason += f"; resume with the same call and resume=True (checkpoint {run.paths['last']})"
        else:
            reason += "; no checkpoint_dir was given, so this run cannot be resumed"
        run.history.stop_reason = reason
    if run.master and run.plan.progress:
        print(f"stopped: {run.history.stop_reason}")


def _finish(run: _Run) -> None:
    run.events.fire("on_fit_end", run)
    done = run.history.records[-1].epoch if run.history.records else run.start_epoch
    run.history.step_lrs = run.curve[0][: run.opt_step]
    run.history.step_momenta = run.curve[1][: run.opt_step] if _uses_momentum(run.opt) else []
    run.history.momentum_name = "beta1" if "betas" in run.opt.param_groups[0] else "momentum"
    if not run.history.stop_reason:
        run.history.stop_reason = f"completed {done} of {run.plan.epochs} epochs"
    if run.runner.precision.mode == "cast":  # trained in bf16: the model goes back in the dtypes it came in
        run.runner.found.restore_dtypes(run.runner.model)
    if run.plan.stop.restore_best:
        if not run.watch.best_epoch:
            never = f"no epoch had a finite {run.plan.stop.monitor}"
            why = "" if never in run.history.stop_reason else f"{never}, so "
            run.history.stop_reason += f"; {why}no best weights were restored (the model holds the last epoch's)"
            return
        best = run.best_state
        if best is None and "best" in run.paths:  # best.pt was checked when the run resumed
            problem, state = _best_problem(run, run.watch.best_epoch)
            if problem:
                raise RuntimeError(f"{run.paths['best']} {problem}, so the best weights cannot be restored")
            best = state["model"]
        if best is not None:
            run.runner.model.load_state_dict(best)
            run.history.stop_reason += f"; restored the best weights (epoch {run.watch.best_epoch})"


def _parameter_digest(model: nn.Module) -> str:
    """Parameter names and shapes, as a short digest (the same model class gives the same)."""
    import hashlib

    text = ";".join(f"{k}:{tuple(v.shape)}" for k, v in model.state_dict().items())
    return f"{len(model.state_dict())} tensors, {hashlib.sha1(text.encode()).hexdigest()[:12]}"


def _uses_momentum(opt: torch.optim.Optimizer) -> bool:
    return all("betas" in g or g.get("momentum", 0) > 0 for g in opt.param_groups)


def _summary(run: _Run) -> str:
    plan, runner = run.plan, run.runner
    device, cores = runner.device, runner.topology.cores
    kind = backend.hardware(device) or device.type
    scaled = f"scaled x{cores} by cores" if plan.schedule.scale_lr_by_cores else "not scaled by cores"
    workers = plan.train.num_workers or 0
    dropped = dropped_per_epoch(run.train_loader)
    loaders = runner.topology.loaders[0]
    where = f" by each of {loaders} loaders" if dropped and loaders > 1 else ""
    return (
        f"one_cycle_fit: {plan.mode} on {cores} {kind} core(s) | batch {plan.train.batch_size} per core, "
        f"{runner.topology.global_batch(plan.train.batch_size)} global | {run.batches} batches/epoch per core "
        f"x {plan.epochs} epochs = {run.total} optimizer steps | max_lr {run.max_lr:.2e} ({scaled}) | "
        f"{runner.precision.label} | {plan.optimizer_name}{' (torch_xla sync-free, fused)' if run.fused else ''}"
        + (f" | peak lr per param group x{[round(r, 6) for r in run.lr_ratios]}" if set(run.lr_ratios) != {1.0} else "")
        + (f" | callbacks {', '.join(map(_named, run.events.callbacks))}" if run.events.callbacks else "")
        + f" | {workers} loader worker(s)"
        + (f" | {dropped} sample(s) an epoch left out{where} to keep one batch shape" if dropped else "")
    )


def _named(callback: Any) -> str:
    """A callback's repr if it has one of its own (``EMA(decay=0.999, restore=True)``), else its class name."""
    return repr(callback) if type(callback).__repr__ is not object.__repr__ else type(callback).__name__


def _versions() -> dict[str, str]:
    return {
        "torch": str(torch.__version__),
        "torch_xla": backend.installed_version("torch_xla") or "",
        "tpu_utility": backend.installed_version("tpu_utility") or "",
    }


def _state(run: _Run, epoch: int) -> dict[str, Any]:
    plan = run.plan
    state = {
        "format": 1,
        "epoch": epoch,
        "step": run.opt_step,
        "total_steps": run.total,
        "model": run.runner.model.state_dict(),
        "optimizer": run.opt.state_dict(),
        "optimizer_class": class_name(run.opt),
        "rng": {
            "torch": torch.get_rng_state(),
            "xla": backend.rng_state() if run.runner.lazy else 0,
            "python": random.getstate(),
        },
        "history": run.history.to_dicts(),
        "monitor": {**run.watch.as_dict(), "name": plan.stop.monitor, "mode": plan.stop.mode},
        "run": run.run_id,
        "callbacks": run.events.state_dict(),
        "versions": _versions(),
        "config": {"epochs": plan.epochs, "max_lr": plan.schedule.max_lr, "batch_size": plan.train.batch_size,
                   "cores": plan.cores, "fingerprint": run.fingerprint},  # fmt: skip
    }
    return to_cpu(state)


def _restore(run: _Run) -> None:
    path = run.paths["last"]
    state = load_checkpoint(path)
    _check_fingerprint(path, state, run)
    load_state_into(state, path, run.runner.model, run.opt)
    run.events.load_state_dict(state.get("callbacks", {}), path)
    if run.runner.lazy:  # the callbacks' restored tensors become device data, not part of epoch 1's first graph;
        backend.sync()  # before the RNG is restored: a sync advances torch_xla's seed
    torch.set_rng_state(state["rng"]["torch"])
    version, internal, gauss = state["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    if run.runner.lazy:
        backend.set_rng_state(int(state["rng"]["xla"]))
    run.start_epoch, run.opt_step = int(state["epoch"]), int(state["step"])
    run.history.records = History.from_dicts(state["history"]).records
    watched = state.get("monitor", {})
    _check_monitor(path, watched, run.plan.stop)
    run.watch = Watch(**{k: watched[k] for k in ("best", "best_epoch", "waited") if k in watched})
    run.history.best_epoch = run.watch.best_epoch or None
    run.run_id = state.get("run", run.run_id)
    run.last_state = state  # for _check_best, then dropped


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


def _best_problem(run: _Run, epoch: int) -> tuple[str | None, dict[str, Any] | None]:
    """What is wrong with best.pt as this run's copy of epoch ``epoch`` (None if nothing), and its state."""
    path = run.paths["best"]
    if not exists(path):
        return "is missing", None
    try:
        state = load_checkpoint(path)
    except DamagedCheckpointError as error:
        return f"is damaged ({error.why})", None
    if not isinstance(state, dict) or "epoch" not in state or "model" not in state:
        return "is not a one_cycle_fit checkpoint", None
    saved = state.get("config", {}).get("fingerprint", {})
    if saved and saved != run.fingerprint:
        keys = sorted(k for k in set(saved) | set(run.fingerprint) if saved.get(k) != run.fingerprint.get(k))
        return f"was written by a run with other arguments (they differ in {', '.join(keys)})", None
    if state.get("run", run.run_id) != run.run_id:
        return f"was written by another run (run {state.get('run')}, this run {run.run_id})", None
    if int(state["epoch"]) != epoch:
        return f"holds epoch {int(state['epoch'])}, not epoch {epoch}", None
    return None, state


def _check_best(run: _Run) -> None:
    """On resume, best.pt must be this run's copy of the best epoch that last.pt records.

    If last.pt holds the best epoch itself (a kill between the two writes), best.pt
    is rewritten from it; otherwise a wrong best.pt is an error with the choices.
    """
    last_state, run.last_state = run.last_state, None
    if "best" not in run.paths:
        return
    best, last, rule = run.watch.best_epoch, int(last_state["epoch"]), run.plan.stop
    if not best:
        if exists(run.paths["best"]):
            raise ValueError(
                f"{run.paths['best']} exists but {run.paths['last']} records no best epoch (no epoch had a finite "
                f"{rule.monitor}), so it is not this run's. Move it away and resume, or start afresh in another "
                f"checkpoint_dir"
            )
        return
    problem, _ = _best_problem(run, best)
    if problem is None:
        return
    if best == last:
        if run.master:
            save_atomic(last_state, run.paths["best"])
            warnings.warn(f"repaired {run.paths['best']}: it {problem}; rewritten from {run.paths['last']}, which "
                          f"holds the best epoch ({best})", stacklevel=2)  # fmt: skip
        return
    if problem == "is missing" and not rule.restore_best:
        if run.master:
            warnings.warn(f"{run.paths['best']} is missing, so epoch {best}'s weights are lost; it is written again "
                          f"when an epoch beats {rule.monitor} {run.watch.best:.4g}", stacklevel=2)  # fmt: skip
        return
    raise ValueError(
        f"{run.paths['best']} {problem}, but {run.paths['last']} records epoch {best} as the best "
        f"({rule.monitor} {run.watch.best:.4g}); resume=True stops now rather than restore wrong weights "
        f"at the end. Either put back this run's best.pt (epoch {best}); or move best.pt away and resume with "
        f"restore_best=False (epoch {best}'s weights are then lost; best.pt is written again when an epoch beats "
        f"it); or start afresh in another checkpoint_dir"
    )


def _check_fingerprint(path: str, state: dict[str, Any], run: _Run) -> None:
    """Refuses a checkpoint written by a different run, naming every difference."""
    saved = state.get("config", {}).get("fingerprint", {})
    mine = run.fingerprint if saved else {}  # a checkpoint from before fingerprints: steps only
    differences = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {mine.get(key)!r}"
        for key in sorted(set(saved) | set(mine))
        if saved.get(key) != mine.get(key)
    ]
    if state.get("total_steps") != run.total:
        differences.append(f"optimizer steps: checkpoint {state.get('total_steps')}, this run {run.total}")
    if differences:
        raise ValueError(
            f"{path} was written by a different run, so resume=True refuses it:\n  "
            + "\n  ".join(differences)
            + "\nResume with the same arguments (changing epochs changes the one-cycle schedule too, "
            "so it cannot extend a run), or give another checkpoint_dir to start afresh."
        )
