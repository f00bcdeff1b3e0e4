"""Ops XLA cannot lower (``nn.EmbeddingBag``, ``torch.bincount``, ``x.nonzero()``): reported with a replacement."""

from __future__ import annotations

from typing import Any

from ..rules import LOWERED_REPLACEMENTS, SOURCE_FALLBACKS
from .registry import Porter, fixes
from .tree import call_names, libcst


@fixes("Call", order=20)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """A call of one of ``rules.SOURCE_FALLBACKS`` on torch, nn, F or a tensor (``unique`` only on torch or bare)."""
    name, last = call_names(updated, porter.plan)
    if last in SOURCE_FALLBACKS and (name.startswith(("torch.", "nn.", "F.")) or
                                     isinstance(original.func, libcst().Attribute)):  # fmt: skip
        if last != "unique" or name.startswith("torch.") or not original.args:
            porter.leave_alone("cpu_fallback", original, LOWERED_REPLACEMENTS[SOURCE_FALLBACKS[last]])
    return None
