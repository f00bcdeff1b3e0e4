"""The porting tool's fixers, one concern a module, each registered for the LibCST node types it leaves.

A fixer is ``fix(porter, original, updated)``: it returns the node that replaces
``updated``, or None to let the next fixer (and then the porter's own rewrites) look.
``porter`` is the walk's transformer: ``porter.plan`` (decisions made before the
walk), ``porter.change(rule, original, new)``, ``porter.leave_alone(rule, original)``,
``porter.device()`` and ``porter.need(name)`` (an import the output needs). An
analysis is ``analyse(module, plan)``, run over every cell before the walk. The
texts (cost, fix) of every rule are in ``tpu_utility.diagnostics.rules``.
"""

from __future__ import annotations

from typing import Any, Callable

from . import colab, cuda_flag, device_strings, move_model, torch_compile, transformers_api

Fixer = Callable[[Any, Any, Any], Any]

# node type -> fixers, in the order they are tried
FIXERS: dict[str, tuple[Fixer, ...]] = {
    "Call": (torch_compile.fix_call, device_strings.fix_call, move_model.fix_call, transformers_api.fix_call),
    "IfExp": (device_strings.fix_ifexp,),
    "Assign": (device_strings.fix_assign, cuda_flag.fix_assign, move_model.fix_assign),
    "If": (cuda_flag.fix_if,),
    "Assert": (colab.fix_assert,),
    "Subscript": (colab.fix_subscript,),
    "Import": (colab.fix_import,),
    "ImportFrom": (colab.fix_import, transformers_api.fix_import),
    "SimpleStatementLine": (torch_compile.fix_statement,),
}
ANALYSES = (move_model.analyse,)


def apply(kind: str, porter: Any, original: Any, updated: Any) -> Any:
    """The first fixer's replacement for ``updated``, or None when no fixer of ``kind`` rewrites it."""
    for fix in FIXERS.get(kind, ()):
        new = fix(porter, original, updated)
        if new is not None:
            return new
    return None
