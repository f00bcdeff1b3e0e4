"""The native backend: eager PyTorch on one device type, replicas over ``torch.distributed``.

One class serves every device ``torch.accelerator`` knows and the CPU, chosen by
device type and process-group backend: ``cuda`` + ``nccl``, ``cpu`` + ``gloo``
(``xpu``/``mps`` where present). Alone in its process it is the serial backend;
inside a launch (ours, or a ``torchrun`` job) each process is one replica and
every collective goes through ``torch.distributed`` with a timeout, so a replica
that dies or diverges ends the job with an error instead of a hang.

Example:
    >>> from tpu_utility.backend.native import NativeBackend
    >>> NativeBackend("cpu", "gloo").devices.device()
    device(type='cpu')
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .base import (Backend, Compute, Devices, Diagnosis, Found, Processes, ReduceOp, Sharding, SyncKind,
                   patch_tensor_methods)  # fmt: skip
from .hardware import TpuHardware, device_name_override, memory_override

# Every collective and the start-up rendezvous give up after this long (seconds): a replica
# that died or took another path raises on the others instead of hanging them forever.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TPU_UTILITY_COLLECTIVE_TIMEOUT", "600"))
# After a timeout, how long a replica waits for the others to report theirs before naming the silent ones.
STALL_REPORT_WAIT_S = 30.0
REPLICA_GRACE_S = 5.0
# compile="auto" compiles a run of at least this many steps on an accelerator. On one H200 a compiled step of a
# 300M Llama saves 40-47 ms (75-83 ms eager, 35 ms compiled) and a 4-layer one 10.5 ms (23.4 against 12.9), while
# inductor's first compile of a step takes seconds to a minute: a few hundred steps pay for it (docs/training.md).
COMPILE_MIN_STEPS = 300

_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}

_ATEN = torch.ops.aten
# A value read into Python: .item(), float(), int(), bool(), `if tensor:`, printing a scalar.
_READ_OPS = {_ATEN._local_scalar_dense}
# Outputs whose shape depends on the data: the host must learn the size before it can go on.
_SHAPE_OPS = {_ATEN.nonzero, _ATEN.masked_select, _ATEN._unique, _ATEN._unique2, _ATEN.unique_dim,
              _ATEN.unique_consecutive}  # fmt: skip
_MASK_INDEX_OPS = {_ATEN.index, _ATEN.index_put, _ATEN.index_put_, _ATEN._index_put_impl_}  # x[mask], x[mask] = v
_REPEAT_OPS = {_ATEN.repeat_interleave.Tensor, _ATEN.repeat_interleave.self_Tensor}  # no output_size: a sync
# torch's optimizers keep their step counters on the host on every device (unless capturable or
# fused) and read them with .item(): no sync on an accelerator, so not counted on the CPU either.
_OPTIM_DIR = os.path.dirname(torch.optim.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _caller(depth: int) -> tuple[str, int]:
    """(file, line) of the code that called the op, past this package's own wrappers of Tensor methods."""
    frame = sys._getframe(depth + 1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back
    return frame.f_code.co_filename, frame.f_lineno


class _HostSyncMode(TorchDispatchMode):
    """Sees every aten op and reports those that make the host wait for the device.

    ``owns(device)`` tells the backend's device from the host. Where the host is the
    device (the CPU backend) nothing waits, so an op counts where it would wait on
    an accelerator: every tensor is taken for a device tensor, except the step
    counters torch.optim reads on the host on every device.
    """

    def __init__(self, owns: Callable[[torch.device], bool], on_sync: Callable[[SyncKind, str], None],
                 host_is_device: bool) -> None:  # fmt: skip
        super().__init__()
        self.owns, self.on_sync, self.host_is_device = owns, on_sync, host_is_device
        self.thread = threading.get_ident()
        # tensors counted as copied to the host, with the line that copied them
        self.on_host: dict[int, tuple[weakref.ref, tuple[str, int]]] = {}

    def on_the_host(self, tensor: Any, line: tuple[str, int]) -> bool:
        """Whether ``tensor`` was copied to the host on this ``line``: x.cpu().tolist() and x.cpu().item()
        wait once on an accelerator (the second call reads the host copy), but on the CPU
        .cpu() returns x itself, so the chain is told by the tensor and the line."""
        ref, copied_at = self.on_host.get(id(tensor), (None, None))
        return ref is not None and ref() is tensor and copied_at == line

    def _device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and self.owns(value.device)

    def sync(self, func: Any, args: tuple, kwargs: dict) -> SyncKind | None:
        """The kind of host sync ``func(*args, **kwargs)`` makes, or None."""
        packet = func.overloadpacket
        first = args[0] if args else None
        if packet in _READ_OPS:
            return "read" if self._device(first) else None
        if packet in _SHAPE_OPS or func in _REPEAT_OPS:
            if func in _REPEAT_OPS and kwargs.get("output_size") is not None:
                return None
            return "shape" if any(self._device(a) for a in args) else None
        if packet in _MASK_INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            masks = [i for i in indices or () if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)]
            return "shape" if masks and self._device(first) else None
        if packet is _ATEN._to_copy:
            target = kwargs.get("device")
            moved = target is not None and self._device(first) and not self.owns(target)
            return "copy" if moved and not kwargs.get("non_blocking", False) else None
        if packet is _ATEN.copy_:
            source = args[1] if len(args) > 1 else kwargs.get("src")
            blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
            moved = self._device(source) and isinstance(first, torch.Tensor) and not self.owns(first.device)
            return "copy" if moved and blocking else None
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = self.sync(func, args, kwargs)
        if kind is not None and self.host_is_device:
            line = _caller(1)
            if line[0].startswith(_OPTIM_DIR) or (kind == "read" and self.on_the_host(args[0], line)):
                kind = None
        if kind is not None:
            masked = func.overloadpacket in _MASK_INDEX_OPS
            self.on_sync(kind, func._schema.name + (" (a boolean mask)" if masked else ""))
        return func(*args, **kwargs)

    def host_reads(self) -> dict[str, Callable[[Callable], Callable]]:
        """Wrappers of the reads the dispatcher never sees when the tensor is already on the host."""

        def make(name: str) -> Callable[[Callable], Callable]:
            def wrap(original: Callable) -> Callable:
                def traced(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                    if threading.get_ident() == self.thread and self.owns(tensor.device):
                        line = _caller(1)
                        if not self.on_the_host(tensor, line):
                            self.on_host[id(tensor)] = (weakref.ref(tensor), line)
                            self.on_sync("copy", f".{name}()")
                    return original(tensor, *args, **kwargs)

                return traced

            return wrap

        return {"cpu": make("cpu"), "tolist": make("tolist")}


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) set by torchrun (or any launcher of torch.distributed's env:// kind), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


class NativeDevices(Devices):
    """The device ``torch.accelerator`` reports (the CPU alone has one), its memory; a sharded tensor read whole."""

    def device(self, index: int | None = None) -> torch.device:
        if self.backend.device_type == "cpu":
            return torch.device("cpu")
        if index is None:
            index = torch.accelerator.current_device_index()
        return torch.device(self.backend.device_type, index)

    def device_count(self) -> int:
        """Accelerators on this host; on the CPU 1 (one process already uses every core)."""
        if self.backend.device_type == "cpu":
            return 1
        return torch.accelerator.device_count()

    def wait(self) -> None:
        if self.backend.device_type != "cpu":
            torch.accelerator.synchronize()

    def to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies; a sharded tensor (FSDP2's ``DTensor``) whole: a collective every process joins, one
        tensor gathered at a time, so the device never holds more than one whole tensor beside its shards."""
        from torch.distributed.tensor import DTensor

        return [(t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu() for t in tensors]

    def device_memory(self, device: torch.device) -> int | None:
        """The override, else a GPU's total memory; None on the CPU."""
        override = memory_override()
        if override is not None or self.backend.device_type != "cuda":
            return override
        return torch.cuda.get_device_properties(device).total_memory

    def chip_name(self, device: torch.device) -> str | None:
        """The override, else a GPU's name ("NVIDIA H100 80GB HBM3"); None on the CPU."""
        named = device_name_override()
        if named is not None or self.backend.device_type != "cuda":
            return named
        return torch.cuda.get_device_name(device)


class NativeProcesses(Processes):
    """One process per device under ``torch.distributed``, a timeout on every collective."""

    def world_size(self) -> int:
        return dist.get_world_size() if distributed_ready() else 1

    def rank(self) -> int:
        return dist.get_rank() if distributed_ready() else 0

    def in_launched_process(self) -> bool:
        env = torchrun_env()
        return distributed_ready() or (env is not None and env[1] > 1)

    def join_job(self) -> None:
        """Joins the torchrun job this process belongs to (its env:// rendezvous), once.

        The process group made here is the package's to end: it is destroyed at
        interpreter exit, while Python is still alive. Left to the interpreter's
        teardown, gloo's worker threads outlive it and the process aborts
        ("terminate called without an active exception", SIGABRT) after a run that
        succeeded. A group the user made stays theirs.
        """
        if distributed_ready() or torchrun_env() is None:
            return
        if self.backend.device_type != "cpu":
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(self.backend.dist_backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        atexit.register(_leave_job)

    def launch(self, fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
        """Runs ``fn(index, *args)`` in ``nprocs`` new processes, one replica each.

        Raises:
            RuntimeError: a replica failed or died (its exit code or signal named),
                or fork was asked for after CUDA started in this process.
        """
        if start_method == "fork" and self.backend.device_type == "cuda" and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialised in this process, and a forked child cannot use it. Restart the "
                "kernel and launch before touching the GPU (no get_device(), no tensors on 'cuda'), or run "
                "the training from a script (spawn)."
            )
        with tempfile.TemporaryDirectory(prefix="tpu_utility_rdzv_") as folder:
            store = os.path.join(folder, "store")
            job = (self.backend.device_type, self.backend.dist_backend, nprocs, store)
            try:
                replicas = torch.multiprocessing.start_processes(
                    _replica_main, args=(job, fn, args), nprocs=nprocs, start_method=start_method, join=False
                )
                # once one fails, the others get REPLICA_GRACE_S to end, then SIGTERM, then as long again
                # before SIGKILL (torch's default is 30 s; a stopped replica ignores SIGTERM)
                while not replicas.join(grace_period=REPLICA_GRACE_S):
                    pass
            except torch.multiprocessing.ProcessRaisedException as error:
                raise RuntimeError(f"a training replica failed:\n{error}") from None
            except torch.multiprocessing.ProcessExitedException as error:
                raise RuntimeError(
                    f"replica {error.error_index} of {nprocs} died ({error}); the others were stopped. "
                    f"Its own output above says why (out of memory is the usual cause of a kill)."
                ) from None

    def all_reduce(self, tensors: list[torch.Tensor], op: ReduceOp = "sum") -> list[torch.Tensor]:
        if self.world_size() == 1:
            return tensors
        reduced = [t.clone() for t in tensors]
        for t in reduced:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, _OPS[op]))
        return reduced

    def all_gather(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        world = self.world_size()
        if world == 1:
            return tensors
        gathered = []
        for t in tensors:
            parts = [torch.empty_like(t) for _ in range(world)]
            dist.all_gather(parts, t.contiguous())
            gathered.append(torch.cat(parts, dim=0))
        return gathered

    def reduce_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Averages the gradients of the optimizer's trainable parameters over the replicas, as DDP does.

        One all-reduce per device and dtype of a flat buffer (the gradients, each divided by
        the world size first, then one presence flag per parameter). A parameter without a
        gradient adds zeros: it gets the average where another replica had a gradient and
        stays None where none had (DDP's rule for unused parameters). The host reads the
        flags only where a gradient here is None.
        """
        world = self.world_size()
        if world == 1:
            return
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    buckets.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), params in buckets.items():
            grads = [None if p.grad is None else p.grad.detach() for p in params]
            flat = torch.cat(
                [(g.to_dense() if g.is_sparse else g).reshape(-1).to(dtype) if g is not None else p.new_zeros(p.numel())
                 for p, g in zip(params, grads)]
                + [torch.tensor([float(g is not None) for g in grads], dtype=dtype, device=device)]
            )  # fmt: skip
            flat.div_(world)
            dist.all_reduce(flat)
            values = flat[: flat.numel() - len(params)].split([p.numel() for p in params])
            present = None if all(g is not None for g in grads) else (flat[-len(params):] > 0).tolist()
            for i, (p, g, averaged) in enumerate(zip(params, grads, values)):
                averaged = averaged.view_as(p)
                if g is None:
                    if present[i]:
                        p.grad = averaged.clone()
                elif g.is_sparse:
                    p.grad = averaged.to_sparse()
                else:
                    p.grad.copy_(averaged)

    def stalled(self, error: BaseException) -> str | None:
        """A collective's timeout (gloo's "Timed out waiting", NCCL's watchdog) explained: the ranks that
        did not arrive are those that do not also report a timeout through the job's store in the next while.

        Every replica that waited times out within about one timeout of the others; one that stopped
        answering (stopped, stuck in its own code, swapping) reports nothing.
        """
        if not distributed_ready():
            return None
        if any(words in str(error).lower() for words in _PEER_LEFT):
            return _peer_left(error, self.rank(), self.world_size(), PEER_WORD_WAIT_S)
        if "timed out" not in str(error).lower():
            return None
        world, me = self.world_size(), self.rank()
        waited = min(COLLECTIVE_TIMEOUT_S, STALL_REPORT_WAIT_S)
        try:
            silent = _silent_ranks(me, world, waited)
        except Exception as store_error:  # the store itself does not answer: rank 0 may host it
            silent, why = None, type(store_error).__name__
        if silent:
            waiting = [r for r in range(world) if r not in silent]
            said = (f"{_ranks(silent)} of {world} did not arrive (still running but not answering: stopped, stuck "
                    f"in its own code, or swapping); {_ranks(waiting)} waited")  # fmt: skip
        elif silent is None:
            said = (f"another replica stopped answering; the job's store did not answer either ({why}), so rank 0, "
                    f"which may hold it, may be the one")  # fmt: skip
        else:
            said = f"every rank of {world} timed out waiting, so none can be named as the one that stopped answering"
        return (f"a collective timed out after {COLLECTIVE_TIMEOUT_S:g} s on rank {me} ({error}): {said}. "
                f"TPU_UTILITY_COLLECTIVE_TIMEOUT sets the wait in seconds")

    def wrap_replica(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``DistributedDataParallel``: gradients averaged during backward, buffers from rank 0; a sharded
        model as it is (FSDP2 averages its gradients itself)."""
        from torch.nn.parallel import DistributedDataParallel

        if self.backend.sharding.sharded(model.parameters()):
            return model

        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])

    def barrier(self, tag: str) -> None:
        if self.world_size() > 1:
            dist.barrier()


class NativeCompute(Compute):
    """torch's own autocast on the device type."""

    def bf16_autocast_available(self) -> bool:
        return self.backend.device_type == "cuda" and torch.cuda.is_bf16_supported()

    def fp16_available(self) -> bool:
        """CUDA (the GPUs without bf16, such as Kaggle's T4, need it), and the CPU, where torch runs both
        float16 autocast and ``GradScaler("cpu")``: slowly, a way to check the machinery, not to train."""
        return self.backend.device_type in ("cuda", "cpu")

    def autocast(self, device: torch.device, dtype: torch.dtype) -> Any:
        return torch.autocast(self.backend.device_type, dtype=dtype)

    def compiled_optimizer_options(self, name: str) -> dict[str, Any]:
        """CUDA: ``fused=True`` for Adam and AdamW (torch's fused kernels: the whole update in one launch)."""
        return {"fused": True} if self.backend.device_type == "cuda" and name in ("adam", "adamw") else {}

    def compile_pays(self, steps: int) -> bool:
        """On an accelerator, from ``COMPILE_MIN_STEPS`` steps on; never on the CPU (minutes of inductor compiles
        on a small host, little gained per step)."""
        return self.backend.device_type != "cpu" and steps >= COMPILE_MIN_STEPS


class NativeDiagnosis(Diagnosis):
    """Host syncs watched with a dispatch mode; torch.compile's graphs and recompiles read from dynamo's own
    counters; what an eager backend cannot count, said."""

    def found(self, tpu: TpuHardware) -> Found:
        """CUDA's first device's name and the GPUs, where torch sees CUDA; else the host CPU alone."""
        name = f"native ({self.backend.name})"
        if torch.cuda.is_available():
            return Found("CUDA", torch.cuda.get_device_name(0), torch.cuda.device_count(), name)
        return Found("cpu", None, 1, name)

    def compile_count(self) -> int:
        """Graphs torch.compile (dynamo) compiled so far in this process, recompiles included; 0 where nothing
        was compiled (dynamo's counters are read only once it was imported: an eager run never imports it)."""
        utils = sys.modules.get("torch._dynamo.utils")
        return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0

    def recompile_causes(self) -> dict[str, str]:
        """Dynamo's reason for each recompile it still records (its last 64 compiles): the guard that failed,
        such as ``tensor 'x' size mismatch at index 0. expected 32, actual 8``."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None or not hasattr(utils, "get_compilation_metrics"):
            return {}
        return {str(m.compile_id): m.recompile_reason for m in utils.get_compilation_metrics()
                if getattr(m, "recompile_reason", None)}  # fmt: skip

    @contextlib.contextmanager
    def watch_host_syncs(self, on_sync: Callable[[SyncKind, str], None]) -> Iterator[bool]:
        """Calls ``on_sync(kind, op)`` at each op of the code inside that makes the host wait.

        A ``TorchDispatchMode`` sees every aten op: value reads (``aten::_local_scalar_dense``
        from ``.item()``, ``bool()``, ``if tensor:``), data-dependent shapes (``nonzero``,
        ``masked_select``, ``unique``, ``x[mask]``) and blocking copies of device data to the
        host. On the CPU, where the host is the device, nothing waits: ops are reported
        where they would wait on a GPU or TPU, and ``.cpu()``/``.tolist()`` (which the
        dispatcher never sees there) are wrapped for the duration. A step under
        ``torch.compile`` runs uncompiled inside (torch does not compile under a dispatch mode).

        Example:
            >>> seen = []
            >>> with NativeBackend("cpu", "gloo").diagnosis.watch_host_syncs(lambda kind, op: seen.append(op)):
            ...     _ = torch.ones(2).sum().item()
            >>> seen
            ['aten::_local_scalar_dense']
        """
        host_is_device = self.backend.device_type == "cpu"
        mode = _HostSyncMode(self.backend.devices.owns, on_sync, host_is_device)
        with contextlib.ExitStack() as stack:
            if host_is_device:
                stack.enter_context(patch_tensor_methods(mode.host_reads()))
            stack.enter_context(mode)
            yield True

    def unmeasured(self) -> tuple[str, ...]:
        compiles = (
            "graph compilations while doctor watches: a step under torch.compile runs uncompiled inside its "
            "dispatch mode (one_cycle_fit counts torch.compile's graphs and names each recompile's cause)"
        )
        if self.backend.device_type == "cuda":
            return (compiles,)  # CUDA has no silent CPU fallback: an op without a kernel raises
        if self.backend.device_type == "cpu":
            return (
                compiles,
                "CPU fallbacks: the CPU runs every op itself; on a TPU with torch_xla, doctor names the ops XLA "
                "cannot lower",
                ".to('cpu') copies: on the CPU they cannot be told from moving a batch to the device (.cpu() and "
                ".tolist() are counted)",
            )
        return (compiles, f"ops that fall back to the host CPU: the {self.backend.device_type} backend does not count them")


class NativeSharding(Sharding):
    """FSDP2 over the job's processes."""

    def sharded(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` is sharded over the job's processes (an FSDP2 ``DTensor``)."""
        from torch.distributed.tensor import DTensor

        return any(isinstance(t, DTensor) for t in tensors)

    def held_bytes(self, tensors: Sequence[torch.Tensor]) -> list[int]:
        """The bytes of each tensor this process holds: an FSDP2 ``DTensor``'s local shard, else the tensor."""
        from torch.distributed.tensor import DTensor

        local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
        return [t.numel() * t.element_size() for t in local]

    def shard_parameters(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module]) -> Callable[[], None]:
        """FSDP2 (``torch.distributed.fsdp.fully_shard``) over the job's processes: each block, then the root.

        Every parameter is sharded on dim 0 over a 1-D device mesh of all ranks (gloo on the CPU, nccl on
        CUDA); a block's weights are gathered for its forward and backward only, and its gradients
        reduce-scattered as the mean over the ranks. Key names stay the model's own (FSDP2 keeps them; the
        strategy's per-block checkpointing, ``checkpoint_module``, replaces ``forward`` rather than wrapping), and a
        whole (unsharded) state dict loads into the sharded model: each rank keeps its own slice.

        Returns:
            The undo: every parameter gathered whole again (a collective), FSDP2's hooks and classes taken
            off; gradients are dropped. Called while an exception leaves the run (this rank's own, or a
            collective's whose peer failed), it gathers nothing and leaves the model sharded: the others are
            in other collectives or gone, and a gather would meet theirs (gloo aborts the process) or wait out
            the collective timeout; the error goes on at once.

        Raises:
            RuntimeError: this process is not one of a job of several (nothing to shard over).

        Example:
            >>> # was: for block in model.layers: fully_shard(block); fully_shard(model)
            >>> undo = backend.current().sharding.shard_parameters(model, list(model.layers))   # doctest: +SKIP
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        world = self.backend.processes.world_size()
        if world < 2:
            raise RuntimeError(f"strategy='fsdp' shards over the processes of a job, but this process runs alone "
                               f"(world size {world}); use cores=N (N >= 2) or run under torchrun")  # fmt: skip
        mesh = init_device_mesh(self.backend.device_type, (world,))
        modules = list(model.modules())
        found = _Found(modules)
        for block in blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model._register_load_state_dict_pre_hook(_shard_loaded, with_module=True)
        handled = sys.exc_info()[1]  # an exception already being handled where this is called is not a failure

        def undo() -> None:
            failing = sys.exc_info()[1]
            if failing is None or failing is handled:
                _unshard(model, found)

        return undo

    def shard_mesh_2d(self, model: torch.nn.Module, blocks: Sequence[torch.nn.Module], split: dict[int, str],
                      tensor: int) -> Callable[[], None]:  # fmt: skip
        """FSDP x tensor parallel over a 2-D ``DeviceMesh`` ("fsdp", "tensor") of the job's processes: torch's
        ``parallelize_module`` splits each Linear whose weight ``split`` names over "tensor" (``ColwiseParallel``,
        ``RowwiseParallel``), then FSDP2 shards every block and the root over "fsdp". The tensor group's processes
        compute on the same rows. A whole state dict loads into it (each rank keeps its slice), and the undo gathers
        every parameter whole again and takes the hooks off, as ``shard_parameters``'s does.

        Raises:
            RuntimeError: the job's processes do not form a 2-D mesh with ``tensor`` along one axis.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        world = self.backend.processes.world_size()
        if world < 2 * tensor or world % tensor:
            raise RuntimeError(f"a 2-D mesh with {tensor} processes along its tensor axis needs a multiple of {tensor}, "
                               f"at least {2 * tensor}, but the job has {world}")  # fmt: skip
        mesh = init_device_mesh(self.backend.device_type, (world // tensor, tensor), mesh_dim_names=("fsdp", "tensor"))
        found = _Found(list(model.modules()))
        style = {"column": ColwiseParallel, "row": RowwiseParallel}
        plan = {name: style[split[id(m.weight)]]() for name, m in model.named_modules()
                if isinstance(m, torch.nn.Linear) and id(m.weight) in split}  # fmt: skip
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        parallelize_module(model, mesh["tensor"], plan)
        for name, param in model.named_parameters():  # its styles make each split Parameter trainable: a LoRA base stays frozen
            if name in frozen:
                param.requires_grad_(False)
        for block in blocks:
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
        model._register_load_state_dict_pre_hook(_shard_loaded, with_module=True)
        handled = sys.exc_info()[1]

        def undo() -> None:
            failing = sys.exc_info()[1]
            if failing is None or failing is handled:
                _unshard(model, found)

        return undo

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Slices whole state tensors (a checkpoint's, just loaded) like their sharded parameters, with no collective."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        for param, state in optimizer.state.items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape:
                    state[key] = distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                                   src_data_rank=None)  # fmt: skip


class NativeBackend(Backend):
    """Eager PyTorch on ``device_type``, several processes through ``torch.distributed``."""

    Devices = NativeDevices
    Processes = NativeProcesses
    Compute = NativeCompute
    Diagnosis = NativeDiagnosis
    Sharding = NativeSharding

    def __init__(self, device_type: str, dist_backend: str) -> None:
        self.name = self.device_type = device_type
        self.dist_backend = dist_backend
        self.core_rule = "any" if device_type == "cpu" else "up_to_available"
        super().__init__()
        env = torchrun_env()
        if env is not None and env[1] > 1:  # a replica that leaves or fails is named to those left waiting
            _watch_torchrun_job()

    def __repr__(self) -> str:
        return f"NativeBackend({self.device_type!r}, {self.dist_backend!r})"


class _Found:
    """What FSDP2 changes on a model's modules, noted before it does: each module's class and hook keys."""

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.classes = {module: type(module) for module in modules}
        self.hooks = {module: {name: set(hooks) for name, hooks in _hook_dicts(module)} for module in modules}
        self.attributes = {module: set(module.__dict__) for module in modules}


def _hook_dicts(module: torch.nn.Module) -> list[tuple[str, dict]]:
    return [(name, value) for name, value in vars(module).items() if name.endswith("hooks") and isinstance(value, dict)]


def _shard_loaded(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    """A load_state_dict pre-hook of the sharded root: each whole tensor given for a sharded one becomes this
    rank's slice of it (the same split FSDP2 made), so a checkpoint of the plain model loads as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    own = dict(module.named_parameters())
    own.update(module.named_buffers())
    for name, target in own.items():
        value = state_dict.get(prefix + name)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            state_dict[prefix + name] = distribute_tensor(value.to(target.device), target.device_mesh,
                                                          target.placements, src_data_rank=None)  # fmt: skip


def _unshard(model: torch.nn.Module, found: _Found) -> None:
    """FSDP2 taken off ``model``: parameters whole again (gathered one at a time, every rank), the classes,
    hooks and attributes it added removed. FSDP2 has no call for this; ``fully_shard`` may be applied again after."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for module in found.classes:
        if isinstance(module, FSDPModule):
            module.reshard()  # the registered parameters are the sharded ones again
    whole: dict[int, torch.nn.Parameter] = {}  # by the sharded parameter: tied weights stay one parameter
    with torch.no_grad():
        for module in found.classes:
            for name, param in list(module._parameters.items()):
                if isinstance(param, DTensor):
                    if id(param) not in whole:
                        whole[id(param)] = torch.nn.Parameter(param.full_tensor(), param.requires_grad)
                    module._parameters[name] = whole[id(param)]
    for module, cls in found.classes.items():
        module.__class__ = cls
        for name, hooks in _hook_dicts(module):
            for key in set(hooks) - found.hooks[module].get(name, set()):
                del hooks[key]
        for name in set(module.__dict__) - found.attributes[module]:
            if name != "forward":  # the checkpointing's, taken off by its own undo
                del module.__dict__[name]
        _module_state_mapping.pop(module, None)


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


# gloo's words when the replica at the other end of a collective has left the job
_PEER_LEFT = ("connection closed by peer", "connection reset by peer")
# optimizer steps this replica took (torch's global step hook counts them), told to the others as it leaves
_STEPS = [0]
# the job's store, kept at the first step: a torchrun script that destroys its group itself still says, at exit,
# how many steps it took (torchrun's store is its agent's, alive after the group)
_STORE: list[Any] = [None]
# How long a replica whose collective's peer left waits for that peer's word (finished or failed) in the store.
PEER_WORD_WAIT_S = 15.0


def _count_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    _STEPS[0] += 1
    if _STORE[0] is None and distributed_ready():
        _STORE[0] = dist.distributed_c10d._get_default_store()


def _job_store() -> Any:
    """The job's store: the live group's, else the one kept at the first step; None without either."""
    return dist.distributed_c10d._get_default_store() if distributed_ready() else _STORE[0]


def _say(kind: str, rank: int, text: str) -> None:
    """Tells the job's store that ``rank`` finished (``text``: its step count) or failed (``text``: its error),
    for a replica left waiting in a collective (``_peer_left``); nothing where no store is known."""
    store = _job_store()
    if store is None:
        return
    with contextlib.suppress(Exception):  # the store went with the job: the others' gloo errors stand
        store.set(f"tpu_utility/{kind}/{rank}", text)


def _error_text(error: BaseException) -> str:
    said = str(error).strip().splitlines()
    return f"{type(error).__name__}: {said[0] if said else ''}"[:300]


def _peer_left(error: BaseException, me: int, world: int, wait_s: float) -> str | None:
    """Why a collective's peer left: the replicas that finished their work (with their step counts) or failed (with
    their error), as they told the job's store when they left; polled up to ``wait_s`` (a peer's word may follow its
    leaving by a moment under torchrun). None where none said so (killed by a signal: the launcher names it)."""
    try:
        store = _job_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        others = [r for r in range(world) if r != me]
        deadline = time.monotonic() + wait_s
        while True:
            failed = {r: store.get(f"tpu_utility/failed/{r}").decode() for r in others
                      if store.check([f"tpu_utility/failed/{r}"])}  # fmt: skip
            left = {r: int(store.get(f"tpu_utility/finished/{r}")) for r in others
                    if store.check([f"tpu_utility/finished/{r}"])}  # fmt: skip
            if failed or left or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    except Exception:  # noqa: BLE001 - the store went with the job: gloo's own error stands
        return None
    if failed:
        said = "; ".join(f"rank {r} failed ({text})" for r, text in sorted(failed.items()))
        return (f"{said} and left the job, so rank {me}'s collective found no one at the other end (gloo: {error}); "
                f"{_ranks(sorted(failed))}'s own error says why")  # fmt: skip
    if not left:
        return None
    said = "; ".join(f"rank {r} finished after {steps} optimizer step(s)" for r, steps in sorted(left.items()))
    return (f"the replicas took different step counts: {said} and left, while rank {me} had taken "
            f"{_STEPS[0]} and went on, so its next collective (DDP's gradient all-reduce, step_optimizer's average) "
            f"found no one at the other end (gloo: {error}). Every replica must take the same number of steps: "
            f"give each the same number of batches (make_sampler(dataset) splits a dataset evenly over the "
            f"replicas; drop_last=True keeps every batch count equal)")


def _watch_torchrun_job() -> None:
    """In a ``torchrun`` process: its optimizer steps counted; an uncaught exception told to the job's store (and,
    where it is a collective whose peer left, explained as ``_peer_left`` says); at exit, the step count told.
    Once per process; a launched replica (``_replica_main``) does the same itself. Nothing starts a group here."""
    if _WATCHING[0]:
        return
    _WATCHING[0] = True
    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(_count_step)
    atexit.register(_say_finished)
    previous = sys.excepthook

    def explain(kind: type, error: BaseException, tb: Any) -> None:
        rank = int(os.environ.get("RANK", "0"))
        report = None
        ours = type(error).__module__.startswith("tpu_utility")  # a CollectiveTimeout: explained already
        if isinstance(error, RuntimeError) and not ours and any(w in str(error).lower() for w in _PEER_LEFT):
            report = _peer_left(error, rank, int(os.environ.get("WORLD_SIZE", "1")), PEER_WORD_WAIT_S)
        _FINISHED[0] = True  # it did not finish: no step count at exit
        _say("failed", rank, _error_text(error))
        if report is None:
            previous(kind, error, tb)
            return
        explained = RuntimeError(f"rank {rank}: {report}")
        explained.__cause__ = error
        previous(RuntimeError, explained, tb)

    sys.excepthook = explain


_WATCHING = [False]
_FINISHED = [False]  # the step count already told (or a failure)


def _say_finished() -> None:
    if not _FINISHED[0]:
        _FINISHED[0] = True
        _say("finished", int(os.environ.get("RANK", "0")), str(_STEPS[0]))


def _silent_ranks(me: int, world: int, wait_s: float) -> list[int]:
    """Ranks that have not reported a timeout through the job's store within ``wait_s`` of this one's report."""
    store = dist.distributed_c10d._get_default_store()
    store.set_timeout(datetime.timedelta(seconds=max(wait_s, 1.0)))  # the job is over: its store need not wait long
    store.set(f"tpu_utility/timed_out/{me}", "1")
    deadline = time.monotonic() + wait_s
    while True:
        silent = [r for r in range(world) if not store.check([f"tpu_utility/timed_out/{r}"])]
        if not silent or time.monotonic() > deadline:
            return silent
        time.sleep(0.2)


# How long a replica that finished waits at exit for the others to finish too (seconds).
LEAVE_WAIT_S = 60.0


def _leave_job() -> None:
    """Destroys the process group ``join_job`` made, if the user has not already, once every replica is done.

    DDP keeps a reference to the group, so destroying it does not end gloo's worker
    threads: they live on into the interpreter's teardown. One still releasing a
    collective's tensors there (a replica that raced ahead to its exit while another
    was mid-collective, on a loaded host) needs the GIL and aborts the process
    ("terminate called without an active exception", SIGABRT) after a run that
    succeeded. A gloo barrier first makes every replica leave together, with no
    collective in flight; it is skipped after an uncaught exception (the others would
    wait for a replica that is gone) and given up after ``LEAVE_WAIT_S``.
    """
    if not distributed_ready():
        return
    if not hasattr(sys, "last_value"):
        _say_finished()  # before the barrier: a replica left waiting in a collective learns why
    if dist.get_backend() == "gloo" and not hasattr(sys, "last_value"):  # sys.last_value: an uncaught exception
        with contextlib.suppress(RuntimeError):
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=LEAVE_WAIT_S), wait_all_ranks=True)
    dist.destroy_process_group()


def _replica_main(index: int, job: tuple[str, str, int, str], fn: Callable[..., Any], args: tuple) -> None:
    """One launched replica: joins the process group (with a timeout), runs ``fn``, leaves."""
    device_type, dist_backend, nprocs, store = job
    _WATCHING[0] = True  # counted and said here, not by _watch_torchrun_job
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs))
    if device_type != "cpu":
        torch.accelerator.set_device_index(index)
    dist.init_process_group(
        dist_backend, init_method=f"file://{store}", rank=index, world_size=nprocs,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip
    from torch.optim.optimizer import register_optimizer_step_post_hook

    counting = register_optimizer_step_post_hook(_count_step)
    try:
        fn(index, *args)  # api.launch hands in fn inside naming_stalls: a hand loop's collectives too
    except BaseException as error:
        _say("failed", index, _error_text(error))  # a replica waiting in a collective names this one
        raise
    else:  # said before the group goes: a replica still training learns why its peer left (_peer_left)
        _say("finished", index, str(_STEPS[0]))
    finally:
        counting.remove()
        dist.destroy_process_group()
