"""A device chosen at import time stays lazy: ``class args: device = get_device().type`` -> ``device_type()``.

``get_device()`` starts the XLA runtime, and a runtime started in the launching process makes
``xmp.spawn`` / ``launch`` refuse ('Runtime is already initialized'). A config class's device
attribute (``class args: device = "cuda" if torch.cuda.is_available() else "cpu"``, often in a
module the launching file imports: the port cannot see which file spawns) and a module-level
device line of a program that launches processes become ``device_type()``, the device's type
without the runtime, or ``torch.device(device_type())``; a string or device of that type
lands on the process's own device when it is used. A module-level line of a one-process
program keeps ``get_device()``.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import LAUNCHES, calls, code, libcst

_LAUNCHERS = {*LAUNCHES, "launch", "mp.spawn", "torch.multiprocessing.spawn"}
_LAZY = {"get_device().type": "device_type()", "str(get_device())": "device_type()",
         "get_device()": "torch.device(device_type())"}  # fmt: skip


@analysis(order=40)
def analyse(module: Any, plan: Any) -> None:
    """``plan.launches``: whether the program starts processes itself (then its module level runs in the parent)."""
    plan.launches = plan.launches or bool(calls(module, plan) & _LAUNCHERS)


def _lazy(node: Any) -> Any:
    cst = libcst()

    class Lazy(cst.CSTTransformer):
        def leave_Call(self, _: Any, updated: Any) -> Any:
            text = code(updated)
            if text == "str(torch.device(device_type()))":
                return cst.parse_expression("device_type()")
            return cst.parse_expression(_LAZY[text]) if text in _LAZY else updated

        def leave_Attribute(self, _: Any, updated: Any) -> Any:
            return cst.parse_expression("device_type()") if code(updated) == "torch.device(device_type()).type" else updated

    return node.visit(Lazy())


@fixes("SimpleStatementLine", order=20)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """A device line (made ``get_device()`` by the fixers before it) in a class body at import time, or at a
    launching program's module level."""
    cst = libcst()
    if len(porter.device_stack) != 1 or not (porter.classes or porter.plan.launches):
        return None
    if len(updated.body) != 1 or not isinstance(updated.body[0], cst.Assign) or "get_device()" not in code(updated.body[0].value):
        return None
    assign = updated.body[0]
    new = updated.with_changes(body=[assign.with_changes(value=_lazy(assign.value))])
    porter.need("device_type")
    porter.change("import_time_device", original.body[0], new.body[0])
    return new
