"""A CPU training step before the device line (a course notebook's CPU baseline, trained first): the runtime starts first.

A backward run on the CPU before the XLA runtime starts breaks every later backward on XLA
(pytorch/xla#4174), so the ported ``get_device()`` would raise. The port puts ``get_device()``
before the first top-level statement that runs a backward (or calls a function that does) when
that comes before the program picks its device: the CPU steps still run on the CPU. In a program
that launches processes the launching process must not start the runtime: the line is named.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes, planning
from .tree import DECIDES_DEVICE, calls, code, function_defs, launched, libcst

_START = "get_device()  # tpu_utility.port: the XLA runtime first (a CPU backward before it breaks XLA's: pytorch/xla#4174)"


def _trains(stmt: Any, training: set[str], plan: Any) -> bool:
    """Whether a top-level statement runs a backward itself or calls a function of the program that trains on the CPU."""
    return ".backward(" in code(stmt) or bool(calls(stmt, plan) & training)


@planning(order=40)
def plan_top(top: list[Any], plan: Any) -> None:
    """The first top-level statement that trains, when it comes before the first that picks or moves to the device."""
    training = {f.name.value for stmt in top for f in function_defs(stmt)  # a function that trains and picks no device
                if ".backward(" in code(f.body) and not DECIDES_DEVICE.search(code(f.body))}  # fmt: skip
    cst = libcst()
    for stmt in top:
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # a definition runs nothing
        if DECIDES_DEVICE.search(code(stmt)) or launched(stmt, plan):
            return  # the device (or the launch) comes first
        if _trains(stmt, training, plan):
            if any(launched(s, plan) for s in top):
                plan.named[id(stmt)] = "cpu_step_before_launch"
            else:
                plan.needs.add("get_device")
                plan.before[id(stmt)] = ("cpu_step_first", _START)
            return


def _name(porter: Porter, original: Any) -> None:
    rule = porter.plan.named.get(id(original))
    if rule == "cpu_step_before_launch":
        porter.leave_alone(rule, original, code=porter.short(code(original).strip().splitlines()[0]))


@fixes("SimpleStatementLine", order=5)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """A CPU backward before the launch: named."""
    _name(porter, original)
    return None


@fixes("For", order=5)
def fix_for(porter: Porter, original: Any, updated: Any) -> Any:
    """A CPU training loop before the launch: named."""
    _name(porter, original)
    return None
