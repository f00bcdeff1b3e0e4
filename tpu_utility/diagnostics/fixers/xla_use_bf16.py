"""``os.environ["XLA_USE_BF16"] = "1"`` (or ``XLA_DOWNCAST_BF16``): deprecated, reported with bfloat16 autocast."""

from __future__ import annotations

import re
from typing import Any

from .registry import Porter, fixes
from .tree import code

_TARGET = re.compile(r"os\.environ\[['\"]XLA_(USE|DOWNCAST)_BF16['\"]\]")


@fixes("Assign", order=10)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """The assignment to the environment variable."""
    if _TARGET.fullmatch(code(original.targets[0].target).replace(" ", "")):
        porter.leave_alone("xla_use_bf16", original)
    return None
