"""strategy="fsdp": parameters, gradients and optimizer state sharded over all cores, one block gathered at a time.

On XLA the backend applies FSDPv2's steps to the model in place (its sharding group's ``shard_parameters``): the model
keeps its own modules and key names, so a checkpoint, ``history.model`` or ``predict`` never asks which
strategy trained it. Batches are sharded over the same devices as under ``strategy="spmd"``, and the model's
output on its batch dimension (so the compiler never replicates the logits). Natively (FSDP2 over
``torch.distributed``) each process of a job holds one shard: ``one_cycle_fit`` launches them
(``MultiprocessFsdp``), or torchrun did (``FsdpProcess``). Each block recomputes its activations in the
backward unless ``FSDP(checkpoint=False)`` (``sharding.around_blocks``).
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import nn

from ... import backend
from ...backend.base import Backend
from ...sharding import FSDP, around_blocks, blocks_of, fsdp_blocks, largest_block
from ..topology import Topology
from .base import InJob, Launching, Strategy, shard_bytes

T = TypeVar("T")


class Fsdp(Strategy):
    """XLA: one process, each parameter split over the mesh of devices; batches split as under SPMD."""

    name = "fsdp"
    options_type = FSDP
    shards = True
    options: FSDP

    def __init__(self, cores: int = 1, options: FSDP | None = None, why: str = "") -> None:
        super().__init__(cores, options or FSDP(), why)
        self._undo: list[Callable[[], None]] = []

    @classmethod
    def for_job(cls, cores: int, on: Backend, options: FSDP | None) -> Strategy | None:
        if not on.sharding.over_mesh():
            return FsdpProcess(cores, options)  # one process of the job, sharding with the others
        raise ValueError(f"strategy='{cls.name}' shards over all cores from one process, but this process is one "
                         f"replica of a multi-process launch; call it from the main process with cores='all'")  # fmt: skip

    @classmethod
    def choose(cls, cores: int, on: Backend, options: FSDP | None) -> Strategy:
        if cores < 2:
            raise ValueError(f"strategy='{cls.name}' shards the model over several cores, but given cores={cores}; give "
                             f"cores=N with N >= 2 (cores='all' where several devices are attached), or strategy='auto' "
                             f"on one core")  # fmt: skip
        return Fsdp(cores, options) if on.sharding.over_mesh() else MultiprocessFsdp(cores, options)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.cores, self.options, self.why) == (other.cores, other.options, other.why)

    def __getstate__(self) -> dict:  # a launched process gets the options, not this process's undo
        return {**vars(self), "_undo": []}

    def alone(self) -> Strategy | None:
        return None  # its shard belongs to the job: it cannot run on data of its own

    def sharding(self) -> Strategy:
        return self

    def topology(self) -> Topology:
        return Topology.mesh()

    def enter(self, model: nn.Module) -> None:
        blocks = fsdp_blocks(model, self.options)
        self._undo = [backend.current().sharding.shard_parameters(model, blocks), *around_blocks(model, blocks, self.options)]
        checkpointed = ", each checkpointed" if self.options.checkpoint else ""
        self.note = f"fsdp: {blocks_of(model, self.options)} gathered one at a time{checkpointed}"
        self.note += f" ({self.why})" if self.why else ""

    def leave(self, model: nn.Module) -> None:
        for step in reversed(self._undo):  # hooks, checkpointing and use_cache given back; the parameters stay
            step()
        self._undo = []

    def held(self, model: nn.Module, tensors: list[torch.Tensor]) -> int:
        return sum(shard_bytes(t.numel(), t.element_size(), self.cores) for t in tensors)  # each split over every core

    def checkpoints(self, own: bool) -> bool:
        return (self.options.checkpoint or own) if self.cores > 1 else own  # one core: nothing sharded

    def gathered(self, model: nn.Module) -> int:
        """One block's weights gathered whole for its forward, then its gradients before they are scattered."""
        block = largest_block(model, self.options.wrap) if self.cores > 1 else []
        return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) for p in block)


class FsdpProcess(InJob, Fsdp):
    """Natively: one process of a job (launched by ``MultiprocessFsdp`` or torchrun), holding its shard."""

    def alone(self) -> Strategy | None:
        return None


class MultiprocessFsdp(Launching, Fsdp):
    """Natively: ``run`` launches ``cores`` processes that shard the model among them (FSDP2); so does ``infer``
    (each batch runs through every process's shard)."""

    name = "multiprocess-fsdp"

    def replica(self) -> Strategy:
        return FsdpProcess(self.cores, self.options, self.why)

    def infer(self, work: Callable[..., T], args: tuple, *, what: str) -> T:
        return self.run(work, args, what=what)
