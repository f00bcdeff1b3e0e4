"""strategy="spmd": one process, each batch split over a mesh of XLA devices (one per host on a pod slice)."""

from __future__ import annotations

from ... import backend
from ...sharding import FSDP
from ..topology import Topology
from .base import Strategy


class Spmd(Strategy):
    """Every device holds the whole model; this process loads its hosts' share of each global batch."""

    name = "spmd"

    def __init__(self, cores: int = 1, options: FSDP | None = None, why: str = "", *, may_shard: bool = False) -> None:
        super().__init__(cores, options, why)
        self.may_shard = may_shard

    @classmethod
    def choose(cls, cores: int, native: bool, options: FSDP | None) -> Strategy:
        if native:
            raise ValueError(
                f"strategy='spmd' needs XLA devices (a TPU, or PJRT_DEVICE set); here the {backend.current().name} "
                f"backend runs one process per device: use strategy='auto' or 'multiprocess' ('fsdp' shards over the "
                f"processes)"
            )
        return super().choose(cores, native, options)

    def topology(self) -> Topology:
        return Topology.mesh()

    def sharded(self, why: str) -> Strategy:
        """The same mesh with the parameters sharded (``strategy="auto"`` when the plan says a replica cannot fit)."""
        from .fsdp import Fsdp

        return Fsdp(self.cores, FSDP(), why)
