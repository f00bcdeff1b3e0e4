"""Strategies: each way of spreading a model over devices in its own room, behind one interface (``base``).

Callers never compare a strategy's word: they ask the object ``choose`` returns (does it launch
processes, does it shard, who loads what) and hand it the model (``enter``/``leave``). ``STRATEGIES``
is the one table from the word a user gives (``strategy="spmd"``) to the class that chooses the
concrete strategy for this process and backend; adding a strategy is one module and one row here.

- ``single``: one device. ``spmd``: one process over a mesh of XLA devices. ``multiprocess``: one
  process per device (``Replica`` in each). ``fsdp``: the parameters sharded (over the mesh on XLA,
  over launched processes natively).
"""

from __future__ import annotations

from typing import Any, Literal

from ... import backend
from ...sharding import FSDP, block_classes, repeated_class
from ..topology import Topology, available_cores, resolve_cores
from .base import Strategy
from .fsdp import Fsdp, FsdpProcess, MultiprocessFsdp
from .multiprocess import Multiprocess, Replica
from .single import Single
from .spmd import Spmd

# the words ``strategy=`` takes besides "auto", each to the class that chooses this process's strategy
STRATEGIES: dict[str, type[Strategy]] = {"spmd": Spmd, "multiprocess": Multiprocess, "fsdp": Fsdp}
StrategyName = Literal["auto", "spmd", "multiprocess", "fsdp"]


def names() -> tuple[str, ...]:
    return ("auto", *STRATEGIES)


def resolve_strategy(strategy: Any) -> tuple[str, FSDP | None]:
    """``strategy=`` as (its word, the FSDP options): ``FSDP(...)`` gives ("fsdp", it), "fsdp" ("fsdp", FSDP()),
    another word (checked where it is chosen) itself and None.

    Example:
        >>> resolve_strategy("fsdp"), resolve_strategy("spmd")
        (('fsdp', FSDP(wrap=None, checkpoint=True, shard_output=True)), ('spmd', None))
    """
    if isinstance(strategy, FSDP):
        return "fsdp", strategy
    if isinstance(strategy, str):
        return strategy, FSDP() if STRATEGIES.get(strategy) is Fsdp else None
    raise TypeError(f"strategy must be a name {names()} or FSDP(...), but given {strategy!r} of type "
                    f"{type(strategy).__name__}")  # fmt: skip


def choose_strategy(word: str, cores: int, in_launch: bool, native: bool = False,
                    options: FSDP | None = None) -> Strategy:  # fmt: skip
    """This process's strategy for the word given, ``cores`` cores, inside a launched job or not, on XLA or natively
    (``native``: one process per device, sharding over processes)."""
    if word != "auto" and word not in STRATEGIES:
        raise ValueError(f"strategy must be one of {names()}, but given {word!r}")
    kind = STRATEGIES.get(word)
    if in_launch:  # one process of a launched job (ours, or torchrun's)
        return (kind.for_job(cores, native, options) if kind else None) or Replica(cores)
    if kind is not None:
        return kind.choose(cores, native, options)
    if cores == 1:
        return Single()
    if native:
        return Multiprocess(cores)
    return Spmd(cores, may_shard=True)


def choose(cores: int | str, strategy: Any = "auto", *, allowed: tuple[str, ...] | None = None,
           auto_alone: bool = False) -> Strategy:  # fmt: skip
    """The strategy this process runs for ``cores`` and ``strategy=`` as a user gives them (a word or FSDP(...)).

    ``allowed``: the words an entry point takes (``find_lr``: no launches); ``auto_alone``: "auto" runs on one
    core in this process whatever ``cores`` says (``find_lr`` sweeps on one core unless told otherwise).

    Raises:
        ValueError: a strategy or core count that this backend cannot run.
    """
    word, options = resolve_strategy(strategy)
    if allowed is not None and word not in allowed:
        raise ValueError(f"strategy must be one of {allowed} or FSDP(...), but given {strategy!r}")
    if auto_alone and word == "auto":
        return Single()
    backend.current().processes.join_job()  # inside torchrun: this process is one replica of its job
    chosen = backend.current()
    n_cores = resolve_cores(cores, available_cores(), chosen.core_rule)
    processes = backend.current().processes
    in_launch = processes.in_launched_process() and processes.world_size() > 1
    return choose_strategy(word, n_cores, in_launch, native=not chosen.lazy, options=options)


__all__ = ["block_classes", "choose", "choose_strategy", "FSDP", "Fsdp", "FsdpProcess", "Multiprocess",
           "MultiprocessFsdp", "names", "repeated_class", "Replica", "resolve_strategy", "Single", "Spmd", "Strategy",
           "STRATEGIES", "StrategyName", "Topology"]  # fmt: skip
