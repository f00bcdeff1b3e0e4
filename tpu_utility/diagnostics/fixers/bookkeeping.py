"""Python bookkeeping on device metrics (``best_acc1 = max(acc1, best_acc1)``, ``if is_best:``): named, it recompiles.

pytorch/examples' imagenet keeps ``acc1`` (an average of device tensors) and compares it in
Python: each comparison reads the value on the host, and the Python number it gives becomes a
constant of the next graphs, so every epoch compiles anew. A metric is a name like ``acc1``,
``top1``, ``loss``, ``score`` that is not bound to a host value (``fixers.dynamic_shape``).
"""

from __future__ import annotations

import re
from typing import Any

from .registry import Porter, analysis, fixes
from .tree import dotted, libcst

_METRIC = re.compile(r"acc|top\d|prec|loss|score|metric|auc|f1", re.I)


def _metrics(nodes: list[Any], plan: Any) -> bool:
    """Whether the operands are names (or attributes) and one is a device metric."""
    names = [dotted(n) for n in nodes]
    return all(names) and any(_METRIC.search(n.rsplit(".", 1)[-1]) and n not in plan.host_values for n in names)


@analysis(order=30)
def analyse(module: Any, plan: Any) -> None:
    """``plan.device_flags``: names bound to a comparison of device metrics (``is_best = acc1 > best_acc1``)."""
    cst = libcst()

    class Flags(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            value = node.value
            if isinstance(value, cst.Comparison) and _metrics([value.left, *(c.comparator for c in value.comparisons)], plan):
                plan.device_flags.update(t.target.value for t in node.targets if isinstance(t.target, cst.Name))

    module.visit(Flags())


@fixes("Call", order=60)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``max(acc1, best_acc1)`` / ``min(loss, best_loss)``."""
    if dotted(updated.func) in ("max", "min") and len(updated.args) > 1 and _metrics([a.value for a in original.args], porter.plan):
        porter.leave_alone("device_bookkeeping", original)
    return None


@fixes("If", order=20)
def fix_if(porter: Porter, original: Any, updated: Any) -> Any:
    """``if is_best:`` of such a flag."""
    if dotted(original.test) in porter.plan.device_flags:
        porter.leave_alone("device_bookkeeping", original, code=f"if {dotted(original.test)}:")
    return None
