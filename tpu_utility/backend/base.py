"""The questions every backend answers, in the groups a backend holds, and the answers of one eager process.

A ``Backend`` is chosen once per process (``backend.current()``) and every
"which accelerator?" question in the package goes to one of its groups:
``devices`` (which device, moving data there and back, where a step ends),
``processes`` (how many replicas, launching them, reducing across them),
``compute`` (autocast, fused optimizers, activation checkpointing),
``diagnosis`` (compiles and host reads counted, doctor's probes) and
``sharding`` (SPMD and FSDP). The defaults here are those of a single eager
process with no collectives (plain CPU); ``native.NativeBackend`` adds
``torch.distributed``, ``xla.XlaBackend`` torch_xla's lazy graphs, SPMD and
counters, and ``tpu.TorchTpuBackend`` TorchTPU's ``tpu`` device, each by
overriding the groups that differ.

Example:
    >>> from tpu_utility import backend
    >>> backend.current().name            # doctest: +SKIP
    'cpu'
    >>> backend.current().processes.world_size()   # doctest: +SKIP
    1
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator, Literal, Sequence

import torch
from torch.utils import _pytree as pytree

from .hardware import TpuHardware, device_name_override, memory_override

ReduceOp = Literal["sum", "min", "max"]
# What a host sync is: a value read (.item(), bool(), print), a copy of device data to the
# host (.cpu(), .tolist()), or an op whose output shape depends on the data (nonzero, x[mask]).
SyncKind = Literal["read", "copy", "shape"]


@dataclass(frozen=True)
class GraphCompile:
    """One graph the backend compiled: how long compiling it took, and its size (IR nodes, None where unknown)."""

    seconds: float
    nodes: int | None = None


@dataclass(frozen=True)
class Found:
    """The devices a backend runs on, as ``setup_tpu`` reports them: their type ("TPU", "CPU" for XLA on the host,
    "CUDA", "cpu" for plain PyTorch), kind (a TPU's generation, a GPU's name), count, the backend as the summary names
    it, and the processes one per chip would launch (the DataLoader workers it suggests are per process)."""

    device_type: str
    kind: str | None
    count: int
    backend: str
    processes: int = 1


@dataclass(frozen=True)
class Counters:
    """What a backend has counted so far in this process.

    ``measured`` is False where the backend cannot see these events (an eager
    backend has no graphs to compile; its host reads are not counted): the
    figures are then 0 and mean "not measured", never "none happened".
    """

    compiles: int = 0
    executions: int = 0
    host_syncs: int = 0
    transfers: int = 0
    measured: bool = False


@contextlib.contextmanager
def patch_tensor_methods(wrappers: dict[str, Callable[[Callable], Callable]]) -> Iterator[None]:
    """Replaces torch.Tensor methods by ``wrappers[name](original)`` for the duration; nothing stays after."""
    originals = {name: getattr(torch.Tensor, name) for name in wrappers}
    own = {name for name in wrappers if name in torch.Tensor.__dict__}
    for name, make in wrappers.items():
        setattr(torch.Tensor, name, make(originals[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # inherited from TensorBase


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Every tensor in a (nested) batch, moved to ``device``; other values unchanged."""
    if type(batch) in (tuple, list) and all(isinstance(t, torch.Tensor) for t in batch):  # (x, y): no tree walk
        return type(batch)(t.to(device, non_blocking=True) for t in batch)
    return pytree.tree_map(lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch)


class Group:
    """One capability of a backend, held by it; ``self.backend`` answers the others (its name, device
    type, and sibling groups), so a group asks ``self.backend.processes.world_size()`` rather than
    inheriting every question."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend


class Devices(Group):
    """Devices and placement: which device, moving data to it and back, the step boundary, its memory and rng."""

    def device(self, index: int | None = None) -> torch.device:
        return torch.device(self.backend.device_type)

    def device_count(self) -> int:
        """Devices this job could use, counted without starting a runtime."""
        return 1

    def owns(self, device: torch.device | str) -> bool:
        """Whether tensors on ``device`` belong to this backend's accelerator."""
        return torch.device(device).type == self.backend.device_type

    def is_lazy(self, device: torch.device | str) -> bool:
        """Whether tensors on ``device`` build graphs that a step boundary runs."""
        return self.backend.lazy and self.owns(device)

    def sync(self, wait: bool = False) -> None:
        """Ends the step here (runs a lazy graph); nothing on an eager backend."""

    def wait(self) -> None:
        """Waits until the device finished every queued operation."""

    def skip_next_loader_sync(self) -> None:
        """Tells the device loader that the step was just cut (lazy backends)."""

    def device_loader(self, loader: Any, device: torch.device, spmd_devices: int | None = None,
                      minibatch: bool = False) -> Iterator[Any]:  # fmt: skip
        """Batches of ``loader`` moved to ``device``."""
        return (move_to_device(batch, device) for batch in loader)

    def to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies tensors to the host, in one transfer where the backend can."""
        return [t.detach().cpu() for t in tensors]

    def state_to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies a model's or an optimizer's state to the host for a checkpoint: as ``to_cpu``, except where a
        backend shards it over devices, whose shards it puts together on the host (never whole on a device)."""
        return self.to_cpu(tensors)

    def device_memory(self, device: torch.device) -> int | None:
        """Bytes of memory of one device (``TPU_UTILITY_DEVICE_MEMORY_GB`` first), or None where unknown (the CPU)."""
        return memory_override()

    def hardware(self, device: torch.device) -> str | None:
        """The hardware under ``device`` where it is not the device itself ("TPU" or "CPU" under XLA, "TPU" under TorchTPU), else None."""
        return None

    def chip_name(self, device: torch.device) -> str | None:
        """The chip under ``device`` as ``hardware.PEAK_BF16_FLOPS`` names it (a TPU kind, "v5e"; a CUDA device's
        name), ``TPU_UTILITY_DEVICE_NAME`` first; None where unknown (the CPU)."""
        return device_name_override()

    def rng_state(self) -> int:
        """The device generator's state where it is separate from torch's CPU one (XLA), else 0."""
        return 0

    def set_rng_state(self, state: int) -> None:
        """Restores (or seeds) the device generator; nothing where torch's own covers it."""


class Processes(Group):
    """Replicas: how many, which one, starting and joining them, and the collectives between them."""

    def world_size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def in_launched_process(self) -> bool:
        """True inside a process started by a multi-process launch (ours, torchrun, torch_xla's)."""
        return False

    def join_job(self) -> None:
        """Joins the multi-process job this process was started in by another launcher (torchrun)."""

    def launch(self, fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
        raise RuntimeError(f"the {self.backend.name} backend cannot launch several processes")

    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp = "sum") -> list[torch.Tensor]:
        return tensors

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Concatenates each tensor over replicas along dim 0 (same shape on every replica)."""
        return tensors

    def barrier(self, tag: str) -> None:
        """Waits until every replica gets here."""

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Averages the optimizer's gradients over the replicas; nothing on one."""

    def stalled(self, error: BaseException) -> str | None:
        """Why a collective failed, naming the replica(s) that did not arrive, if ``error`` is a
        collective's timeout this backend can explain; None leaves the error as it is."""
        return None

    def wrap_replica(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """The model a replica trains through, so that its gradients are averaged (XLA: the model itself)."""
        return model

    def metric_sync_fn(self) -> Callable[..., list[torch.Tensor]] | None:
        """torchmetrics' ``dist_sync_fn`` for this backend; None keeps torchmetrics' own."""
        return None


class Compute(Group):
    """How the math runs here: autocast and the precisions it offers, fused optimizers, activation checkpointing."""

    def bf16_autocast_available(self) -> bool:
        return False

    def fp16_available(self) -> bool:
        """Whether float16 autocast with torch's ``GradScaler`` runs on this backend's device."""
        return False

    def autocast(self, device: torch.device, dtype: torch.dtype) -> Any:
        return contextlib.nullcontext()

    def fused_optimizer(self, name: str) -> type | None:
        """A backend's own optimizer class for ``name`` ("adam", "adamw"), or None."""
        return None

    def is_fused_optimizer(self, optimizer: Any) -> bool:
        return False

    # torch.compile's backend for this device: inductor (CPU and GPU kernels); TorchTPU names its own
    compile_backend: str = "inductor"

    def graph_compiler(self) -> str | None:
        """The compiler that runs every step as a graph whatever the user asks ("XLA" under torch_xla), or None
        where steps run eagerly, op by op, unless ``compile_model`` compiles them."""
        return None

    def torch_compile(self, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
        """``torch.compile(model, **options)`` with this backend's compiler (``compile_backend`` unless
        ``options`` names one): a wrapper whose calls run compiled graphs; the model itself is unchanged (its
        class, its state-dict keys). A backend whose ``graph_compiler`` compiles every step returns the model.

        Example:
            >>> # was: model = torch.compile(model)
            >>> compiled = backend.current().compute.torch_compile(model, {})   # doctest: +SKIP
        """
        if self.graph_compiler() is not None:
            return model
        return torch.compile(model, **{"backend": self.compile_backend, **options})

    def compile_cache(self, folder: str, given: str | None, enabled: bool | None) -> tuple[str | None, str]:
        """Turns on the persistent compile cache in ``folder`` (``setup_tpu``'s ``cache_dir=``, ``given``, with a
        folder per launched process) where this backend keeps one and ``enabled`` asks (None: where it can reload
        compiled programs); returns (the folder in use or None, why it is off). Here: none to keep."""
        return None, "off"

    def compiled_optimizer_options(self, name: str) -> dict[str, Any]:
        """Options for one_cycle_fit's own optimizer ``name`` ("adam", "adamw", "sgd") in a compiled run, where
        they pay here (CUDA: ``fused=True``, one kernel for every parameter, as a compiled hand loop uses it)."""
        return {}

    def compile_pays(self, steps: int) -> bool:
        """Whether compiling a run of ``steps`` steps pays for its compile time (``compile="auto"``): never on the
        CPU, where inductor's compile takes minutes on a small host and the step gains little."""
        return False

    def checkpoint_function(self) -> Callable[..., Any]:
        """The activation-checkpointing function for this backend's tensors: torch's, here."""
        from torch.utils.checkpoint import checkpoint

        return checkpoint

    def layer_scan(self) -> tuple[Callable[..., Any] | None, str]:
        """The loop that compiles one decoder layer and runs it over stacked weights (``scan.scan_layers``), and
        why there is none ("" where there is one): here layers run one after the other anyway (eagerly, or traced
        by torch.compile).

        The function is ``layer_scan(fn, init, xs, checkpoint) -> (carry, ys)``: ``fn(carry, x) -> (carry, y)``
        applied along the leading dimension of every tensor of ``xs``, as ``jax.lax.scan``; ``checkpoint``
        recomputes each iteration's activations in the backward instead of keeping them.
        """
        return None, "scan is torch_xla's"

    def segment_attention(self, device: torch.device) -> Callable[..., torch.Tensor] | None:
        """A fused kernel for causal attention within segments (the samples of packed rows) on ``device``, or
        None where there is none (here: packed rows attend through SDPA with a block-diagonal mask).

        The function is ``kernel(q, k, v, segment_ids, scale)``: ``q``, ``k``, ``v`` of shape ``(batch, heads,
        length, head_dim)`` (as many key heads as query heads), ``segment_ids`` ``(batch, length)`` integers
        (equal: one sample); it returns ``(batch, heads, length, head_dim)``, each query attending to the keys
        at or before it in its own segment, scores scaled by ``scale``.
        """
        return None

    def optimization_barrier(self) -> Callable[[list[torch.Tensor]], None] | None:
        """A function that makes the compiler finish every one of a list of tensors before any op that reads one
        of them (in place), so independent parts of a step run one after another, not all at once; None where
        ops run in the order they are called, as here."""
        return None

    def checkpoint_module(self, module: torch.nn.Module) -> Callable[[], None]:
        """Recomputes ``module``'s activations in the backward (gradient checkpointing of one block), in place:
        its ``forward`` runs under ``checkpoint_function()`` when an input needs gradients. Returns the undo.

        Example:
            >>> undo = backend.current().compute.checkpoint_module(model.layers[0])   # doctest: +SKIP
        """
        function = self.checkpoint_function()
        found = module.__dict__.get("forward")

        original = found if found is not None else type(module).forward.__get__(module)

        def unpacked(count: int, names: tuple[str, ...], *packed: Any) -> Any:
            return original(*packed[:count], **dict(zip(names, packed[count:])))

        def forward(*args: Any, **kwargs: Any) -> Any:
            packed = (*args, *kwargs.values())  # keyword tensors as inputs too: their gradients flow
            if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in packed):
                return original(*args, **kwargs)  # nothing to recompute for: inference, or frozen inputs
            return function(unpacked, len(args), tuple(kwargs), *packed, use_reentrant=False)

        module.forward = forward

        def undo() -> None:
            if found is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = found

        return undo


class Diagnosis(Group):
    """Counters and probes: compiles, executions, host syncs and transfers, CPU fallbacks, live graphs (doctor's), and
    the devices found (setup_tpu's summary)."""

    def found(self, tpu: TpuHardware) -> Found:
        """The devices this backend runs on, as ``setup_tpu`` reports them (``tpu``: the TPU on the PCI bus)."""
        return Found(self.backend.device_type, None, 1, self.backend.name)

    def counters(self) -> Counters:
        return Counters()

    def compile_count(self) -> int:
        """Graphs compiled so far in this process (0 where nothing compiles).

        The training loop's compile notice reads it after every step, so a backend
        whose counters cost more than this one figure answers it alone.
        """
        return self.counters().compiles

    def fallback_ops(self) -> list[str]:
        return []

    def last_compiles(self, n: int) -> list[GraphCompile]:
        """The last ``n`` graphs compiled in this process, oldest first: each one's compile seconds and size.

        Empty where the backend does not time its compiles (an eager backend compiles nothing), so a caller
        that counted ``n`` new graphs with ``compile_count`` may get fewer.
        """
        return []

    def recompile_causes(self) -> dict[str, str]:
        """Why each graph recompiled so far in this process (``{compile id: the guard that failed}``), where the
        compiler says (torch.compile's dynamo); empty where it does not (XLA: ``doctor`` names the causes)."""
        return {}

    def clear_counters(self) -> None:
        """Starts the counters afresh."""

    def watch_host_syncs(self, on_sync: Callable[[SyncKind, str], None]) -> ContextManager[bool]:
        """Calls ``on_sync(kind, op)`` at each host sync of the code run inside.

        Yields whether this backend watches that way. Here it does not (nothing is
        seen); ``NativeDiagnosis`` watches with a dispatch mode, and torch_xla counts
        host syncs in its own counters (``counters().host_syncs``) instead.
        """
        return contextlib.nullcontext(False)

    def unmeasured(self) -> tuple[str, ...]:
        """What neither ``counters()`` nor ``watch_host_syncs`` sees here, each as "what: why"."""
        return (
            "graph compilations: this backend counts none",
            "host syncs: this backend counts none",
            "CPU fallbacks: this backend counts none",
        )

    def pending_ir_nodes(self) -> int:
        """IR nodes live tensors still wait to run (lazy backends); 0 where nothing waits."""
        return 0

    def tensors_created(self) -> int:
        """Device tensors created so far, where the backend counts them; else 0."""
        return 0


class Sharding(Group):
    """Sharding: SPMD over a mesh (XLA), parameters sharded over devices or processes (FSDP), the mesh's counts."""

    def is_spmd(self) -> bool:
        return False

    def over_mesh(self) -> bool:
        """Whether one process can spread a model over a mesh of devices (SPMD: XLA); else one process per device,
        a sharded model's shards held by a job's processes. What a strategy asks to choose its form."""
        return False

    def use_spmd(self) -> None:
        raise ValueError(
            f"SPMD (one process over a mesh of devices) is a torch_xla feature; the {self.backend.name} backend "
            f"runs one process per device: use strategy='auto' or 'multiprocess'"
        )

    def shard_batch(self, tensors: Sequence[torch.Tensor]) -> None:
        """Marks each tensor as split along dim 0 over the SPMD mesh (a cache the size of the batch); nothing elsewhere."""

    def shard_parameters(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
        """Shards every parameter of ``model`` over all devices, ``blocks`` one at a time (FSDP); returns the
        function that removes what it added to the model (its hooks)."""
        raise NotImplementedError(f"strategy='fsdp' is built for XLA (SPMD) and torch.distributed (FSDP2, several "
                                  f"processes); the {self.backend.name} backend has no sharded strategy: use strategy='auto'")  # fmt: skip

    def shard_mesh_2d(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module], split: dict[int, str],
                      tensor: int) -> Callable[[], None]:  # fmt: skip
        """FSDP x tensor parallel over a 2-D mesh of all devices (``tensor`` along its tensor axis): each parameter
        in ``split`` (by ``id``) sharded "column"-wise or "row"-wise over the tensor axis, every parameter over the FSDP axis,
        ``blocks`` gathered one at a time; returns the undo (what it added to the model)."""
        raise NotImplementedError(f"the 2-D mesh (FSDP x tensor parallel) is built for XLA (SPMD) and "
                                  f"torch.distributed (DTensor); the {self.backend.name} backend has none: use strategy='auto'")  # fmt: skip

    def sharded(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` is sharded over the job's processes, so reading it whole is a collective
        every process joins (FSDP2 on the native backend); False here."""
        return False

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Gives loaded (whole) optimizer state the layout of its sharded parameters; nothing where none is."""

    def held_bytes(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The bytes of each tensor this process's (first) device holds: its shard where it is sharded, else
        the whole tensor (here, where nothing is sharded)."""
        return [t.numel() * t.element_size() for t in tensors]

    def process_count(self) -> int:
        """Processes of one SPMD program (hosts of a pod slice); 1 elsewhere."""
        return 1

    def process_index(self) -> int:
        return 0

    def global_device_count(self) -> int:
        return self.backend.processes.world_size()

    def addressable_device_count(self) -> int:
        return 1


class Backend:
    """One accelerator stack, as the rest of the package sees it: a name and device type, and the capability
    groups it holds (``devices``, ``processes``, ``compute``, ``diagnosis``, ``sharding``).

    A backend kind overrides a group by naming its own class (``Devices = XlaDevices``); everything here
    is the answer of one eager process that runs alone (no replicas, no graphs, no step boundary).

    Example:
        >>> Backend().processes.world_size()
        1
    """

    name: str = "cpu"
    device_type: str = "cpu"
    lazy: bool = False  # tensors build graphs that run at a step boundary (sync)
    # which core counts run: "one_or_all" (XLA), "up_to_available" (GPUs), "any" (CPU processes)
    core_rule: str = "any"

    Devices: type[Devices] = Devices
    Processes: type[Processes] = Processes
    Compute: type[Compute] = Compute
    Diagnosis: type[Diagnosis] = Diagnosis
    Sharding: type[Sharding] = Sharding

    def __init__(self) -> None:
        self.devices = self.Devices(self)
        self.processes = self.Processes(self)
        self.compute = self.Compute(self)
        self.diagnosis = self.Diagnosis(self)
        self.sharding = self.Sharding(self)

    def started(self) -> bool:
        """True once this backend's runtime runs here, so the choice can no longer change."""
        return False
