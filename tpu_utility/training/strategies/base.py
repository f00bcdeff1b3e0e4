"""What every strategy answers: the questions callers ask instead of comparing words.

A strategy is one way of spreading a model over devices. Callers never ask which one runs;
they ask what it does: does it launch processes (``launches``, and what each launched
process runs: ``replica()``), does it shard the parameters (``shards``), who loads which
samples (``topology()``), and they hand it the model once it is on its device (``enter``)
and before it goes back (``leave``). ``name`` is the word the summary line says.
"""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from ...sharding import FSDP
from ..topology import Topology


class Strategy:
    """The base of every strategy: one process, the whole model on its device, nothing launched.

    ``cores``: the cores (devices or processes) the run spreads over. ``options``: the FSDP options
    of a sharding strategy. ``why``: what chose the strategy, when not the user (``strategy="auto"``
    from the memory plan), said on the summary line.
    """

    name: ClassVar[str] = ""
    launches: ClassVar[bool] = False  # the caller launches ``cores`` processes, each running ``replica()``
    shards: ClassVar[bool] = False  # parameters, gradients and optimizer state sharded over the cores
    in_job: ClassVar[bool] = False  # this process is one of a launched job (ours or torchrun's), each its own data
    may_shard: bool = False  # chosen by "auto": the memory plan may shard it instead (``sharded``)

    def __init__(self, cores: int = 1, options: FSDP | None = None, why: str = "") -> None:
        self.cores, self.options, self.why = cores, options, why
        self.note = ""  # said on the summary line, once the model has entered

    def __repr__(self) -> str:
        return f"{type(self).__name__}(cores={self.cores})"

    def __eq__(self, other: object) -> bool:  # the same kind of strategy with the same settings
        return type(other) is type(self) and vars(other) == vars(self)

    @classmethod
    def choose(cls, cores: int, native: bool, options: FSDP | None) -> Strategy:
        """The strategy this class's word gives a process of its own (not one of a launched job): ``cores`` cores, on
        XLA or natively (one process per device)."""
        return cls(cores, options)

    @classmethod
    def for_job(cls, cores: int, native: bool, options: FSDP | None) -> Strategy | None:
        """What this class's word gives one process of a launched job; None: a plain replica of it."""
        return None

    def sharded(self, why: str) -> Strategy:
        """This strategy with the parameters sharded, ``why`` said on the summary line (where ``may_shard``)."""
        raise RuntimeError(f"{self.name} has no sharded form")

    def replica(self) -> Strategy:
        """What each process a launching strategy starts runs."""
        raise RuntimeError(f"{self.name} runs in this process; it launches no replicas")

    def topology(self) -> Topology:
        """This process's data layout (switches SPMD on first where the strategy runs over a mesh)."""
        return Topology()

    def enter(self, model: nn.Module) -> None:
        """Called once the model is on its device."""

    def leave(self, model: nn.Module) -> None:
        """Called before the model goes back where it was found."""


class InJob:
    """Mixed into a strategy that one process of a launched job runs (ours, or torchrun's): each process its own
    share of the samples, as one of the job's replicas."""

    in_job = True

    def topology(self) -> Topology:
        return Topology.job()
