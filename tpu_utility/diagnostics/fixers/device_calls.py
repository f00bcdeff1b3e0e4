"""``torch.cuda`` / ``torch.accelerator`` device calls beyond the device line: each given its XLA meaning, or named.

One process drives one device after the port (``get_device()``, chosen by the launch), so
``set_device(local_rank)`` has nothing to do (the statement goes), ``device_count()`` is
that one device (0 on a CPU-only host, as before), ``current_device()`` its index. Memory
statistics have no XLA:CPU meaning: ``reset_peak_memory_stats()`` and ``empty_cache()`` go, and a
read of them is named. ``getattr(torch, device_type).memory_allocated()`` (a device type's module)
counts too, and so does a name bound to that lookup (peft's memory tracker:
``self.device_module = getattr(torch, device_type, torch.cuda)``, then
``self.device_module.reset_peak_memory_stats()``): on XLA ``device_type`` is ``"xla"`` and the
lookup falls back to ``torch.cuda``, whose calls raise without CUDA.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import code, dotted, libcst

_PREFIXES = ("torch.cuda.", "torch.accelerator.")
_DROPPED = {"set_device", "set_device_index", "set_device_idx", "reset_peak_memory_stats", "reset_max_memory_allocated",
            "empty_cache"}  # fmt: skip
_VALUES = {"device_count": 'int(get_device().type != "cpu")', "current_device": "(get_device().index or 0)",
           "current_device_index": "(get_device().index or 0)", "current_device_idx": "(get_device().index or 0)"}  # fmt: skip
_MEMORY = {"memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved", "memory_stats",
           "mem_get_info"}  # fmt: skip
HANDLED = _DROPPED | set(_VALUES) | _MEMORY  # cuda_call leaves these to this fixer
_MARK = "pass  # tpu_utility.port: {} dropped: each process drives one device, get_device()\n"


def _lookup(node: Any) -> bool:
    """``getattr(torch, device_type)`` / ``getattr(torch, device_type, torch.cuda)``: a device type's module."""
    cst = libcst()
    return isinstance(node, cst.Call) and dotted(node.func) == "getattr" and bool(node.args) and code(node.args[0].value) == "torch"


@analysis(order=70)
def analyse(module: Any, plan: Any) -> None:
    """``plan.device_modules``: names bound to a device type's module (``self.device_module = getattr(torch, ...)``)."""
    cst = libcst()

    class Lookups(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            if _lookup(node.value):
                plan.device_modules.update(dotted(t.target) for t in node.targets if dotted(t.target))

    module.visit(Lookups())


def device_call(call: Any, plan: Any = None) -> str | None:
    """The function's name (``set_device``) for ``torch.cuda.X(...)``, ``torch.accelerator.X(...)``,
    ``getattr(torch, device_type).X(...)`` and a name bound to that lookup; None for anything else."""
    cst = libcst()
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Attribute):
        return None
    owner, last = call.func.value, call.func.attr.value
    if _lookup(owner) or (plan is not None and dotted(owner) and dotted(owner) in plan.device_modules):
        return last
    return last if dotted(call.func).startswith(_PREFIXES) else None


@fixes("Call", order=70)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``device_count()`` and ``current_device()`` -> the ported device's; a memory read is named."""
    name = device_call(updated, porter.plan)
    if name in _VALUES:
        porter.need("get_device")
        new = libcst().parse_expression(_VALUES[name])
        porter.change("device_calls", original, new)
        return new
    if name in _MEMORY:
        porter.leave_alone("memory_stats", original)
    return None


@fixes("SimpleStatementLine", order=50)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.cuda.set_device(device)`` / ``reset_peak_memory_stats()`` as a statement -> a ``pass`` that says so."""
    cst = libcst()
    if len(original.body) != 1 or not isinstance(original.body[0], cst.Expr) or device_call(original.body[0].value, porter.plan) not in _DROPPED:
        return None
    if device_call(original.body[0].value, porter.plan) == "empty_cache" and any(porter.guards):
        return None  # harmless, and guarded by a CUDA test: left as written
    new = cst.parse_statement(_MARK.format(porter.short(code(original.body[0].value), 60)))
    porter.note("device_calls", original, "pass (dropped)")
    return new.with_changes(leading_lines=updated.leading_lines)
