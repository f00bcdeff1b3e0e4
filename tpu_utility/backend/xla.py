"""The torch_xla backend: the one module that talks to torch_xla.

It answers "is an XLA device here, and which
kind?" without importing torch_xla or starting its runtime, and maps torch_xla's
API across versions 2.5 to 2.9+: ``torch_xla.device``/``sync``/``launch`` and
``torch_xla.runtime`` stand in for xla_model's deprecated device and step calls
and its removed world-size and ordinal calls.

torch_xla is imported lazily, inside functions: importing it has side effects
(it registers the XLA backend and reads ``PJRT_DEVICE``), and starting its
runtime before a multi-process launch breaks the launch.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import sys
import warnings
from typing import Any, Callable, Sequence

import torch

from . import choice
from .base import Backend, Compute, Counters, GraphCompile, Devices, Diagnosis, Found, Processes, ReduceOp, Sharding
from .hardware import TpuHardware, detect_tpu, device_name_override, memory_override, pjrt_device, tpu_device_memory
from .versions import INSTALL_HINT, module_installed, check_versions, installed_version, torch_tpu_installed

XLA_INSTALLED: bool = module_installed("torch_xla")


def xla_requested() -> bool:
    """True when XLA should be used: torch_xla installed, and asked for (``backend="xla"``), or with
    ``backend="auto"`` a TPU attached or PJRT_DEVICE set, in a process not in a gloo or nccl job."""
    name, _ = choice.asked()
    if name != "auto":
        return name == "xla" and XLA_INSTALLED
    return XLA_INSTALLED and choice.native_job() is None and (pjrt_device() is not None or detect_tpu().chips > 0)


def spawn_in_this_process() -> None:
    """Makes ``xmp.spawn`` (and ``torch_xla.launch``, which calls it) run its function in this process, on the
    runtime already started, as torch_xla's own one-process path does: ``port --check`` runs a launching program's
    first steps this way. Nothing where torch_xla is not installed."""
    try:
        import torch_xla.distributed.xla_multiprocessing as xmp
    except ImportError:
        return
    spawn = xmp.spawn

    def one_process(fn: Any, args: tuple = (), nprocs: int | None = None, join: bool = True, daemon: bool = False,
                    start_method: str = "spawn") -> Any:  # fmt: skip
        return spawn(fn, args=args, nprocs=1, join=join, daemon=daemon, start_method=start_method)

    xmp.spawn = one_process


def xla_loaded() -> bool:
    """True when torch_xla has already been imported in this process."""
    return "torch_xla" in sys.modules


def require_xla() -> Any:
    """Imports torch_xla, or raises ModuleNotFoundError with the install command.

    Cheap once the runtime runs (every ``sync`` and ``step_optimizer`` comes here):
    the checks below passed before it started.
    """
    if runtime_started():
        return sys.modules["torch_xla"]
    if not XLA_INSTALLED:
        raise ModuleNotFoundError(f"torch_xla is not installed. Install it with: {INSTALL_HINT}")
    check_versions(torch.__version__, installed_version("torch_xla"))
    refuse_missing_tpu(pjrt_device())
    module = importlib.import_module("torch_xla")
    _quiet_profiler_jax_probe()
    return module


@functools.lru_cache(maxsize=None)
def _quiet_profiler_jax_probe() -> None:
    """Stops torch_xla 2.8 printing a jax warning several times per batch.

    Its profiler traces, which MpDeviceLoader opens around every batch, probe for jax and,
    without jax, log "You are trying to use a feature that requires jax/pallas" to the root
    logger each time; 2.9 probes quietly. Only the profiler's probe is silenced: a real
    jax/pallas feature still warns.
    """
    if module_installed("jax"):
        return
    profiler = importlib.import_module("torch_xla.debug.profiler")
    probe = getattr(profiler, "maybe_get_jax", None)
    if probe is not None and "log" not in inspect.signature(probe).parameters:  # 2.8; 2.9 has log=
        profiler.maybe_get_jax = lambda: None


# The PJRT devices tpu_utility runs XLA on; torch_xla knows others (CUDA, NEURON), untested and unsupported here.
PJRT_DEVICES = ("TPU", "CPU")


def refuse_missing_tpu(requested: str | None) -> None:
    """Refuses a ``PJRT_DEVICE`` this package does not run XLA on, and TPU on a machine without one.

    torch_xla's own failures here are a plugin error, or a C++ error deep in client start-up.

    Raises:
        ValueError: ``PJRT_DEVICE`` is neither TPU nor CPU (for CUDA: unset it, for PyTorch's own GPU device).
        RuntimeError: TPU is requested and no TPU chip is attached.
    """
    if requested is not None and requested not in PJRT_DEVICES:
        given = os.environ.get("PJRT_DEVICE", requested)
        cuda = (" For a GPU, unset PJRT_DEVICE: tpu_utility then trains on CUDA through PyTorch's own device "
                "(backend 'native')") if requested in ("CUDA", "GPU") else ""  # fmt: skip
        raise ValueError(f"PJRT_DEVICE={given!r} is not one of {PJRT_DEVICES}, the devices tpu_utility runs XLA on; "
                         f"set PJRT_DEVICE=TPU or CPU, or unset it.{cuda}")  # fmt: skip
    if requested == "TPU" and detect_tpu().chips == 0:
        raise RuntimeError(
            "PJRT_DEVICE='TPU' is requested but this machine has no TPU chip (no Google TPU on "
            "the PCI bus). Allowed here: unset PJRT_DEVICE to fall back to CUDA/CPU, or use "
            "'CPU' to run XLA on the host CPU."
        )


def requested_device(device: str, name: str, tpu: TpuHardware) -> str | None:
    """The PJRT device ("TPU" or "CPU") that ``setup_tpu(device=device, backend=name)`` asks torch_xla for, or None
    where XLA does not run: ``PJRT_DEVICE`` first, then ``device``, then a TPU attached (``tpu``), then XLA:CPU for
    ``backend="xla"``. Checked before the backend is chosen, so a conflict is named before anything changes.

    Raises:
        ValueError: ``device`` names an XLA device while ``name`` rules XLA out; a ``PJRT_DEVICE`` that is neither
            TPU nor CPU.
        RuntimeError: ``device`` and ``PJRT_DEVICE`` disagree, the runtime already runs on another device type, or
            TPU is asked for on a machine without one.
        ModuleNotFoundError: a PJRT device is asked for and torch_xla is not installed.
    """
    forced_xla = choice.runs_xla(name)
    if forced_xla is False and device != "auto":
        raise ValueError(
            f"setup_tpu(device={device!r}) picks an XLA device, but backend={name!r} does not run XLA: "
            f"give device='auto' with it, or backend='xla'"
        )
    user_choice = None if forced_xla is False else pjrt_device()
    refuse_missing_tpu(user_choice)  # a PJRT_DEVICE we do not run (CUDA, garbage), before any other check
    if device != "auto" and user_choice is not None and user_choice != device:
        raise RuntimeError(
            f"setup_tpu(device={device!r}) conflicts with PJRT_DEVICE={user_choice!r} set in "
            f"the environment. Unset one of them."
        )
    xla_default = "TPU" if tpu.chips else ("CPU" if forced_xla else None)
    wanted = user_choice or (device if device != "auto" else xla_default)
    running = runtime_device_type()
    if running is not None and wanted is not None and running != wanted:
        raise RuntimeError(
            f"The XLA runtime already started on {running!r} in this process, so it cannot "
            f"switch to {wanted!r}. Restart the kernel and call setup_tpu() first."
        )
    refuse_missing_tpu(wanted)
    if wanted is not None and not XLA_INSTALLED:
        also = " (torch_tpu is installed: unset PJRT_DEVICE to run on TorchTPU instead)" if torch_tpu_installed() else ""
        raise ModuleNotFoundError(f"PJRT_DEVICE={wanted!r} needs torch_xla{also}. Install it with: {INSTALL_HINT}")
    return wanted


def use_device(wanted: str) -> None:
    """Sets ``PJRT_DEVICE`` for this process (``requested_device``'s answer), before torch_xla's runtime starts; says
    so where TorchTPU is installed, which this process then does not use (a warning on ``setup_tpu``'s caller)."""
    os.environ["PJRT_DEVICE"] = wanted
    if torch_tpu_installed():
        warnings.warn(
            f"torch_tpu (TorchTPU, device 'tpu') is installed, but tpu_utility runs on torch_xla (device 'xla') "
            f"in this process, because PJRT_DEVICE={wanted!r} asks for it. Start without PJRT_DEVICE (and "
            f"without setup_tpu(device=...)), or call setup_tpu(backend='tpu'), to use TorchTPU.",
            stacklevel=3,
        )


# torch_xla 2.8/2.9 on a TPU write compiled programs to the persistent cache but never load them: its
# DeserializeComputation calls PjRtClient::DeserializeExecutable, which libtpu's PJRT C API client leaves
# unimplemented ("Failed to deserialize executable: UNIMPLEMENTED: Deserializing serialized executable not
# supported", pytorch/xla#9094, open; the fix, pytorch/xla#9759, calls LoadSerializedExecutable and is not
# released). So the cache is off by default and the summary says why; `python -m tpu_utility.check` measures
# on a TPU whether a second run is faster.
CACHE_ON_TPU = "off (torch_xla 2.8/2.9 on TPU write compiled programs but cannot load them back: pytorch/xla#9094)"
CACHE_OFF = {"CPU": "off (XLA:CPU cannot reload compiled programs)", "TPU": CACHE_ON_TPU}


def _check_folder(folder: str, given: str | None) -> None:
    """The compile cache's folder (or one above it) that is a file is named, not a bare FileExistsError."""
    probe = folder
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        probe = parent if parent != probe else ""
    if probe and not os.path.isdir(probe):
        raise ValueError(f"cache_dir={given if given is not None else folder!r} cannot be made: {probe!r} is a file, "
                         f"not a folder; give a folder path for the compile cache")  # fmt: skip


def runtime_started() -> bool:
    """True when torch_xla's runtime is running in this process (never starts it)."""
    if not xla_loaded():
        return False
    return bool(sys.modules["torch_xla"]._XLAC._xla_runtime_is_initialized())


def runtime_device_type() -> str | None:
    """The device type the running runtime uses ("TPU", "CPU"...), or None if not started."""
    if not runtime_started():
        return None
    import torch_xla

    return torch_xla.real_devices()[0].split(":")[0] if hasattr(torch_xla, "real_devices") else pjrt_device()


def in_launched_process() -> bool:
    """True inside a process started by torch_xla.launch / xmp.spawn."""
    return "PJRT_LOCAL_PROCESS_RANK" in os.environ


def local_process_rank() -> int | None:
    rank = os.environ.get("PJRT_LOCAL_PROCESS_RANK")
    return int(rank) if rank is not None else None


# ----------------------------------------------------------------- devices
CPU_BACKWARD_FIRST = (
    "A backward pass ran on the CPU before torch_xla's runtime started in this process (a CPU check of the "
    "model, a CPU baseline), so PyTorch's autograd engine has no queue for XLA devices: every XLA backward in "
    "this process would fail with 'device_ready_queues_ ... INTERNAL ASSERT FAILED' (pytorch/xla#4174). "
    "Restart the runtime (the notebook's kernel) and call setup_tpu() first, in the first cell: it starts "
    "the XLA runtime, and from then on CPU and XLA backward passes may come in any order."
)
_autograd_ready = False
MIXED_FLOATS = (
    "XLA refused to compile the step: one of its operations mixes floating-point types of different precisions, "
    "which XLA does not promote (its HLO verifier: 'mixed precision is disallowed'), for example a model cast to "
    "bfloat16 given float32 batches; on the CPU PyTorch refuses the same step ('mat1 and mat2 must have the same "
    "dtype'). Give precision='bf16' (bf16 compute for the model as it is: autocast on a TPU, the batches' floats "
    "cast on XLA:CPU), cast the batches to the model's dtype in your train_step, or keep the model in float32. "
    "The model's weights went into the refused step and cannot be read back: build or load it again first."
)


def _check_autograd(dev: torch.device) -> None:
    """One small backward on ``dev``, traced, never run: the autograd engine sizes its device queues at
    the first backward of the process, so this is that first one once the runtime runs, or it finds the trap
    already sprung and says so (instead of the engine's internal assert at the user's first backward)."""
    global _autograd_ready
    if _autograd_ready:
        return
    probe = torch.ones(2, device=dev, requires_grad=True)
    try:
        with torch.enable_grad():  # a first get_device() inside torch.no_grad() too
            (probe * 2).sum().backward()  # with an op between: a bare leaf's sum (or a 0-dim one) fails under SPMD
    except RuntimeError as error:
        if "device_ready_queues_" in str(error):
            raise RuntimeError(CPU_BACKWARD_FIRST) from None
        raise
    _autograd_ready = True


def global_device_count() -> int:
    """All XLA devices of the job (the SPMD mesh size). Starts the runtime."""
    require_xla()
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def world_size() -> int:
    """Replicas (processes x threads) of a torch_xla launch, without starting a runtime needlessly (1 outside one)."""
    if xla_loaded() and (runtime_started() or in_launched_process()):
        import torch_xla.runtime as xr

        return xr.world_size()
    return 1


def initialize_cache(path: str) -> bool:
    """Turns on the persistent compile cache; False if it is too late in this process."""
    require_xla()
    import torch_xla
    import torch_xla.runtime as xr

    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        return os.environ.get("XLA_PERSISTENT_CACHE_PATH") == path
    xr.initialize_cache(path, readonly=False)
    return True


# --------------------------------------------------------------- training
def checkpoint(function: Callable[..., Any], *args: Any, use_reentrant: bool | None = None, **kwargs: Any) -> Any:
    """torch_xla's activation checkpoint, called as torch's is.

    torch's ``torch.utils.checkpoint.checkpoint`` fails on XLA tensors (it looks up
    ``torch.xla`` for their RNG state), and XLA's common-subexpression pass would undo
    its recomputation; torch_xla's keeps it with an optimization barrier. It runs only
    the re-entrant variant, so ``use_reentrant=False`` (transformers' default) is run
    re-entrantly: transformers makes the inputs require grad for that case.
    """
    from torch_xla.utils.checkpoint import checkpoint as xla_checkpoint

    return xla_checkpoint(function, *args, use_reentrant=True, **kwargs)


# ------------------------------------------------------------------- SPMD
def use_spmd() -> None:
    """Switches this process to SPMD (one process, the mesh of all devices).

    Raises:
        RuntimeError: the runtime already runs without SPMD (something touched
            the XLA device first). Switching then would move live tensors to a
            virtual device, which crashes the process with several devices.
    """
    torch_xla = require_xla()
    import torch_xla.runtime as xr

    from .xla_log import say_once

    say_once()  # GSPMD's deprecation notice, once per compiled graph: said once
    if xr.is_spmd():
        return
    if torch_xla._XLAC._xla_get_spmd_config_is_locked():
        raise RuntimeError(
            "cores='all' needs SPMD, but the XLA runtime already started without it in this "
            "process (something used the XLA device first: find_lr, get_device(), a tensor on "
            "'xla'). Call setup_tpu() first thing (it switches SPMD on when several XLA devices "
            "are visible), or restart the kernel and train with cores='all' before other XLA work."
        )
    xr.use_spmd()


def is_spmd() -> bool:
    if not xla_loaded():
        return False
    import torch_xla.runtime as xr

    return xr.is_spmd()


@functools.lru_cache(maxsize=None)
def _fsdp_mesh(devices: int) -> Any:
    """The 1-D mesh (axis "fsdp", FSDPv2's name) that parameters are sharded over: the data mesh's devices, in its
    order, so a batch sharded over one lines up with the other."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(devices), (devices,), ("fsdp",))


def shard_parameters(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
    """FSDPv2's steps (``SpmdFullyShardedDataParallel``) on the model as it is: each parameter sharded on its
    largest dimension over the "fsdp" mesh, an optimization barrier after each block's backward (and the
    root's), so the compiler gathers one block's weights at a time. Applied in place rather than through
    the wrapper class, whose ``_orig_module.`` renames every state_dict key (huggingface/transformers#36004):
    checkpoints and the trained model keep the model's own key names. Returns the undo (the hooks removed).
    """
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    mesh = _fsdp_mesh(global_device_count())
    for param in model.parameters():
        xs.mark_sharding(param, mesh, _prepare_spmd_partition_spec(param, shard_maximal=True))
    return _barriers(model, blocks)


def _barriers(model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
    """An optimization barrier after each block's backward (and the root's), so the compiler gathers one block's
    weights at a time; returns the undo (the hooks removed)."""
    import torch_xla.distributed.spmd as xs

    # a transformers model (or a peft model of one) returns a ModelOutput, for which torch never calls a full
    # backward hook (and warns so at every run): the root's barrier is left out where it could not act
    transformers = sys.modules.get("transformers")
    root = [] if _returns(model, getattr(transformers, "PreTrainedModel", ())) else [model]
    added = []
    for module in (*blocks, *root):
        before = set(module._backward_hooks)
        xs.xla_sharding.apply_backward_optimization_barrier(module)
        added += [(module, key) for key in set(module._backward_hooks) - before]

    def undo() -> None:
        for module, key in added:
            module._backward_hooks.pop(key, None)
            module._is_full_backward_hook = None if not module._backward_hooks else module._is_full_backward_hook

    return undo


@functools.lru_cache(maxsize=None)
def _mesh_2d(devices: int, tensor: int) -> Any:
    """The 2-D mesh ("fsdp", "tensor") of ``devices`` devices, ``tensor`` along the tensor axis: neighbours in the
    data mesh's order share a tensor group."""
    import numpy as np
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(devices), (devices // tensor, tensor), ("fsdp", "tensor"))


def shard_mesh_2d(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], split: dict[int, str],
                  tensor: int) -> Callable[[], None]:  # fmt: skip
    """FSDP x tensor parallel on a 2-D SPMD mesh: each parameter in ``split`` (by ``id``) sharded column-wise (a projection
    whose output features split over "tensor", its input over "fsdp") or row-wise (the reverse), every other
    one as FSDPv2 shards it (its largest dimension over "fsdp", whole along "tensor"); the blocks' backward
    barriers as ``shard_parameters`` puts them. Returns the undo (the barriers' hooks removed)."""
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

    mesh = _mesh_2d(global_device_count(), tensor)
    column, row = ("tensor", "fsdp"), ("fsdp", "tensor")
    for param in model.parameters():
        kind = split.get(id(param))
        if kind is None:
            spec = _prepare_spmd_partition_spec(param, shard_maximal=True)
        elif param.dim() > 1:  # a weight (out features, in features)
            spec = column if kind == "column" else row
        else:  # a bias: a column projection's split with its outputs, a row projection's whole
            spec = ("tensor",) if kind == "column" else (None,)
        xs.mark_sharding(param, mesh, spec)
    return _barriers(model, blocks)


def scan_shards_backward() -> bool:
    """Whether torch_xla's scan can run its backward under SPMD here: it shards each gradient as its input through
    JAX's ``shard_alike`` (``shard_as``), which needs JAX and a TPU client (XLA:CPU raises 'Jax is required')."""
    return module_installed("jax") and runtime_device_type() == "TPU"


def _returns(model: torch.nn.Module, kind: Any) -> bool:
    """Whether ``model`` (or the model inside a peft wrapper) is of ``kind``, found without importing its library."""
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return bool(kind) and isinstance(inner, kind)


def _data_mesh(devices: int) -> Any:
    """The 1-D mesh of ``devices`` devices (axis "data") that batches are sharded over.

    One object per size: torch_xla caches the shardings it derives per mesh object.
    """
    import numpy as np
    import torch_xla.distributed.spmd as xs

    return xs.Mesh(np.arange(devices), (devices,), ("data",))


class _BatchSharding:
    """Shards every tensor of a batch along dim 0 over a 1-D data mesh.

    torch_xla's ShardingSpec applies only to tensors of its own rank; a batch
    holds images (4-D) and labels (1-D), so we build one spec per rank.
    ``minibatch=True`` says each host's loader yields only its own share of the
    global batch (several hosts on a pod slice).
    """

    def __init__(self, mesh: Any, minibatch: bool = False) -> None:
        self._mesh, self.minibatch = mesh, minibatch
        self._specs: dict[int, Any] = {}

    def xla_spec(self, t: torch.Tensor) -> Any:
        import torch_xla.distributed.spmd as xs

        if t.dim() == 0:
            return None
        if t.dim() not in self._specs:
            partition = ("data",) + (None,) * (t.dim() - 1)
            self._specs[t.dim()] = xs.ShardingSpec(self._mesh, partition, minibatch=self.minibatch)
        return self._specs[t.dim()].xla_spec(t)


class _Relay:
    """Iterates the host loader for torch_xla's loader thread, keeping its exception.

    torch_xla's loader thread swallows an exception raised by the user's
    Dataset: the epoch would just end early. The relay ends the iteration
    cleanly and keeps the exception for the caller to raise.
    """

    def __init__(self, loader: Any) -> None:
        self.loader, self.error = loader, None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        try:
            yield from self.loader
        except Exception as error:  # noqa: BLE001 - re-raised in the caller's thread
            self.error = error


def all_gather(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Concatenates each tensor over replicas along dim 0; identity on one replica."""
    if world_size() == 1:
        return tensors
    import torch_xla.core.xla_model as xm

    return [xm.all_gather(t, dim=0) for t in tensors]


def gather_all_tensors(tensor: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """torchmetrics' ``dist_sync_fn``: one tensor per replica, over XLA collectives."""
    gathered = all_gather([tensor.unsqueeze(0)])[0]
    return list(gathered.unbind(0))


def local_shards(t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Each device's piece of an XLA tensor (SPMD-sharded or not), as (device, CPU tensor)."""
    import torch_xla

    return [(dev, data.cpu()) for data, dev in torch_xla._XLAC._get_local_shards([t])[0]]


# ---------------------------------------------------------------- metrics
def compile_count() -> int:
    """Graphs compiled so far in this process (torch_xla's CompileTime metric)."""
    if not xla_loaded():
        return 0
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def last_compiles(n: int) -> list[GraphCompile]:
    """The last ``n`` graphs compiled in this process, oldest first, from torch_xla's own metrics: each
    CompileTime sample (one per compile, in nanoseconds) with the TensorsGraphSize sample (the IR nodes of
    the graph synced) that torch_xla records just after it, at the end of the same sync. torch_xla keeps a window of the last
    samples (1,024 by default), so ask right after the compiles; reading them starts nothing."""
    if n <= 0 or not xla_loaded():
        return []
    import bisect

    import torch_xla.debug.metrics as met

    times, sizes = met.metric_data("CompileTime"), met.metric_data("TensorsGraphSize")
    stamps = [stamp for stamp, _ in sizes[2]] if sizes else []
    found = []
    for stamp, nanoseconds in (times[2][-n:] if times else ()):
        at = bisect.bisect_left(stamps, stamp)
        found.append(GraphCompile(nanoseconds / 1e9, int(sizes[2][at][1]) if at < len(stamps) else None))
    return found


def execute_count() -> int:
    """Graphs run on the device so far (torch_xla's ExecuteTime metric): one per graph cut with work."""
    if not xla_loaded():
        return 0
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteTime")
    return int(data[0]) if data else 0


def host_sync_count() -> int:
    """Device-to-host reads forced by Python (``.item()``, ``bool(t)``, printing)."""
    if not xla_loaded():
        return 0
    import torch_xla.debug.metrics as met

    return int(met.counter_value("aten::_local_scalar_dense") or 0)


def transfer_from_device_count() -> int:
    """Times tensors were copied device-to-host (``.cpu()``, ``.item()``, ...)."""
    if not xla_loaded():
        return 0
    import torch_xla.debug.metrics as met

    data = met.metric_data("TransferFromDeviceTime")
    return int(data[0]) if data else 0


def _replicated(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors, each that may be sharded (pending ones included) replaced by a copy every device holds whole.

    The copies run in one graph with the tensors themselves (which become device
    data, as a transfer would leave them), the same graph at every call with these
    shapes; a transfer then reads one device's copy.
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs

    spec = torch_xla._XLAC._get_xla_sharding_spec
    copies = {}
    for i, t in enumerate(tensors):
        if t.numel() and t.dim() and spec(t) != "{replicated}":
            copies[i] = torch.cat([t.detach()])  # a node of its own: a clone would share the tensor's data
            xs.mark_sharding(copies[i], _data_mesh(global_device_count()), (None,) * t.dim())
    if not copies:
        return tensors
    torch_xla._XLAC._xla_sync_multi([*tensors, *copies.values()], devices=[], wait=False)
    return [copies.get(i, t) for i, t in enumerate(tensors)]


def _from_shards(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor sharded over this host's devices, put together on the host from their shards (a transfer each, no
    graph, never whole on a device); None where a part of it lives on another host's devices."""
    import torch_xla

    shards = torch_xla._XLAC._get_local_shards([t])[0]
    places = torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]
    whole, filled = torch.empty(t.shape, dtype=t.dtype), set()
    for (data, _), (_, indices) in zip(shards, places):
        if indices is Ellipsis:  # replicated over the devices: any one shard is the whole
            return data.clone()
        region = tuple(indices)
        key = tuple((s.start, s.stop) for s in region)
        if key not in filled:  # a partly replicated sharding holds a region on several devices
            whole[region] = data[tuple(slice(0, s.stop - s.start) for s in region)]  # its padding left out
            filled.add(key)
    covered = sum(torch.Size(stop - start for start, stop in key).numel() for key in filled)
    return whole if covered == t.numel() else None


class XlaDevices(Devices):
    """The XLA device, the step boundary (``torch_xla.sync``), torch_xla's device loader, one-transfer host copies."""

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend)
        self._hardware: str | None = None  # fixed once the runtime runs

    def device(self, index: int | None = None) -> torch.device:
        """The XLA device (this process's, or core ``index``). Starts the runtime.

        Raises:
            RuntimeError: a CPU backward pass ran before the runtime started (``CPU_BACKWARD_FIRST``).
        """
        torch_xla = require_xla()
        chosen = torch_xla.device(index)
        _check_autograd(chosen)
        return chosen

    def device_count(self) -> int:
        """XLA devices this job could use, counted without starting the runtime."""
        if not xla_requested():
            return 1
        kind = pjrt_device() or ("TPU" if detect_tpu().chips else "CPU")  # unset: what torch_xla's import picks
        if kind == "TPU":
            return detect_tpu().devices
        return int(os.environ.get(f"{kind}_NUM_DEVICES", "1"))

    def sync(self, wait: bool = False) -> None:
        """Cuts the lazy graph here and runs it (torch_xla.sync)."""
        torch_xla = require_xla()
        torch_xla.sync(wait=wait)  # since torch_xla 2.4

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def skip_next_loader_sync(self) -> None:
        """Tells torch_xla's MpDeviceLoader that the graph was just cut, so its next batch skips its own cut
        (torch_xla's own flag, which its StepTrace sets for the same reason)."""
        import torch_xla.debug.profiler as xp

        xp.set_tracer_marked_step(True)

    def device_loader(self, loader: Any, device: torch.device, spmd_devices: int | None = None,
                      minibatch: bool = False) -> Any:  # fmt: skip
        """torch_xla's MpDeviceLoader: background host-to-device copies, one graph cut per batch.

        With ``spmd_devices``, each batch is sharded along dim 0 over that many
        devices; ``minibatch`` when each host loads only its share. An exception in
        the user's Dataset or collate_fn is raised here, in the caller's thread.
        """
        import torch_xla.distributed.parallel_loader as pl

        sharding = _BatchSharding(_data_mesh(spmd_devices), minibatch) if spmd_devices else None
        relay = _Relay(loader)
        batches = pl.MpDeviceLoader(relay, device, input_sharding=sharding)

        def relayed() -> Any:
            import torch_xla.debug.profiler as xp

            xp.set_tracer_marked_step(False)  # a cut left marked by an earlier loop is not this loop's
            try:
                yield from batches  # each batch cuts the graph of the step before it: a refused graph raises here
            except ValueError as error:
                if "mixed precision is disallowed" in str(error):
                    raise TypeError(MIXED_FLOATS) from error
                raise
            if relay.error is not None:
                raise relay.error

        return relayed()

    def to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Copies XLA tensors to the host in one transfer (CPU tensors pass through).

        Under SPMD, tensors sharded over the devices (a batch, an output computed from
        one) are first made whole on every device in one graph, which compiles once for
        their shapes: torch_xla's own transfer of a sharded tensor gathers its shards
        with a program that it compiles anew at every transfer.
        """
        xla = [t for t in tensors if t.device.type == "xla"]
        if not xla:
            return [t.detach().cpu() for t in tensors]
        import torch_xla

        if is_spmd():
            xla = _replicated(xla)
        moved = iter(torch_xla._XLAC._xla_get_cpu_tensors(xla))
        return [next(moved) if t.device.type == "xla" else t.detach().cpu() for t in tensors]

    def state_to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """As ``to_cpu``, but a tensor sharded over the devices (an FSDP model's parameters, their optimizer
        state) is put together on the host from its shards: never whole on a device (where a model that
        only fits sharded could not be), and no graph to compile for it."""
        import torch_xla

        spec = torch_xla._XLAC._get_xla_sharding_spec
        sharded = [i for i, t in enumerate(tensors)
                   if t.device.type == "xla" and t.dim() and t.numel() and spec(t) not in ("", "{replicated}")]  # fmt: skip
        if not is_spmd() or not sharded:
            return self.to_cpu(tensors)
        torch_xla._XLAC._xla_sync_multi([tensors[i] for i in sharded], devices=[], wait=True)  # pending -> device data
        whole = {i: _from_shards(tensors[i]) for i in sharded}
        rest = [i for i in range(len(tensors)) if whole.get(i) is None]
        whole.update(zip(rest, self.to_cpu([tensors[i] for i in rest])))
        return [whole[i] for i in range(len(tensors))]

    def hardware(self, device: torch.device) -> str | None:
        if not self.owns(device):
            return None
        if self._hardware is None:  # fixed once the runtime runs, so asked once, not at every step
            started = runtime_device_type()
            if started is None:
                return pjrt_device() or ("TPU" if detect_tpu().chips else None)
            self._hardware = started
        return self._hardware

    def device_memory(self, device: torch.device) -> int | None:
        """The override, else the TPU table's figure for the chip found on the PCI bus; None on XLA:CPU."""
        override = memory_override()
        if override is not None or self.hardware(device) != "TPU":
            return override
        return tpu_device_memory(detect_tpu().kind)

    def chip_name(self, device: torch.device) -> str | None:
        """The override, else the TPU kind found on the PCI bus ("v5e"); None on XLA:CPU."""
        named = device_name_override()
        if named is not None or self.hardware(device) != "TPU":
            return named
        return detect_tpu().kind

    def rng_state(self) -> int:
        import torch_xla.core.xla_model as xm

        return int(xm.get_rng_state())

    def set_rng_state(self, state: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(state)


class XlaProcesses(Processes):
    """One process per chip (``torch_xla.launch``), xla_model's collectives."""

    world_size = staticmethod(world_size)

    def rank(self) -> int:
        """This replica's global rank (xr.global_ordinal); 0 outside a launch."""
        if xla_loaded() and (runtime_started() or in_launched_process()):
            import torch_xla.runtime as xr

            return xr.global_ordinal()
        return 0

    in_launched_process = staticmethod(in_launched_process)

    def launch(self, fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
        """Runs ``fn(index, *args)`` once per device in fresh processes (torch_xla starts one per chip itself);
        with one device whose runtime already runs here (``setup_tpu`` started it), this process is the replica.

        Raises:
            RuntimeError: the runtime already runs here with several devices, so no launch can follow.
        """
        if runtime_started() and not is_spmd() and self.backend.sharding.addressable_device_count() == 1:
            fn(0, *args)
            return
        torch_xla = require_xla()
        if runtime_started():
            raise RuntimeError(
                "The XLA runtime already started in this process, so a multi-process launch "
                "cannot follow. Restart the kernel and launch before touching the XLA device "
                "(no get_device(), no tensors on 'xla'), or use one process for all cores: "
                "use_all_cores() in a hand-written loop, strategy='spmd' in one_cycle_fit."
            )
        if hasattr(torch_xla, "launch"):
            torch_xla.launch(fn, args=args, start_method=start_method)
        else:  # torch_xla < 2.5
            import torch_xla.distributed.xla_multiprocessing as xmp

            xmp.spawn(fn, args=args, start_method=start_method)

    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp = "sum") -> list[torch.Tensor]:
        """Reduces each tensor over replicas ("sum", "min" or "max"); identity on one replica.

        Under SPMD there is one replica: the graph already spans every device.
        """
        if world_size() == 1:
            return tensors
        import torch_xla.core.xla_model as xm

        reduce_type = {"sum": xm.REDUCE_SUM, "min": xm.REDUCE_MIN, "max": xm.REDUCE_MAX}[op]
        return [xm.all_reduce(reduce_type, t) for t in tensors]

    all_gather = staticmethod(all_gather)

    def barrier(self, tag: str) -> None:
        """Waits until every replica gets here (xm.rendezvous)."""
        if world_size() == 1:
            return
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """All-reduces (averages) gradients across replicas; a no-op on one replica."""
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer)

    def metric_sync_fn(self) -> Callable[..., list[torch.Tensor]] | None:
        return gather_all_tensors if world_size() > 1 else None


class XlaCompute(Compute):
    """torch_xla's autocast (TPU only), its sync-free Adam/AdamW and its activation checkpointing."""

    def bf16_autocast_available(self) -> bool:
        """torch_xla's autocast supports TPU (and CUDA builds), but refuses XLA:CPU; False while no runtime runs."""
        return runtime_device_type() == "TPU"

    def fp16_available(self) -> bool:
        """TPUs compute in bfloat16 and XLA:CPU has no autocast at all: no float16 path to scale."""
        return False

    def autocast(self, device: torch.device, dtype: torch.dtype) -> Any:
        from torch_xla.amp import autocast as xla_autocast

        return xla_autocast(device, dtype=dtype)

    def graph_compiler(self) -> str | None:
        """XLA: torch_xla traces every step into a graph and compiles it (inductor does not target XLA)."""
        return "XLA"

    def compile_cache(self, folder: str, given: str | None, enabled: bool | None) -> tuple[str | None, str]:
        """torch_xla's persistent cache: off unless ``enabled`` is True (None: on where torch_xla can reload compiled
        programs, which at 2.8/2.9 is nowhere: ``CACHE_OFF`` says why), and then too late once XLA compiled a graph
        in this process (a warning on ``setup_tpu``'s caller)."""
        if enabled is None:
            return None, CACHE_OFF.get(pjrt_device() or "", "off")
        if not enabled:
            return None, "off"
        _check_folder(folder, given)
        os.makedirs(folder, exist_ok=True)
        if initialize_cache(folder):
            return folder, "off"
        warnings.warn(
            "The compile cache could not be switched on: XLA already compiled a graph in "
            "this process. Call setup_tpu() before any XLA work to keep compiled graphs "
            "across kernel restarts.",
            stacklevel=3,
        )
        return None, "off"

    def checkpoint_function(self) -> Callable[..., Any]:
        return checkpoint

    def layer_scan(self) -> tuple[Callable[..., Any] | None, str]:
        """torch_xla's ``scan`` (``torch_xla.experimental.scan``, 2.6 and later): ``fn`` traced once by AOTAutograd,
        its forward and backward each a loop body; its trace cached per function object (``is_fn_pure``), so a
        caller keeps one function per kind of call. ``checkpoint``: min-cut rematerialization (scan's own policy).
        Under SPMD its backward shards the gradients like the inputs through JAX's ``shard_alike``, which needs
        JAX with a TPU client: elsewhere (XLA:CPU's devices) there is none."""
        if self.backend.sharding.is_spmd() and not scan_shards_backward():
            return None, ("under SPMD torch_xla's scan shards its backward through JAX, which needs JAX on a TPU "
                          "(pip install 'torch_xla[pallas]')")  # fmt: skip
        from functorch.compile import default_partition, min_cut_rematerialization_partition
        from torch_xla.experimental.scan import scan

        def layer_scan(fn: Callable[..., Any], init: Any, xs: Any, checkpoint: bool = False) -> Any:
            partition = min_cut_rematerialization_partition if checkpoint else default_partition
            return scan(fn, init, xs, partition_fn=partition, is_fn_pure=True)

        return layer_scan, ""

    def segment_attention(self, device: torch.device) -> Callable[..., torch.Tensor] | None:
        """torch_xla's Pallas flash attention with segment ids, on one TPU device where the installed torch_xla has
        it (``flash_attention(..., q_segment_ids=, kv_segment_ids=)``, 2.8 and 2.9) and JAX is installed (its
        kernels are JAX's: ``pip install 'torch_xla[pallas]'``); None elsewhere: XLA:CPU, or SPMD, whose sharded
        call takes no segment ids in torch_xla 2.9."""
        if self.backend.devices.hardware(device) != "TPU" or self.backend.sharding.is_spmd():
            return None
        if not module_installed("jax"):
            return None
        from torch_xla.experimental.custom_kernel import flash_attention

        if "q_segment_ids" not in inspect.signature(flash_attention).parameters:
            return None

        def torch_xla_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                                      scale: float) -> torch.Tensor:  # fmt: skip
            ids = segment_ids.to(torch.int32)
            return flash_attention(q, k, v, causal=True, q_segment_ids=ids, kv_segment_ids=ids, sm_scale=scale)

        return torch_xla_flash_attention

    def optimization_barrier(self) -> Callable[[list[torch.Tensor]], None] | None:
        import torch_xla.core.xla_model as xm

        return xm.optimization_barrier_

    def fused_optimizer(self, name: str) -> type | None:
        """torch_xla's sync-free Adam / AdamW for ``name``, or None.

        They take the same arguments as torch's and run one fused XLA op per
        parameter, with the step count on the device, so a learning rate that changes
        every step (as Python floats) neither syncs nor recompiles, and tracing is cheap.
        """
        from torch_xla.amp import syncfree

        return {"adam": syncfree.Adam, "adamw": syncfree.AdamW}.get(name)

    def is_fused_optimizer(self, optimizer: Any) -> bool:
        if not xla_loaded():
            return False
        from torch_xla.amp import syncfree

        return isinstance(optimizer, (syncfree.Adam, syncfree.AdamW))


class XlaDiagnosis(Diagnosis):
    """torch_xla's own metrics: compiles, executions, host syncs, transfers, CPU fallbacks, live IR."""

    def found(self, tpu: TpuHardware) -> Found:
        """The TPU's kind and devices (one process per chip for a launch), or XLA:CPU's ``CPU_NUM_DEVICES``."""
        if pjrt_device() == "TPU":
            return Found("TPU", tpu.kind, tpu.devices, "xla", tpu.chips or 1)
        return Found("CPU", "XLA:CPU", int(os.environ.get("CPU_NUM_DEVICES", "1")), "xla")

    def counters(self) -> Counters:
        return Counters(compile_count(), execute_count(), host_sync_count(), transfer_from_device_count(), True)

    compile_count = staticmethod(compile_count)  # one metric read, not the four of counters()
    last_compiles = staticmethod(last_compiles)

    def fallback_ops(self) -> list[str]:
        """Ops that ran on the host CPU because XLA has no lowering for them.

        torch_xla also lists ``aten::_local_scalar_dense`` there: that is the read
        of a value by ``.item()`` (a host sync, counted by host_sync_count), not a
        missing lowering.
        """
        if not xla_loaded():
            return []
        import torch_xla.debug.metrics as met

        return sorted(op for op in met.executed_fallback_ops() if op != "aten::_local_scalar_dense")

    def clear_counters(self) -> None:
        import torch_xla.debug.metrics as met

        met.clear_all()

    def unmeasured(self) -> tuple[str, ...]:
        """Nothing: torch_xla counts compiles, host syncs and CPU fallbacks itself."""
        return ()

    def pending_ir_nodes(self) -> int:
        """IR nodes that live XLA tensors still wait to run, summed over the tensors; 0 if none.

        After a step that cuts its graph (``torch_xla.sync()``) this stays the same
        from step to step; a step without a cut leaves a graph that grows with every
        step. Reads torch_xla's live-tensor report; starts nothing.
        """
        if not xla_loaded():
            return 0
        import re

        import torch_xla

        report = torch_xla._XLAC._xla_tensors_report(0, "")
        return sum(int(n) for n in re.findall(r"ir_nodes=(\d+)", report))

    def tensors_created(self) -> int:
        """XLA tensors created so far in this process (torch_xla's CreateXlaTensor counter)."""
        if not xla_loaded():
            return 0
        import torch_xla.debug.metrics as met

        return int(met.counter_value("CreateXlaTensor") or 0)


class XlaSharding(Sharding):
    """SPMD: batches split over the mesh, FSDPv2 parameters, the devices and hosts of the program."""

    is_spmd = staticmethod(is_spmd)

    def over_mesh(self) -> bool:
        return True

    def shard_batch(self, tensors: Sequence[torch.Tensor]) -> None:
        if is_spmd():
            import torch_xla.distributed.spmd as xs

            mesh = _data_mesh(global_device_count())
            for t in tensors:
                xs.mark_sharding(t, mesh, ("data",) + (None,) * (t.dim() - 1))

    def use_spmd(self) -> None:
        use_spmd()

    def shard_parameters(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
        return shard_parameters(model, blocks)

    shard_mesh_2d = staticmethod(shard_mesh_2d)

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Gives whole state tensors (a checkpoint's, just loaded: torch moves them to the device replicated) the
        sharding of their parameter, so a resumed run holds the same quarter per device as an uninterrupted one."""
        import torch_xla

        if not is_spmd():
            return
        for param, state in optimizer.state.items():
            if param.device.type != "xla" or torch_xla._XLAC._get_xla_sharding_spec(param) in ("", "{replicated}"):
                continue
            layout = torch_xla._XLAC._get_xla_op_sharding(param)
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                    torch_xla._XLAC._xla_mark_sharding(value, layout)

    def held_bytes(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The bytes of each tensor the first device holds, from its live shard's indices under SPMD (the
        runtime reports no per-device memory there); a tensor with no sharding is whole on every device."""
        import torch_xla

        spec = torch_xla._XLAC._get_xla_sharding_spec
        marked = [t for t in tensors if t.device.type == "xla" and t.numel() and spec(t)]
        places = iter(torch_xla._XLAC._get_local_shard_replica_and_indices(marked) if marked else [])
        held, ids = [], {id(t) for t in marked}
        for t in tensors:
            index = next(places)[0][1] if id(t) in ids else Ellipsis
            if index is Ellipsis or not isinstance(index, (tuple, list)):
                held.append(t.numel() * t.element_size())
            else:
                held.append(math.prod(len(range(*s.indices(n))) for s, n in zip(index, t.shape)) * t.element_size())
        return held

    def process_count(self) -> int:
        """Processes of the job (one per host on a pod slice under SPMD); 1 off XLA."""
        if not runtime_started():
            return 1
        import torch_xla.runtime as xr

        return xr.process_count()

    def process_index(self) -> int:
        if not runtime_started():
            return 0
        import torch_xla.runtime as xr

        return xr.process_index()

    global_device_count = staticmethod(global_device_count)

    def addressable_device_count(self) -> int:
        """XLA devices this process can address (starts the runtime)."""
        require_xla()
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count() if xr.is_spmd() else xr.addressable_device_count()


class XlaBackend(Backend):
    """torch_xla: lazy graphs cut at each step, SPMD or one process per chip, real counters.

    Each operation lives in one place: in its group's method, or, where other functions of this module use
    it too (``runtime_started``, ``world_size``, ``all_gather``, ``is_spmd``...), in that module function,
    bound in its group as the method itself.
    """

    name = "xla"
    device_type = "xla"
    lazy = True
    core_rule = "one_or_all"

    Devices = XlaDevices
    Processes = XlaProcesses
    Compute = XlaCompute
    Diagnosis = XlaDiagnosis
    Sharding = XlaSharding

    def __repr__(self) -> str:
        return "XlaBackend()"

    started = staticmethod(runtime_started)
