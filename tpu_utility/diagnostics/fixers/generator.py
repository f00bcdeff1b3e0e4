"""``torch.Generator(device=device)``: XLA has no generator objects ('XLA device type not an accelerator'): a CPU one.

Only torch's ``Generator`` (``torch.Generator``, or imported from torch): a program's own
``class Generator(nn.Module)`` shadows it (``netG = Generator(ngpu).to(device)`` keeps its argument).
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import canonical, dotted, keyword, libcst


@fixes("Call", order=80)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.Generator(device=...)`` (or the device given positionally) -> ``torch.Generator()``."""
    cst = libcst()
    # by name resolution: a program's own ``class Generator(nn.Module)`` (every GAN example's netG) is not torch's
    if canonical(dotted(updated.func), porter.plan) != "torch.Generator" or not updated.args:
        return None
    placed = keyword(updated, "device") or (updated.args[0] if updated.args[0].keyword is None else None)
    if placed is None:
        return None
    new = updated.with_changes(args=[a for a in updated.args if a is not placed])
    if new.args:
        new = new.with_changes(args=[*new.args[:-1], new.args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
    porter.change("generator_device", original, new)
    return new
