"""one_cycle_fit(): train on one core or all cores with the one-cycle policy.

This module is the entry: it checks the arguments, chooses the strategy and,
for ``strategy="multiprocess"``, launches one process per chip. Each process
then runs ``training.train`` on a ``runner.Runner``.

What a run does for you, and how:

* **Fixed shapes, no recompiles.** The short last training batch is dropped;
  validation batches are padded to full size and carry a mask.
* **No per-step host syncs.** Losses and metrics are summed on the device and
  read once per epoch, in one transfer; the progress bar counts batches only.
* **A schedule that knows what each core iterates.** Its length is per-core
  batches x epochs / accumulate_steps: one-cycle (``schedule.one_cycle``), linear or
  cosine with warm-up, constant, your function of the step, or ``schedule=None``
  for a scheduler of your own.
* **All cores** by SPMD (one process, the batch sharded over a device mesh) or
  by ``torch_xla.launch`` (one process per chip; fork in notebooks).
* **Exact metrics:** every validation sample counts once on any core count.
* **Best epoch, early stop, time limit**, decided by every replica from the
  same all-reduced figures.
* **Checkpoints** of CPU tensors, written atomically by the master, resumable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
import inspect
import io
import math
import os
import tempfile
import warnings
from typing import Any, Callable, Literal, Sequence, get_args

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .. import remote
from ..checkpoint import to_cpu
from ..compiler import Compile
from ..data.loaders import LoaderSpec, unpack_loader
from ..files import exists, join
from .callbacks import GradientCheckpointing
from .chunked import ChunkedLoss
from .builtins import (BestEpoch, Checkpoints, MultiplierSchedule, OneCycleSchedule, OwnLearningRates, ProgressLine,
                       RecompileNotice, RestoreBest, StopOnNaN, TimeLimit)  # fmt: skip
from .agreement import ReplicaAgreement
from .events import Events, check_callbacks
from .history import History
from .metrics import METRICS, CrossEntropy, accuracy, check_loss_fn, per_sample_loss, resolve_metrics
from .memory import MemoryPlan, first_length, memory_plan, refuse_host_shortage, refuse_replicating
from .monitor import Mode, StopRule, parse_duration, resolve_mode
from .optimizers import OPTIMIZERS, named_optimizer
from .precision import Precision, PrecisionName
from .topology import available_cores, resolve_cores
from .schedule import LrSchedule, OneCycle, ScheduleName, check_warmup, is_default
from .strategies import FSDP, Strategy, StrategyName, choose, choose_strategy
from .trainer import FitPlan, Steps, train

__all__ = ["one_cycle_fit", "resolve_optimizer", "resolve_cores", "choose_strategy", "available_cores",
           "accuracy", "METRICS"]  # fmt: skip

Batch = Any
TrainStep = Callable[[nn.Module, Batch], torch.Tensor]
EvalStep = Callable[[nn.Module, Batch], "tuple[torch.Tensor, torch.Tensor]"]
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ----------------------------------------------------------- pure choices
def resolve_optimizer(optimizer: Any) -> tuple[Callable[..., torch.optim.Optimizer], str]:
    """An optimizer name or ``params -> Optimizer`` callable as (factory, name)."""
    if isinstance(optimizer, str):
        return named_optimizer(optimizer).factory, optimizer
    if callable(optimizer):
        return optimizer, getattr(optimizer, "__name__", type(optimizer).__name__)
    raise TypeError(f"optimizer must be a name or a callable params -> Optimizer, but given {optimizer!r}")


def check_number(name: str, value: Any, low: float, high: float, *, closed: str = "()") -> float:
    """``value`` as a float, checked against an interval; ``closed`` says which ends belong to it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= low if closed[0] == "[" else value > low) and (value <= high if closed[1] == "]" else value < high)
    if not ok:
        bound = f"{closed[0]}{low}, {high}{closed[1]}".replace("inf", "∞")
        raise ValueError(f"{name} must be a number in {bound}, but given {value!r}")
    return float(value)


def _positive(name: str, value: Any, kind: type = float) -> Any:
    """``value``, checked to be a positive number (``kind=int``: a positive int)."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int) and value > 0
    if not ok or (kind is float and not math.isfinite(value)):
        what = "a positive number" if kind is float else "a positive int"
        raise ValueError(f"{name} must be {what}, but given {value!r}")
    return value


def _check_model(model: Any) -> tuple[nn.Module | None, Callable[[], nn.Module] | None]:
    """(the model, None) for a module with something to train, (None, the factory) for a zero-argument factory."""
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a zero-argument factory, but given {model!r}")
        _check_factory(model)
        return None, model
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("the model has no trainable parameters (all have requires_grad=False); unfreeze some layers")
    return model, None


def _check_factory(model: Callable) -> None:
    """A class or function given as the model must build one with no arguments; say so now, not at the call."""
    name = getattr(model, "__qualname__", type(model).__name__)
    if isinstance(model, type) and not issubclass(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a zero-argument factory, but given the class {name}, "
                        f"which is not an nn.Module")  # fmt: skip
    try:
        inspect.signature(model).bind()
    except ValueError:
        return  # no signature to read (a builtin): its own call says what it lacks
    except TypeError as error:
        what = f"the class {name}, not a model" if isinstance(model, type) else f"the function {name}"
        raise TypeError(
            f"model is {what}, and {name}() cannot build one ({error}). Give an instance, one_cycle_fit({name}(...), "
            f"...), or a zero-argument factory, lambda: {name}(...) (functools.partial({name}, ...) under spawn)"
        ) from None


def _check_reduced(loss_fn: Any) -> None:
    """A torch loss with reduction='none' gives one value per sample, where backward needs one number."""
    if getattr(loss_fn, "reduction", None) == "none":
        raise ValueError(
            f"loss_fn {loss_fn!r} has reduction='none', so it returns one loss per sample, but training needs one "
            f"number to backpropagate. Leave reduction at 'mean' (validation unreduces it itself to leave padding "
            f"out), or pass train_step= to reduce a per-sample loss your way"
        )


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int in [0, 2**63), but given {seed!r}")
    return seed


def _check_checkpoint_dir(folder: Any) -> None:
    """A writable folder (created if missing), checked before any epoch is spent."""
    if folder is None:
        return
    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a folder path or a URL, but given {folder!r}")
    if remote.is_url(folder):  # gs://bucket/run: through fsspec, or a clear error, never a local folder "gs:"
        remote.check_folder(folder)
        return
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"checkpoint_dir={str(folder)!r} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ValueError(f"checkpoint_dir={str(folder)!r} is not a writable folder: {error}") from error


def _refuse_another_run(folder: str) -> None:
    """A folder holding a run's last.pt is not written over unless the user says so (re-running a cell)."""
    from ..checkpoint import CHECKPOINT_NAME

    path = join(folder, CHECKPOINT_NAME)
    if not exists(path):
        return
    try:  # memory-mapped: only the few bytes of the epoch are read (a URL's object is read whole)
        source = io.BytesIO(remote.read_bytes(path)) if remote.is_url(path) else path
        state = torch.load(source, map_location="cpu", weights_only=True, mmap=not remote.is_url(path))
        held = f"epoch {int(state['epoch'])} of {int(state['config']['epochs'])}"
    except Exception:  # damaged, or not one_cycle_fit's: still not ours to overwrite silently
        held = "a checkpoint"
    raise ValueError(
        f"checkpoint_dir={folder!r} holds another run's {CHECKPOINT_NAME} ({held}); this call would overwrite it. "
        f"Continue that run with resume=True, or start afresh in a new checkpoint_dir or with overwrite=True"
    )


def _check_optimizer(optimizer: Any, weight_decay: Any) -> ChosenOptimizer:
    """``optimizer=`` (a name or a factory) and ``weight_decay=`` (for a named one) checked together."""
    factory, name = resolve_optimizer(optimizer)
    return ChosenOptimizer(optimizer, factory, name, weight_decay, _optimizer_args(optimizer, weight_decay))


def _optimizer_args(optimizer: Any, weight_decay: float | None) -> dict[str, float]:
    if weight_decay is None:
        return {}
    check_number("weight_decay", weight_decay, 0, math.inf, closed="[)")
    if not isinstance(optimizer, str):
        raise ValueError(
            f"weight_decay={weight_decay} applies to a named optimizer {tuple(OPTIMIZERS)}; "
            f"give it to your own optimizer factory instead"
        )
    return {"weight_decay": float(weight_decay)}


# -------------------------------------------------------------- the entry
def one_cycle_fit(
    model: nn.Module | Callable[[], nn.Module],
    train_data: Any,
    *,
    epochs: int,
    max_lr: float,
    valid_data: Any = None,
    loss_fn: Callable | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    batch_size: int | None = None,
    cores: int | str = 1,
    strategy: StrategyName | FSDP = "auto",
    precision: PrecisionName = "fp32",
    compile: bool | Literal["auto"] | Compile = "auto",
    scan: bool | Literal["auto"] = "auto",
    metrics: str | Metric | Sequence[str | Metric] | dict[str, Any] | None = None,
    accumulate_steps: int = 1,
    max_grad_norm: float | None = None,
    schedule: ScheduleName | OneCycle | Callable[[int, int], float] | None = "one_cycle",
    warmup: float | int = 0,
    pct_start: float = OneCycle.pct_start,  # deprecated (schedule=OneCycle(...)); the defaults are written in OneCycle
    div_factor: float = OneCycle.div_factor,
    final_div_factor: float = OneCycle.final_div_factor,
    base_momentum: float = OneCycle.base_momentum,
    max_momentum: float = OneCycle.max_momentum,
    scale_lr_by_cores: bool = False,
    weight_decay: float | None = None,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    overwrite: bool = False,
    monitor: str | None = None,
    mode: Mode = "auto",
    early_stopping: int | None = None,
    restore_best: bool = False,
    time_limit: float | str | None = None,
    train_step: TrainStep | None = None,
    eval_step: EvalStep | None = None,
    num_workers: int | None = None,
    seed: int = 0,
    progress: bool = True,
    callbacks: Sequence[Any] | None = None,
) -> History:
    """Trains ``model`` with the one-cycle policy (or another schedule) on one core or all cores.

    Args:
        model: An ``nn.Module`` (trained in place), or a zero-argument factory
            (which ``strategy="multiprocess"`` with spawn needs).
        train_data: A map-style Dataset or a DataLoader yielding ``(inputs, targets)``,
            ``(*inputs, targets)``, or dicts of model arguments with ``labels`` (a
            tokenized Hugging Face dataset: ``model(**batch)``, its ``output.loss``)
            or anything ``train_step`` understands. A DataLoader's own sampler and
            settings are kept.
        epochs: Passes over the training data.
        max_lr: Peak learning rate (``OneCycleLR``'s name); with ``schedule=None`` the
            lr every param group starts from (your scheduler's base lr).
        valid_data: Dataset or DataLoader evaluated after every epoch.
        loss_fn: Default: a model that computes its own loss from ``labels`` (a Hugging Face
            model given a dict batch: causal and masked LMs, classifiers, peft models) trains
            on that loss; otherwise ``nn.CrossEntropyLoss()`` over the class dimension (the
            last for ``(N, T, C)`` scores against ``(N, T)`` targets). Targets of -100 count in
            no loss or metric. Reduced in fp32.
        optimizer: "adamw", "adam", "sgd", ``params -> Optimizer``, or ``model -> Optimizer``
            (first parameter named ``model``, or timm's ``model_or_params``) building its own param groups.
        batch_size: Per-core batch size (default 64, or the DataLoader's own).
        cores: 1, "all", or the number of all cores.
        strategy: "auto" (SPMD for several cores; on XLA "fsdp" when the memory plan says one replica
            cannot fit a chip and a shard can, said on the summary line), "spmd", "multiprocess", "fsdp"
            (SPMD with the parameters, gradients and optimizer state sharded over all cores, each block
            checkpointed: docs/large_models.md), or ``FSDP(wrap=..., checkpoint=...)`` for its options.
        precision: "fp32", "bf16" (autocast on TPU, casting on XLA:CPU) or "fp16":
            float16 autocast around the forward and the loss, with torch's ``GradScaler``
            (the loss scaled before backward, the gradients unscaled before clipping, a
            step with inf/NaN gradients skipped; its state kept in ``last.pt``). For CUDA
            GPUs without bf16 (Kaggle's T4); on the CPU it runs slowly, to check a run;
            refused on TPUs (torch_xla, TorchTPU), which compute in bf16.
        compile: Whether the step is compiled with ``torch.compile`` on the native backend: "auto" (on CUDA and
            TorchTPU for a run of 300 steps or more, never on the CPU), True, False, or
            ``Compile(mode=..., fullgraph=..., dynamic=...)``; said on the summary line, its first epoch's
            line says how long it compiled. The model is left as it is (checkpoints keep its own keys); a
            ``torch.compile(model)`` given is trained as it is. Under torch_xla every step is compiled by XLA
            whatever this says (docs/training.md).
        scan: Under torch_xla, whether a Hugging Face decoder's layers are compiled once and looped (torch_xla's
            scan over their stacked weights: the first compile no longer grows with depth): "auto" for 8 layers
            or more, True for any decoder that can be, False never; said on the summary line, with why a model
            runs unrolled. Checkpoints keep each layer's own keys and the model comes back unstacked
            (docs/llm.md "Layers compiled once").
        metrics: Names ("accuracy"), functions ``(output, target) -> values`` (one
            per sample, or a per-batch mean), torchmetrics ``Metric`` objects, or a
            dict naming them. Default "accuracy" when ``loss_fn`` is the default.
        accumulate_steps: Batches per optimizer step.
        max_grad_norm: Clip the gradient norm (after the all-reduce).
        schedule: The learning rate of every optimizer step: "one_cycle" (it also
            cycles momentum), ``OneCycle(pct_start=0.3, ...)`` for its settings (``max_lr``
            left out: the call's fills it), "linear" or "cosine" (Hugging Face's ``get_scheduler``
            shapes, decaying to 0; the cosine is timm's with ``warmup_prefix=True``),
            "constant", a function ``(step, total_steps) -> multiplier of max_lr``, or
            None: the lr is yours, set by your callbacks or a torch, Hugging Face or timm
            scheduler you step in one (docs/training.md). Except for one-cycle, momentum
            is left as the optimizer has it. With a schedule, a callback that changes
            the lr is reported once, naming it.
        warmup: For "linear", "cosine" and "constant": the steps rising from 0 to
            ``max_lr``, as a fraction of the run's optimizer steps (a float in [0, 1),
            rounded up) or a number of steps (an int), as in Hugging Face's
            ``TrainingArguments(warmup_steps=...)``.
        pct_start, div_factor, final_div_factor, base_momentum, max_momentum:
            Deprecated: write ``schedule=OneCycle(pct_start=0.3, ...)``, which says the same in
            one value. Given, they still shape the one-cycle schedule (as in
            ``torch.optim.lr_scheduler.OneCycleLR``), with a FutureWarning naming the
            ``OneCycle(...)`` to write instead (give one or the other).
        scale_lr_by_cores: Multiply ``max_lr`` by the number of cores.
        weight_decay: For the named optimizers (default: theirs).
        checkpoint_dir: Write ``last.pt`` and ``history.csv`` there after every
            epoch, and ``best.pt`` when the monitored figure improves. A local
            folder, or a URL (``gs://bucket/run``, ``s3://``, ``memory://``) written
            through fsspec (``pip install fsspec gcsfs``).
        resume: Continue from ``checkpoint_dir/last.pt`` if it exists (the same
            run only: a different one is refused, naming the differences).
        overwrite: Start afresh in a ``checkpoint_dir`` that holds another run's
            ``last.pt`` (its ``last.pt``, ``best.pt`` and ``history.csv`` are
            replaced). Without it or ``resume=True`` such a folder is refused.
        monitor: The figure that decides the best epoch: "valid_loss" (default
            with ``valid_data``, else "train_loss") or a metric's name.
        mode: "min", "max", or "auto" ("min" for a loss, else "max").
        early_stopping: Stop after this many epochs without improvement.
        restore_best: Load the best epoch's weights into the model at the end.
        time_limit: Seconds, or a string like "8h30m": do not start an epoch that
            would not finish in time (estimated from the epochs so far); the run
            can continue with ``resume=True``.
        train_step: ``(model, batch) -> loss`` replacing ``loss_fn(model(x), y)``.
        eval_step: ``(model, batch) -> (output, target)`` replacing ``(model(x), y)``.
        num_workers: DataLoader workers per process (default: the DataLoader's own,
            else what ``setup_tpu`` suggests for this host (0 where the model trains on
            the host CPU itself: workers would take cores from its compute threads),
            or 0 for a TensorDataset, whose samples are already in memory; the summary
            line says).
        seed: Seeds the random ops during training (dropout, augmentation) and the data order
            (epoch-wise); not the weights of a model built before the call.
        progress: A progress bar per epoch (a widget in notebooks, none in logs) and a line per epoch (master only).
        callbacks: Objects hooking into the loop's events (``events.py``): ``EMA``,
            ``CSVLogger``, ``TensorBoardLogger``, or your own ``Callback`` (a
            logger, a stop rule: ``loop.stop(reason)``). Their state is saved in
            ``last.pt``; a resume needs the same stateful callbacks.

    Returns:
        History: per-epoch records (losses, metrics, lr, seconds, samples/s,
        compile and host-sync counts), ``stop_reason``, ``best_epoch``, the
        per-step schedule, ``to_csv``/``to_pandas``/``plot``; ``history.model``
        is the trained model.

    Raises:
        ValueError, TypeError: a bad argument (the message names it and what is
            allowed), or a metric, the loss or ``eval_step`` that does not fit the
            first validation batch (checked before training).
        RuntimeError: ``cores="all"`` after the XLA runtime started without SPMD.
        FloatingPointError: the loss became NaN or inf (names the epoch and step;
            the last good checkpoint is kept).
        OSError: a checkpoint could not be written (``files.WriteError``: disk full;
            names the file, the free space and the size needed; the previous
            checkpoint is intact and the run continues with ``resume=True``).
        KeyboardInterrupt: re-raised with one line: the epoch ``last.pt`` holds
            and the call that continues.

    Example:
        >>> # was: a hand-written loop with torch.device("cuda"), OneCycleLR and opt.step()
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds,   # doctest: +SKIP
        ...                         epochs=5, max_lr=3e-3, cores="all", checkpoint_dir="ckpt",
        ...                         early_stopping=3, restore_best=True, time_limit="8h30m")
        >>> history.plot("history.png")                                     # doctest: +SKIP
        >>> # was: scaler = torch.cuda.amp.GradScaler() and, around the forward and the loss,
        >>> #      with torch.autocast("cuda", dtype=torch.float16): (a T4 GPU, which has no bf16)
        >>> history = one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3,  # doctest: +SKIP
        ...                         precision="fp16")
        >>> # was: get_scheduler("linear", opt, num_warmup_steps=0.1 * total, num_training_steps=total)
        >>> history = one_cycle_fit(model, train_ds, epochs=3, max_lr=5e-5,  # doctest: +SKIP
        ...                         schedule="linear", warmup=0.1)
        >>> # was: FSDP(model, auto_wrap_policy=...) around a CUDA loop: a model one chip cannot hold
        >>> history = one_cycle_fit(model, train_ds, epochs=1, max_lr=2e-5,  # doctest: +SKIP
        ...                         cores="all", strategy=FSDP(checkpoint=True))
    """
    built, factory = _check_model(model)
    check_loss_fn(loss_fn)
    _check_reduced(loss_fn)
    metric_table = resolve_metrics(metrics, loss_fn is None)
    _check_resume(checkpoint_dir, resume, overwrite)
    cycle = OneCycle(max_lr=max_lr, pct_start=pct_start, div_factor=div_factor, final_div_factor=final_div_factor,
                     base_momentum=base_momentum, max_momentum=max_momentum, scale_lr_by_cores=scale_lr_by_cores)  # fmt: skip
    checked = FitArguments(  # every argument checked once, here, before any launch, compile or epoch
        model=built, factory=factory, epochs=_positive("epochs", epochs, int),
        precision=Precision.of(precision),  # fp16 where the device has no float16 path: refused before any launch
        compile=_with_scan(Compile.of(compile), scan),
        steps=Steps(CrossEntropy() if loss_fn is None else loss_fn, train_step=train_step, eval_step=eval_step,
                    accumulate_steps=_positive("accumulate_steps", accumulate_steps, int), default_loss=loss_fn is None,
                    max_grad_norm=None if max_grad_norm is None else _positive("max_grad_norm", max_grad_norm)),
        schedule=resolve_schedule(schedule, warmup, cycle), optimizer=_check_optimizer(optimizer, weight_decay),
        metrics=metric_table, callbacks=check_callbacks(callbacks),
        stop=_stop_rule(monitor=monitor, mode=mode, patience=early_stopping, restore_best=restore_best,
                        time_limit=time_limit, figures=(valid_data is not None, metric_table)),
        cores=cores, strategy=strategy, data=_loader_specs(train_data, valid_data, batch_size),
        num_workers=_check_workers(num_workers), checkpoint_dir=checkpoint_dir, resume=resume, overwrite=overwrite,
        seed=check_seed(seed), progress=progress,
    )  # fmt: skip
    factory, plan = plan_fit(checked)
    return plan.strategy.run(_train, (model, plan), what="training", pack=_packed,
                             unpack=lambda state: _unpacked(state, model if factory is None else factory()))  # fmt: skip


@dataclass(frozen=True)
class ChosenOptimizer:
    """``optimizer=`` and ``weight_decay=`` checked: the value given (a name or a factory), the factory and name it
    resolves to, and the keyword arguments the factory is called with."""

    given: str | Callable[..., torch.optim.Optimizer]
    factory: Callable[..., torch.optim.Optimizer]
    name: str
    weight_decay: float | int | None
    args: dict[str, float]


@dataclass(frozen=True)
class FitArguments:
    """``one_cycle_fit``'s arguments, each checked once where its signature reads them, typed as checked: the values
    ``plan_fit`` makes the run from (the one-cycle arguments in ``schedule``, the loss and steps in ``steps``, the
    monitored figure, patience and time limit in ``stop``)."""

    model: nn.Module | None  # None: ``factory`` builds it, in each process
    factory: Callable[[], nn.Module] | None
    epochs: int
    precision: Precision
    compile: Compile
    steps: Steps
    schedule: OneCycle | LrSchedule
    optimizer: ChosenOptimizer
    metrics: dict[str, Callable[..., torch.Tensor]]
    callbacks: list[object]
    stop: StopRule
    cores: int | str  # checked with strategy= by the strategies' choose, in plan_fit
    strategy: StrategyName | FSDP
    data: tuple[LoaderSpec, LoaderSpec | None]  # train_data, valid_data
    num_workers: int | None
    checkpoint_dir: str | os.PathLike[str] | None
    resume: bool
    overwrite: bool
    seed: int
    progress: bool


@dataclass(frozen=True)
class CheckpointSettings:
    """Where and how a run keeps its checkpoints, and what makes a later call the same run (``identity``:
    the fingerprint a resume must match, and the config)."""

    folder: str
    resume: bool
    identity: dict[str, Any]


def plan_fit(a: FitArguments) -> tuple[Callable[[], nn.Module] | None, FitPlan]:
    """``one_cycle_fit``'s checked arguments made into the run's ``FitPlan`` (and the model factory, when a factory
    was given): the loaders' workers, the memory plan the model is checked against, the checkpoint folder, and what
    a resume and every replica must agree on; a model that cannot fit is named before any launch, compile or epoch."""
    model, factory, precision, callbacks = a.model, a.factory, a.precision, a.callbacks
    chosen = choose(a.cores, a.strategy)
    n_cores, processes = chosen.cores, chosen.processes()
    train_spec, valid_spec = _with_workers(a.data, a.num_workers, processes)
    memory = None
    if factory is None:  # a model that cannot fit: said now, not after minutes of compiling
        memory = _memory_plan(model, a, chosen, precision, train_spec, callbacks)
        chosen = chosen.settled(memory)  # strategy="auto" over a mesh: sharded where one replica cannot fit
        refuse_replicating(model, memory, batch_size=train_spec.batch_size, column=chosen.column())
        if chosen.column() == "sharded":  # the host holds it whole before it is sharded, and each save
            refuse_host_shortage(model, a.optimizer.given, processes=processes, checkpoints=a.checkpoint_dir is not None)
    if valid_spec is not None:
        per_sample_loss(a.steps.loss_fn)  # fail now, not after the first epoch
        _check_buckets(valid_spec, "valid_data")  # a long sequence would fail only after an epoch of training
    _check_checkpoint_dir(a.checkpoint_dir)
    if a.checkpoint_dir is not None and not (a.resume or a.overwrite):
        _refuse_another_run(str(a.checkpoint_dir))
    fingerprint = {
        "schedule": repr(a.schedule), "optimizer": a.optimizer.name, "weight_decay": a.optimizer.weight_decay,
        "seed": a.seed, "train samples": len(train_spec), "batch_size": train_spec.batch_size,
        "cores": n_cores, "accumulate_steps": a.steps.accumulate_steps,
    }  # fmt: skip
    if train_spec.batch_sampler is not None:
        fingerprint["batch_sampler"] = train_spec.batch_sampler.fingerprint()
    if Events(callbacks).keys():  # a resume restores their state: the same ones, or a clear refusal
        fingerprint["callbacks"] = Events(callbacks).keys()
    config = {"epochs": a.epochs, "max_lr": a.schedule.max_lr, "batch_size": train_spec.batch_size, "cores": n_cores}
    checkpoints = None if a.checkpoint_dir is None else CheckpointSettings(
        str(a.checkpoint_dir), a.resume, {"fingerprint": fingerprint, "config": config})  # fmt: skip
    # what every replica must be given alike (ReplicaAgreement adds the data, the model and the resume point)
    run_shape = {**config, **{k: v for k, v in fingerprint.items() if k != "train samples"},
                 "precision": precision.name, "max_grad_norm": a.steps.max_grad_norm, "stop": repr(a.stop)}  # fmt: skip
    plan = FitPlan(
        epochs=a.epochs, train=train_spec, valid=valid_spec, steps=a.steps,
        optimizer=a.optimizer.factory, optimizer_name=a.optimizer.name, optimizer_args=a.optimizer.args,
        metrics=a.metrics, checkpoint_dir=a.checkpoint_dir, overwrite=a.overwrite, precision=precision,
        seed=a.seed, progress=a.progress, cores=n_cores, strategy=chosen, compile=a.compile, callbacks=callbacks,
        builtins=builtin_callbacks(a.schedule, a.stop, checkpoints=checkpoints, progress=a.progress, run_shape=run_shape),
        memory=memory.summary() if memory is not None and memory.usable is not None else "",
    )  # fmt: skip
    return factory, plan


def _memory_plan(model: nn.Module, a: FitArguments, chosen: Any, precision: Precision, train: LoaderSpec,
                 callbacks: list[Any]) -> MemoryPlan:  # fmt: skip
    """The plan the run is checked against, as the run will be: its cores, batch per core, precision, optimizer
    and fsdp options (their checkpointing), and its activations where the chip's memory is known and the data are
    tokens (their first row's length; traced where it can be: ``memory_plan``)."""
    run = dict(cores=chosen.cores, batch_size=train.batch_size, optimizer=a.optimizer.given, precision=precision,
               fsdp=chosen.sharding())  # fmt: skip
    plan = memory_plan(model, **run, method="estimate")
    if plan.usable is None:  # nothing to check it against: no sample is read
        return plan
    seq_len = first_length(train.dataset)
    if seq_len is None:  # no length to plan activations for
        return plan
    ckpt = True if any(isinstance(c, GradientCheckpointing) for c in callbacks) else None
    chunked = next((c for c in callbacks if isinstance(c, ChunkedLoss)), None)
    return memory_plan(model, **run, seq_len=seq_len, checkpointing=ckpt, chunked_loss=chunked)


def _with_scan(compile: Compile, scan: Any) -> Compile:
    """``scan=`` folded into the ``Compile`` setting (whose ``scan`` field carries it to each process's Runner)."""
    if scan == "auto" and isinstance(scan, str):
        return compile
    if not isinstance(scan, bool):
        raise ValueError(f"scan must be True, False or 'auto', but given {scan!r}")
    if compile.scan != "auto" and compile.scan != scan:
        raise ValueError(f"scan={scan} and compile=Compile(scan={compile.scan}) disagree; give one of them")
    return dataclasses.replace(compile, scan=scan)


def _check_resume(checkpoint_dir: Any, resume: Any, overwrite: Any) -> None:
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir, the folder holding last.pt")
    for name, flag in (("resume", resume), ("overwrite", overwrite)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, but given {flag!r}")
    if resume and overwrite:
        raise ValueError("resume=True continues the run in checkpoint_dir and overwrite=True replaces it; give one")


def resolve_schedule(schedule: Any, warmup: Any, cycle: OneCycle) -> OneCycle | LrSchedule:
    """``schedule=`` and ``warmup=`` checked against each other and the one-cycle arguments, as a value object.

    ``cycle`` is made from ``max_lr`` and the separate one-cycle arguments (deprecated, kept for calls written
    before ``schedule=OneCycle(...)``: given, they still shape the schedule, with a FutureWarning naming the
    ``OneCycle(...)`` that says the same). A one-cycle argument changed from its default while another schedule, or
    a ``OneCycle`` of its own, is given would be ignored, so it is an error naming it (as is ``warmup`` with
    one-cycle).
    """
    check_warmup(warmup)
    allowed = (f"one of {get_args(ScheduleName)}, OneCycle(...), a function (step, total_steps) -> multiplier of "
               f"max_lr, or None")  # fmt: skip
    changed = _changed_cycle_settings(cycle)
    if isinstance(schedule, OneCycle) or (isinstance(schedule, str) and schedule == "one_cycle"):
        if warmup:  # 0 and 0.0: the default
            pct_start = schedule.pct_start if isinstance(schedule, OneCycle) else cycle.pct_start
            raise ValueError(f"warmup={warmup!r} shapes schedule='linear', 'cosine' or 'constant'; "
                             f"schedule='one_cycle' warms up over pct_start of the steps (now {pct_start!r})")  # fmt: skip
        if isinstance(schedule, OneCycle):
            return _given_cycle(schedule, cycle, changed)
        if changed:  # one_cycle_fit -> here: the warning names the user's call
            settings = ", ".join(changed)
            warnings.warn(f"{settings} {'is' if len(changed) == 1 else 'are'} deprecated: write "
                          f"schedule=OneCycle({settings})", FutureWarning, stacklevel=3)  # fmt: skip
        return cycle
    if isinstance(schedule, str) and schedule not in get_args(ScheduleName):
        raise ValueError(f"schedule must be {allowed}, but given {schedule!r}")
    if isinstance(schedule, type):  # callable, but calling it builds an object, not a multiplier
        name = schedule.__qualname__
        way = (f"an instance, schedule={name}() or {name}(pct_start=0.3)" if issubclass(schedule, OneCycle) else
               "schedule=None and step your own scheduler in a callback (docs/training.md)")  # fmt: skip
        raise TypeError(f"schedule={name} is the class {name}, not a schedule: give {way}; schedule must be {allowed}")
    if not (schedule is None or isinstance(schedule, str) or callable(schedule)):
        raise TypeError(f"schedule must be {allowed}, but given {schedule!r} of type {type(schedule).__name__}")
    chosen = LrSchedule(schedule, cycle.max_lr, warmup, cycle.scale_lr_by_cores)
    if changed:
        given = chosen.name if callable(schedule) else repr(schedule)
        one = len(changed) == 1
        raise ValueError(f"{', '.join(changed)} shape{'s' if one else ''} schedule='one_cycle' only, but this call "
                         f"gives schedule={given}; leave {'it' if one else 'them'} out (a warm-up is warmup=)")  # fmt: skip
    chosen.check()
    return chosen


def _changed_cycle_settings(cycle: OneCycle) -> list[str]:
    """The one-cycle arguments a call gave (its default's value written out counts: it is given), as ``name=value``."""
    shaping = [f.name for f in dataclasses.fields(OneCycle) if f.name not in ("max_lr", "scale_lr_by_cores")]
    return [f"{n}={getattr(cycle, n)!r}" for n in shaping if not is_default(getattr(cycle, n))]


def _given_cycle(given: OneCycle, cycle: OneCycle, changed: list[str]) -> OneCycle:
    """``schedule=OneCycle(...)`` with the call's ``max_lr`` (and ``scale_lr_by_cores``) filled in."""
    if changed:
        raise ValueError(f"{', '.join(changed)} and schedule={given!r} both shape the one-cycle schedule; give "
                         f"the settings in OneCycle(...) alone")  # fmt: skip
    if given.max_lr is not None and given.max_lr != cycle.max_lr:
        raise ValueError(f"schedule=OneCycle(max_lr={given.max_lr!r}) and max_lr={cycle.max_lr!r} disagree; leave "
                         f"max_lr out of OneCycle(...) (one_cycle_fit's max_lr fills it)")  # fmt: skip
    return dataclasses.replace(given, max_lr=cycle.max_lr,
                               scale_lr_by_cores=given.scale_lr_by_cores or cycle.scale_lr_by_cores)  # fmt: skip


def builtin_callbacks(schedule: OneCycle | LrSchedule, stop: StopRule, checkpoints: CheckpointSettings | None,
                      progress: bool, run_shape: dict[str, Any]) -> list[Any]:  # fmt: skip
    """The callbacks that do what one_cycle_fit's arguments ask (``builtins.py``), from the checked values;
    ``run_shape``: the arguments every replica must be given alike (``agreement.ReplicaAgreement``)."""
    best = BestEpoch(stop)
    if isinstance(schedule, OneCycle):
        lrs = OneCycleSchedule(schedule)
    else:
        lrs = OwnLearningRates(schedule) if schedule.shape is None else MultiplierSchedule(schedule)
    chosen = [lrs, StopOnNaN(), best, ReplicaAgreement(run_shape), RecompileNotice()]
    if checkpoints is not None:
        chosen.append(Checkpoints(checkpoints.folder, best, checkpoints.resume, checkpoints.identity))
    if stop.time_limit is not None:
        chosen.append(TimeLimit(stop.time_limit))
    if progress:
        chosen.append(ProgressLine(best))
    if stop.restore_best:
        chosen.append(RestoreBest(best, checkpoints.folder if checkpoints is not None else None))
    return chosen


def _stop_rule(monitor: str | None, mode: str, patience: int | None, restore_best: bool, time_limit: Any,
               figures: tuple[bool, dict[str, Any]]) -> StopRule:  # fmt: skip
    has_valid, metric_table = figures
    watched = monitor if monitor is not None else ("valid_loss" if has_valid else "train_loss")
    if not isinstance(watched, str):
        raise TypeError(f"monitor must be a figure's name ('valid_loss', 'train_loss' or a metric's), but given {monitor!r}")
    names = ["train_loss"] + (["valid_loss", *metric_table] if has_valid else [])
    if watched not in names:  # before the mode is guessed from the name: say what is missing
        hint = " (metrics are computed on valid_data, and none was given)" if watched in metric_table else ""
        raise ValueError(f"monitor={watched!r} is not a figure of this run; it has {names}{hint}")
    if not isinstance(restore_best, bool):
        raise TypeError(f"restore_best must be True or False, but given {restore_best!r}")
    if patience is not None:
        _positive("early_stopping", patience, int)
    higher_is_better = getattr(metric_table.get(watched), "higher_is_better", None)  # a torchmetrics Metric knows
    mode = resolve_mode(watched, mode, higher_is_better)
    return StopRule(watched, mode, patience, parse_duration(time_limit), restore_best)


def _check_buckets(spec: LoaderSpec, what: str) -> None:
    """Every sequence fits the largest bucket of a BucketCollate (one read of each sample, on the host)."""
    from ..data.buckets import BucketCollate

    if isinstance(spec.collate_fn, BucketCollate):
        lengths = spec.batch_sampler.lengths if spec.batch_sampler is not None else None
        spec.collate_fn.check_fits(spec.dataset, what, lengths, None if spec.sampler is None else list(spec.sampler))


def _loader_specs(train_data: Any, valid_data: Any, batch_size: int | None) -> tuple[LoaderSpec, LoaderSpec | None]:
    """``train_data`` and ``valid_data`` (a Dataset or a DataLoader) as what they ask for, batched by ``batch_size``."""
    train_spec = unpack_loader(train_data, batch_size, "train_data")
    valid_spec = None
    if valid_data is not None:
        # a DataLoader keeps its own batch size; a Dataset is batched like the training data
        own_size = None if isinstance(valid_data, DataLoader) else train_spec.batch_size
        valid_spec = unpack_loader(valid_data, own_size, "valid_data")
    return train_spec, valid_spec


def _check_workers(num_workers: Any) -> int | None:
    if num_workers is not None and (isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0):
        raise ValueError(f"num_workers must be an int >= 0, but given {num_workers!r}")
    return num_workers


def _with_workers(specs: tuple[LoaderSpec, LoaderSpec | None], num_workers: int | None,
                  processes: int) -> tuple[LoaderSpec, LoaderSpec | None]:  # fmt: skip
    """The loaders with their DataLoader workers: ``num_workers`` when given, else the DataLoader's own, else (a
    Dataset) what setup_tpu suggests for this host and ``processes``, none for tensors in memory."""
    train_spec, valid_spec = specs
    workers = num_workers if num_workers is not None else train_spec.num_workers
    if workers is None:
        from ..environment import default_num_workers

        in_memory = isinstance(train_spec.dataset, TensorDataset)
        workers = 0 if in_memory else default_num_workers(processes)
    for spec in (train_spec, valid_spec):
        if spec is not None and (num_workers is not None or spec.num_workers is None):
            spec.num_workers = workers
    return train_spec, valid_spec


def _train(strategy: Strategy, model: Any, plan: FitPlan) -> History:
    """One process's run under ``strategy`` (this process's, or, launched, its replica's): ``model`` or a factory."""
    trained, history = train(model if isinstance(model, nn.Module) else model(), dataclasses.replace(plan, strategy=strategy))
    history.model = trained
    return history


def _packed(history: History) -> dict[str, Any]:
    """A launched run's answer as the master sends it back: tensors and plain values."""
    return {"model": to_cpu(history.model.state_dict()), "history": history.to_dicts(), "summary": history.summary,
            "stop_reason": history.stop_reason, "best_epoch": history.best_epoch or 0,
            "schedule": [history.step_lrs, history.step_momenta, history.steps_per_epoch],
            "momentum_name": history.momentum_name}  # fmt: skip


def _unpacked(state: dict[str, Any], target: nn.Module) -> History:
    """The master's answer as this process's ``History``, its weights loaded into ``target``."""
    target.load_state_dict(state["model"])
    history = History.from_dicts(state["history"])
    history.summary, history.model, history.stop_reason = state["summary"], target, state["stop_reason"]
    history.best_epoch = state["best_epoch"] or None
    history.step_lrs, history.step_momenta, history.steps_per_epoch = state["schedule"]
    history.momentum_name = state["momentum_name"]
    return history
