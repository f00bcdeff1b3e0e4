"""strategy="fsdp": parameters, gradients and optimizer state sharded over all cores, one block gathered at a time.

On XLA the backend applies FSDPv2's steps to the model in place (``backend.shard_parameters``): the model
keeps its own modules and key names, so a checkpoint, ``history.model`` or ``predict`` never asks which
strategy trained it. Batches are sharded over the same devices as under ``strategy="spmd"``, and the model's
output on its batch dimension (so the compiler never replicates the logits).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ... import backend
from .blocks import block_classes


class Replicated:
    """Every core holds the whole model (single core, SPMD data parallel, replicas): nothing to do."""

    name = "replicated"

    def enter(self, model: nn.Module) -> None:
        """Called once the model is on its device."""

    def leave(self, model: nn.Module) -> None:
        """Called before the model goes back where it was found."""


class Fsdp(Replicated):
    """Each core holds 1/N of every parameter; the blocks (``block_classes``) are gathered one at a time."""

    name = "fsdp"

    def __init__(self, wrap: Any = None) -> None:
        self.wrap = wrap
        self._undo: list[Any] = []

    def enter(self, model: nn.Module) -> None:
        classes = block_classes(model, self.wrap)
        blocks = [m for m in model.modules() if isinstance(m, classes)]
        self._undo = [backend.current().shard_parameters(model, blocks), model.register_forward_hook(_shard_output).remove]

    def leave(self, model: nn.Module) -> None:
        for undo in self._undo:
            undo()
        self._undo = []


def _shard_output(module: nn.Module, inputs: Any, output: Any) -> None:
    """The output's scores sharded on the batch dimension: the tensor, a ``ModelOutput``'s logits, a tuple's first."""
    scores = output
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping):
        scores = output.get("logits")
    elif isinstance(output, tuple) and output:
        scores = output[0]
    if isinstance(scores, torch.Tensor) and scores.dim() > 0:
        backend.shard_batch([scores])


def room(mode: str) -> Replicated:
    """The strategy room for a run mode: ``Fsdp`` for "fsdp", else ``Replicated``."""
    return Fsdp() if mode == "fsdp" else Replicated()
