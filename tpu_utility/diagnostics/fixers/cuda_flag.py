"""The GPU chosen by a flag (``--cuda``, ``--no-cuda``, ``use_cuda``, ``--accel``): after the port the accelerator is the default.

``if opt.cuda: netD.cuda()`` moves nothing without the flag, so the port tests the device
instead (``get_device().type != "cpu"``: the same as no flag on the CPU). A
``use_cuda = not args.no_cuda and torch.cuda.is_available()`` that decides other settings is
named in the report. pytorch/examples' 2025 scripts spell the flag ``--accel`` (``if args.accel: device =
torch.accelerator.current_accelerator()``, off by default): the same.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes, opening
from .tree import DECIDES_DEVICE, code, dotted, libcst


_FLAG_WORDS = ("cuda", "accel")  # args.cuda, use_cuda; args.accel, use_accel


def _is_flag(test: Any) -> bool:
    cst = libcst()
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return False  # `if not args.cuda:` keeps the CPU branch: left alone
    name = dotted(test)
    return bool(name) and any(word in name.rsplit(".", 1)[-1] for word in _FLAG_WORDS) and not name.startswith("torch.")


@opening
def opens(node: Any) -> bool:
    """Whether an ``if`` tests a CUDA flag and moves to the GPU or picks the device in its body."""
    return _is_flag(node.test) and bool(DECIDES_DEVICE.search(code(node.body)))


@fixes("If", order=40)
def fix_if(porter: Porter, original: Any, updated: Any) -> Any:
    """``if opt.cuda:`` around a move to the GPU, or ``if use_cuda:`` around the device line -> ``if get_device().type != "cpu":``."""
    if not opens(original):
        return None
    porter.need("get_device")
    test = libcst().parse_expression('get_device().type != "cpu"')
    porter.change("cuda_flag", original.test, test)
    return updated.with_changes(test=test)


@fixes("Assign", order=50)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``use_cuda = not args.no_cuda and torch.cuda.is_available()``: reported, the device line is ported."""
    cst = libcst()
    targets = [dotted(t.target) for t in original.targets]
    if (isinstance(original.value, cst.BooleanOperation) and "torch.cuda.is_available()" in code(original.value)
            and any("cuda" in t for t in targets)):  # fmt: skip
        porter.leave_alone("cuda_flag_settings", original)
    return None
