"""Topology: how many cores, which strategy, and who loads which samples.

Pure choices (``resolve_cores``, ``choose_strategy``, ``process_mode``) from the arguments and the
backend's counts, and ``Topology``, the data layout of one process: single core, SPMD over a mesh of
devices and hosts, or one replica of a multi-process launch. Plain arithmetic, tested with simulated
process counts; a new strategy is a word here and a room in ``strategies/``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from .. import backend

Strategy = Literal["auto", "spmd", "multiprocess", "fsdp"]


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


def choose_strategy(strategy: str, cores: int, in_launch: bool, sharded_processes: bool = False) -> str:
    """"single", "spmd", "fsdp" (this process shards: over its SPMD mesh on XLA, or as one process of a job
    natively), "multiprocess" (we launch), "multiprocess-fsdp" (we launch processes that shard) or "replica"
    (already launched). ``sharded_processes``: the backend shards over processes (native FSDP2), not a mesh."""
    if strategy not in get_args(Strategy):
        raise ValueError(f"strategy must be one of {get_args(Strategy)}, but given {strategy!r}")
    if strategy == "fsdp" and in_launch:
        if sharded_processes:
            return "fsdp"  # one process of the job, sharding with the others
        raise ValueError("strategy='fsdp' shards over all cores from one process, but this process is one replica of "
                         "a multi-process launch; call it from the main process with cores='all'")  # fmt: skip
    if strategy == "fsdp":
        if cores < 2:
            raise ValueError(f"strategy='fsdp' shards the model over several cores, but given cores={cores}; give "
                             f"cores=N with N >= 2 (cores='all' where several devices are attached), or strategy='auto' "
                             f"on one core")  # fmt: skip
        return "multiprocess-fsdp" if sharded_processes else "fsdp"
    if in_launch:
        return "replica"
    if strategy == "multiprocess":
        return "multiprocess"
    if cores == 1 and strategy == "auto":
        return "single"
    return "spmd"


# the modes that launch processes, and the mode each launched process runs
LAUNCHED_MODE = {"multiprocess": "replica", "multiprocess-fsdp": "fsdp"}


def available_cores() -> int:
    """Devices this job could use, counted without starting a runtime."""
    return backend.device_count()


def process_mode(cores: int | str, strategy: str = "auto") -> tuple[int, str]:
    """(cores, mode) for this process; ``mode`` as ``choose_strategy`` names it.

    On XLA several cores run SPMD (one process) or one process per chip; on the
    native backends (CUDA, CPU) one process per device, under ``torch.distributed``.

    Raises:
        ValueError: a strategy or core count that this backend cannot run.
    """
    backend.join_job()  # inside torchrun: this process is one replica of its job
    chosen = backend.current()
    n_cores = resolve_cores(cores, available_cores(), chosen.core_rule)
    in_launch = backend.in_launched_process() and backend.world_size() > 1
    mode = choose_strategy(strategy, n_cores, in_launch, sharded_processes=not chosen.lazy)
    if chosen.lazy or mode in ("single", "replica", "fsdp", "multiprocess-fsdp"):
        return n_cores, mode
    if strategy == "spmd":
        raise ValueError(
            f"strategy={strategy!r} needs XLA devices (a TPU, or PJRT_DEVICE set); here the {chosen.name} backend runs "
            f"one process per device: use strategy='auto' or 'multiprocess' ('fsdp' shards over the processes)"
        )
    return n_cores, "multiprocess" if n_cores > 1 else "single"


@dataclass(frozen=True)
class Topology:
    """Who runs and who loads what, as plain numbers.

    ``replicas``/``rank``: processes that each run their own copy of the graph
    (a multi-process launch). ``hosts``/``host``: processes of one SPMD program
    (one per host on a pod slice), each loading its share of the global batch.
    ``devices``: the SPMD mesh size over all hosts.
    """

    mode: str = "single"  # "single", "spmd" or "replica"
    replicas: int = 1
    rank: int = 0
    hosts: int = 1
    host: int = 0
    devices: int = 1

    def __post_init__(self) -> None:
        if self.mode == "spmd" and self.devices % self.hosts:
            raise ValueError(f"{self.devices} devices do not split evenly over {self.hosts} hosts")

    @property
    def cores(self) -> int:
        return self.devices if self.mode == "spmd" else self.replicas

    @property
    def loaders(self) -> tuple[int, int]:
        """(how many loaders split the data, this one's index)."""
        return (self.hosts, self.host) if self.mode == "spmd" else (self.replicas, self.rank)

    @property
    def master(self) -> bool:
        return self.rank == 0 and self.host == 0

    def loader_batch(self, per_core: int) -> int:
        """Samples this process loads per step: its cores' share of the global batch."""
        return per_core * self.devices // self.hosts if self.mode == "spmd" else per_core

    def global_batch(self, per_core: int) -> int:
        return per_core * self.cores


def current_topology(mode: str) -> Topology:
    """This process's Topology; switches SPMD on for mode "spmd" (before the runtime starts)."""
    if mode == "fsdp" and not backend.current().lazy:  # natively: one process of a job, its parameters sharded
        return Topology("replica", replicas=backend.world_size(), rank=backend.rank())
    if mode in ("spmd", "fsdp"):  # fsdp: the same data layout, the parameters sharded too (strategies.fsdp)
        backend.use_spmd()
        mesh = backend.current().sharding
        return Topology("spmd", hosts=mesh.process_count(), host=mesh.process_index(), devices=mesh.global_device_count())
    if mode == "replica":
        return Topology("replica", replicas=backend.world_size(), rank=backend.rank())
    return Topology("single")
