"""strategy="multiprocess": one process per device (per chip on XLA, per GPU or CPU process natively), each a
replica of the model on its own share of the data, gradients averaged every step."""

from __future__ import annotations

from ...sharding import FSDP
from .base import InJob, Strategy
from .single import Single


class Replica(InJob, Strategy):
    """One process of a launched job (ours, or torchrun's): the whole model, its own share of the samples."""

    name = "replica"


class Multiprocess(Strategy):
    """The caller launches ``cores`` processes, each running ``Replica``."""

    name = "multiprocess"
    launches = True

    @classmethod
    def choose(cls, cores: int, native: bool, options: FSDP | None) -> Strategy:
        if native and cores == 1:  # natively one process per device: one device, nothing to launch
            return Single()
        return super().choose(cores, native, options)

    def replica(self) -> Strategy:
        return Replica(self.cores)
