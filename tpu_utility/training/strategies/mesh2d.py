"""strategy="fsdp-tp": a 2-D mesh, FSDP over one axis and tensor parallelism over the other.

The layout torch_xla's Llama 2 work trained with (54% MFU on v4): the devices form a ("fsdp", "tensor") mesh;
each attention and MLP projection is split over the tensor axis, column-wise (``q/k/v``, ``gate``/``up``: the
output features) or row-wise (``o``, ``down``: the input features), and over the FSDP axis the other way; every
other parameter is sharded as FSDPv2 shards it. A block's full gather then spans the FSDP axis alone (1/tensor of
it), which helps when one layer's gather does not fit, or sequences are long. Batches split as under FSDP.

Natively (``torch.distributed``, gloo on the CPU) the processes form a 2-D ``DeviceMesh``: torch's
``parallelize_module`` splits the projections (``ColwiseParallel``/``RowwiseParallel``) over "tensor", FSDP2
shards the blocks over "fsdp"; a tensor group's processes read the same rows.

On XLA the backend's sharding group marks the 2-D shardings on the model in place (``shard_mesh_2d``); the
compiler adds the collectives, so the step computes what one replica computes and the model keeps its modules
and key names (checkpoints load into the plain model, ``export_pretrained`` works from it). A peft model's
adapters inside a projection split as their projection does.

This module is the whole strategy: its options (``Mesh2D``), its choice, what it does to the model, and its
column of the memory plan; ``STRATEGIES`` names it, and the backend's sharding group places the shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, TypeVar

import torch
from torch import nn

from ... import backend
from ...backend.base import Backend
from ...sharding import FSDP, around_blocks, blocks_of, fsdp_blocks, largest_block
from ..topology import Topology
from .base import Launching, Strategy, shard_bytes
from .fsdp import Fsdp

T = TypeVar("T")

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
        # a LoRA adapter's near half follows its projection, its far half stays whole along the tensor axis:
        # lora_A of a column projection reads the whole input, lora_B of a row projection writes the whole output
        far = "lora_A" in parts if kind == "column" else "lora_B" in parts
        if kind is not None and isinstance(module, nn.Linear) and not far:
            split.update({id(p): kind for p in module.parameters(recurse=False)})
    return split


class FsdpTensorParallel(Fsdp):
    """XLA: one process over a ("fsdp", "tensor") mesh of all devices; the projections split over both axes. Natively
    ``MultiprocessFsdpTensorParallel`` launches the processes that form the mesh."""

    name = "fsdp-tp"
    options_type = Mesh2D
    options: Mesh2D

    def __init__(self, cores: int = 1, options: Mesh2D | None = None, why: str = "") -> None:
        super().__init__(cores, options or Mesh2D(), why)

    @classmethod
    def choose(cls, cores: int, on: Backend, options: Mesh2D | None) -> Strategy:
        tensor = (options or Mesh2D()).tensor
        if cores < 2 * tensor or cores % tensor:
            raise ValueError(f"strategy='{cls.name}' needs a 2-D mesh: cores a multiple of Mesh2D(tensor={tensor}) and at "
                             f"least {2 * tensor}, but given cores={cores}; give a smaller tensor= or strategy='fsdp'")  # fmt: skip
        return cls(cores, options) if on.sharding.over_mesh() else MultiprocessFsdpTensorParallel(cores, options)

    @classmethod
    def for_job(cls, cores: int, on: Backend, options: Mesh2D | None) -> Strategy | None:
        if not on.sharding.over_mesh():
            return FsdpTensorParallelProcess(on.processes.world_size(), options)  # one process of the 2-D job
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


class FsdpTensorParallelProcess(FsdpTensorParallel):
    """Natively: one process of the 2-D job (launched by ``MultiprocessFsdpTensorParallel``, or torchrun's); its
    tensor group's processes load the same rows, each FSDP group its own share of them."""

    in_job = True

    def topology(self) -> Topology:
        processes, tensor = backend.current().processes, self.options.tensor
        # one loader share per FSDP rank; the tensor group's other processes (host > 0) read it too, and are not
        # the job's master (one writes the checkpoints and speaks)
        rank = processes.rank()
        return Topology(replicas=processes.world_size() // tensor, rank=rank // tensor, hosts=tensor, host=rank % tensor)

    def job_size(self) -> int:
        return backend.current().processes.world_size()

    def alone(self) -> Strategy | None:
        return None


class MultiprocessFsdpTensorParallel(Launching, FsdpTensorParallel):
    """Natively: ``run`` launches ``cores`` processes (gloo on the CPU, nccl on GPUs) that form the 2-D mesh."""

    name = "multiprocess-fsdp-tp"

    def replica(self) -> Strategy:
        return FsdpTensorParallelProcess(self.cores, self.options, self.why)

    def infer(self, work: Callable[..., T], args: tuple, *, what: str) -> T:
        raise ValueError(f"{what} with strategy='fsdp-tp' is built on XLA's mesh; natively the tensor groups' processes "
                         f"share rows, which {what} does not split that way yet: use strategy='fsdp' for {what}")  # fmt: skip
