"""Topology: how many cores, and who loads which samples.

``resolve_cores`` from the argument and the backend's counts, and ``Topology``, the data layout of one
process: single core, SPMD over a mesh of devices and hosts, or one replica of a multi-process launch.
Plain arithmetic, tested with simulated process counts; each strategy (``strategies/``) says which
layout its process has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .. import backend


# ----------------------------------------------------------- pure choices
CoreRule = Literal["one_or_all", "up_to_available", "any"]


def resolve_cores(cores: int | str, available: int, rule: CoreRule = "one_or_all") -> int:
    """The number of cores (or devices, or processes) to run on.

    ``rule``: XLA runs 1 or all of its cores ("one_or_all"); a GPU host any number
    up to its GPUs ("up_to_available"); the CPU any number of processes ("any"),
    which is how DDP code is tested there.
    """
    if cores == "all":
        return available
    if isinstance(cores, bool) or not isinstance(cores, int):
        raise TypeError(f"cores must be 1, 'all' or an int, but given {cores!r}")
    if rule == "any" and cores < 1:
        raise ValueError(f"cores must be 'all' or an int >= 1, but given {cores}")
    if rule == "up_to_available" and not 1 <= cores <= available:
        raise ValueError(f"cores must be between 1 and {available} (the devices here), or 'all', but given {cores}")
    if rule == "one_or_all" and cores != 1 and cores != available:
        raise ValueError(f"cores must be 1 or {available} (all cores here), or 'all', but given {cores}")
    return cores


def available_cores() -> int:
    """Devices this job could use, counted without starting a runtime."""
    return backend.current().devices.device_count()


@dataclass(frozen=True)
class Topology:
    """Who runs and who loads what, as plain numbers.

    ``replicas``/``rank``: processes that each run their own copy of the graph
    (a multi-process launch). ``hosts``/``host``: processes of one SPMD program
    (one per host on a pod slice), each loading its share of the global batch.
    ``devices``: the SPMD mesh size over all hosts.
    """

    spmd: bool = False  # one program over a mesh of ``devices`` (else one device, or one of ``replicas``)
    replicas: int = 1
    rank: int = 0
    hosts: int = 1
    host: int = 0
    devices: int = 1

    def __post_init__(self) -> None:
        if self.spmd and self.devices % self.hosts:
            raise ValueError(f"{self.devices} devices do not split evenly over {self.hosts} hosts")

    @property
    def cores(self) -> int:
        return self.devices if self.spmd else self.replicas

    @property
    def loaders(self) -> tuple[int, int]:
        """(how many loaders split the data, this one's index)."""
        return (self.hosts, self.host) if self.spmd else (self.replicas, self.rank)

    @property
    def master(self) -> bool:
        return self.rank == 0 and self.host == 0

    def loader_batch(self, per_core: int) -> int:
        """Samples this process loads per step: its cores' share of the global batch."""
        return per_core * self.devices // self.hosts if self.spmd else per_core

    def global_batch(self, per_core: int) -> int:
        return per_core * self.cores

    @classmethod
    def mesh(cls) -> Topology:
        """This process's share of one SPMD program over all devices (SPMD switched on first, before the runtime
        starts)."""
        backend.current().sharding.use_spmd()
        mesh = backend.current().sharding
        return cls(spmd=True, hosts=mesh.process_count(), host=mesh.process_index(), devices=mesh.global_device_count())

    @classmethod
    def job(cls) -> Topology:
        """This process as one of a launched job's replicas."""
        processes = backend.current().processes
        return cls(replicas=processes.world_size(), rank=processes.rank())
