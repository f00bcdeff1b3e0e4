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

from typing import Callable

from torch import nn

from ... import backend
from ...sharding import FSDP, around_blocks, blocks_of, fsdp_blocks
from ..topology import Topology
from .base import InJob, Strategy


class Fsdp(Strategy):
    """XLA: one process, each parameter split over the mesh of devices; batches split as under SPMD."""

    name = "fsdp"
    shards = True

    def __init__(self, cores: int = 1, options: FSDP | None = None, why: str = "") -> None:
        super().__init__(cores, options or FSDP(), why)
        self._undo: list[Callable[[], None]] = []

    @classmethod
    def for_job(cls, cores: int, native: bool, options: FSDP | None) -> Strategy | None:
        if native:
            return FsdpProcess(cores, options)  # one process of the job, sharding with the others
        raise ValueError("strategy='fsdp' shards over all cores from one process, but this process is one replica "
                         "of a multi-process launch; call it from the main process with cores='all'")  # fmt: skip

    @classmethod
    def choose(cls, cores: int, native: bool, options: FSDP | None) -> Strategy:
        if cores < 2:
            raise ValueError(f"strategy='fsdp' shards the model over several cores, but given cores={cores}; give "
                             f"cores=N with N >= 2 (cores='all' where several devices are attached), or strategy='auto' "
                             f"on one core")  # fmt: skip
        return MultiprocessFsdp(cores, options) if native else Fsdp(cores, options)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and (self.cores, self.options, self.why) == (other.cores, other.options, other.why)

    def __getstate__(self) -> dict:  # a launched process gets the options, not this process's undo
        return {**vars(self), "_undo": []}

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


class FsdpProcess(InJob, Fsdp):
    """Natively: one process of a job (launched by ``MultiprocessFsdp`` or torchrun), holding its shard."""


class MultiprocessFsdp(Fsdp):
    """Natively: the caller launches ``cores`` processes that shard the model among them (FSDP2)."""

    name = "multiprocess-fsdp"
    launches = True

    def replica(self) -> Strategy:
        return FsdpProcess(self.cores, self.options, self.why)
