"""The GPU chosen by a flag (``--cuda``, ``--no-cuda``, ``use_cuda``): after the port the accelerator is the default.

``if opt.cuda: netD.cuda()`` moves nothing without the flag, so the port tests the device
instead (``get_device().type != "cpu"``: the same as no flag on the CPU). A
``use_cuda = not args.no_cuda and torch.cuda.is_available()`` that decides other settings is
named in the report.
"""

from __future__ import annotations

import re
from typing import Any

from .tree import code, dotted, libcst

_MOVES = re.compile(r"\.(cuda|to)\(|move_model\(")


def _is_flag(test: Any) -> bool:
    cst = libcst()
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return False  # `if not args.cuda:` keeps the CPU branch: left alone
    name = dotted(test)
    return bool(name) and "cuda" in name.rsplit(".", 1)[-1] and not name.startswith("torch.")


def fix_if(porter: Any, original: Any, updated: Any) -> Any:
    """``if opt.cuda:`` around a move to the GPU -> ``if get_device().type != "cpu":``."""
    if not _is_flag(original.test) or not _MOVES.search(code(original.body)):
        return None
    porter.need("get_device")
    test = libcst().parse_expression('get_device().type != "cpu"')
    porter.change("cuda_flag", original.test, test)
    return updated.with_changes(test=test)


def fix_assign(porter: Any, original: Any, updated: Any) -> Any:
    """``use_cuda = not args.no_cuda and torch.cuda.is_available()``: reported, the device line is ported."""
    cst = libcst()
    targets = [dotted(t.target) for t in original.targets]
    if (isinstance(original.value, cst.BooleanOperation) and "torch.cuda.is_available()" in code(original.value)
            and any("cuda" in t for t in targets)):  # fmt: skip
        porter.leave_alone("cuda_flag_settings", original)
    return None
