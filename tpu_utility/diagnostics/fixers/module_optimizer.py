"""An optimizer built in a module's own method (forward-forward's ``self.opt = Adam(self.parameters())`` in ``__init__``): the module moves first.

The program moves the model after building it (``Net().to(device)``), by then the optimizer
holds the CPU parameters, and on XLA the move makes new ones: the optimizer updates the CPU
copies (``step_optimizer`` refuses). The port puts ``move_model(self, device)`` before the
optimizer's line, so the optimizer is built on the device's parameters and the later move is a
no-op; the report says so.
"""

from __future__ import annotations

from typing import Any

from .registry import planning
from .tree import DECIDES_DEVICE, OPTIMIZERS, code, dotted, function_defs, libcst, value


def _builds_on_self(stmt: Any) -> bool:
    """``self.<x> = <Optimizer>(self.parameters(), ...)``."""
    cst = libcst()
    call = value(stmt)
    return (isinstance(call, cst.Call) and dotted(call.func).rsplit(".", 1)[-1] in OPTIMIZERS
            and isinstance(stmt.body[0], cst.Assign) and "self.parameters()" in code(call))  # fmt: skip


@planning(order=50)
def plan_top(top: list[Any], plan: Any) -> None:
    """In every class's methods, the optimizer built on ``self.parameters()`` gets the move before it."""
    cst = libcst()
    if plan.device is None and not any(DECIDES_DEVICE.search(code(stmt)) for stmt in top):
        return  # a program that never picks a device trains where it is
    device = plan.device or "get_device()"
    for stmt in top:
        if not isinstance(stmt, cst.ClassDef):
            continue
        for method in function_defs(stmt):
            for line in method.body.body if isinstance(method.body, cst.IndentedBlock) else []:
                if _builds_on_self(line):
                    plan.needs.update({"move_model"} | ({"get_device"} if device == "get_device()" else set()))
                    plan.before[id(line)] = ("optimizer_in_init", f"move_model(self, {device})  # tpu_utility.port: "
                                             "the module on the device before its optimizer is built")
