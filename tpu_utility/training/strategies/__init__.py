"""Strategies: each way of spreading a model over devices in its own room, behind one interface
(``enter`` once the model is on its device, ``leave`` before it goes back, ``note`` for the summary line).

``fsdp`` holds ``Replicated`` (every core the whole model) and ``Fsdp`` (parameters, gradients and optimizer
state sharded over all cores). The blocks a sharded strategy gathers one at a time, and its options
(``FSDP``), live in the kit's ``sharding`` module, which ``shard_model`` shares.
"""

from ...sharding import FSDP, block_classes, repeated_class, resolve_strategy
from .fsdp import Fsdp, Replicated, room

__all__ = ["block_classes", "FSDP", "Fsdp", "repeated_class", "Replicated", "resolve_strategy", "room"]
