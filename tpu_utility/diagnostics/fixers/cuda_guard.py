"""A CUDA test around mixed precision (``if device.type == "cuda": scaler = GradScaler()``): reported, it is False on a TPU."""

from __future__ import annotations

import re
from typing import Any

from .registry import Porter, fixes
from .tree import code, mentions_cuda

_AMP = re.compile(r"autocast|GradScaler|\bamp\b")


@fixes("If", order=10)
def fix_if(porter: Porter, original: Any, updated: Any) -> Any:
    """``if <a test that mentions cuda>:`` whose body sets up autocast or a GradScaler."""
    if mentions_cuda(original.test) and _AMP.search(code(original.body)):
        porter.leave_alone("cuda_guard", original, code=f"if {porter.short(code(original.test))}:")
    return None
