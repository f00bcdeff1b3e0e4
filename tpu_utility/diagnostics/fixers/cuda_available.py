"""A CUDA check that decides the device (``if torch.cuda.is_available(): device = "cuda"``): it tests for an accelerator.

``torch.cuda.is_available()`` is False on a TPU, so a branch that picks the device or moves
the model there is never taken, and the ported program trains on the host CPU. The check in
such an ``if`` becomes ``get_device().type != "cpu"`` (the accelerator, the CPU where there is
none), as ``torch.accelerator.is_available()`` does (``device_strings``). A check that guards
anything else (a ``torch.cuda`` call, mixed precision) stays: it is right to skip those on a TPU.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes, opening
from .tree import DECIDES_DEVICE, code, dotted, libcst

_CHECK = "torch.cuda.is_available"


@opening
def decides_device(node: Any) -> bool:
    """Whether an ``if`` tests ``torch.cuda.is_available()`` and picks or moves to the device in a branch."""
    branches = code(node.body) + (code(node.orelse) if node.orelse is not None else "")
    return f"{_CHECK}()" in code(node.test) and bool(DECIDES_DEVICE.search(branches))


@fixes("If", order=30)
def fix_if(porter: Porter, original: Any, updated: Any) -> Any:
    """``if torch.cuda.is_available():`` around ``device = "cuda"`` / ``model.cuda()`` -> ``if get_device().type != "cpu":``."""
    cst = libcst()
    if not decides_device(original):
        return None

    class Check(cst.CSTTransformer):
        def leave_Call(self, _: Any, call: Any) -> Any:
            return cst.parse_expression('get_device().type != "cpu"') if dotted(call.func) == _CHECK and not call.args else call

    test = updated.test.visit(Check())
    porter.need("get_device")
    porter.change("cuda_available", original.test, test)
    return updated.with_changes(test=test)
