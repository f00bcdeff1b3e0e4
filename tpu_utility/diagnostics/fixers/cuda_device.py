"""The device made CUDA: ``torch.device("cuda")``, ``device="cuda"`` and ``"cuda" if <cuda test> else ...`` -> the ported device."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import call_names, code, cuda_string, libcst, mentions_cuda

_PORTED = ("get_device()", "get_device().type", "str(get_device())")


@fixes("Call", order=140)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.device("cuda")`` (or of a device string already ported) -> ``get_device()``."""
    name, _ = call_names(updated, porter.plan)
    args = updated.args
    if name == "torch.device" and args and (cuda_string(args[0].value) is not None or code(args[0].value) in _PORTED):
        porter.need("get_device")
        new = libcst().parse_expression("get_device()")
        porter.change("cuda_device", original, new)
        return new
    return None


@fixes("Arg", order=10)
def fix_arg(porter: Porter, original: Any, updated: Any) -> Any:
    """``f(..., device="cuda")`` -> the device the scope holds."""
    if updated.keyword is not None and updated.keyword.value == "device" and cuda_string(updated.value) is not None:
        new = updated.with_changes(value=libcst().parse_expression(porter.device()))
        porter.change("cuda_device", original, new)
        return new
    return None


@fixes("IfExp", order=20)
def fix_ifexp(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.device("cuda") if torch.cuda.is_available() else ...`` (what device_strings left) -> ``get_device()``."""
    if mentions_cuda(original.test) and mentions_cuda(original.body):
        new = libcst().parse_expression("get_device()")
        porter.need("get_device")
        porter.change("cuda_device", original, new)
        return new
    return None
