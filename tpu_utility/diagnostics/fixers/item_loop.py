"""A per-sample ``.item()`` loop over a device tensor (``for i in range(n): out[i] = scores[i].item()``): named with the host-side rewrite.

Each ``.item()`` waits for the device, and each indexed write of a device value compiles a
graph (32 samples: 33 compiles). The loop is not a training step, so the host-sync rule
(``host_sync``, per step) does not see it; this one names the loop with its rewrite: read the
tensor to the host once before the loop.
"""

from __future__ import annotations

from typing import Any

from .dynamic_shape import root
from .registry import Porter, fixes
from .tree import code, libcst, uses


def _per_sample_reads(loop: Any, host: set[str]) -> bool:
    """Whether the loop's body calls ``<tensor>[..i..].item()`` with ``i`` the loop's own variable."""
    cst = libcst()
    targets = uses(loop.target)
    found: list[bool] = []

    class Reads(cst.CSTVisitor):
        def visit_Call(self, node: Any) -> None:
            func = node.func
            if isinstance(func, cst.Attribute) and func.attr.value == "item" and isinstance(func.value, cst.Subscript):
                indexed = any(uses(element) & targets for element in func.value.slice)
                found.append(indexed and root(func) not in host)

    loop.body.visit(Reads())
    return any(found)


@fixes("For", order=10)
def fix_for(porter: Porter, original: Any, updated: Any) -> Any:
    """``for i in ...:`` whose body reads ``x[i].item()`` of a tensor (not a list or an array): named."""
    if _per_sample_reads(original, porter.plan.host_values):
        header = code(original).strip().splitlines()[0]
        porter.leave_alone("item_loop", original, code=porter.short(header))
    return None
