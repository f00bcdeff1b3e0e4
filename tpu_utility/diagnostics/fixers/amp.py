"""CUDA's mixed precision -> the kit's: ``torch.autocast("cuda", ...)`` -> ``autocast(...)``, ``GradScaler()`` -> ``grad_scaler()``.

TPUs need bfloat16 and no loss scaling; ``tpu_utility.autocast`` and ``grad_scaler`` give that on
a TPU and the program's own dtype and scaler on CUDA. The names the kit replaces leave
``from torch.cuda.amp import autocast, GradScaler``.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import call_names, code, dotted, drop_imported, libcst

_AUTOCASTS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast")
_PARTIAL = ("partial", "functools.partial")
_SCALERS = ("torch.cuda.amp.GradScaler", "torch.amp.GradScaler", "GradScaler")


def _changed(porter: Porter, original: Any, text: str) -> Any:
    new = libcst().parse_expression(text)
    porter.change("cuda_amp", original, new)
    return new


def _autocast(porter: Porter, original: Any, updated: Any, name: str) -> Any:
    args = list(updated.args)
    porter.need("autocast")
    if name in _PARTIAL:
        kept = [a for a in args[1:] if a.keyword is not None and a.keyword.value in ("dtype", "enabled")]
        text = ", ".join(["autocast", *(code(a).strip().rstrip(",") for a in kept)])
        return _changed(porter, original, f"{code(updated.func)}({text})")
    # positional arguments by name: torch.cuda.amp.autocast(enabled, dtype), torch.autocast(device_type, dtype, enabled)
    order = ("enabled", "dtype") if name == "torch.cuda.amp.autocast" else ("device_type", "dtype", "enabled")
    named = {(a.keyword.value if a.keyword is not None else order[i] if i < len(order) else ""): a.value
             for i, a in enumerate(args)}  # fmt: skip
    kept = [f"{k}={code(named[k])}" for k in ("dtype", "enabled") if k in named]
    return _changed(porter, original, f"autocast({', '.join(kept)})")


@fixes("Call", order=170)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.autocast(...)``, ``partial(torch.autocast, ...)``, ``GradScaler(...)``."""
    name, _ = call_names(updated, porter.plan)
    args = updated.args
    if name in (*_AUTOCASTS, "autocast") or (name in _PARTIAL and args and dotted(args[0].value) in _AUTOCASTS):
        return _autocast(porter, original, updated, name)
    if name in _SCALERS:
        kept = [a for a in args if a.keyword is not None and a.keyword.value != "device"]
        porter.need("grad_scaler")
        return _changed(porter, original, f"grad_scaler({', '.join(code(a).strip().rstrip(',') for a in kept)})")
    return None


@fixes("ImportFrom", order=30)
def fix_import(porter: Porter, original: Any, updated: Any) -> Any:
    """``from torch.cuda.amp import autocast, GradScaler``: the kit's names replace these (the line goes when empty)."""
    cst = libcst()
    module = dotted(updated.module) if updated.module is not None else ""
    if module not in ("torch", "torch.amp", "torch.cuda.amp") or isinstance(updated.names, cst.ImportStar):
        return None
    return drop_imported(porter, "cuda_amp", original, updated, ("autocast", "GradScaler"))
