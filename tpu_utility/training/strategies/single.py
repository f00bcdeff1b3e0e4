"""One core: the whole model on one device, in this process."""

from __future__ import annotations

from .base import Strategy


class Single(Strategy):
    """One device, one process: nothing to spread."""

    name = "single"
