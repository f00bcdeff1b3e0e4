"""strategy="multiprocess": one process per device (per chip on XLA, per GPU or CPU process natively), each a
replica of the model on its own share of the data, gradients averaged every step."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from ...backend.base import Backend
from .base import InJob, Launching, Strategy
from .single import Single

T = TypeVar("T")


class Replica(InJob, Strategy):
    """One process of a launched job (ours, or torchrun's): the whole model, its own share of the samples."""

    name = "replica"

    def alone(self) -> Strategy:
        return Single()  # given data of its own: every row of it, on its own device


class Multiprocess(Launching, Strategy):
    """``run`` launches ``cores`` processes, each running ``Replica``."""

    name = "multiprocess"

    @classmethod
    def choose(cls, cores: int, on: Backend, options: Any) -> Strategy:
        if cores == 1 and not on.sharding.over_mesh():  # one process per device: one device, nothing to launch
            return Single()
        return super().choose(cores, on, options)

    def replica(self) -> Strategy:
        return Replica(self.cores)

    def infer(self, work: Callable[..., T], args: tuple, *, what: str) -> T:
        return work(Single(), *args)  # replicas add nothing to inference: this process, its device
