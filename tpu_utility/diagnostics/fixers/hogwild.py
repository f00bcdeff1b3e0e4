"""Hogwild (``model.share_memory()`` and ``mp.Process`` workers updating one model): no XLA form, named."""

from __future__ import annotations

from typing import Any

from .tree import libcst


def fix_call(porter: Any, original: Any, updated: Any) -> Any:
    """``<model>.share_memory()``."""
    cst = libcst()
    if isinstance(updated.func, cst.Attribute) and updated.func.attr.value == "share_memory" and not updated.args:
        porter.leave_alone("hogwild", original)
    return None
