"""Top-level code that asks the XLA runtime before ``xmp.spawn`` moves into the launched function.

A torch_xla 1.x kernel builds its samplers (``num_replicas=xm.xrt_world_size()``) at the top
level; under PJRT that starts the runtime in the launching process and the spawn refuses
('Runtime is already initialized'). Simple statements that ask the runtime (or use what such
a statement bound) move to the top of the launched function with a ``global`` line; a block
(``if``, ``for``) that asks it cannot move and is reported.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, finishing, fixes, planning
from .tree import assigned, calls, code, function_defs, is_docstring, launched, libcst, uses

_RUNTIME = {"xm.xrt_world_size", "xm.get_ordinal", "xm.get_local_ordinal", "xm.is_master_ordinal", "xm.xla_device",
            "xr.world_size", "xr.global_ordinal", "xr.local_ordinal", "torch_xla.device", "make_sampler"}  # fmt: skip


@planning(order=20)
def plan_top(top: list[Any], plan: Any) -> None:
    """Marks the top-level statements before the launch that ask the runtime (when the launched function is here)."""
    cst = libcst()
    if plan.spawned not in {node.name.value for stmt in top for node in function_defs(stmt)}:
        return
    bound: set[str] = set()
    for stmt in top:
        if launched(stmt, plan):
            break
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # they run later, in the launched process
        if not (calls(stmt, plan) & _RUNTIME or uses(stmt) & bound):
            continue
        if isinstance(stmt, cst.SimpleStatementLine):
            plan.relocate[id(stmt)] = None
            bound.update(assigned(stmt))
        else:
            plan.stuck.append(stmt)


@fixes("SimpleStatementLine", order=10)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """A statement that moves: kept (with its comments, not its blank lines) for the launched function, removed here."""
    plan = porter.plan
    if id(original) not in plan.relocate:
        return None
    plan.relocate[id(original)] = updated.with_changes(
        leading_lines=[line for line in updated.leading_lines if line.comment is not None])
    porter.note("runtime_before_spawn", original, f"(moved into {plan.spawned}(), which the launch runs)")
    return libcst().RemovalSentinel.REMOVE


def _insert(module: Any, plan: Any, statements: list[Any]) -> Any:
    """Inserts the relocated statements (with a ``global`` line) at the top of the launched function."""
    cst = libcst()
    names = ", ".join(sorted({n for s in statements for n in assigned(s)}))
    head = [cst.parse_statement(f"global {names}  # tpu_utility.port: built here, in each launched process\n")]

    class Insert(cst.CSTTransformer):
        def leave_FunctionDef(self, original: Any, updated: Any) -> Any:
            if original.name.value != plan.spawned:
                return updated
            body = list(updated.body.body)
            start = 1 if body and is_docstring(body[0]) else 0
            return updated.with_changes(body=updated.body.with_changes(body=[*body[:start], *head, *statements,
                                                                             *body[start:]]))  # fmt: skip

    return module.visit(Insert())


@finishing(order=10)
def after_walk(results: list[str | None], plan: Any) -> tuple[list[str | None], list[tuple[str, str]]]:
    """The cells' new sources with the moved statements in the launched function; and (rule, code) of blocks left."""
    import re

    moved = [stmt for stmt in plan.relocate.values() if stmt is not None]
    if moved:
        results = [_insert(libcst().parse_module(r), plan, moved).code
                   if r is not None and re.search(rf"^def {plan.spawned}\(", r, re.M) else r for r in results]  # fmt: skip
    return results, [("runtime_before_spawn", code(stmt)) for stmt in plan.stuck]
