"""An optimizer built before its model moves (the Hugging Face course's order): the move goes first.

On XLA an optimizer built on the CPU copies updates them, and the model does not learn. The
plan finds, in each block of statements, ``opt = AdamW(model.parameters())`` followed by
``model.to(device)``; the walk puts ``move_model(model, device)`` before the optimizer and drops
a bare ``model.to(device)`` (``model = model.to(device)`` stays, as a no-op move).
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes, planning
from .tree import OPTIMIZERS, assigned, code, dotted, function_defs, libcst, value


def _moves_model(stmt: Any) -> tuple[str, str] | None:
    """(model, device code) for ``model.to(device)`` / ``model = model.to(device)`` / ``model.cuda()``."""
    cst = libcst()
    call = value(stmt)
    if isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda"):
        model = dotted(call.func.value)
        if model and "." not in model:
            device = code(call.args[0].value) if call.func.attr.value == "to" and call.args else ""
            return model, device
    return None


def _builds_optimizer(stmt: Any) -> str | None:
    """The model whose parameters ``opt = AdamW(model.parameters(), ...)`` takes, if the statement is that."""
    cst = libcst()
    call = value(stmt)
    if not (isinstance(call, cst.Call) and dotted(call.func).rsplit(".", 1)[-1] in OPTIMIZERS):
        return None
    for arg in call.args:
        inner = arg.value
        if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute) and inner.func.attr.value in (
            "parameters", "named_parameters"):  # fmt: skip
            return dotted(inner.func.value) or None
        if isinstance(inner, cst.Name):
            return inner.value
    return None


def _plan_block(block: list[Any], plan: Any) -> None:
    defined: set[str] = set()
    for i, stmt in enumerate(block):
        model = _builds_optimizer(stmt)
        if model:
            for later in block[i + 1:]:
                moved = _moves_model(later)
                if moved and moved[0] == model:
                    device = moved[1] if moved[1] in defined else "get_device()"
                    if device == "get_device()":
                        plan.needs.add("get_device")
                    plan.needs.add("move_model")  # keeps tied weights tied (fixers.move_model)
                    plan.insert_before[id(stmt)] = (f"move_model({model}, {device})", model)
                    if assigned(later) == []:  # a bare model.to(device) is now done; model = model.to(...) stays
                        plan.remove.add(id(later))
                    break
        defined.update(assigned(stmt))


@planning(order=10)
def plan_top(top: list[Any], plan: Any) -> None:
    """Plans the moves in the top-level statements and in each function's body."""
    blocks = [top]
    for stmt in top:
        for node in function_defs(stmt):
            if isinstance(node.body, libcst().IndentedBlock):
                blocks.append(list(node.body.body))
    for block in blocks:
        _plan_block(block, plan)


@fixes("SimpleStatementLine", order=30)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """The planned move before the optimizer's line; the bare move it replaces goes."""
    cst = libcst()
    key = id(original)
    if key in porter.plan.remove:
        porter.note("optimizer_params", original, "(moved up, before the optimizer is built)")
        return cst.RemovalSentinel.REMOVE
    if key in porter.plan.insert_before:
        move, _ = porter.plan.insert_before[key]
        moved = cst.parse_statement(f"{move}  # tpu_utility.port: before the optimizer is built\n")
        porter.note("optimizer_params", original, f"{move}; {porter.short(code(updated))}")
        return cst.FlattenSentinel([moved, updated])
    return None
