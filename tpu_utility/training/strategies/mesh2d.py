"""strategy="fsdp-tp": a 2-D mesh, FSDP over one axis and tensor parallelism over the other.

The layout torch_xla's Llama 2 work trained with (54% MFU on v4): the devices form a ("fsdp", "tensor") mesh;
each attention and MLP projection is split over the tensor axis, column-wise (``q/k/v``, ``gate``/``up``: the
output features) or row-wise (``o``, ``down``: the input features), and over the FSDP axis the other way; every
other parameter is sharded as FSDPv2 shards it. A block's full gather then spans the FSDP axis alone (1/tensor of
it), which helps when one layer's gather does not fit, or sequences are long. Batches split as under FSDP.

On XLA the backend's sharding group marks the 2-D shardings on the model in place (``shard_mesh_2d``); the
compiler adds the collectives, so the step computes what one replica computes and the model keeps its modules
and key names (checkpoints load into the plain model, ``export_pretrained`` works from it). A peft model's
adapters inside a projection split as their projection does.

This module is the whole strategy: its options (``Mesh2D``), its choice, what it does to the model, and its
column of the memory plan; ``STRATEGIES`` names it, and the backend's sharding group places the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ... import backend
from ...backend.base import Backend
from ...sharding import FSDP, around_blocks, blocks_of, fsdp_blocks, largest_block
from .base import Strategy, shard_bytes
from .fsdp import Fsdp

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split over the tensor axis
ROW = ("o_proj", "down_proj")  # input features split: each device's share of a column projection's output


@dataclass(frozen=True)
class Mesh2D(FSDP):
    """Options of ``strategy="fsdp-tp"``: ``FSDP``'s, and ``tensor``, the devices along the tensor axis.

    Raises:
        TypeError: ``tensor`` not an int >= 2 (and ``FSDP``'s own checks).

    Example:
        >>> Mesh2D(tensor=2, checkpoint=False)
        Mesh2D(wrap=None, checkpoint=False, shard_output=True, tensor=2)
    """

    tensor: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.tensor, bool) or not isinstance(self.tensor, int) or self.tensor < 2:
            raise TypeError(f"Mesh2D(tensor=...) is the devices along the tensor axis, an int >= 2, but given {self.tensor!r}")


def projections(model: nn.Module) -> dict[int, str]:
    """Each parameter of an attention or MLP projection (and of a peft adapter inside one), by ``id``: "column" or
    "row".

    Example:
        >>> block = nn.Module(); block.q_proj, block.o_proj = nn.Linear(4, 4), nn.Linear(4, 4, bias=False)
        >>> sorted(projections(block).values())
        ['column', 'column', 'row']
    """
    split: dict[int, str] = {}
    for name, module in model.named_modules():
        parts = set(name.split("."))
        kind = "column" if parts & set(COLUMN) else "row" if parts & set(ROW) else None
        if kind is not None and isinstance(module, nn.Linear):
            split.update({id(p): kind for p in module.parameters(recurse=False)})
    return split


class FsdpTensorParallel(Fsdp):
    """XLA: one process over a ("fsdp", "tensor") mesh of all devices; the projections split over both axes."""

    name = "fsdp-tp"
    options_type = Mesh2D
    options: Mesh2D

    def __init__(self, cores: int = 1, options: Mesh2D | None = None, why: str = "") -> None:
        super().__init__(cores, options or Mesh2D(), why)

    @classmethod
    def choose(cls, cores: int, on: Backend, options: Mesh2D | None) -> Strategy:
        tensor = (options or Mesh2D()).tensor
        if not on.sharding.over_mesh():
            raise ValueError(f"strategy='{cls.name}' runs over an SPMD mesh of XLA devices (a TPU, or PJRT_DEVICE set); "
                             f"the {backend.current().name} backend runs one process per device: use strategy='fsdp'")  # fmt: skip
        if cores < 2 * tensor or cores % tensor:
            raise ValueError(f"strategy='{cls.name}' needs a 2-D mesh: cores a multiple of Mesh2D(tensor={tensor}) and at "
                             f"least {2 * tensor}, but given cores={cores}; give a smaller tensor= or strategy='fsdp'")  # fmt: skip
        return cls(cores, options)

    @classmethod
    def for_job(cls, cores: int, on: Backend, options: Mesh2D | None) -> Strategy | None:
        raise ValueError(f"strategy='{cls.name}' spreads over an SPMD mesh from one process, but this process is one "
                         f"replica of a multi-process launch; call it from the main process with cores='all'")  # fmt: skip

    def enter(self, model: nn.Module) -> None:
        blocks = fsdp_blocks(model, self.options)
        place = backend.current().sharding.shard_mesh_2d(model, blocks, projections(model), self.options.tensor)
        self._undo = [place, *around_blocks(model, blocks, self.options)]
        mesh = f"{self.cores // self.options.tensor}x{self.options.tensor}"
        self.note = f"fsdp-tp: a {mesh} mesh, {blocks_of(model, self.options)} gathered one at a time over fsdp"
        self.note += f" ({self.why})" if self.why else ""

    def held(self, model: nn.Module, tensors: list[torch.Tensor]) -> int:
        """A projection's weight split over every device (its bias: a column projection's over the tensor axis, a
        row projection's whole), any other tensor over the FSDP axis alone."""
        split, fsdp, tensor = projections(model), self.cores // self.options.tensor, self.options.tensor
        held = 0
        for t in tensors:
            kind, size = split.get(id(t)), (t.numel(), t.element_size())
            if kind is None:
                held += shard_bytes(*size, fsdp)
            else:
                held += shard_bytes(*size, self.cores if t.dim() > 1 else tensor if kind == "column" else 1)
        return held

    def gathered(self, model: nn.Module) -> int:
        """One block gathered over the FSDP axis (a projection keeps its tensor-axis share), weights then gradients."""
        split = projections(model)
        block = largest_block(model, self.options.wrap)
        tensor = self.options.tensor
        return sum(p.numel() * p.element_size() * (2 if p.requires_grad else 1) // (tensor if id(p) in split else 1)
                   for p in block)  # fmt: skip
