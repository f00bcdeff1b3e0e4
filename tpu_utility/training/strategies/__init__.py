"""Strategies: each way of spreading a model over devices in its own room.

``blocks`` finds the units a sharded strategy wraps; ``fsdp`` shards parameters, gradients and
optimizer state over the cores (FSDPv2 on XLA's SPMD mesh).
"""

from .blocks import block_classes, repeated_class

__all__ = ["block_classes", "repeated_class"]
