"""Strategies: each way of spreading a model over devices in its own room, behind one interface
(``enter`` once the model is on its device, ``leave`` before it goes back).

``blocks`` finds the units a sharded strategy gathers one at a time; ``fsdp`` holds ``Replicated`` (every core
the whole model) and ``Fsdp`` (parameters, gradients and optimizer state sharded over all cores).
"""

from .blocks import block_classes, repeated_class
from .fsdp import Fsdp, Replicated, room

__all__ = ["block_classes", "Fsdp", "repeated_class", "Replicated", "room"]
