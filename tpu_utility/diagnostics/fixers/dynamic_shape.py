"""A boolean-mask index (``x[x > 0]``): a data-dependent shape, reported with the masked form."""

from __future__ import annotations

from typing import Any

from .tree import libcst


def fix_subscript(porter: Any, original: Any, updated: Any) -> Any:
    """``x[<comparison>]``."""
    cst = libcst()
    if any(isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.Comparison) for e in original.slice):
        porter.leave_alone("dynamic_shape", original)
    return None
