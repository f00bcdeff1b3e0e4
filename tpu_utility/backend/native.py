"""The native backend: eager PyTorch on one device type, replicas over ``torch.distributed``.

One class serves every device ``torch.accelerator`` knows and the CPU, chosen by
device type and process-group backend: ``cuda`` + ``nccl``, ``cpu`` + ``gloo``
(``xpu``/``mps`` where present). Alone in its process it is the serial backend;
inside a launch (ours, or a ``torchrun`` job) each process is one replica and
every collective goes through ``torch.distributed`` with a timeout, so a replica
that dies or diverges ends the job with an error instead of a hang.

Example:
    >>> from tpu_utility.backend.native import NativeBackend
    >>> NativeBackend("cpu", "gloo").device()
    device(type='cpu')
"""

from __future__ import annotations

import datetime
import os
import tempfile
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from .base import Backend, ReduceOp

# Every collective and the start-up rendezvous give up after this long (seconds): a replica
# that died or took another path raises on the others instead of hanging them forever.
COLLECTIVE_TIMEOUT_S = float(os.environ.get("TPU_UTILITY_COLLECTIVE_TIMEOUT", "600"))

_OPS = {"sum": "SUM", "min": "MIN", "max": "MAX"}


def distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def torchrun_env() -> tuple[int, int] | None:
    """(rank, world size) set by torchrun (or any launcher of torch.distributed's env:// kind), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return None


class NativeBackend(Backend):
    """Eager PyTorch on ``device_type``, several processes through ``torch.distributed``."""

    def __init__(self, device_type: str, dist_backend: str) -> None:
        self.name = self.device_type = device_type
        self.dist_backend = dist_backend
        self.core_rule = "any" if device_type == "cpu" else "up_to_available"

    def __repr__(self) -> str:
        return f"NativeBackend({self.device_type!r}, {self.dist_backend!r})"

    # ------------------------------------------------------------- devices
    def device(self, index: int | None = None) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        if index is None:
            index = torch.accelerator.current_device_index()
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        """Accelerators on this host; on the CPU 1 (one process already uses every core)."""
        if self.device_type == "cpu":
            return 1
        return torch.accelerator.device_count()

    # ------------------------------------------------------------ replicas
    def world_size(self) -> int:
        return dist.get_world_size() if distributed_ready() else 1

    def rank(self) -> int:
        return dist.get_rank() if distributed_ready() else 0

    def in_launched_process(self) -> bool:
        env = torchrun_env()
        return distributed_ready() or (env is not None and env[1] > 1)

    def join_job(self) -> None:
        """Joins the torchrun job this process belongs to (its env:// rendezvous), once."""
        if distributed_ready() or torchrun_env() is None:
            return
        if self.device_type != "cpu":
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(self.dist_backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))

    def launch(self, fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
        """Runs ``fn(index, *args)`` in ``nprocs`` new processes, one replica each.

        Raises:
            RuntimeError: a replica failed or died (its exit code or signal named),
                or fork was asked for after CUDA started in this process.
        """
        if start_method == "fork" and self.device_type == "cuda" and torch.cuda.is_initialized():
            raise RuntimeError(
                "CUDA is already initialised in this process, and a forked child cannot use it. Restart the "
                "kernel and launch before touching the GPU (no get_device(), no tensors on 'cuda'), or run "
                "the training from a script (spawn)."
            )
        with tempfile.TemporaryDirectory(prefix="tpu_utility_rdzv_") as folder:
            store = os.path.join(folder, "store")
            job = (self.device_type, self.dist_backend, nprocs, store)
            try:
                torch.multiprocessing.start_processes(
                    _replica_main, args=(job, fn, args), nprocs=nprocs, start_method=start_method, join=True
                )
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

    def wrap_replica(self, model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        """``DistributedDataParallel``: gradients averaged during backward, buffers from rank 0."""
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])

    def barrier(self, tag: str) -> None:
        if self.world_size() > 1:
            dist.barrier()

    # --------------------------------------------------------------- steps
    def wait(self) -> None:
        if self.device_type != "cpu":
            torch.accelerator.synchronize()

    def to_cpu(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        return [t.detach().cpu() for t in tensors]

    # ----------------------------------------------------------- precision
    def bf16_autocast_available(self) -> bool:
        return self.device_type == "cuda" and torch.cuda.is_bf16_supported()

    def autocast(self, device: torch.device, dtype: torch.dtype) -> Any:
        return torch.autocast(self.device_type, dtype=dtype)


def _replica_main(index: int, job: tuple[str, str, int, str], fn: Callable[..., Any], args: tuple) -> None:
    """One launched replica: joins the process group (with a timeout), runs ``fn``, leaves."""
    device_type, dist_backend, nprocs, store = job
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(nprocs))
    if device_type != "cpu":
        torch.accelerator.set_device_index(index)
    dist.init_process_group(
        dist_backend, init_method=f"file://{store}", rank=index, world_size=nprocs,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )  # fmt: skip
    try:
        fn(index, *args)
    finally:
        dist.destroy_process_group()
