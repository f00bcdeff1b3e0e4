"""The training loop one_cycle_fit runs in each process, on a Runner.

The loop trains, evaluates, and reads each epoch's figures from the device once,
all-reduced over replicas. Everything else a run does is a callback that the loop
fires events to: the schedule, the stop rules, checkpoints and the progress line
(``builtins.py``), and the user's own (``events.py`` lists the events). An epoch::

    on_train_epoch_start
    every batch: forward, backward, the loss kept on the device (added up every 64 batches)
        every accumulate_steps batches: on_before_step, the optimizer step, on_step_end
        (under precision="fp16" the loss is scaled before backward, and the GradScaler steps:
        it unscales before clipping and skips a step whose gradients hold inf or NaN)
    on_train_epoch_end
    evaluation, then one read of every figure
    on_epoch_end(record)     (loop.stop(reason) ends the run after it)
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from .. import backend
from ..checkpoint import CHECKPOINT_NAME
from ..compiler import EAGER, Compile
from ..data.loaders import LabelCheck, LoaderSpec, dropped_per_epoch, refuse_uncounted, set_epoch
from ..data.packing import PackedDataset
from ..files import folder_lock, join, remove, remove_stale_temporaries
from ..huggingface import is_causal_lm, restore_masks, restore_packed_attention
from ..optim import on_xla, take_step
from ..progress import CompileProgress, progress_bar
from .builtins import BEST_NAME, HISTORY_NAME
from .events import Events, StopFit
from .graphs import GraphLog
from .history import EpochRecord, History
from .metrics import MetricSet
from .optimizers import OPTIMIZERS
from .precision import Precision
from .runner import Runner
from .strategies import Single, Strategy
from .throughput import Throughput
from .steps import EvalStep, LossStep
from .schedule import peak_ratios, total_optimizer_steps

_NO_BAD_STEP = float(2**24)  # "no non-finite loss yet"; exact in float32
_clock = time.monotonic  # the time-limit clock (tests replace it)


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
    """Everything a training process needs; picklable for a spawned launch.

    ``builtins`` are the callbacks one_cycle_fit's arguments asked for
    (``builtins.py``), ``callbacks`` the user's; the loop fires events to both.
    """

    epochs: int
    train: LoaderSpec
    valid: LoaderSpec | None
    steps: Steps
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_name: str
    optimizer_args: dict[str, Any]
    metrics: dict[str, Any]
    checkpoint_dir: str | None = None
    overwrite: bool = False
    precision: Precision = field(default_factory=Precision)  # checked once, where one_cycle_fit was called
    seed: int = 0
    progress: bool = True
    cores: int = 1
    strategy: Strategy = field(default_factory=Single)  # how the model spreads over the cores (``strategies/``)
    compile: Compile = EAGER  # whether the step is torch.compile'd (natively)
    callbacks: list[Any] = field(default_factory=list)
    builtins: list[Any] = field(default_factory=list)
    memory: str = ""  # the memory plan the run was checked against, in one line (said on the summary line)


# ------------------------------------------------------------ one process
class Trainer:
    """One process's training state; callbacks are handed it as ``loop`` (``events.Loop``, ``events.TrainerLoop``)."""

    def __init__(self, model: nn.Module, plan: FitPlan) -> None:
        self.plan, self.epochs = plan, plan.epochs
        torch.manual_seed(plan.seed)
        random.seed(plan.seed)
        self.runner = runner = Runner(model, plan.precision, plan.strategy, plan.compile)
        if runner.lazy:
            backend.current().devices.set_rng_state(plan.seed)
        self.model, self.device = runner.model, runner.device
        self.master, self.cores = runner.topology.master, runner.topology.cores
        self.optimizer, self.fused = _optimizer(runner, plan)
        # take_step's `reduce`, asked once (on_xla checks the optimizer's parameters are on the device): True on
        # XLA, False for a process that trains alone, None to average where other processes' gradients differ
        self.reduce = True if on_xla(self.optimizer) else (False if backend.current().processes.world_size() == 1 else None)
        self.lr_ratios = peak_ratios([float(g["lr"]) for g in self.optimizer.param_groups], lr_of(self.optimizer))
        # torch_xla's sync-free optimizers skip the step when found_inf is 1 (never, here)
        self.step_args = {"found_inf": _device_values(runner.device, 0.0)[0]} if self.fused else {}
        self._loaders()
        per_epoch = self.batches // plan.steps.accumulate_steps
        if not self.batches:
            raise ValueError(f"train_data gives no full batch of {plan.train.batch_size} on each core "
                             f"({len(plan.train)} samples); give more data or a smaller batch_size")  # fmt: skip
        if per_epoch < 1:
            raise ValueError(
                f"accumulate_steps={plan.steps.accumulate_steps} exceeds the {self.batches} batches per epoch on each core"
            )
        self.total_steps = total_optimizer_steps(self.batches, plan.epochs, plan.steps.accumulate_steps)
        runner.compile_for(self.total_steps)
        self.events = Events([*plan.builtins, *plan.callbacks])
        self.history = History(steps_per_epoch=per_epoch)
        # real tokens/s and MFU for token data that knows its tokens (a PackedDataset), where the chip's peak is known
        self.throughput = Throughput.of(plan.train.dataset, runner.model, backend.current().devices.chip_name(runner.device),
                                        self.cores)
        self.history.summary = _summary(self)
        self.graphs = GraphLog(self.history.graphs) if runner.lazy else None  # XLA's graphs, each with its cause
        # what the loop and the callbacks update as the run goes
        self.start_epoch = self.step = 0  # a resume sets them
        self.saved_epoch = 0  # the epoch last.pt holds
        self.lr = lr_of(self.optimizer) or math.nan  # the schedule writes each step's
        self.loss: torch.Tensor | None = None  # the latest batch's, on the device
        self.elapsed, self.compile_seconds = 0.0, 0.0  # all-reduced seconds since the start; the epoch's compiling
        self.first_bad_step: int | None = None  # the epoch's first step with a non-finite loss
        self.stop_request: str | None = None
        folder = plan.checkpoint_dir
        self.last_path = join(folder, CHECKPOINT_NAME) if folder else None

    def _loaders(self) -> None:
        plan, runner, steps = self.plan, self.runner, self.plan.steps
        self.train_loader = runner.train_loader(plan.train, plan.seed)
        self.valid_loader = runner.eval_loader(plan.valid) if plan.valid is not None else None
        self.metrics = MetricSet(plan.metrics, steps.loss_fn, runner.device) if plan.valid is not None else None
        # the default loss's labels, checked on the host against the first real output's class count
        # (and where no target counts, or a causal LM's labels are not shaped as its input_ids, named as loaded)
        causal = steps.default_loss and is_causal_lm(runner.model)
        labels = LabelCheck(causal=causal) if steps.default_loss and steps.train_step is None else None
        if labels is not None:
            self.train_loader = labels.loader(self.train_loader, what="train_data")
        # the default validation loss of a causal LM pairs its scores and labels as the model's own loss does
        self.eval_step = steps.eval_step or EvalStep(labels, causal=causal)
        if self.valid_loader is not None and labels is not None and steps.eval_step is None:
            self.valid_loader = labels.loader(self.valid_loader, masked=True, what="valid_data")
        self.train_step = steps.train_step or LossStep(steps.loss_fn, labels, model_loss=steps.default_loss)
        self.batches = len(self.train_loader)

    def stop(self, reason: str) -> None:
        """Ends the run after the current epoch (which is saved first), with ``reason`` as its stop reason."""
        if not isinstance(reason, str) or not reason:
            raise TypeError(f"loop.stop takes the reason as a non-empty string, but given {reason!r}")
        self.stop_request = self.stop_request or reason


def _optimizer(runner: Runner, plan: FitPlan) -> tuple[torch.optim.Optimizer, bool]:
    """The run's optimizer, and whether it is torch_xla's fused one."""
    # torch_xla's fused Adam fails to compile for bf16 parameters: cast mode keeps torch's.
    use_fused = runner.lazy and plan.optimizer_name in ("adam", "adamw") and runner.precision.mode != "cast"
    fused = backend.current().compute.fused_optimizer(plan.optimizer_name) if use_fused else None
    params = [p for p in runner.model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters (all have requires_grad=False); unfreeze some layers")
    if fused:
        return fused(params, **plan.optimizer_args), True
    own = runner.decision.on and plan.optimizer_name in OPTIMIZERS  # one_cycle_fit's own, by name
    extra = backend.current().compute.compiled_optimizer_options(plan.optimizer_name) if own else {}
    return build_optimizer(plan.optimizer, runner.model, {**plan.optimizer_args, **extra}), False


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
    with backend.naming_stalls("one_cycle_fit"):  # a replica that stopped answering is named, not only the wait
        return _locked_train(model, plan)


def _locked_train(model: nn.Module, plan: FitPlan) -> tuple[nn.Module, History]:
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
    backend.current().processes.barrier("tpu_utility.train.saved")
    return result


def _train(model: nn.Module, plan: FitPlan) -> tuple[nn.Module, History]:
    loop = Trainer(model, plan)
    try:
        return _run(loop, model, plan)
    finally:  # a transformers model leaves with its own attention implementation (see static_masks)
        restore_masks(model, loop.runner.found_attention)
        restore_packed_attention(loop.runner.packed_attention)
        loop.runner.strategy.leave(model)  # its hooks off: history.model is the plain model
        loop.runner.unstack_layers()  # scanned layers' weights back in the layers
        loop.runner.stop_workers()  # persistent loaders' workers stopped now, not waited out at a garbage collection


def _run(loop: Trainer, model: nn.Module, plan: FitPlan) -> tuple[nn.Module, History]:
    if loop.valid_loader is not None:
        loop.runner.check_eval(loop.valid_loader, loop.metrics, loop.eval_step)
        refuse_uncounted(loop.valid_loader)  # NaN figures for every epoch: refused before the first
    epoch, history = loop.start_epoch, loop.history
    try:
        loop.events.fire("on_fit_start", loop)  # a resume happens here (Checkpoints)
        if loop.runner.lazy:  # set-up tensors become device data, not part of epoch 1's first graph; a sync
            seed = backend.current().devices.rng_state()  # advances torch_xla's seed, so the seed is kept as it was
            backend.current().devices.sync()
            backend.current().devices.set_rng_state(seed)
        started = _clock()
        for epoch in range(loop.start_epoch, plan.epochs):
            history.records.append(_epoch(loop, epoch, started))
            loop.events.fire("on_epoch_end", loop, history.records[-1])
            if loop.stop_request:
                history.stop_reason = loop.stop_request
                break
    except StopFit as stop:
        history.stop_reason = str(stop) or f"stopped by a callback in epoch {epoch + 1}"
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupted(loop, epoch + 1)) from None  # one line: what is saved, how to go on
    if not history.stop_reason:
        done = history.records[-1].epoch if history.records else loop.start_epoch
        history.stop_reason = f"completed {done} of {plan.epochs} epochs"
    loop.events.fire("on_fit_end", loop)
    loop.runner.unstack_layers()  # the layers' own parameters back first: their dtypes are given back by name
    if loop.runner.precision.mode == "cast":  # trained in bf16: the model goes back in the dtypes it came in
        loop.runner.found.restore_dtypes(loop.model)
    return model, history


def _epoch(loop: Trainer, epoch: int, started: float) -> EpochRecord:
    """Trains and evaluates one epoch; its figures, read once."""
    runner = loop.runner
    syncs0, transfers0 = backend.host_sync_count(), backend.transfer_from_device_count()
    t0 = time.perf_counter()
    train_sums, compile_seconds = _train_epoch(loop, epoch)
    graphs, t1 = backend.current().diagnosis.compile_count(), time.perf_counter()
    log = loop.graphs
    if log is not None and loop.valid_loader:
        log.begin("eval step", epoch + 1)
    sums, computed = (runner.eval_sums(loop.valid_loader, loop.metrics, loop.eval_step,
                                       log.step if log is not None else None)
                      if loop.valid_loader else ([], []))  # fmt: skip
    if log is not None:
        log.begin("epoch figures", epoch + 1)
    values, synced, bad_step = _read_epoch(runner.device, train_sums, sums, [*computed, torch.tensor(_clock() - started)])
    if log is not None:
        log.end()
    if backend.current().diagnosis.compile_count() > graphs:  # the first validation pass and read compile their graphs: counted as compiling
        compile_seconds += time.perf_counter() - t1
    del train_sums, sums, computed  # lazy views kept alive would run as a graph of their own at the next sync
    loop.first_bad_step = int(bad_step) if bad_step < _NO_BAD_STEP else None
    loop.elapsed, loop.compile_seconds = synced[-1], compile_seconds  # elapsed: the same on every replica
    seconds = time.perf_counter() - t0
    record = EpochRecord(
        epoch=epoch + 1, train_loss=values[0] / values[1], valid_loss=None, metrics={}, lr=loop.lr, seconds=seconds,
        samples_per_s=loop.batches * runner.topology.global_batch(loop.plan.train.batch_size)
        / max(seconds - compile_seconds, 1e-9),
    )  # fmt: skip
    record.tokens_per_s, record.mfu = loop.throughput.figures(record.samples_per_s)
    if loop.metrics is not None:
        record.valid_loss, record.metrics = loop.metrics.values(values[2:], synced[:-1])
    record.compiles = backend.current().diagnosis.compile_count()
    record.host_syncs = backend.host_sync_count() - syncs0
    record.transfers = backend.transfer_from_device_count() - transfers0
    return record


def _train_epoch(loop: Trainer, epoch: int) -> tuple[list[torch.Tensor], float]:
    """The epoch's training pass: its device sums, and the seconds its steps spent compiling."""
    plan, runner = loop.plan, loop.runner
    set_epoch(loop.train_loader, epoch)  # its sampler's order, and a CachedDataset's augmented copy
    loop.events.fire("on_train_epoch_start", loop, epoch)
    runner.model.train()
    loop.optimizer.zero_grad(set_to_none=True)
    losses = LossTally(runner.device, runner.lazy)
    desc, speak = f"epoch {epoch + 1}/{plan.epochs}", plan.progress and loop.master
    bar = progress_bar(loop.batches, desc, enabled=speak)
    # the run's first epoch on XLA compiles: say so before the first batch's compile, not after
    notice = CompileProgress(bar, desc, backend.current().diagnosis.compile_count, expect=runner.compiles and epoch == loop.start_epoch, speak=speak)
    watch = runner.compiles  # XLA's or torch.compile's graphs: an eager step's count never moves
    if loop.graphs is not None:
        loop.graphs.begin("train step", epoch + 1)
    done = 0
    try:
        for i, batch in enumerate(runner.batches(loop.train_loader)):
            losses.make_room()  # before this batch's step is traced
            losses.keep(_train_batch(loop, i, batch))
            bar.update(1)
            if watch:
                notice.after_step()
            if loop.graphs is not None:
                loop.graphs.step(batch)
            done = i + 1
    finally:
        notice.close()
        bar.close()
    if loop.graphs is not None:
        loop.graphs.end()  # the loader's end cut the last batch's graph
    loop.optimizer.zero_grad(set_to_none=True)  # a partial accumulation at the epoch's end is dropped
    loop.events.fire("on_train_epoch_end", loop)
    return [*losses.sums(), torch.tensor(float(done))], notice.compile_seconds


class LossTally:
    """The epoch's training losses on the device: kept a batch at a time, added up 64 at a time.

    A step only keeps its loss (a list append, nothing traced); every ``every`` losses
    become the running sum and a count of the batches after which that sum was finite,
    in a small graph of their own, so the step's graph stays the hand loop's plus its
    loss as an output. The running sum stays non-finite from the first non-finite loss
    on, so the count is the first bad batch's number less one (the NaN stop's figure).
    Nothing is read: the epoch's one read takes ``sums()``.
    """

    every = 64  # a graph with this many losses as inputs runs every this many steps

    def __init__(self, device: torch.device, lazy: bool) -> None:
        self.loss_sum, self.finite = _device_values(device, 0.0, 0.0)
        self.lazy, self.kept = lazy, []

    def make_room(self) -> None:
        """Adds up a full list; called between steps (the loader has cut the graph), so on XLA the
        addition runs as a graph of its own rather than in a step's."""
        if len(self.kept) == self.every:
            self._add_up()
            if self.lazy:
                backend.current().devices.sync()

    def keep(self, loss: torch.Tensor) -> None:
        self.kept.append(loss)

    def sums(self) -> list[torch.Tensor]:
        """The loss sum and the finite count, with the losses kept since the last add traced in (not run)."""
        if self.kept:
            self._add_up()
        return [self.loss_sum, self.finite]

    def _add_up(self) -> None:
        losses, self.kept = torch.stack(self.kept), []
        bad = ~torch.isfinite(losses)
        finite_run = torch.where(bad.any(), bad.int().argmax(), len(losses))  # the losses before the first bad one
        self.finite = self.finite + torch.where(torch.isfinite(self.loss_sum), finite_run, 0)
        self.loss_sum = self.loss_sum + losses.sum()


def _train_batch(loop: Trainer, i: int, batch: Any) -> torch.Tensor:
    """One batch, top to bottom: the loss and its gradients; the optimizer step every ``accumulate_steps``
    batches, between ``on_before_step`` (the schedule) and ``on_step_end``. Returns the loss, detached."""
    steps = loop.plan.steps
    loss = loop.runner.run(loop.train_step, batch, training=True)
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"train_step must return the loss as a tensor (so it can be backpropagated), but returned "
            f"{type(loss).__name__} {loss!r}"
        )
    if loss.numel() != 1:  # metadata, no device read
        raise ValueError(f"train_step must return one loss value (a 0-d tensor), but returned shape "
                         f"{tuple(loss.shape)} (a loss with reduction='none'?); reduce it (.mean()) or use a loss "
                         f"with reduction='mean'")  # fmt: skip
    if loss.dtype != torch.float32:  # a bf16 or fp16 loss; a float32 one as it is (no op to trace)
        loss = loss.float()
    precision = loop.runner.precision  # under fp16 it scales the loss, and its GradScaler steps the optimizer
    precision.backward(loss / steps.accumulate_steps if steps.accumulate_steps > 1 else loss)
    loop.loss = loss.detach()
    if (i + 1) % steps.accumulate_steps == 0:
        loop.events.fire("on_before_step", loop)
        # step_optimizer's step, its arguments checked before the first epoch (FitPlan, Trainer); MpDeviceLoader
        # cuts the graph at every batch, so the step needs no barrier
        take_step(loop.optimizer, loop.reduce, precision.scaler, False, steps.max_grad_norm, loop.step_args)
        loop.optimizer.zero_grad(set_to_none=True)
        loop.step += 1
        loop.events.fire("on_step_end", loop)
    return loop.loss


def _device_values(device: torch.device, *values: Any) -> list[torch.Tensor]:
    """Accumulators materialised on the device, like the previous step's outputs they stand for.

    Left as pending constants (torch_xla keeps small uploads as scalars in the
    graph), they would merge into an epoch's first step and make it a graph of its
    own; run now, they are plain device data in every epoch.
    """
    tensors = [torch.tensor(v, dtype=torch.float32).to(device) for v in values]
    if backend.current().devices.is_lazy(device):
        backend.current().devices.sync()
    return tensors


def _read_epoch(device: torch.device, train_sums: list[torch.Tensor], eval_sums: list[torch.Tensor],
                same: list[torch.Tensor]) -> tuple[list[float], list[float], float]:  # fmt: skip
    """The epoch's one device read, reduced over replicas: sums added, the first bad step
    the minimum, figures already equal on every replica (torchmetrics, elapsed time) the maximum."""
    loss_sum, finite, n_batches = train_sums
    bad_step = torch.where(torch.isfinite(loss_sum), _NO_BAD_STEP, finite + 1)  # the first non-finite batch, 1-based
    summed = torch.stack([t.float().reshape(()).to(device) for t in [loss_sum, n_batches, *eval_sums]])
    synced = torch.stack([t.float().reshape(()).to(device) for t in same])
    chosen = backend.current()
    summed, synced = chosen.processes.all_reduce([summed], "sum")[0], chosen.processes.all_reduce([synced], "max")[0]
    bad_step = chosen.processes.all_reduce([bad_step.reshape(1)], "min")[0]
    values, synced_values, (first_bad,) = (t.tolist() for t in chosen.devices.to_cpu([summed, synced, bad_step]))
    return values, synced_values, first_bad


def _interrupted(loop: Trainer, epoch: int) -> str:
    """What a Ctrl-C left: the epoch last.pt holds and the call that continues."""
    where = f"one_cycle_fit interrupted in epoch {epoch} of {loop.epochs}"
    if not loop.last_path:
        return f"{where}; nothing was saved (no checkpoint_dir), so it cannot be continued"
    if not loop.saved_epoch:
        return f"{where}, before any epoch was saved; run the same call again to start afresh"
    return f"{where}; {loop.last_path} holds epoch {loop.saved_epoch}: continue with the same call and resume=True"


def _summary(loop: Trainer) -> str:
    plan, runner = loop.plan, loop.runner
    kind = backend.current().devices.hardware(loop.device) or loop.device.type
    workers = plan.train.num_workers or 0
    dropped = dropped_per_epoch(loop.train_loader)
    loaders = runner.topology.loaders[0]
    where = f" by each of {loaders} loaders" if dropped and loaders > 1 else ""
    schedule = [c.describe(loop) for c in loop.events.callbacks if callable(getattr(c, "describe", None))]
    users = [c for c in loop.events.callbacks if any(c is given for given in plan.callbacks)]  # in their order
    return (
        f"one_cycle_fit: {plan.strategy.name} on {loop.cores} {kind} core(s) | batch {plan.train.batch_size} per core, "
        f"{runner.topology.global_batch(plan.train.batch_size)} global | {loop.batches} batches/epoch per core "
        f"x {plan.epochs} epochs = {loop.total_steps} optimizer steps | "
        + (f"{runner.strategy.note} | " if runner.strategy.note else "")
        + (f"{plan.memory} | " if plan.memory else "")
        + "".join(f"{part} | " for part in schedule)
        + (f"{runner.decision.words} | " if runner.decision.words else "")
        + (f"{runner.scan_words} | " if runner.scan_words else "")
        + f"{runner.precision.words(loop.model)} | {plan.optimizer_name}{' (torch_xla sync-free, fused)' if loop.fused else ''}"
        + (" (fused)" if loop.optimizer.defaults.get("fused") else "")
        + (f" | peak lr per param group x{[round(r, 6) for r in loop.lr_ratios]}" if set(loop.lr_ratios) != {1.0} else "")
        + (f" | callbacks {', '.join(map(_named, users))}" if users else "")
        + f" | {workers} loader worker(s)"
        + (f" | {dropped} sample(s) an epoch left out{where} to keep one batch shape" if dropped else "")
        + (f" | {plan.train.dataset.summary()}{_attention(runner.packed_attention)}"
           if isinstance(plan.train.dataset, PackedDataset) else "")
        + (f" | {loop.throughput.describe()}" if loop.throughput.describe() else "")
    )


def _attention(handle: Any) -> str:
    """``; packed rows attend through ...`` for the summary, where ``packed_attention`` changed the model."""
    return f"; {handle.attention}" if handle is not None else ""


def _named(callback: Any) -> str:
    """A callback's repr if it has one of its own (``EMA(decay=0.999, restore=True)``), else its class name."""
    return repr(callback) if type(callback).__repr__ is not object.__repr__ else type(callback).__name__
