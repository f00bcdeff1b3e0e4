"""What every strategy does: the work callers hand it instead of reading its flags.

A strategy is one way of spreading a model over devices, and the unit that does the spreading. Callers
never ask which one runs, nor read what it is; they hand it the work:

- ``run(work, args)``: a training run (``one_cycle_fit``, ``find_lr``), here or in the processes it launches;
  ``infer(work, args)``: ``predict``/``evaluate``, the same, where inference needs the launch (a sharded
  model's processes) and in this process otherwise; ``one_program(what)``: what a single program over this
  process's devices runs (``generate``); ``alone()``: what a process of a job runs on data of its own.
- ``enter(model)``/``leave(model)``: the model once it is on its device and before it goes back.
- ``topology()``: who loads which samples; ``processes()``: how many processes the run has.
- the memory plan's column for it: ``column()`` (which of the plan's two columns its devices hold),
  ``held(tensor)``, ``checkpoints(own)`` and ``gathered(model)`` (the figures of the sharded column, from the
  shards it makes); ``settled(plan)``: what ``strategy="auto"`` turns into once the plan is known, and why.

A strategy asks the backend what it can do (``backend.sharding.over_mesh()``: one process over a mesh of
devices, or one process per device), never which backend it is. ``name`` is the word the summary line says.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Literal, TypeVar

import torch
from torch import nn

from ... import backend
from ...backend.base import Backend
from ...checkpoint import save_atomic
from ..topology import Topology

T = TypeVar("T")
Column = Literal["replicated", "sharded"]  # the memory plan's two columns: one device's share of a run


class Strategy:
    """The base of every strategy: one process, the whole model on its device, nothing launched.

    ``cores``: the cores (devices or processes) the run spreads over. ``options``: a sharding strategy's options
    (``FSDP(...)``, ``Mesh2D(...)``: each strategy types its own; None here). ``why``: what chose the strategy,
    when not the user (``strategy="auto"`` from the memory plan), said on the summary line.
    """

    name: ClassVar[str] = ""
    options_type: ClassVar[type | None] = None  # the options ``strategy=`` may give as an object (``FSDP(...)``)
    launches: ClassVar[bool] = False  # ``run`` launches ``cores`` processes, each running ``replica()``
    shards: ClassVar[bool] = False  # parameters, gradients and optimizer state sharded over the cores
    in_job: ClassVar[bool] = False  # this process is one of a launched job (ours or torchrun's), each its own data
    may_shard: bool = False  # chosen by "auto": the memory plan may shard it instead (``settled``)

    def __init__(self, cores: int = 1, options: Any = None, why: str = "") -> None:
        self.cores, self.options, self.why = cores, options, why
        self.note = ""  # said on the summary line, once the model has entered

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cores={self.cores})"

    def __eq__(self, other: object) -> bool:  # the same kind of strategy with the same settings
        return type(other) is type(self) and vars(other) == vars(self)

    # ------------------------------------------------------------- choosing
    @classmethod
    def choose(cls, cores: int, on: Backend, options: Any) -> Strategy:
        """The strategy this class's word gives a process of its own (not one of a launched job): ``cores`` cores
        on the backend ``on`` (asked what it can do: ``on.sharding.over_mesh()``)."""
        return cls(cores, options)

    @classmethod
    def for_job(cls, cores: int, on: Backend, options: Any) -> Strategy | None:
        """What this class's word gives one process of a launched job; None: a plain replica of it."""
        return None

    def settled(self, plan: Any) -> Strategy:
        """What this strategy becomes once the run's memory plan is known (``strategy="auto"``: sharded where one
        replica cannot fit a chip and a shard can); itself here."""
        return self

    def replica(self) -> Strategy:
        """What each process a launching strategy starts runs."""
        raise RuntimeError(f"{self.name} runs in this process; it launches no replicas")

    def alone(self) -> Strategy | None:
        """What this process runs on data of its own, apart from the job's other processes; None where it cannot
        (it holds a shard the others need)."""
        return self

    def one_program(self, what: str) -> Strategy:
        """What runs ``what`` as one program over this process's devices (``generate``): this strategy, where it
        neither launches processes nor shards the parameters.

        Raises:
            ValueError: a strategy that launches processes or shards (``what`` cannot run that way).
        """
        if self.launches or self.shards:
            how = "processes" if self.launches else "devices holding shards of the model"
            raise ValueError(f"{what} runs on one device, or on all XLA devices as one program (SPMD); the "
                             f"{backend.current().name} backend's {self.name} runs {self.cores} {how}: use cores=1")  # fmt: skip
        return self

    def job_size(self) -> int:
        """The processes of the job this process belongs to, each given its own data (1: none)."""
        return 1

    def processes(self) -> int:
        """The processes the run has on this host (each loads its own batches)."""
        return 1

    # -------------------------------------------------------------- running
    def run(self, work: Callable[..., T], args: tuple, *, what: str, pack: Callable[[T], Any] | None = None,
            unpack: Callable[[Any], T] | None = None) -> T:  # fmt: skip
        """``work(strategy, *args)`` where this strategy spreads it: here, in this process.

        A launching strategy runs it in each process it starts (``strategy`` that process's ``replica()``), and
        returns the master's answer, ``pack``-ed there into tensors and plain values and ``unpack``-ed here.
        """
        return work(self, *args)

    def infer(self, work: Callable[..., T], args: tuple, *, what: str) -> T:
        """``predict``/``evaluate``'s ``work(strategy, *args)``: as ``run`` runs it (a launching strategy whose
        processes are replicas runs it in this process, on one device: inference needs no replicas)."""
        return self.run(work, args, what=what)

    def topology(self) -> Topology:
        """This process's data layout (switches SPMD on first where the strategy runs over a mesh)."""
        return Topology()

    def enter(self, model: nn.Module) -> None:
        """Called once the model is on its device."""

    def leave(self, model: nn.Module) -> None:
        """Called before the model goes back where it was found."""

    # --------------------------------------------------- the memory plan's column
    def column(self) -> Column:
        """Which column of the memory plan one device of this strategy holds."""
        return "sharded" if self.shards else "replicated"

    def sharding(self) -> Strategy | None:
        """The sharded strategy the plan's sharded column is for (a sharding strategy: itself); None: the plan's
        default, FSDP over the same cores (what "auto" or a refusal would offer)."""
        return None

    def held(self, model: nn.Module, tensors: list[torch.Tensor]) -> int:
        """The bytes one device holds of ``tensors`` (``model``'s parameters, or their gradients or optimizer state,
        of the same sizes), planned before anything is placed: each whole, replicated."""
        return sum(t.numel() * t.element_size() for t in tensors)

    def checkpoints(self, own: bool) -> bool:
        """Whether a step under this strategy checkpoints each block: the model's ``own`` setting here."""
        return own

    def gathered(self, model: nn.Module) -> int:
        """The bytes a step gathers for a moment beyond the shards one device keeps (a sharded block's weights
        and gradients); 0 where nothing is sharded."""
        return 0


def shard_bytes(numel: int, itemsize: int, shards: int) -> int:
    """Bytes one of ``shards`` devices holds of a tensor split on one dimension, padded to divide evenly.

    Example:
        >>> shard_bytes(10, 4, 4), shard_bytes(10, 4, 1)
        (12, 40)
    """
    return math.ceil(numel / shards) * itemsize


class InJob:
    """Mixed into a strategy that one process of a launched job runs (ours, or torchrun's): each process its own
    share of the samples, as one of the job's replicas."""

    in_job = True

    def topology(self) -> Topology:
        return Topology.job()

    def job_size(self) -> int:
        return backend.current().processes.world_size()


class Launching:
    """Mixed into a strategy whose run is ``cores`` launched processes, each running ``replica()``; the master's
    answer comes back through a file (tensors and plain values: ``torch.load(weights_only=True)``)."""

    launches = True

    def processes(self) -> int:
        return self.cores

    def run(self, work: Callable[..., T], args: tuple, *, what: str, pack: Callable[[T], Any] | None = None,
            unpack: Callable[[Any], T] | None = None) -> T:  # fmt: skip
        from ...environment import choose_start_method, is_interactive

        if backend.current().sharding.is_spmd():
            raise RuntimeError(
                f"strategy='{self.name}' launches processes, which cannot run from a process already switched to SPMD "
                f"(setup_tpu does that when several XLA devices are visible). Call setup_tpu(spmd=False) first thing, "
                f"or use strategy='spmd'."
            )
        with tempfile.TemporaryDirectory(prefix="tpu_utility_") as tmp:
            result = os.path.join(tmp, "result.pt")
            job = _Job(work, self.replica(), args, pack, result, what)
            backend.launch(_launched, (job,), self.cores, choose_start_method(is_interactive()))
            if not os.path.exists(result):
                raise RuntimeError(f"the launched {what} processes ended without a result; see their output above")
            answer = torch.load(result, map_location="cpu", weights_only=True)["result"]
        return answer if unpack is None else unpack(answer)


@dataclass(frozen=True)
class _Job:
    """What each process ``Launching.run`` starts is handed: the work, its strategy and arguments, and where the
    master leaves its answer (``pack``-ed)."""

    work: Callable[..., Any]
    replica: Strategy
    args: tuple
    pack: Callable[[Any], Any] | None
    result: str
    what: str


def _launched(index: int, job: _Job) -> None:
    """One launched process of ``Launching.run``: the work as one process of the job; the master keeps the answer."""
    if backend.current().lazy:
        from ...environment import setup_tpu

        setup_tpu(verbose=False)  # this process's own compile-cache folder
    answer = job.work(job.replica, *job.args)
    if backend.is_master():
        save_atomic({"result": answer if job.pack is None else job.pack(answer)}, job.result)
    backend.current().processes.barrier(f"tpu_utility.{job.what}.done")
