"""Reads of a device value inside a per-step loop (``.item()``, ``.cpu()``, ``print(loss)``): reported, not rewritten."""

from __future__ import annotations

import re
from typing import Any

from ..rules import COLLECT_ON_DEVICE, RULES
from .dynamic_shape import root
from .registry import Porter, fixes
from .tree import call_names, dotted, libcst

_READS = {"item", "cpu", "numpy", "tolist"}
_PRINTS = {"print", "xm.master_print", "tqdm.write"}
_TENSOR_NAME = re.compile(r"^(loss|losses|logits|outputs?|preds?|predictions|probs|acc)(_\w+)?$")


def _prints_a_tensor(call: Any, host: set[str]) -> bool:
    """A print of a name that holds a tensor by its name (loss, logits, outputs, preds), not a read of it."""
    cst = libcst()
    found: list[str] = []

    class Names(cst.CSTVisitor):
        def visit_Call(self, node: Any) -> bool:
            return False  # loss.item() is counted as a read; len(x) is no sync

        def visit_Attribute(self, node: Any) -> bool:
            found.append(dotted(node).rsplit(".", 1)[-1])
            return False

        def visit_Name(self, node: Any) -> None:
            if node.value not in host:  # a list, an array, a Python number
                found.append(node.value)

    for arg in call.args:
        arg.value.visit(Names())
    return any(_TENSOR_NAME.search(n) for n in found)


@fixes("Call", order=10)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``loss.item()``, ``logits.cpu()``, ``print(loss)`` in a loop that runs once per step."""
    if not any(porter.loops):
        return None
    name, last = call_names(updated, porter.plan)
    if last in _READS and isinstance(original.func, libcst().Attribute) and root(original.func) not in porter.plan.host_values:
        porter.leave_alone("host_sync", original, RULES["host_sync"].fix + (f"; {COLLECT_ON_DEVICE}" if last != "item" else ""))
    if name in _PRINTS and _prints_a_tensor(original, porter.plan.host_values):
        porter.leave_alone("host_sync", original)
    return None
