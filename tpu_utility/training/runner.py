"""Runner: what one process needs to run a model on its share of the cores.

``one_cycle_fit``, ``evaluate``, ``predict`` and ``find_lr`` each build one
``Runner`` per process. It holds the device, the model, the precision and the
data layout (``Topology``: single core, SPMD over a mesh of devices and hosts,
or one replica of a multi-process launch), builds the loaders for that layout,
turns host batches into device batches (sharded under SPMD), and runs the two
loops that never train: evaluation sums and prediction.

Who loads which samples is plain arithmetic (``Topology``), tested with
simulated process counts; the runner only asks torch_xla for the numbers.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Literal, Sequence, get_args

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import backend
from ..data.loaders import IGNORE_INDEX, LABELS, LabelCheck, LoaderSpec, eval_loader, real_counts, train_loader
from ..device import get_device, move_model, move_to_device
from ..huggingface import give_back_checkpoint_functions, restore_masks, static_masks, use_checkpoint_function
from .metrics import MetricSet
from .strategies import room
from ..progress import progress_bar

Strategy = Literal["auto", "spmd", "multiprocess", "fsdp"]
Precision = Literal["fp32", "bf16", "fp16"]
Batch = Any
Step = Callable[[nn.Module, Batch], Any]

PREDICT_CHUNK = 16  # batches of outputs kept on the device between host transfers


# ----------------------------------------------------------- pure choices
CoreRule = Literal["one_or_all", "up_to_available", "any"]


def resolve_cores(cores: int | str, available: int, rule: CoreRule = "one_or_all") -> int:
    """The number of cores (or devices, or processes) to run on.

    ``rule``: XLA runs 1 or all of its cores ("one_or_all"); a GPU host any number
    up to its GPUs ("up_to_available"); the CPU any number of processes ("any"),
    which is how DDP code is tested there.
    """
    if cores == "all":
        return available
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise TypeError(f"cores must be 1, 'all' or an int, but given {cores!r}")
    if rule == "any" and cores < 1:
        raise ValueError(f"cores must be 'all' or an int >= 1, but given {cores}")
    if rule == "up_to_available" and not 1 <= cores <= available:
        raise ValueError(f"cores must be between 1 and {available} (the devices here), or 'all', but given {cores}")
    if rule == "one_or_all" and cores != 1 and cores != available:
        raise ValueError(f"cores must be 1 or {available} (all cores here), or 'all', but given {cores}")
    return cores


def choose_strategy(strategy: str, cores: int, in_launch: bool, sharded_processes: bool = False) -> str:
    """"single", "spmd", "fsdp" (this process shards: over its SPMD mesh on XLA, or as one process of a job
    natively), "multiprocess" (we launch), "multiprocess-fsdp" (we launch processes that shard) or "replica"
    (already launched). ``sharded_processes``: the backend shards over processes (native FSDP2), not a mesh."""
    if strategy not in get_args(Strategy):
        raise ValueError(f"strategy must be one of {get_args(Strategy)}, but given {strategy!r}")
    if strategy == "fsdp" and in_launch:
        if sharded_processes:
            return "fsdp"  # one process of the job, sharding with the others
        raise ValueError("strategy='fsdp' shards over all cores from one process, but this process is one replica of "
                         "a multi-process launch; call it from the main process with cores='all'")  # fmt: skip
    if strategy == "fsdp":
        if cores < 2:
            raise ValueError(f"strategy='fsdp' shards the model over several cores, but given cores={cores}; give "
                             f"cores=N with N >= 2 (cores='all' where several devices are attached), or strategy='auto' "
                             f"on one core")  # fmt: skip
        return "multiprocess-fsdp" if sharded_processes else "fsdp"
    if in_launch:
        return "replica"
    if strategy == "multiprocess":
        return "multiprocess"
    if cores == 1 and strategy == "auto":
        return "single"
    return "spmd"


# the modes that launch processes, and the mode each launched process runs
LAUNCHED_MODE = {"multiprocess": "replica", "multiprocess-fsdp": "fsdp"}


def available_cores() -> int:
    """Devices this job could use, counted without starting a runtime."""
    return backend.device_count()


def process_mode(cores: int | str, strategy: str = "auto") -> tuple[int, str]:
    """(cores, mode) for this process; ``mode`` as ``choose_strategy`` names it.

    On XLA several cores run SPMD (one process) or one process per chip; on the
    native backends (CUDA, CPU) one process per device, under ``torch.distributed``.

    Raises:
        ValueError: a strategy or core count that this backend cannot run.
    """
    backend.join_job()  # inside torchrun: this process is one replica of its job
    chosen = backend.current()
    n_cores = resolve_cores(cores, available_cores(), chosen.core_rule)
    in_launch = backend.in_launched_process() and backend.world_size() > 1
    mode = choose_strategy(strategy, n_cores, in_launch, sharded_processes=not chosen.lazy)
    if chosen.lazy or mode in ("single", "replica", "fsdp", "multiprocess-fsdp"):
        return n_cores, mode
    if strategy == "spmd":
        raise ValueError(
            f"strategy={strategy!r} needs XLA devices (a TPU, or PJRT_DEVICE set); here the {chosen.name} backend runs "
            f"one process per device: use strategy='auto' or 'multiprocess' ('fsdp' shards over the processes)"
        )
    return n_cores, "multiprocess" if n_cores > 1 else "single"


@dataclass(frozen=True)
class Topology:
    """Who runs and who loads what, as plain numbers.

    ``replicas``/``rank``: processes that each run their own copy of the graph
    (a multi-process launch). ``hosts``/``host``: processes of one SPMD program
    (one per host on a pod slice), each loading its share of the global batch.
    ``devices``: the SPMD mesh size over all hosts.
    """

    mode: str = "single"  # "single", "spmd" or "replica"
    replicas: int = 1
    rank: int = 0
    hosts: int = 1
    host: int = 0
    devices: int = 1

    def __post_init__(self) -> None:
        if self.mode == "spmd" and self.devices % self.hosts:
            raise ValueError(f"{self.devices} devices do not split evenly over {self.hosts} hosts")

    @property
    def cores(self) -> int:
        return self.devices if self.mode == "spmd" else self.replicas

    @property
    def loaders(self) -> tuple[int, int]:
        """(how many loaders split the data, this one's index)."""
        return (self.hosts, self.host) if self.mode == "spmd" else (self.replicas, self.rank)

    @property
    def master(self) -> bool:
        return self.rank == 0 and self.host == 0

    def loader_batch(self, per_core: int) -> int:
        """Samples this process loads per step: its cores' share of the global batch."""
        return per_core * self.devices // self.hosts if self.mode == "spmd" else per_core

    def global_batch(self, per_core: int) -> int:
        return per_core * self.cores


def current_topology(mode: str) -> Topology:
    """This process's Topology; switches SPMD on for mode "spmd" (before the runtime starts)."""
    if mode == "fsdp" and not backend.current().lazy:  # natively: one process of a job, its parameters sharded
        return Topology("replica", replicas=backend.world_size(), rank=backend.rank())
    if mode in ("spmd", "fsdp"):  # fsdp: the same data layout, the parameters sharded too (strategies.fsdp)
        backend.use_spmd()
        return Topology("spmd", hosts=backend.process_count(), host=backend.process_index(), devices=backend.global_device_count())
    if mode == "replica":
        return Topology("replica", replicas=backend.world_size(), rank=backend.rank())
    return Topology("single")


# ----------------------------------------------------------------- batches
def _cast_floats(batch: Batch, dtype: torch.dtype) -> Batch:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
    )


def split_batch(batch: Batch, what: str) -> tuple[Any, Any]:
    """``(inputs, target)`` of a default batch.

    ``(*inputs, target)`` gives ``(inputs, target)``: ``model(*inputs)`` is compared with
    ``target``. A dict batch (a tokenized Hugging Face dataset) is passed as keyword
    arguments: ``(batch, batch["labels"])`` (None without labels), the labels left in
    so that a Hugging Face model computes its own loss.
    """
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:  # the common case first: no Mapping check
        return tuple(batch[:-1]), batch[-1]
    if isinstance(batch, Mapping):
        return batch, batch.get(LABELS)
    size = f" of length {len(batch)}" if hasattr(batch, "__len__") else ""
    fix = "give find_lr a Dataset of (inputs, target) samples" if what == "find_lr" else f"pass {what}=... to handle this batch structure"
    raise TypeError(
        f"the default {what} expects batches of (inputs, targets), (*inputs, targets) or a dict of model "
        f"arguments, but a batch is {type(batch).__name__}{size}; {fix}"
    )


def without_labels(inputs: Any) -> Any:
    """A dict batch's model arguments less its labels (the model's own loss is not wanted); tuples as they are."""
    return {k: v for k, v in inputs.items() if k != LABELS} if isinstance(inputs, Mapping) else inputs


def call_model(model: nn.Module, inputs: Any, what: str) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple; a forward that cannot take
    that many inputs is named with the batch's layout."""
    if not isinstance(inputs, tuple) and isinstance(inputs, Mapping):  # a tuple first: no Mapping check
        return model(**inputs)
    try:
        return model(*inputs)
    except TypeError as error:
        if len(inputs) < 2:
            raise
        try:
            inspect.signature(model.forward).bind(*inputs)
        except (TypeError, ValueError):
            raise TypeError(
                f"a batch has {len(inputs) + 1} parts, which the default {what} reads as (*inputs, targets): "
                f"model(*batch[:-1]) with {len(inputs)} inputs, but {type(model).__name__}.forward"
                f"{inspect.signature(model.forward)} does not take {len(inputs)}. For batches such as "
                f"(inputs, targets, weights), pass {what}=lambda model, batch: ..."
            ) from error
        raise


def logits_of(output: Any) -> Any:
    """The scores in a model's output: the tensor itself, or the ``logits`` of a Hugging Face
    ``ModelOutput`` or any dict that has them; other outputs as they are."""
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping) and output.get("logits") is not None:
        return output["logits"]
    return output


def _no_labels(what: str, batch: Mapping) -> TypeError:
    return TypeError(
        f"the default {what} needs the targets: a dict batch must hold them under '{LABELS}' (as a tokenized "
        f"Hugging Face dataset does), but this one has {sorted(batch)}; rename the key, or pass "
        f"{what}=lambda model, batch: ..."
    )


class LossStep:
    """The default train step: ``loss_fn(model(*inputs).float(), target)``.

    A dict batch is passed as keyword arguments. With the default loss and a model
    that computes its own (a Hugging Face model given ``labels``), the loss is its
    ``output.loss``; otherwise ``loss_fn(logits, batch["labels"])``, the labels
    kept out of the model's arguments. The scores are shown to ``labels`` (a
    LabelCheck) first, so a bad label fails before the loss.
    """

    def __init__(self, loss_fn: Callable, labels: LabelCheck | None = None, model_loss: bool = False) -> None:
        self.loss_fn, self.labels, self.model_loss = loss_fn, labels, model_loss

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, target = split_batch(batch, "train_step")
        if target is None and isinstance(inputs, Mapping):
            raise _no_labels("train_step", inputs)
        output = call_model(model, inputs if self.model_loss else without_labels(inputs), "train_step")
        scores = logits_of(output)
        own = None
        if self.model_loss and not isinstance(output, torch.Tensor) and isinstance(output, Mapping):  # a ModelOutput's own loss
            own = output.get("loss")
        if self.labels is not None:
            self.labels.see(scores, target, own_loss=own is not None)
        if own is not None:
            return own
        return self.loss_fn(scores if scores.dtype == torch.float32 else scores.float(), target)


def default_eval_step(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    inputs, target = split_batch(batch, "eval_step")
    if isinstance(inputs, Mapping) and target is None:
        raise _no_labels("eval_step", inputs)
    return logits_of(call_model(model, without_labels(inputs), "eval_step")), target


def next_token_targets(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's scores and targets paired as its own loss pairs them: position t predicts label t + 1.

    Logits longer than the labels (peft's prompt tuning prepends virtual tokens) get the labels
    right-aligned, the virtual positions ignored (-100), as peft and transformers do.

    Example:
        >>> logits, labels = torch.zeros(2, 5, 11), torch.arange(5).repeat(2, 1)
        >>> [tuple(t.shape) for t in next_token_targets(logits, labels)]
        [(2, 4, 11), (2, 4)]
    """
    extra = logits.shape[1] - labels.shape[1]
    if extra > 0:
        labels = torch.cat([labels.new_full((labels.shape[0], extra), IGNORE_INDEX), labels], dim=1)
    return logits[:, :-1], labels[:, 1:]


class EvalStep:
    """``default_eval_step`` whose scores and targets are paired as the default loss reads them.

    ``causal``: a causal LM's (``next_token_targets``), so the validation loss is the
    model's own. ``labels``: a LabelCheck shown each output (it learns the class count
    from the first).
    """

    def __init__(self, labels: LabelCheck | None = None, causal: bool = False) -> None:
        self.labels, self.causal = labels, causal

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Any, Any]:
        output, target = default_eval_step(model, batch)
        if self.causal and isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
            output, target = next_token_targets(output, target)
        if self.labels is not None:
            self.labels.see(output, target)
        return output, target


def default_predict_step(model: nn.Module, batch: Batch) -> Any:
    """``model(x)`` for a tensor, ``model(*inputs)`` for ``(*inputs, target)`` (the target is ignored),
    ``model(**batch)`` less its labels for a dict; a ``ModelOutput``'s (or dict's) logits."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return logits_of(model(**without_labels(batch)))
    if isinstance(batch, (list, tuple)) and batch:
        return logits_of(model(*batch[:-1]) if len(batch) > 1 else model(batch[0]))
    raise TypeError(
        f"the default predict_step expects batches of inputs, (*inputs, target) or a dict of model arguments, "
        f"but a batch is {type(batch).__name__}; pass predict_step=lambda model, batch: ... to handle it"
    )


def check_precision(precision: Any, device: torch.device | None = None) -> None:
    """Refuses a precision that is not one of ``Precision``, and ``"fp16"`` where this backend has no float16 path.

    float16 autocast with torch's ``GradScaler`` runs on CUDA and the CPU (native backend);
    TPUs (torch_xla, TorchTPU) compute in bfloat16 and XLA:CPU has no autocast.

    Args:
        precision: The value given.
        device: The run's device, where it is known (naming the hardware under it); None
            names the backend's device type without starting its runtime.

    Raises:
        ValueError: the value, and for fp16 the device and the precisions it has.
    """
    if precision not in get_args(Precision):
        raise ValueError(f"precision must be one of {get_args(Precision)}, but given {precision!r}")
    chosen = backend.current()
    if precision != "fp16" or chosen.fp16_available():
        return
    if device is None and chosen.lazy:
        device = torch.device(chosen.device_type)  # "xla": its hardware is named without starting the runtime
    hardware = chosen.hardware(device) if device is not None else None
    where = f"XLA:{hardware}" if chosen.lazy and hardware else hardware or chosen.device_type
    raise ValueError(
        f"precision='fp16' (float16 autocast and a GradScaler) has no path on {where} (the {chosen.name} backend): "
        f"use precision='bf16' (what TPUs compute in; it has float32's range, so no loss scaling is needed) or "
        f"precision='fp32'. fp16 runs on CUDA GPUs (and, slowly, the CPU)"
    )


@dataclass
class PrecisionMode:
    """How the precision is applied on this device.

    ``mode``: "fp32"; bf16 by "autocast", or by "cast"ing model and inputs where the
    device has no bf16 autocast (XLA:CPU); "fp16": float16 autocast around the forward
    and the loss, and torch's ``GradScaler`` in training (``backward``, ``scaler``), whose
    state a checkpoint keeps (``state_dict``).

    Example:
        >>> # was: scaler = torch.cuda.amp.GradScaler()
        >>> #      with torch.autocast("cuda", dtype=torch.float16): loss = loss_fn(model(x), y)
        >>> #      scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        >>> precision = PrecisionMode.choose("fp16", torch.device("cuda"))   # doctest: +SKIP
        >>> with precision.context():                                        # doctest: +SKIP
        ...     loss = loss_fn(model(x), y)
        >>> precision.backward(loss)                                         # doctest: +SKIP
        >>> step_optimizer(opt, scaler=precision.scaler)                     # doctest: +SKIP
    """

    mode: str  # "fp32", "autocast", "cast" or "fp16"
    device: torch.device

    @classmethod
    def choose(cls, precision: str, device: torch.device) -> PrecisionMode:
        check_precision(precision, device)
        if precision in ("fp32", "fp16"):
            return cls(precision, device)
        if backend.is_lazy(device):  # XLA: its autocast on TPUs, else cast (XLA:CPU refuses autocast)
            return cls("autocast" if backend.bf16_autocast_available() else "cast", device)
        return cls("autocast", device)

    @property
    def name(self) -> str:
        """The ``precision=`` value: "fp32", "bf16" or "fp16"."""
        return {"autocast": "bf16", "cast": "bf16"}.get(self.mode, self.mode)

    def context(self) -> Any:
        if self.mode not in ("autocast", "fp16"):
            return nullcontext()
        dtype = torch.float16 if self.mode == "fp16" else torch.bfloat16
        if backend.owns(self.device):
            return backend.autocast(self.device, dtype)
        return torch.autocast(self.device.type, dtype=dtype)

    def inputs(self, batch: Batch) -> Batch:
        return _cast_floats(batch, torch.bfloat16) if self.mode == "cast" else batch

    @cached_property
    def scaler(self) -> torch.amp.GradScaler | None:
        """torch's ``GradScaler`` under fp16 (made when training first asks; evaluate and predict never do), else None."""
        return torch.amp.GradScaler(self.device.type) if self.mode == "fp16" else None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under fp16 (``scaler.scale(loss).backward()``)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the precision, and the GradScaler's state (``{}`` without one)."""
        return {"precision": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: Mapping[str, Any], path: str) -> str | None:
        """Takes a checkpoint's GradScaler state, so a resumed fp16 run goes on with its scale.

        Returns what a change of precision since ``path`` was written means (a fresh
        scaler, or a scaler state left unused), for the caller to say; None if none.
        """
        saved, scaler_state = state.get("precision"), state.get("scaler") or {}
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
        if saved == self.name or (saved is None and self.scaler is None):
            return None  # the same precision, or a checkpoint from before it was recorded and nothing to restore
        written = f"was written with precision={saved!r}" if saved else "records no precision (an earlier release)"
        change = f"{path} {written} and this run uses precision={self.name!r}"
        if self.scaler is not None and not scaler_state:
            fresh = f"a fresh GradScaler starts at scale {self.scaler.get_scale():g}"
            return f"{change}: {fresh} (halved at each step whose gradients overflow)"
        if scaler_state:
            unused = f"the checkpoint's GradScaler state (scale {scaler_state.get('scale'):g}) is left unused"
            return f"{change}: {unused}, as {self.name} scales no loss"
        return f"{change}: the weights and optimizer state go on in {self.name}"

    @property
    def label(self) -> str:
        return {"fp32": "fp32", "autocast": "bf16 (autocast)", "cast": "bf16 (model and inputs cast)",
                "fp16": "fp16 (autocast + GradScaler)"}[self.mode]  # fmt: skip


@dataclass(frozen=True)
class Placement:
    """Where and how a model was found: device, train/eval mode, each tensor's dtype."""

    device: torch.device
    training: bool
    dtypes: dict[str, torch.dtype]

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        params = [p for p in model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        return cls(device, model.training, {name: t.dtype for name, t in _tensors(model)})

    def restore_dtypes(self, model: nn.Module) -> None:
        """Gives each parameter and buffer its own found dtype back (after a bf16 cast)."""
        for name, tensor in _tensors(model):
            found = self.dtypes.get(name)
            if found is not None and tensor.dtype != found:
                tensor.data = tensor.data.to(found)

    def restore(self, model: nn.Module) -> None:
        move_model(model, self.device)
        self.restore_dtypes(model)
        model.train(self.training)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


# ------------------------------------------------------------------ runner
class Runner:
    """One process's device, model, precision and data layout.

    Example:
        >>> runner = Runner(model, precision="bf16", mode="spmd")   # doctest: +SKIP
        >>> loader = runner.eval_loader(unpack_loader(valid_ds, 64, "valid_data"))  # doctest: +SKIP
        >>> for batch, index in runner.batches(loader): ...          # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, precision: str = "fp32", mode: str = "single", sharding: Any = None,
                 why: str = "") -> None:  # fmt: skip
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, but given {model!r}")
        self.found = Placement.of(model)
        self.topology = current_topology(mode)
        self.device = get_device()
        self.model = model
        self._train_model: nn.Module | None = None
        self.precision = PrecisionMode.choose(precision, self.device)
        self.found_weights = None
        if self.precision.mode == "cast":  # bf16 -> fp32 would not give the weights back exactly
            self.found_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        move_model(model, self.device)
        if self.precision.mode == "cast":
            model.to(torch.bfloat16)
        # the parameters sharded under "fsdp" (``sharding``: its FSDP options, ``why``: what chose it); nothing replicated
        self.strategy = room(mode, sharding, why)
        self.strategy.enter(model)
        # a transformers model's masks built on the device: no host read per forward on XLA (given back after)
        self.found_attention = static_masks(model) if self.lazy else None
        # gradient_checkpointing_enable()'s torch checkpoint fails on XLA: torch_xla's in its place (given back after)
        self.found_checkpointing = use_checkpoint_function(model, backend.checkpoint_function()) if self.lazy else []

    @property
    def lazy(self) -> bool:
        """Whether the model's device builds graphs that a step boundary runs (XLA)."""
        return backend.is_lazy(self.device)

    def restore_model(self) -> None:
        """Puts the model back on the device, dtype and mode it was found in."""
        self.strategy.leave(self.model)
        self.found.restore(self.model)
        restore_masks(self.model, self.found_attention)
        give_back_checkpoint_functions(self.found_checkpointing)
        if self.found_weights is not None:
            self.model.load_state_dict(self.found_weights)

    # -- loaders
    def train_loader(self, spec: LoaderSpec, seed: int) -> Any:
        loaders, index = self.topology.loaders
        return train_loader(spec, self.topology.loader_batch(spec.batch_size), replicas=loaders, rank=index, seed=seed)

    def eval_loader(self, spec: LoaderSpec) -> Any:
        loaders, index = self.topology.loaders
        return eval_loader(spec, self.topology.loader_batch(spec.batch_size), replicas=loaders, rank=index)

    def batches(self, loader: Any) -> Iterator[Batch]:
        """Device batches (sharded over the mesh under SPMD); Dataset errors reach the caller."""
        if self.lazy:
            spmd = self.topology.mode == "spmd"
            devices = self.topology.devices if spmd else None
            return backend.device_loader(loader, self.device, devices, minibatch=spmd and self.topology.hosts > 1)
        if self.device.type == "cpu":  # the loader's batches are where the model is: nothing to move
            return iter(loader)
        return (move_to_device(b, self.device) for b in loader)

    def first_batch(self, loader: Any) -> Batch:
        """The loader's first batch on the device, for checks before a run (traced, not run)."""
        return move_to_device(next(iter(loader)), self.device)

    @property
    def train_model(self) -> nn.Module:
        """The model a training step calls: the backend's replica wrapper (DDP on CUDA/CPU) when replicas train."""
        if self._train_model is None:
            replicas = self.topology.mode == "replica" and self.topology.replicas > 1
            self._train_model = backend.current().wrap_replica(self.model, self.device) if replicas else self.model
        return self._train_model

    def run(self, step: Step, batch: Batch, training: bool = False) -> Any:
        """``step(model, batch)`` under this precision (the replica wrapper when ``training``)."""
        model = self.train_model if training else self.model
        if self.precision.mode == "fp32":  # nothing to cast or enter
            return step(model, batch)
        batch = self.precision.inputs(batch)
        with self.precision.context():
            return step(model, batch)

    # -- the loops that do not train
    def eval_sums(self, loader: Any, metrics: MetricSet, eval_step: Step) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Evaluates every sample once; returns ``metrics.figures()`` (on the device, not read)."""
        self.model.eval()
        metrics.reset()
        counts = real_counts(loader)
        with torch.no_grad():
            for (batch, index), real in zip(self.batches(loader), counts):
                output, target = self.run(eval_step, batch)
                metrics.update(output.float(), target, index, real)
        if metrics.whole:  # every output and target, gathered to the host in one transfer
            if self.lazy:
                backend.sync()  # the last batch's graph runs as every other batch's did (no new compile)
            parts, metrics.outputs = self._to_host(metrics.outputs), []
            metrics.finish(*_in_order(parts, sum(int((index >= 0).sum()) for _, index in parts)))
        return metrics.figures()

    def check_eval(self, loader: Any, metrics: MetricSet, eval_step: Step) -> None:
        """eval_step, the loss and every metric on the first batch, before any epoch is spent."""
        batch, _ = self.first_batch(loader)
        self.model.eval()
        with torch.no_grad():
            result = self.run(eval_step, batch)
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(
                    f"eval_step must return (output, target), but returned {type(result).__name__}"
                    f"{f' of length {len(result)}' if hasattr(result, '__len__') else ''}"
                )
            output, target = result
            metrics.check(output.float() if isinstance(output, torch.Tensor) else output, target)

    def predict(self, loader: Any, step: Step, tta: Sequence[Callable] | None, progress: bool = False) -> Any:
        """Outputs for every sample in dataset order, on the CPU, padding removed.

        Outputs stay on the device in chunks of ``PREDICT_CHUNK`` batches; a chunk
        moves to the host in one transfer once the next chunk is under way, so the
        device never waits for the host (and at most two chunks are held).
        """
        self.model.eval()
        on_host: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        previous: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        current: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        spec = None
        speak = progress and self.topology.master and backend.is_master()  # one bar per job, also when each predicts alone
        bar = progress_bar(len(loader), "predict", enabled=speak)
        with torch.no_grad():
            for batch, index in self.batches(loader):
                bar.update(1)
                leaves, spec = batch_first_leaves(self._predict_batch(step, batch, tta), index.shape[0])
                current.append((leaves, index))
                if len(current) == PREDICT_CHUNK:
                    on_host += self._to_host(previous)  # computed already: the device goes on with `current`
                    previous, current = current, []
            if self.lazy:
                backend.sync()  # the last batch's graph runs as every other batch's did (no new compile)
            on_host += self._to_host(previous + current)
        bar.close()
        return pytree.tree_unflatten(_in_order(on_host, loader.dataset.n), spec)

    def _predict_batch(self, step: Step, batch: Batch, tta: Sequence[Callable] | None) -> Any:
        if not tta:
            return self.run(step, batch)
        outputs = [self.run(step, _transformed(k, transform, batch)) for k, transform in enumerate(tta)]
        return _tta_mean(outputs)

    def _to_host(self, pending: list[tuple[list[torch.Tensor], torch.Tensor]]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """One device-to-host transfer for many batches (gathered over replicas first)."""
        if not pending:
            return []
        flat = [t for leaves, index in pending for t in (*leaves, index)]
        if self.topology.replicas > 1:  # one replica of several, each with its share of the samples
            flat = backend.all_gather(flat)
        moved = iter(backend.to_cpu(flat))
        width = len(pending[0][0])
        result = []
        for _ in pending:
            leaves = [next(moved) for _ in range(width)]
            result.append((leaves, next(moved)))
        return result


def batch_first_leaves(output: Any, batch: int) -> tuple[list[torch.Tensor], Any]:
    """The output's tensors and structure, each checked to be batch-first: dim 0 is the batch.

    Raises:
        TypeError: a leaf that is not a tensor.
        ValueError: a 0-d leaf, or one whose dim 0 is not the batch size (an LSTM's
            ``(h, c)``, a transposed ``(C, N)`` output, a value reduced over the batch).
    """
    paths, spec = pytree.tree_flatten_with_path(output)
    for path, leaf in paths:
        where = f"output{pytree.keystr(path)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"predict needs tensors (a tensor, or tuples, lists and dicts of them), but {where} is "
                f"{type(leaf).__name__}; return only tensors from the model or predict_step"
            )
        if leaf.dim() == 0 or leaf.shape[0] != batch:
            raise ValueError(
                f"predict needs batch-first outputs (dim 0 = the batch), but {where} has shape "
                f"{tuple(leaf.shape)} for a batch of {batch} samples; leave it out or move the batch to "
                f"dim 0 with predict_step=lambda model, batch: ... (for an LSTM: its output, not (h, c))"
            )
    return [leaf for _, leaf in paths], spec


def _transformed(k: int, transform: Callable, batch: Batch) -> Batch:
    """tta[k](batch), its error naming the transform and the batch it was given."""
    try:
        return transform(batch)
    except Exception as error:
        kind = type(error) if type(error) in (ValueError, TypeError, AttributeError, IndexError, KeyError) else RuntimeError
        raise kind(
            f"tta[{k}] failed on a batch {_structure(batch)}: {error}. A tta transform gets the whole batch "
            f"as the loader gives it; for (inputs, target) batches write lambda b: (b[0].flip(-1), *b[1:])"
        ) from error


def _tta_mean(outputs: list[Any]) -> Any:
    """The mean of the tta outputs, which must all have tta[0]'s structure and shapes, and be floats
    (the mean of class ids 2 and 3 is no class)."""
    for path, leaf in pytree.tree_flatten_with_path(outputs[0])[0]:  # dtypes: known without reading the device
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"tta averages the outputs of its transforms, but output{pytree.keystr(path)} is {leaf.dtype} "
                f"(class ids or votes?), whose mean would be fractions of classes. Return logits or "
                f"probabilities (and take .argmax(-1) of predict's result), or predict without tta once per "
                f"transform and take the vote yourself (torch.mode)"
            )
    want = _structure(outputs[0])
    for k, output in enumerate(outputs[1:], 1):
        if _structure(output) != want:
            raise ValueError(
                f"tta[{k}] gives the output {_structure(output)}, but tta[0] gives {want}; tta outputs "
                f"are averaged, so every transform must keep the output's structure and shapes"
            )
    return pytree.tree_map(lambda *ts: torch.stack([t.float() for t in ts]).mean(0), *outputs)


class _Shape:
    def __init__(self, t: torch.Tensor) -> None:
        self.text = f"Tensor{tuple(t.shape)}"

    def __repr__(self) -> str:
        return self.text


def _structure(batch: Batch) -> str:
    """A batch described by its structure and shapes, for error messages: [Tensor(16, 4), Tensor(16,)]."""
    return repr(pytree.tree_map(lambda t: _Shape(t) if isinstance(t, torch.Tensor) else t, batch))


def _in_order(parts: list[tuple[list[torch.Tensor], torch.Tensor]], n: int) -> list[torch.Tensor]:
    """Each output leaf over all batches, placed by dataset index, padding dropped."""
    index = torch.cat([i for _, i in parts])
    keep = index >= 0
    where = index[keep]
    in_place = len(index) >= n and torch.equal(index[:n], torch.arange(n))  # one loader, no sampler: in order
    ordered = []
    for k in range(len(parts[0][0])):
        values = torch.cat([leaves[k] for leaves, _ in parts])
        values = values[:n] if in_place else values[keep]
        if not in_place:
            values = values.new_empty((n, *values.shape[1:])).index_copy_(0, where, values)
        ordered.append(values)
    return ordered
