"""``optimizer.step()`` -> ``step_optimizer(optimizer)``: on XLA the step must cut the graph (and average gradients)."""

from __future__ import annotations

import re
from typing import Any

from .registry import Porter, fixes
from .tree import code, libcst

_OPTIMIZER_NAME = re.compile(r"(^|\.)(opt|optim|optimizer|optimiser)(_?\w*)?$")


@fixes("Call", order=160)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``<an optimizer>.step()`` with no arguments; a scheduler's ``step()`` stays."""
    cst = libcst()
    if not (isinstance(updated.func, cst.Attribute) and updated.func.attr.value == "step" and not updated.args):
        return None
    owner = code(updated.func.value)
    if owner in porter.plan.optimizers or (_OPTIMIZER_NAME.search(owner) and "sched" not in owner):
        porter.need("step_optimizer")
        new = cst.parse_expression(f"step_optimizer({owner})")
        porter.change("optimizer_step", original, new)
        return new
    return None
