"""strategy="spmd": one process, each batch split over a mesh of XLA devices (one per host on a pod slice)."""

from __future__ import annotations

from typing import Any

from ... import backend
from ...backend.base import Backend
from ..topology import Topology
from .base import Strategy


def gb(n: float) -> str:
    """Bytes as the summary line says them: GB (10**9), or MB below one GB."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.2f} MB"


class Spmd(Strategy):
    """Every device holds the whole model; this process loads its hosts' share of each global batch."""

    name = "spmd"

    def __init__(self, cores: int = 1, options: Any = None, why: str = "", *, may_shard: bool = False) -> None:
        super().__init__(cores, options, why)
        self.may_shard = may_shard

    @classmethod
    def choose(cls, cores: int, on: Backend, options: Any) -> Strategy:
        if not on.sharding.over_mesh():
            raise ValueError(
                f"strategy='spmd' needs XLA devices (a TPU, or PJRT_DEVICE set); here the {backend.current().name} "
                f"backend runs one process per device: use strategy='auto' or 'multiprocess' ('fsdp' shards over the "
                f"processes)"
            )
        return super().choose(cores, on, options)

    def topology(self) -> Topology:
        return Topology.mesh()

    def settled(self, plan: Any) -> Strategy:
        """Chosen by "auto": the same mesh with the parameters sharded (FSDP) where the plan says one replica
        cannot fit a chip and a shard can, the plan's figures said why; else itself."""
        if not self.may_shard or plan.fits_replicated or not plan.fits_sharded:
            return self
        why = (f"strategy='auto' chose fsdp: one replica needs {gb(plan.replicated)} per chip, more than the "
               f"{gb(plan.usable)} usable of {gb(plan.device_memory)}; sharded over {plan.cores}: {gb(plan.sharded)}")  # fmt: skip
        from .fsdp import Fsdp

        return Fsdp(self.cores, why=why)
