"""``torch.inference_mode()`` -> the kit's ``inference_mode()``: XLA cannot run layers that view a weight inside it."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import call_names, libcst


@fixes("Call", order=180)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.inference_mode(...)`` -> ``inference_mode(...)``."""
    if call_names(updated, porter.plan)[0] != "torch.inference_mode":
        return None
    porter.need("inference_mode")
    new = updated.with_changes(func=libcst().Name("inference_mode"))
    porter.change("inference_mode", original, new)
    return new
