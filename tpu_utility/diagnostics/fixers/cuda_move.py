"""Moves to CUDA: ``x.cuda()`` -> ``x.to(device)``, ``x.to("cuda")`` -> ``x.to(device)`` (the device the scope holds)."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import call_names, code, cuda_string, libcst


@fixes("Call", order=150)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``x.cuda(non_blocking=True)`` -> ``x.to(device, non_blocking=True)``; ``x.to("cuda", ...)``."""
    cst = libcst()
    name, last = call_names(updated, porter.plan)
    args = updated.args
    if not isinstance(updated.func, cst.Attribute):
        return None
    if last == "cuda" and not name.startswith("torch.cuda"):
        kept = [a for a in args if a.keyword is not None and a.keyword.value == "non_blocking"]
        rest = "".join(f", {code(a).strip().rstrip(',')}" for a in kept)
        new = cst.parse_expression(f"{code(updated.func.value)}.to({porter.device()}{rest})")
        porter.change("cuda_move", original, new)
        return new
    if last == "to" and args and cuda_string(args[0].value) is not None:
        new = updated.with_changes(args=[args[0].with_changes(value=cst.parse_expression(porter.device())), *args[1:]])
        porter.change("cuda_device", original, new)
        return new
    return None
