"""The porting tool's fixers, one concern a module, each registering itself for the LibCST node types it leaves.

A module here registers its hooks with the decorators of ``registry.py`` (``@fixes("Call",
order=...)``, ``@analysis``, ``@planning``, ...), as pyupgrade's plugins do; importing this
package imports every module of it, and the pipeline reads the registry: ``apply`` (the walk,
``port/walk.py``), ``analyses``/``plans`` (``port/plan.py``), ``magics``/``after_walk``
(``port/cells.py``), ``opened``. A new fixer is one module (and its test in
``tests/test_fixers.py``). ``tree.py`` holds the questions about a tree the fixers share.

A fixer is ``fix(porter, original, updated)``: it returns the node that replaces
``updated``, or None to let the next fixer look (a fixer that only reports returns None).
``porter`` is the walk's transformer (``registry.Porter`` says what a fixer may use of it):
``porter.plan`` (decisions made before the walk), ``porter.change(rule, original, new)``,
``porter.note(rule, original, after)``, ``porter.leave_alone(rule, original)``,
``porter.device()``, ``porter.need(name)`` (an import the output needs), ``porter.loops`` and
``porter.guards`` (per enclosing loop: runs per step; per enclosing test: mentions CUDA).
The texts (cost, fix) of every rule are in ``tpu_utility.diagnostics.rules``.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Callable

from .registry import REGISTRY, Analyse, Fix, Magic, NodeType, PlanTop, Porter, fixers_of, hooks

HELPERS = ("registry", "tree")  # the modules here that are no fixer
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if _module not in HELPERS:
        importlib.import_module(f"{__name__}.{_module}")

__all__ = ["REGISTRY", "Fix", "NodeType", "Porter", "after_walk", "analyses", "apply", "fixers_of", "magics",
           "opened", "plans"]


def analyses() -> tuple[Analyse, ...]:
    """``analyse(module, plan)`` of every fixer that has one, in their order: run over every cell before the walk."""
    return hooks("analyse")


def plans() -> tuple[PlanTop, ...]:
    """``plan_top(top_level_statements, plan)`` of every fixer that has one, in their order."""
    return hooks("plan")


def magics() -> tuple[Magic, ...]:
    """``rule_of(line)`` for a cell's IPython lines, in their order."""
    return hooks("magic")


def after_walk(results: list[str | None], plan: Any) -> tuple[list[str | None], list[tuple[str, str]]]:
    """The cells' new sources once every fixer's after-walk hook ran, and the (rule, code) of what they left."""
    left: list[tuple[str, str]] = []
    after: Callable[..., Any]
    for after in hooks("after_walk"):
        results, stuck = after(results, plan)
        left += stuck
    return results, left


def opened(node: Any) -> bool:
    """Whether an ``if``'s CUDA test becomes the accelerator test (its body then runs on a TPU: no guard)."""
    return any(opens(node) for opens in hooks("opens"))


def apply(kind: NodeType, porter: Porter, original: Any, updated: Any) -> Any:
    """The first fixer's replacement for ``updated``, or None when no fixer of ``kind`` rewrites it."""
    for fix in fixers_of(kind):
        new = fix(porter, original, updated)
        if new is not None:
            return new
    return None
