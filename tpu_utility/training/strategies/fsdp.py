"""strategy="fsdp": parameters, gradients and optimizer state sharded over all cores, one block gathered at a time.

On XLA the backend applies FSDPv2's steps to the model in place (``backend.shard_parameters``): the model
keeps its own modules and key names, so a checkpoint, ``history.model`` or ``predict`` never asks which
strategy trained it. Batches are sharded over the same devices as under ``strategy="spmd"``, and the model's
output on its batch dimension (so the compiler never replicates the logits). Each block recomputes its
activations in the backward unless ``FSDP(checkpoint=False)`` (``sharding.apply_sharding``).
"""

from __future__ import annotations

from typing import Callable

from torch import nn

from ...sharding import FSDP, apply_sharding, blocks_of


class Replicated:
    """Every core holds the whole model (single core, SPMD data parallel, replicas): nothing to do."""

    name = "replicated"
    note = ""  # said on the summary line

    def enter(self, model: nn.Module) -> None:
        """Called once the model is on its device."""

    def leave(self, model: nn.Module) -> None:
        """Called before the model goes back where it was found."""


class Fsdp(Replicated):
    """Each core holds 1/N of every parameter; the blocks (``block_classes``) are gathered one at a time.

    ``why``: what chose it, when not the user (``strategy="auto"`` from the memory plan).
    """

    name = "fsdp"

    def __init__(self, options: FSDP | None = None, why: str = "") -> None:
        self.options = options or FSDP()
        self.why = why
        self._undo: Callable[[], None] | None = None
        self.note = ""

    def enter(self, model: nn.Module) -> None:
        self._undo = apply_sharding(model, self.options)
        checkpointed = ", each checkpointed" if self.options.checkpoint else ""
        self.note = f"fsdp: {blocks_of(model, self.options)} gathered one at a time{checkpointed}"
        self.note += f" ({self.why})" if self.why else ""

    def leave(self, model: nn.Module) -> None:
        if self._undo is not None:
            self._undo()
        self._undo = None


def room(mode: str, options: FSDP | None = None, why: str = "") -> Replicated:
    """The strategy room for a run mode: ``Fsdp(options, why)`` for "fsdp", else ``Replicated``."""
    return Fsdp(options, why) if mode == "fsdp" else Replicated()
