"""``torch.Generator(device=device)``: XLA has no generator objects ('XLA device type not an accelerator'): a CPU one."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import dotted, keyword, libcst


@fixes("Call", order=80)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.Generator(device=...)`` (or the device given positionally) -> ``torch.Generator()``."""
    cst = libcst()
    if dotted(updated.func) not in ("torch.Generator", "Generator") or not updated.args:
        return None
    placed = keyword(updated, "device") or (updated.args[0] if updated.args[0].keyword is None else None)
    if placed is None:
        return None
    new = updated.with_changes(args=[a for a in updated.args if a is not placed])
    if new.args:
        new = new.with_changes(args=[*new.args[:-1], new.args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
    porter.change("generator_device", original, new)
    return new
