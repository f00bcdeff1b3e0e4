"""Hogwild (``model.share_memory()`` and ``mp.Process`` workers updating one model): no XLA form, named."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import libcst


@fixes("Call", order=50)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``<model>.share_memory()``."""
    cst = libcst()
    if isinstance(updated.func, cst.Attribute) and updated.func.attr.value == "share_memory" and not updated.args:
        porter.leave_alone("hogwild", original)
    return None
