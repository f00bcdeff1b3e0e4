"""The device as the program keeps it: a string stays a string, a ``torch.device`` stays one.

``device = 'cuda'``, ``'cuda' if 'cuda' in device else 'cpu'``, ``--device`` defaulting to
``'cuda'``, and both spellings of the ``torch.accelerator`` idiom become the ported device
(``get_device()``: the TPU, CUDA where there is one, else the CPU), as a string where the
program had a string.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, cuda_string, device_string, dotted, keyword, libcst

_ACCELERATOR = "torch.accelerator.current_accelerator()"


def _new(porter: Porter, original: Any, text: str) -> Any:
    porter.need("get_device")
    new = libcst().parse_expression(text)
    porter.change("cuda_device", original, new)
    return new


@fixes("IfExp", order=10)
def fix_ifexp(porter: Porter, original: Any, updated: Any) -> Any:
    """``'cuda' if <test> else 'cpu'`` and ``torch.accelerator.current_accelerator().type if ... else ...``."""
    branches = (original.body, original.orelse)
    if any(_ACCELERATOR in code(b) for b in branches):
        typed = any(code(b).replace(" ", "").endswith(f"{_ACCELERATOR}.type") for b in branches)
        return _new(porter, original, "get_device().type" if typed else "get_device()")
    cuda = cuda_string(original.body) or cuda_string(original.orelse)
    out = porter.plan.opt_outs.get(dotted(original.test))
    if cuda and out and cuda_string(original.body):  # "cuda" if use_cuda else "cpu": the user's --no-cuda holds
        porter.need("get_device")
        new = libcst().parse_expression(f"{device_string(cuda)} if {out} else {code(original.orelse)}")
        porter.change("flag_opt_out", original, new)
        return new
    if cuda and "cuda" in code(original.test):
        return _new(porter, original, device_string(cuda))
    return None


@fixes("Assign", order=40)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``device = 'cuda'`` / ``'cuda:0'``."""
    cuda = cuda_string(original.value)
    if cuda is None:
        return None
    return updated.with_changes(value=_new(porter, original.value, device_string(cuda)))


@fixes("Call", order=110)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``add_argument('--device', default='cuda')``, ``torch.accelerator.current_accelerator()`` and ``.is_available()``."""
    name = dotted(updated.func)
    if name.endswith("add_argument"):
        default = keyword(updated, "default")
        cuda = cuda_string(default.value) if default is not None else None
        if cuda:
            porter.need("get_device")
            value = libcst().parse_expression(device_string(cuda))
            new = updated.with_changes(args=[a.with_changes(value=value) if a is default else a for a in updated.args])
            porter.change("cuda_device", original, new)
            return new
    if name == "torch.accelerator.current_accelerator" and not updated.args:
        return _new(porter, original, "get_device()")
    if name == "torch.accelerator.is_available" and not updated.args:
        return _new(porter, original, 'get_device().type != "cpu"')
    return None
