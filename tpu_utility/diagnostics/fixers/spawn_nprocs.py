"""``xmp.spawn(fn, args, nprocs=8)`` -> ``xmp.spawn(fn, args)``: under PJRT any nprocs but None or 1 raises."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import call_names, libcst


@fixes("Call", order=210)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """The ``nprocs`` argument, by keyword or third position, goes."""
    if call_names(updated, porter.plan)[0] != "xmp.spawn":
        return None
    args = updated.args
    kept = [a for i, a in enumerate(args)
            if not ((a.keyword is not None and a.keyword.value == "nprocs") or (a.keyword is None and i == 2))]
    if len(kept) == len(args):
        return None
    new = updated.with_changes(args=[*kept[:-1], kept[-1].with_changes(comma=libcst().MaybeSentinel.DEFAULT)])
    porter.change("spawn_nprocs", original, new)
    return new
