"""The choice of backend, and the functions the hand-loop kit calls; each asks a group of the backend chosen for this process.

The rule for what is here: a function stays only when (1) a module of the hand-loop kit (``loop``, ``device``,
``optim``, ``amp``, ``checkpoint``, ``sharding``, ``environment``) calls it, or (2) it chooses the backend
(``current``, ``ask``, ``why``) or spans the backends or groups (``is_master``, ``is_accelerated``,
``naming_stalls``, ``launch``), or (3) it is a counter or clock that tests/ and bench/ read as the public
``tpu_utility.backend`` API (``compile_count``, ``counters``, ``wait``, ``to_cpu``, ...). Every other caller,
the trainer, diagnostics, data and the exporters included, asks the group itself
(``backend.current().devices.sync()``, or ``chosen = backend.current()`` for several questions); the groups are
listed in ``base.py``. ``tests/test_layout.py`` holds the list (``API_PUBLIC``) and checks both halves.

``current()`` picks the backend once per process, in this order: torch_xla when its
runtime runs or is asked for (a TPU attached, or ``PJRT_DEVICE`` set), TorchTPU when
``torch.accelerator`` reports a ``tpu`` device and Google's ``torch-tpu`` is installed,
then the native backend on ``torch.accelerator``'s device (``cuda`` + ``nccl``), else
the CPU (``gloo``). Until a runtime starts the choice is made again at each call, so
``setup_tpu()`` may still set ``PJRT_DEVICE``; once one runs it is fixed. A process in a
``torch.distributed`` job of another backend (gloo, nccl) stays native: torch_xla imported
after it joined sets ``PJRT_DEVICE``, which then chooses nothing.

Example:
    >>> from tpu_utility import backend
    >>> backend.world_size()       # was: torch.distributed.get_world_size() / xr.world_size()
    1
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
from typing import Any, Callable, Iterator, Sequence

import torch

from . import choice, xla
from .base import Backend, Counters, GraphCompile, ReduceOp, SyncKind, patch_tensor_methods
from .hardware import MEMORY_ENV, TpuHardware, detect_tpu, memory_override, pjrt_device
from .native import NativeBackend
from .tpu import TorchTpuBackend
from .versions import INSTALL_HINT, check_versions, fix_command, installed_version, torch_tpu_installed
from .xla import (
    XLA_INSTALLED,
    initialize_cache,
    local_process_rank,
    refuse_missing_tpu,
    requested_device,
    runtime_device_type,
    runtime_started,
    use_device,
    xla_requested,
)

_XLA = xla.XlaBackend()
_native: dict[str, Backend] = {}
_fixed: Backend | None = None
_unfixed: tuple[tuple, Backend] | None = None  # the last choice not yet fixed, and what it was made from

_DIST_BACKENDS = {"cuda": "nccl", "xpu": "xccl"}


def accelerator_type() -> str | None:
    """The device type ``torch.accelerator`` reports ("cuda", "tpu", ...), or None; never raises."""
    accelerator = getattr(torch, "accelerator", None)
    try:
        if accelerator is None:
            return "cuda" if torch.cuda.is_available() else None
        return accelerator.current_accelerator().type if accelerator.is_available() else None
    except RuntimeError:  # a backend extension that cannot start here
        return None


def _choose() -> Backend:
    name, where = choice.asked()
    if name == "xla" or (name == "auto" and (runtime_started() or xla_requested())):
        if not XLA_INSTALLED:
            raise ModuleNotFoundError(f"{where} needs torch_xla, which is not installed. Install it with: {INSTALL_HINT}")
        return _XLA
    kind = accelerator_type() or "cpu"
    if name == "tpu" and not (kind == "tpu" and torch_tpu_installed()):
        found = "torch_tpu is not installed" if not torch_tpu_installed() else f"torch.accelerator reports {kind!r}"
        raise RuntimeError(f"{where} asks for TorchTPU (device 'tpu'), but {found}. Allowed here: 'native', 'xla', 'auto'")
    return _native_on(kind)


def _native_on(kind: str) -> Backend:
    """The one native backend object of device type ``kind`` (TorchTPU's for "tpu" where it is installed)."""
    if kind not in _native:
        if kind == "tpu" and torch_tpu_installed():
            _native[kind] = TorchTpuBackend()
        else:
            _native[kind] = NativeBackend(kind, _DIST_BACKENDS.get(kind, "gloo"))
    return _native[kind]


def current() -> Backend:
    """The backend of this process (fixed once its runtime started, or once it is in a native job).

    A backend that never starts a runtime (plain PyTorch in one process) is chosen again
    only when what the choice is made from changed: the training loop asks at every step.
    """
    global _fixed, _unfixed
    if _fixed is not None:
        return _fixed
    inputs = (*choice.inputs(), runtime_started())
    if _unfixed is not None and _unfixed[0] == inputs:
        return _unfixed[1]
    chosen = _choose()
    if chosen.started() or (chosen is not _XLA and choice.native_job() is not None):
        _fixed, _unfixed = chosen, None
    else:
        _unfixed = (inputs, chosen)
    return chosen


def ask(name: str, where: str = "setup_tpu(backend=...)") -> Backend:
    """Chooses the backend by name ("auto", "native", "xla", "tpu") for this process and returns it.

    Raises:
        ValueError: ``name`` is not one of those.
        RuntimeError: another backend already runs in this process (restart and choose first).
    """
    choice.check(name, where)
    previous = choice.ask(name)
    try:
        chosen = _choose()
        running = _fixed or (_XLA if runtime_started() else None)
        if running is None and choice.native_job() is not None:
            running = _native_on(accelerator_type() or "cpu")
        if running is not None and running is not chosen:
            raise RuntimeError(
                f"{where.replace('...', repr(name))} cannot switch this process to the {chosen.name} backend: "
                f"the {running.name} backend already runs here. Restart the runtime and call setup_tpu(backend="
                f"{name!r}) first, or set {choice.VARIABLE}={name} before starting Python"
            )
    except Exception:
        choice.ask(previous)
        raise
    return chosen


def why() -> str:
    """Why ``current()`` is the backend it is, as the setup summary says it."""
    name, where = choice.asked()
    chosen = current()
    if name != "auto":
        ignored = f"; {choice.pjrt_origin()}, ignored" if name != "xla" and pjrt_device() else ""
        return f"{where}{ignored}"
    job = choice.native_job()
    if chosen is not _XLA and job is not None and XLA_INSTALLED and (pjrt_device() or detect_tpu().chips):
        found = choice.pjrt_origin() if pjrt_device() else f"a TPU is attached ({detect_tpu().chips} chips)"
        return f"this process is in a torch.distributed job ({job}); {found}, ignored"
    if chosen is _XLA:
        if runtime_started() and pjrt_device() is None:
            return "the XLA runtime already runs in this process"
        if pjrt_device() is not None:
            origin = choice.pjrt_origin()
            other = f" ({choice.VARIABLE}=native or setup_tpu(backend='native') for torch's own devices)"
            return origin + (other if "torch_xla" in origin else "")
        return f"a TPU is attached ({detect_tpu().chips} chips on the PCI bus)"
    if isinstance(chosen, TorchTpuBackend):
        return "torch.accelerator reports TorchTPU's 'tpu' device"
    if chosen.device_type != "cpu":
        return f"torch.accelerator reports {chosen.device_type!r}"
    missing = "no TPU or GPU found" + (", PJRT_DEVICE not set" if XLA_INSTALLED else ", torch_xla not installed")
    return missing


# ------------------------------------------------------------------ devices
def device(index: int | None = None) -> torch.device:
    return current().devices.device(index)


def is_lazy(dev: torch.device | str) -> bool:
    """Whether tensors on ``dev`` build graphs that a step boundary runs (XLA)."""
    return current().devices.is_lazy(dev)


def is_accelerated(dev: torch.device | str) -> bool:
    """Whether ``dev`` is the accelerator of this process's backend (not the host CPU)."""
    chosen = current()
    return chosen.device_type != "cpu" and chosen.devices.owns(dev)


# ----------------------------------------------------------------- replicas
def world_size() -> int:
    return current().processes.world_size()


def rank() -> int:
    return current().processes.rank()


def is_master() -> bool:
    return current().processes.rank() == 0


def in_launched_process() -> bool:
    return current().processes.in_launched_process()


def join_job() -> None:
    """Joins the job of an outside launcher (a ``torchrun`` process group) once; nothing elsewhere."""
    current().processes.join_job()


def launch(fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
    current().processes.launch(functools.partial(_naming_replica_stalls, fn), args, nprocs, start_method)


def _naming_replica_stalls(fn: Callable[..., Any], index: int, *args: Any) -> None:
    """One launched replica's ``fn(index, *args)``, a collective's timeout in it named (picklable for spawn).

    Here rather than in the backends' launchers, so that they never import this module back.
    """
    with naming_stalls(f"replica {index}"):
        fn(index, *args)


def barrier(tag: str) -> None:
    current().processes.barrier(tag)


class CollectiveTimeout(RuntimeError):
    """A collective gave up waiting: the message names the replica(s) that did not arrive."""


@contextlib.contextmanager
def naming_stalls(where: str) -> Iterator[None]:
    """Turns a collective's timeout inside the block into a ``CollectiveTimeout`` naming the replicas
    that stopped answering (as far as the backend can tell) and ``where`` it waited.

    Example:
        >>> with naming_stalls("one_cycle_fit"):   # doctest: +SKIP
        ...     train(model, plan)
    """
    try:
        yield
    except CollectiveTimeout:
        raise
    except RuntimeError as error:
        report = current().processes.stalled(error)
        if report is None:
            raise
        raise CollectiveTimeout(f"{where}{_waiting_in(error)}: {report}") from error


def _waiting_in(error: BaseException) -> str:
    """`` (waiting in backward, training/runner.py:374)``: the package's innermost frame outside the backend."""
    here = os.path.dirname(os.path.abspath(__file__))  # the backend package
    package = os.path.dirname(here)
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f.filename.startswith(package + os.sep) and not f.filename.startswith(here)]
    if not ours:
        return ""
    frame = ours[-1]
    what = " (the gradient all-reduce of DDP)" if frame.name == "backward" else ""
    return f", waiting in {frame.name}{what} ({os.path.relpath(frame.filename, package)}:{frame.lineno})"


def reduce_gradients(optimizer: torch.optim.Optimizer) -> None:
    current().processes.reduce_gradients(optimizer)


# -------------------------------------------------------------------- steps
def sync(wait: bool = False) -> None:
    current().devices.sync(wait)


def wait() -> None:
    """Waits until the device finished every queued operation (a benchmark's clock, doctor's measured step)."""
    current().devices.wait()


def skip_next_loader_sync() -> None:
    current().devices.skip_next_loader_sync()


def device_loader(loader: Any, dev: torch.device, spmd_devices: int | None = None, minibatch: bool = False) -> Any:
    return current().devices.device_loader(loader, dev, spmd_devices, minibatch)


def to_cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return current().devices.to_cpu(tensors)


def state_to_cpu(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return current().devices.state_to_cpu(tensors)


def shard_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    current().sharding.shard_optimizer_state(optimizer)


# ---------------------------------------------------- precision, optimizers
def autocast(dev: torch.device, dtype: torch.dtype) -> Any:
    return current().compute.autocast(dev, dtype)


def shard_batch(tensors: Sequence[torch.Tensor]) -> None:
    """Splits each tensor along dim 0 over the SPMD mesh, as a batch is; nothing outside SPMD."""
    current().sharding.shard_batch(tensors)


def hardware(dev: torch.device) -> str | None:
    return current().devices.hardware(dev)


def is_fused_optimizer(optimizer: Any) -> bool:
    return current().compute.is_fused_optimizer(optimizer)


# ----------------------------------------------------------------- counters
def counters() -> Counters:
    return current().diagnosis.counters()


def compile_count() -> int:
    """Graphs compiled so far in this process (0 where nothing compiles).

    The training loop's compile notice reads it after every step: on XLA one metric is
    read, not the four of ``counters()`` (0.1 ms of host time a step, each a copy of
    the metric's samples).
    """
    return current().diagnosis.compile_count()


def execute_count() -> int:
    return current().diagnosis.counters().executions


def host_sync_count() -> int:
    """Device-to-host reads forced by Python (``.item()``, printing), where counted."""
    return current().diagnosis.counters().host_syncs


def transfer_from_device_count() -> int:
    return current().diagnosis.counters().transfers


def fallback_ops() -> list[str]:
    return current().diagnosis.fallback_ops()


def clear_counters() -> None:
    current().diagnosis.clear_counters()


# --------------------------------------------------------------------- SPMD
def is_spmd() -> bool:
    return current().sharding.is_spmd()


def use_spmd() -> None:
    current().sharding.use_spmd()


def global_device_count() -> int:
    return current().sharding.global_device_count()


def addressable_device_count() -> int:
    return current().sharding.addressable_device_count()
