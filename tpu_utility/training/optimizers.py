"""The optimizers one_cycle_fit, memory_plan and trace_step take by name: one table, read by all three.

    entry = named_optimizer("sgd")      # ValueError naming the allowed names for any other word
    entry.factory                       # functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    entry.states                        # 1: the momentum buffer, per trainable parameter

A name is a torch class and the keywords one_cycle_fit gives it beyond the user's (``"sgd"`` is SGD with momentum
0.9); the state tensors it keeps per parameter follow from the class and those keywords (``optimizer_states``),
so the memory plan, the traced step and the run all build and count the same optimizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch

__all__ = ["NamedOptimizer", "OPTIMIZERS", "named_optimizer", "optimizer_states"]

# optimizer state tensors per trainable parameter at torch's defaults, each in the parameter's dtype (as torch keeps
# them), by torch class name; SGD's momentum buffer and RMSprop's extra ones depend on keywords (optimizer_states)
STATE_TENSORS = {"Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1, "Adadelta": 2, "ASGD": 2,
                 "Rprop": 2, "LBFGS": 2, "SGD": 0, "RMSprop": 1, "Lion": 1}  # fmt: skip


@dataclass(frozen=True)
class NamedOptimizer:
    """One name a user may give as ``optimizer=``: the torch class and the keywords given to it by default.

    Example:
        >>> sgd = named_optimizer("sgd")
        >>> sgd.cls.__name__, dict(sgd.defaults), sgd.states
        ('SGD', {'lr': 0.1, 'momentum': 0.9}, 1)
    """

    name: str
    cls: type[torch.optim.Optimizer]
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def factory(self) -> Callable[..., torch.optim.Optimizer]:
        """``params -> Optimizer`` with the defaults; keywords given at the call win over them."""
        return functools.partial(self.cls, **self.defaults)

    @property
    def states(self) -> int:
        """State tensors kept per trainable parameter, from the class and the defaults."""
        return _state_count(self.cls.__name__, self.defaults)


OPTIMIZERS: dict[str, NamedOptimizer] = {
    entry.name: entry
    for entry in (
        NamedOptimizer("adamw", torch.optim.AdamW),
        NamedOptimizer("adam", torch.optim.Adam),
        NamedOptimizer("sgd", torch.optim.SGD, MappingProxyType({"lr": 0.1, "momentum": 0.9})),
    )
}


def named_optimizer(name: str) -> NamedOptimizer:
    """The table's entry for ``name``; a ValueError naming the value and the allowed names for any other word."""
    entry = OPTIMIZERS.get(name)
    if entry is None:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)} or a callable, but given {name!r}")
    return entry


def _state_count(class_name: str, keywords: Mapping[str, Any]) -> int:
    count = STATE_TENSORS[class_name]
    if class_name == "SGD":
        count = 1 if keywords.get("momentum", 0) else 0
    if class_name == "RMSprop":
        count += bool(keywords.get("momentum", 0)) + bool(keywords.get("centered", False))
    return count


def optimizer_states(optimizer: Any) -> tuple[int, str]:
    """(state tensors kept per parameter, the optimizer's name) for a name, a class or a ``functools.partial``.

    AdamW and Adam keep two moments; SGD one momentum buffer when ``momentum`` is set (one_cycle_fit's
    ``"sgd"`` has 0.9), none without; RMSprop one (two with momentum, three centered). A factory whose
    class cannot be read is counted as AdamW, the largest common case, and named so.

    Example:
        >>> optimizer_states("adamw"), optimizer_states(functools.partial(torch.optim.SGD, momentum=0))
        ((2, 'AdamW'), (0, 'SGD'))
    """
    if isinstance(optimizer, str):
        entry = named_optimizer(optimizer)
        return entry.states, entry.cls.__name__
    keywords: dict[str, Any] = {}
    while isinstance(optimizer, functools.partial):
        keywords = {**optimizer.keywords, **keywords}
        optimizer = optimizer.func
    name = getattr(optimizer, "__name__", "")
    if not (isinstance(optimizer, type) and name in STATE_TENSORS):
        return 2, f"{name or type(optimizer).__name__} (counted as AdamW)"
    return _state_count(name, keywords), name
