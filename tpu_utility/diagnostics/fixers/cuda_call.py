"""``torch.cuda.*`` calls no test guards (``torch.cuda.synchronize()``): reported, they raise without CUDA."""

from __future__ import annotations

from typing import Any

from .tree import call_names


def fix_call(porter: Any, original: Any, updated: Any) -> Any:
    """A ``torch.cuda`` call outside an ``if`` (or ``and``) that tests CUDA; availability and count are fine."""
    name, last = call_names(updated, porter.plan)
    if name.startswith("torch.cuda.") and last not in ("is_available", "device_count"):
        if not any(porter.guards) and "amp." not in name:
            porter.leave_alone("cuda_call", original)
    return None
