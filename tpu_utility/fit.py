"""one_cycle_fit(): train on one core or all cores with the one-cycle policy.

What it does for you, and how:

* **Fixed shapes, no recompiles.** The short last training batch is dropped;
  validation batches are padded to full size and carry a mask.
* **No per-step host syncs.** Losses and metrics are summed on the device and
  read once per epoch, in one transfer; the progress bar counts batches only.
* **A schedule that knows what each core iterates.** The one-cycle length is
  per-core batches x epochs / accumulate_steps (``schedule.one_cycle``).
* **All cores** by SPMD (one process, the batch sharded over a device mesh) or
  by ``torch_xla.launch`` (one process per chip; fork in notebooks).
* **Exact metrics:** every validation sample counts once on any core count.
* **Checkpoints** of CPU tensors, written atomically by the master, resumable.
"""

from __future__ import annotations

import copy
import inspect
import math
import os
import random
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Literal, Sequence, get_args

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils import _pytree as pytree

from . import xla
from .checkpoint import CHECKPOINT_NAME, load_checkpoint, save_atomic, to_cpu
from .data import eval_loader, train_loader, unpack_loader
from .device import get_device, move_model
from .history import EpochRecord, History
from .optim import step_optimizer
from .schedule import one_cycle_curve

Strategy = Literal["auto", "spmd", "multiprocess"]
Precision = Literal["fp32", "bf16"]
Batch = Any
TrainStep = Callable[[nn.Module, Batch], torch.Tensor]
EvalStep = Callable[[nn.Module, Batch], "tuple[torch.Tensor, torch.Tensor]"]
Metric = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "adam": torch.optim.Adam,
    "sgd": partial(torch.optim.SGD, lr=0.1, momentum=0.9),
}


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample correctness of the arg-max class (1.0 or 0.0)."""
    return (output.argmax(dim=-1) == target).float()


METRICS: dict[str, Metric] = {"accuracy": accuracy}

_NO_BAD_STEP = float(2**24)  # "no non-finite loss yet"; exact in float32


# ----------------------------------------------------------- pure choices
def resolve_cores(cores: int | str, available: int) -> int:
    """The number of cores to train on: 1 or all of them (TPUs run 1 or all)."""
    if cores == "all":
        return available
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise TypeError(f"cores must be 1, 'all' or an int, but given {cores!r}")
    if cores != 1 and cores != available:
        raise ValueError(f"cores must be 1 or {available} (all cores here), or 'all', but given {cores}")
    return cores


def choose_strategy(strategy: str, cores: int, in_launch: bool) -> str:
    """"single", "spmd", "multiprocess" (we launch) or "replica" (already launched)."""
    if strategy not in get_args(Strategy):
        raise ValueError(f"strategy must be one of {get_args(Strategy)}, but given {strategy!r}")
    if in_launch:
        return "replica"
    if strategy == "multiprocess":
        return "multiprocess"
    if cores == 1 and strategy == "auto":
        return "single"
    return "spmd"


def choose_start_method(interactive: bool) -> str:
    """fork in a notebook (spawn cannot find functions defined there), spawn otherwise."""
    return "fork" if interactive else "spawn"


def is_interactive() -> bool:
    main = sys.modules.get("__main__")
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(main, "__file__")


def available_cores() -> int:
    """XLA devices this job could use, counted without starting the runtime."""
    if not xla.xla_requested():
        return 1
    if xla.pjrt_device() == "TPU" or (xla.pjrt_device() is None and xla.detect_tpu().chips):
        return xla.detect_tpu().devices
    return int(os.environ.get(f"{xla.pjrt_device()}_NUM_DEVICES", "1"))


# ------------------------------------------------------------ the options
@dataclass
class FitConfig:
    """Everything a training process needs; picklable for a spawned launch."""

    epochs: int
    max_lr: float
    batch_size: int
    collate_fn: Callable | None
    valid_batch_size: int
    valid_collate_fn: Callable | None
    loss_fn: Callable
    optimizer: Callable[..., torch.optim.Optimizer]
    optimizer_name: str
    precision: str
    metrics: dict[str, Metric]
    accumulate_steps: int
    max_grad_norm: float | None
    pct_start: float
    div_factor: float
    final_div_factor: float
    base_momentum: float
    max_momentum: float
    scale_lr_by_cores: bool
    checkpoint_dir: str | None
    resume: bool
    train_step: TrainStep | None
    eval_step: EvalStep | None
    num_workers: int
    seed: int
    progress: bool
    cores: int
    mode: str


def resolve_optimizer(optimizer: Any) -> tuple[Callable[..., torch.optim.Optimizer], str]:
    """An optimizer name or ``params -> Optimizer`` callable as (factory, name)."""
    if isinstance(optimizer, str):
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)} or a callable, but given {optimizer!r}")
        return OPTIMIZERS[optimizer], optimizer
    if callable(optimizer):
        return optimizer, getattr(optimizer, "__name__", type(optimizer).__name__)
    raise TypeError(f"optimizer must be a name or a callable params -> Optimizer, but given {optimizer!r}")


def _metric_table(metrics: Any, loss_fn_given: bool) -> dict[str, Metric]:
    if metrics is None:
        metrics = [] if loss_fn_given else ["accuracy"]
    if isinstance(metrics, str) or callable(metrics):
        metrics = [metrics]
    table: dict[str, Metric] = {}
    for m in metrics:
        if isinstance(m, str):
            if m not in METRICS:
                raise ValueError(f"metric {m!r} is unknown; allowed names: {sorted(METRICS)}, or functions")
            table[m] = METRICS[m]
        elif callable(m):
            table[getattr(m, "__name__", f"metric{len(table)}")] = m
        else:
            raise TypeError(f"metrics must be names or functions, but given {m!r}")
    return table


def _per_sample_loss(loss_fn: Callable) -> Callable:
    """The same loss with reduction='none', so padded samples can be masked out."""
    if hasattr(loss_fn, "reduction"):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        return unreduced
    try:
        accepts = "reduction" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        raise TypeError(
            f"loss_fn {loss_fn!r} has no 'reduction' argument, so validation cannot leave padded "
            f"samples out. Give a torch loss (nn.CrossEntropyLoss(), F.cross_entropy, ...) or an "
            f"eval_step that returns (output, target) for a loss that accepts reduction='none'."
        )
    return partial(loss_fn, reduction="none")


def _positive(name: str, value: Any, kind: type = float) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float) if kind is float else int) and value > 0
    if not ok or (kind is float and not math.isfinite(value)):
        what = "a positive number" if kind is float else "a positive int"
        raise ValueError(f"{name} must be {what}, but given {value!r}")


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
    strategy: Strategy = "auto",
    precision: Precision = "fp32",
    metrics: str | Metric | Sequence[str | Metric] | None = None,
    accumulate_steps: int = 1,
    max_grad_norm: float | None = None,
    pct_start: float = 0.25,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
    scale_lr_by_cores: bool = False,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    train_step: TrainStep | None = None,
    eval_step: EvalStep | None = None,
    num_workers: int | None = None,
    seed: int = 0,
    progress: bool = True,
) -> History:
    """Trains ``model`` with the one-cycle policy on one core or all cores.

    Args:
        model: An ``nn.Module`` (trained in place), or a zero-argument factory
            (which ``strategy="multiprocess"`` with spawn needs).
        train_data: A map-style Dataset or a DataLoader yielding ``(inputs, targets)``
            (or anything ``train_step`` understands).
        epochs: Passes over the training data.
        max_lr: Peak learning rate (``OneCycleLR``'s name).
        valid_data: Dataset or DataLoader evaluated after every epoch.
        loss_fn: Default ``nn.CrossEntropyLoss()``. Reduced in fp32.
        optimizer: "adamw", "adam", "sgd", or ``params -> Optimizer``.
        batch_size: Per-core batch size (default 64, or the DataLoader's own).
        cores: 1, "all", or the number of all cores.
        strategy: "auto" (SPMD for several cores), "spmd" or "multiprocess".
        precision: "fp32" or "bf16" (autocast on TPU, casting on XLA:CPU).
        metrics: Names ("accuracy") or functions ``(output, target) -> per-sample
            values``. Default "accuracy" when ``loss_fn`` is the default.
        accumulate_steps: Batches per optimizer step.
        max_grad_norm: Clip the gradient norm (after the all-reduce).
        pct_start, div_factor, final_div_factor, base_momentum, max_momentum:
            The schedule, as in ``torch.optim.lr_scheduler.OneCycleLR``.
        scale_lr_by_cores: Multiply ``max_lr`` by the number of cores.
        checkpoint_dir: Write ``last.pt`` there after every epoch.
        resume: Continue from ``checkpoint_dir/last.pt`` if it exists.
        train_step: ``(model, batch) -> loss`` replacing ``loss_fn(model(x), y)``.
        eval_step: ``(model, batch) -> (output, target)`` replacing ``(model(x), y)``.
        num_workers: DataLoader workers per process (default: the DataLoader's, else 0).
        seed: Seeds the model's random ops and the data order (epoch-wise).
        progress: A tqdm bar per epoch and a line per epoch (master only).

    Returns:
        History: per-epoch records (losses, metrics, lr, seconds, samples/s,
        compile and host-sync counts) with ``.plot()``; ``history.model`` is the
        trained model.

    Raises:
        ValueError, TypeError: a bad argument (the message names it and what is allowed).
        FloatingPointError: the loss became NaN or inf (names the epoch and step;
            the last good checkpoint is kept).

    Example:
        >>> # was: a hand-written loop with torch.device("cuda"), OneCycleLR and opt.step()
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds,   # doctest: +SKIP
        ...                         epochs=5, max_lr=3e-3, cores="all")
        >>> history.plot("history.png")                                     # doctest: +SKIP
    """
    factory = None
    if not isinstance(model, nn.Module):
        if not callable(model):
            raise TypeError(f"model must be an nn.Module or a zero-argument factory, but given {model!r}")
        factory = model
    _positive("epochs", epochs, int)
    _positive("max_lr", max_lr)
    _positive("accumulate_steps", accumulate_steps, int)
    if precision not in get_args(Precision):
        raise ValueError(f"precision must be one of {get_args(Precision)}, but given {precision!r}")
    if max_grad_norm is not None:
        _positive("max_grad_norm", max_grad_norm)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs checkpoint_dir, the folder holding last.pt")
    opt_factory, opt_name = resolve_optimizer(optimizer)
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"loss_fn must be callable, but given {loss_fn!r}")

    train_ds, bs, collate, loader_workers = unpack_loader(train_data, batch_size, "train_data")
    valid_ds = valid_bs = valid_collate = None
    if valid_data is not None:
        # a DataLoader keeps its own batch size; a Dataset is batched like the training data
        own_size = None if isinstance(valid_data, DataLoader) else bs
        valid_ds, valid_bs, valid_collate, _ = unpack_loader(valid_data, own_size, "valid_data")
    workers = num_workers if num_workers is not None else (loader_workers or 0)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, but given {workers!r}")

    n_cores = resolve_cores(cores, available_cores())
    mode = choose_strategy(strategy, n_cores, xla.in_launched_process() and xla.world_size() > 1)
    if mode in ("spmd", "multiprocess") and not xla.xla_requested():
        raise ValueError(
            f"strategy={strategy!r} with cores={cores!r} needs XLA devices (a TPU, or PJRT_DEVICE set); "
            f"none here, so use cores=1"
        )
    loss = loss_fn if loss_fn is not None else nn.CrossEntropyLoss()
    metric_table = _metric_table(metrics, loss_fn is not None)
    if valid_ds is not None:
        _per_sample_loss(loss)  # fail now, not after the first epoch
    cfg = FitConfig(
        epochs=epochs, max_lr=float(max_lr), batch_size=bs, collate_fn=collate,
        valid_batch_size=valid_bs or bs, valid_collate_fn=valid_collate, loss_fn=loss,
        optimizer=opt_factory, optimizer_name=opt_name, precision=precision, metrics=metric_table,
        accumulate_steps=accumulate_steps, max_grad_norm=max_grad_norm, pct_start=pct_start,
        div_factor=div_factor, final_div_factor=final_div_factor, base_momentum=base_momentum,
        max_momentum=max_momentum, scale_lr_by_cores=scale_lr_by_cores, checkpoint_dir=checkpoint_dir,
        resume=resume, train_step=train_step, eval_step=eval_step, num_workers=workers, seed=seed,
        progress=progress, cores=n_cores, mode=mode,
    )  # fmt: skip

    if mode != "multiprocess":
        trained, history = _fit_in_process(model if factory is None else factory(), train_ds, valid_ds, cfg)
        history.model = trained
        return history
    return _fit_multiprocess(model, factory, train_ds, valid_ds, cfg)


def _fit_multiprocess(model: Any, factory: Any, train_ds: Any, valid_ds: Any, cfg: FitConfig) -> History:
    """Launches one process per chip; the master sends back weights and history."""
    with tempfile.TemporaryDirectory(prefix="tpu_utility_") as tmp:
        result = os.path.join(tmp, "result.pt")
        start = choose_start_method(is_interactive())
        xla.launch(_mp_worker, args=(model, train_ds, valid_ds, cfg, result), start_method=start)
        if not os.path.exists(result):
            raise RuntimeError("the launched training processes ended without a result; see their output above")
        state = torch.load(result, map_location="cpu", weights_only=True)
    target = model if factory is None else factory()
    target.load_state_dict(state["model"])
    history = History.from_dicts(state["history"])
    history.summary, history.model = state["summary"], target
    return history


def _mp_worker(index: int, model: Any, train_ds: Any, valid_ds: Any, cfg: FitConfig, result: str) -> None:
    from .environment import setup_tpu

    setup_tpu(verbose=False)  # this process's own compile-cache folder
    trained, history = _fit_in_process(model if isinstance(model, nn.Module) else model(), train_ds, valid_ds, cfg)
    if xla.is_master():
        save_atomic(
            {"model": to_cpu(trained.state_dict()), "history": history.to_dicts(), "summary": history.summary},
            result,
        )
    xla.rendezvous("tpu_utility.fit.done")


# --------------------------------------------------- inside one process
def _move_batch(batch: Batch, device: torch.device) -> Batch:
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


def _cast_floats(batch: Batch, dtype: torch.dtype) -> Batch:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
    )


def _split_xy(batch: Batch, what: str) -> tuple[Any, Any]:
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise TypeError(
            f"the default {what} expects batches of (inputs, targets), but a batch is "
            f"{type(batch).__name__}{f' of length {len(batch)}' if hasattr(batch, '__len__') else ''}; "
            f"pass {what}=... to handle this batch structure"
        )
    return batch[0], batch[1]


@dataclass
class _Precision:
    """How bf16 is applied on this device: autocast, or casting model and inputs."""

    mode: str  # "fp32", "autocast" or "cast"
    device: torch.device

    @classmethod
    def choose(cls, precision: str, device: torch.device) -> _Precision:
        if precision == "fp32":
            return cls("fp32", device)
        if device.type == "xla":
            return cls("autocast" if xla.bf16_autocast_available() else "cast", device)
        return cls("autocast", device)

    def context(self) -> Any:
        if self.mode != "autocast":
            return nullcontext()
        if self.device.type == "xla":
            return xla.autocast(self.device, torch.bfloat16)
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def inputs(self, batch: Batch) -> Batch:
        return _cast_floats(batch, torch.bfloat16) if self.mode == "cast" else batch


def _device_batches(loader: Any, device: torch.device, spmd_devices: int | None) -> Any:
    if device.type == "xla":
        return xla.device_loader(loader, device, spmd_devices)
    return (_move_batch(b, device) for b in loader)


class _OneCycleDriver:
    """Feeds the one-cycle schedule to the optimizer before every step.

    The named optimizers "adam" and "adamw" are torch_xla's fused sync-free ones
    on XLA and take Python floats. A user's own torch Adam-family optimizer gets ``lr`` and ``betas`` as device tensors
    (``capturable=True``) copied from a table of the whole schedule, uploaded
    once. Python-float hyperparameters would change the graph whenever a value
    happens to round to a special constant (``1 - lr * wd == 1.0`` in float32 late
    in the schedule), because torch_xla uploads scalars by value: recompiles.
    Other optimizers (SGD) take Python floats, the only form their step accepts
    without a host sync.
    """

    def __init__(self, opt: torch.optim.Optimizer, cfg: FitConfig, total: int, max_lr: float,
                 device: torch.device, start_step: int) -> None:  # fmt: skip
        self.lrs, self.moms = one_cycle_curve(
            total, max_lr, pct_start=cfg.pct_start, div_factor=cfg.div_factor,
            final_div_factor=cfg.final_div_factor, base_momentum=cfg.base_momentum, max_momentum=cfg.max_momentum,
        )  # fmt: skip
        self.total, self.step_index = total, start_step
        self.on_device = (
            device.type == "xla"
            and not xla.is_fused_optimizer(opt)  # they take Python floats without syncing or recompiling
            and all("betas" in g and "capturable" in g for g in opt.param_groups)
        )
        if self.on_device:
            self.table = torch.tensor([self.lrs, self.moms], dtype=torch.float32).T.contiguous().to(device)
            self.device_index = torch.tensor([min(start_step, total - 1)], device=device)
            self.lr = torch.tensor(self.lrs[0], device=device)
            self.beta1 = torch.tensor(self.moms[0], device=device)
            for group in opt.param_groups:
                group["capturable"] = True
                group["lr"] = self.lr
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
            self.device_index.add_(1).clamp_(max=self.total - 1)
            return self.lrs[i]
        for group in opt.param_groups:
            group["lr"] = self.lrs[i]
            if "betas" in group:
                group["betas"] = (self.moms[i], group["betas"][1])
            elif group.get("momentum", 0) > 0:
                group["momentum"] = self.moms[i]
        return self.lrs[i]


def _fit_in_process(model: nn.Module, train_ds: Any, valid_ds: Any, cfg: FitConfig) -> tuple[nn.Module, History]:
    spmd_devices = None
    if cfg.mode == "spmd":
        xla.use_spmd()
        spmd_devices = xla.global_device_count()
    device = get_device()
    on_xla = device.type == "xla"
    replicas, rank = xla.world_size(), xla.ordinal()
    master = rank == 0
    cores = spmd_devices or replicas

    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    if on_xla:
        xla.set_rng_seed(cfg.seed)
    move_model(model, device)
    precision = _Precision.choose(cfg.precision, device)
    if precision.mode == "cast":
        model.to(torch.bfloat16)
    # torch_xla's fused Adam fails to compile for bf16 parameters: cast mode keeps torch's.
    use_fused = on_xla and cfg.optimizer_name in OPTIMIZERS and precision.mode != "cast"
    fused = xla.fused_optimizer(cfg.optimizer_name) if use_fused else None
    opt = (fused or cfg.optimizer)(model.parameters())
    # torch_xla's sync-free optimizers skip the step when found_inf is 1 (never, here)
    step_args = {"found_inf": _device_values(device, 0.0)[0]} if fused else {}

    global_bs = cfg.batch_size * (spmd_devices or 1)
    tl = train_loader(
        train_ds, global_bs, replicas=replicas, rank=rank, seed=cfg.seed,
        collate_fn=cfg.collate_fn, num_workers=cfg.num_workers,
    )  # fmt: skip
    vl = None
    if valid_ds is not None:
        vl = eval_loader(
            valid_ds, cfg.valid_batch_size * (spmd_devices or 1), replicas=replicas, rank=rank,
            collate_fn=cfg.valid_collate_fn, num_workers=cfg.num_workers,
        )  # fmt: skip
    batches = len(tl)
    per_epoch = batches // cfg.accumulate_steps
    if per_epoch < 1:
        raise ValueError(
            f"accumulate_steps={cfg.accumulate_steps} exceeds the {batches} batches per epoch on each core"
        )
    total = per_epoch * cfg.epochs
    max_lr = cfg.max_lr * (cores if cfg.scale_lr_by_cores else 1)

    history = History()
    history.summary = _summary(cfg, device, cores, batches, total, max_lr, precision, fused is not None)
    start_epoch, opt_step = 0, 0
    ckpt_path = os.path.join(cfg.checkpoint_dir, CHECKPOINT_NAME) if cfg.checkpoint_dir else None
    if cfg.resume and ckpt_path and os.path.exists(ckpt_path):
        start_epoch, opt_step, history.records = _restore(ckpt_path, model, opt, total, on_xla)
    schedule = _OneCycleDriver(opt, cfg, total, max_lr, device, opt_step)
    if master and cfg.progress:
        print(history.summary)
        if start_epoch:
            print(f"resumed from {ckpt_path} after epoch {start_epoch}")

    loss_none = _per_sample_loss(cfg.loss_fn) if vl is not None else None
    for epoch in range(start_epoch, cfg.epochs):
        syncs0, transfers0 = xla.host_sync_count(), xla.transfer_from_device_count()
        started = time.perf_counter()
        tl.sampler.set_epoch(epoch)
        if hasattr(train_ds, "set_epoch"):
            train_ds.set_epoch(epoch)  # e.g. CachedDataset serving another augmented copy
        train_sums, opt_step, lr = _train_epoch(
            model, opt, step_args, schedule, tl, device, spmd_devices, precision, cfg, epoch, opt_step, master
        )
        eval_sums = _eval_epoch(model, vl, device, spmd_devices, precision, cfg, loss_none) if vl is not None else []
        values, bad_step = _read_epoch(train_sums, eval_sums)
        # Lazy views of these sums, if kept alive, would run as a graph of their own at the next sync.
        del train_sums, eval_sums
        seconds = time.perf_counter() - started
        loss_sum, n_batches = values[0], values[1]
        if bad_step < _NO_BAD_STEP or not math.isfinite(loss_sum):
            where = f"step {int(bad_step)}" if bad_step < _NO_BAD_STEP else "a step"
            raise FloatingPointError(
                f"the training loss became NaN or inf in epoch {epoch + 1} at {where} of {batches}; "
                f"stopped. The last good checkpoint (if any) is {ckpt_path or 'not kept (no checkpoint_dir)'}. "
                f"Try a lower max_lr, max_grad_norm=1.0 or precision='fp32'."
            )
        record = EpochRecord(
            epoch=epoch + 1,
            train_loss=loss_sum / n_batches,
            valid_loss=None,
            metrics={},
            lr=lr,
            seconds=seconds,
            samples_per_s=batches * global_bs * replicas / seconds,
        )
        if vl is not None:
            count = values[-1]
            record.valid_loss = values[2] / count
            record.metrics = {name: v / count for name, v in zip(cfg.metrics, values[3:-1])}
        record.compiles = xla.compile_count()
        record.host_syncs = xla.host_sync_count() - syncs0
        record.transfers = xla.transfer_from_device_count() - transfers0
        history.records.append(record)
        if ckpt_path and master:
            _save(ckpt_path, model, opt, epoch + 1, opt_step, history, total, on_xla, cfg)
        if master and cfg.progress:
            from tqdm.auto import tqdm

            tqdm.write(record.line(cfg.epochs))
    return model, history


def _train_epoch(
    model: nn.Module, opt: torch.optim.Optimizer, step_args: dict, schedule: _OneCycleDriver, loader: Any,
    device: torch.device, spmd_devices: int | None, precision: _Precision, cfg: FitConfig, epoch: int,
    opt_step: int, master: bool,
) -> tuple[list[torch.Tensor], int, float]:  # fmt: skip
    from tqdm.auto import tqdm

    model.train()
    opt.zero_grad(set_to_none=True)
    # bad_step: 1-based step of the first non-finite loss
    loss_sum, n_batches, bad_step = _device_values(device, 0.0, 0.0, _NO_BAD_STEP)
    lr = schedule.lrs[min(opt_step, schedule.total - 1)]
    bar = tqdm(
        total=len(loader), desc=f"epoch {epoch + 1}/{cfg.epochs}", disable=not (cfg.progress and master),
        leave=False, dynamic_ncols=True,
    )  # fmt: skip
    for i, batch in enumerate(_device_batches(loader, device, spmd_devices)):
        batch = precision.inputs(batch)
        with precision.context():
            if cfg.train_step is not None:
                loss = cfg.train_step(model, batch)
            else:
                x, y = _split_xy(batch, "train_step")
                loss = cfg.loss_fn(model(x).float(), y)
        loss = loss.float()
        (loss / cfg.accumulate_steps if cfg.accumulate_steps > 1 else loss).backward()
        n_batches = n_batches + 1
        bad_step = torch.where((bad_step == _NO_BAD_STEP) & ~torch.isfinite(loss), n_batches, bad_step)
        loss_sum = loss_sum + loss.detach()
        if (i + 1) % cfg.accumulate_steps == 0:
            lr = schedule.before_step(opt)
            # MpDeviceLoader cuts the graph at every batch, so the step needs no barrier
            step_optimizer(opt, barrier=False, max_grad_norm=cfg.max_grad_norm, optimizer_args=step_args)
            opt.zero_grad(set_to_none=True)
            opt_step += 1
        bar.update(1)
    bar.close()
    opt.zero_grad(set_to_none=True)  # a partial accumulation at the epoch's end is dropped
    return [loss_sum, bad_step, n_batches], opt_step, lr


def _eval_epoch(
    model: nn.Module, loader: Any, device: torch.device, spmd_devices: int | None,
    precision: _Precision, cfg: FitConfig, loss_none: Callable,
) -> list[torch.Tensor]:  # fmt: skip
    model.eval()
    sums, count = _device_values(device, [0.0] * (1 + len(cfg.metrics)), 0.0)
    with torch.no_grad():
        for batch, mask in _device_batches(loader, device, spmd_devices):
            batch = precision.inputs(batch)
            with precision.context():
                if cfg.eval_step is not None:
                    output, target = cfg.eval_step(model, batch)
                else:
                    x, target = _split_xy(batch, "eval_step")
                    output = model(x)
            output = output.float()
            per_sample = [loss_none(output, target)] + [m(output, target) for m in cfg.metrics.values()]
            rows = torch.stack([_per_sample(v, mask.shape[0]) for v in per_sample])
            weight = mask.float()
            sums = sums + (rows * weight).sum(dim=1)
            count = count + weight.sum()
    return [*sums.unbind(0), count]


def _read_epoch(train_sums: list[torch.Tensor], eval_sums: list[torch.Tensor]) -> tuple[list[float], float]:
    """The epoch's one device read: sums over replicas, then one transfer to the host."""
    loss_sum, bad_step, n_batches = train_sums
    figures = torch.stack([t.float() for t in [loss_sum, n_batches, *eval_sums]])
    figures, bad_step = xla.all_reduce([figures], "sum")[0], xla.all_reduce([bad_step], "min")[0]
    values, (first_bad,) = (t.tolist() for t in xla.to_cpu([figures, bad_step.reshape(1)]))
    return values, first_bad


def _device_values(device: torch.device, *values: Any) -> list[torch.Tensor]:
    """Accumulators materialised on the device, like the previous step's outputs they stand for.

    Left as pending constants (torch_xla keeps small uploads as scalars in the
    graph), they would merge into an epoch's first step and make it a graph of its
    own; run now, they are plain device data in every epoch.
    """
    tensors = [torch.tensor(v, dtype=torch.float32).to(device) for v in values]
    if device.type == "xla":
        xla.sync()
    return tensors


def _per_sample(values: torch.Tensor, batch: int) -> torch.Tensor:
    if values.dim() == 0 or values.shape[0] != batch:
        raise ValueError(
            f"a metric or the unreduced loss returned shape {tuple(values.shape)}; it must give one "
            f"value per sample (first dimension {batch})"
        )
    return values.reshape(batch, -1).float().mean(dim=1)


def _summary(cfg: FitConfig, device: torch.device, cores: int, batches: int, total: int, max_lr: float,
             precision: _Precision, fused: bool) -> str:  # fmt: skip
    kind = xla.runtime_device_type() if device.type == "xla" else device.type
    scaled = f"scaled x{cores} by cores" if cfg.scale_lr_by_cores else "not scaled by cores"
    bf16 = {"fp32": "fp32", "autocast": "bf16 (autocast)", "cast": "bf16 (model and inputs cast)"}[precision.mode]
    return (
        f"one_cycle_fit: {cfg.mode} on {cores} {kind} core(s) | batch {cfg.batch_size} per core, "
        f"{cfg.batch_size * cores} global | {batches} batches/epoch per core x {cfg.epochs} epochs = "
        f"{total} optimizer steps | max_lr {max_lr:.2e} ({scaled}) | {bf16} | {cfg.optimizer_name}"
        f"{' (torch_xla sync-free, fused)' if fused else ''}"
    )


def _versions() -> dict[str, str]:
    return {
        "torch": str(torch.__version__),
        "torch_xla": xla.installed_version("torch_xla") or "",
        "tpu_utility": xla.installed_version("tpu_utility") or "",
    }


def _save(path: str, model: nn.Module, opt: torch.optim.Optimizer, epoch: int, opt_step: int,
          history: History, total: int, on_xla: bool, cfg: FitConfig) -> None:  # fmt: skip
    state = {
        "format": 1,
        "epoch": epoch,
        "step": opt_step,
        "total_steps": total,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "xla": xla.get_rng_state() if on_xla else 0,
            "python": random.getstate(),
        },
        "history": history.to_dicts(),
        "versions": _versions(),
        "config": {"epochs": cfg.epochs, "max_lr": cfg.max_lr, "batch_size": cfg.batch_size, "cores": cfg.cores},
    }
    save_atomic(to_cpu(state), path)


def _restore(path: str, model: nn.Module, opt: torch.optim.Optimizer, total: int, on_xla: bool
             ) -> tuple[int, int, list[EpochRecord]]:  # fmt: skip
    state = load_checkpoint(path)
    if state.get("total_steps") != total:
        raise ValueError(
            f"{path} was written for a schedule of {state.get('total_steps')} optimizer steps, but this "
            f"run has {total}; resume with the same epochs, batch_size, cores and accumulate_steps"
        )
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if xla.is_fused_optimizer(opt):  # torch's loader leaves "step" on the CPU; the fused op needs it on the device
        for param, param_state in opt.state.items():
            param_state["step"] = param_state["step"].to(param.device)
    torch.set_rng_state(state["rng"]["torch"])
    version, internal, gauss = state["rng"]["python"]
    random.setstate((version, tuple(internal), gauss))
    if on_xla:
        xla.set_rng_state(int(state["rng"]["xla"]))
    return int(state["epoch"]), int(state["step"]), History.from_dicts(state["history"]).records
