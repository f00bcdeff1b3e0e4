"""Strategies: each way of spreading a model over devices in its own room, behind one interface (``base``).

Callers never compare a strategy's word nor read its flags: they hand the object ``choose`` returns the work
(``run``, ``infer``, ``one_program``), the model (``enter``/``leave``) and the memory plan (``settled``,
``column``); ``base`` lists what each answers. ``STRATEGIES``
is the one table from the word a user gives (``strategy="spmd"``) to the class that chooses the
concrete strategy for this process and backend; adding a strategy is one module and one row here.

- ``single``: one device. ``spmd``: one process over a mesh of XLA devices. ``multiprocess``: one
  process per device (``Replica`` in each). ``fsdp``: the parameters sharded (over the mesh on XLA,
  over launched processes natively). ``fsdp-tp``: a 2-D mesh, FSDP x tensor parallel (``Mesh2D(tensor=2)``).
"""

from __future__ import annotations

from typing import Any, Literal

from ... import backend
from ...backend.base import Backend
from ...sharding import FSDP, block_classes, repeated_class
from ..topology import Topology, available_cores, resolve_cores
from .base import Strategy
from .fsdp import Fsdp, FsdpProcess, MultiprocessFsdp
from .mesh2d import FsdpTensorParallel, Mesh2D
from .multiprocess import Multiprocess, Replica
from .single import Single
from .spmd import Spmd

# the words ``strategy=`` takes besides "auto", each to the class that chooses this process's strategy
STRATEGIES: dict[str, type[Strategy]] = {"spmd": Spmd, "multiprocess": Multiprocess, "fsdp": Fsdp,
                                         "fsdp-tp": FsdpTensorParallel}  # fmt: skip
StrategyName = Literal["auto", "spmd", "multiprocess", "fsdp", "fsdp-tp"]


def names() -> tuple[str, ...]:
    return ("auto", *STRATEGIES)


def resolve_strategy(strategy: Any) -> tuple[str, Any]:
    """``strategy=`` as (its word, its options): a strategy's options object (``FSDP(...)``) gives its word and
    itself, its word alone the default options (``"fsdp"``: ``FSDP()``), another word (checked where it is
    chosen) itself and None.

    Example:
        >>> resolve_strategy("fsdp"), resolve_strategy("spmd")
        (('fsdp', FSDP(wrap=None, checkpoint=True, shard_output=True)), ('spmd', None))
    """
    for word, kind in STRATEGIES.items():  # the options' own class: Mesh2D is an FSDP too, but its own word's
        if kind.options_type is not None and type(strategy) is kind.options_type:
            return word, strategy
    if isinstance(strategy, str):
        kind = STRATEGIES.get(strategy)
        return strategy, kind.options_type() if kind is not None and kind.options_type is not None else None
    objects = " or ".join(f"{k.options_type.__name__}(...)" for k in STRATEGIES.values() if k.options_type)
    raise TypeError(f"strategy must be a name {names()} or {objects}, but given {strategy!r} of type "
                    f"{type(strategy).__name__}")  # fmt: skip


def sharding_of(options: Any, cores: int) -> Strategy:
    """The sharded strategy whose options ``options`` are (``FSDP(...)``: FSDP), over ``cores`` cores on the backend
    in use: the memory plan's sharded column is its.

    Raises:
        TypeError: options no sharded strategy takes.
    """
    word, options = resolve_strategy(options)
    chosen = STRATEGIES[word](cores, options) if word in STRATEGIES else None
    if chosen is None or chosen.column() != "sharded":
        raise TypeError(f"fsdp= takes a sharded strategy's options (FSDP(...)), but given {options!r}")
    return chosen


def choose_strategy(word: str, cores: int, in_launch: bool, on: Backend | None = None, options: Any = None) -> Strategy:
    """This process's strategy for the word given, ``cores`` cores, inside a launched job or not, on the backend
    ``on`` (default: the one in use), which each strategy asks what it can do (``on.sharding.over_mesh()``: one
    process over a mesh of devices; else one process per device, sharding over processes)."""
    if word != "auto" and word not in STRATEGIES:
        raise ValueError(f"strategy must be one of {names()}, but given {word!r}")
    on = on if on is not None else backend.current()
    kind = STRATEGIES.get(word)
    if in_launch:  # one process of a launched job (ours, or torchrun's)
        return (kind.for_job(cores, on, options) if kind else None) or Replica(cores)
    if kind is not None:
        return kind.choose(cores, on, options)
    if cores == 1:
        return Single()
    if not on.sharding.over_mesh():
        return Multiprocess(cores)
    return Spmd(cores, may_shard=True)


def choose(cores: int | str, strategy: Any = "auto", *, allowed: tuple[str, ...] | None = None,
           auto_alone: bool = False) -> Strategy:  # fmt: skip
    """The strategy this process runs for ``cores`` and ``strategy=`` as a user gives them (a word or options).

    ``allowed``: the words an entry point takes (``find_lr``: no launched replicas); ``auto_alone``: "auto" runs
    on one core in this process whatever ``cores`` says (``find_lr`` sweeps on one core unless told otherwise).

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
    return choose_strategy(word, n_cores, in_launch, on=chosen, options=options)


__all__ = ["block_classes", "choose", "choose_strategy", "FSDP", "Fsdp", "FsdpProcess", "FsdpTensorParallel", "Mesh2D", "Multiprocess",
           "MultiprocessFsdp", "names", "repeated_class", "Replica", "resolve_strategy", "sharding_of", "Single", "Spmd", "Strategy",
           "STRATEGIES", "StrategyName", "Topology"]  # fmt: skip
