"""``torch.cuda.*`` / ``torch.accelerator.*`` calls no test guards (``torch.cuda.synchronize()``): reported, they raise without CUDA."""

from __future__ import annotations

from typing import Any

from .cuda_seed import FINE as SEEDS
from .device_calls import HANDLED
from .registry import Porter, fixes
from .tree import call_names

# answered, given their XLA meaning by device_calls, or harmless without CUDA and handled by cuda_seed
_FINE = {"is_available", "current_accelerator", *HANDLED, *SEEDS}


@fixes("Call", order=30)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """A ``torch.cuda`` or ``torch.accelerator`` call outside an ``if`` (or ``and``) that tests CUDA."""
    name, last = call_names(updated, porter.plan)
    if name.startswith(("torch.cuda.", "torch.accelerator.")) and last not in _FINE:
        if not any(porter.guards) and "amp." not in name:
            porter.leave_alone("cuda_call", original)
    return None
