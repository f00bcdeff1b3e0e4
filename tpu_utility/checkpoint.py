"""Checkpoints that load anywhere: CPU tensors only, written atomically.

A checkpoint is a plain dict of CPU tensors, numbers, strings, lists and dicts,
so ``torch.load(path, weights_only=True)`` reads it on a machine without
torch_xla. It is written to a temporary file and renamed over the old one, so a
crash while writing leaves the previous checkpoint whole.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
from torch.utils import _pytree as pytree

from . import xla

CHECKPOINT_NAME = "last.pt"


def to_cpu(tree: Any) -> Any:
    """The same structure with every tensor copied to the host (one transfer on XLA)."""
    leaves, spec = pytree.tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    moved = xla.to_cpu([leaves[i] for i in positions])
    for i, tensor in zip(positions, moved):
        leaves[i] = tensor
    return pytree.tree_unflatten(leaves, spec)


def save_atomic(obj: Any, path: str) -> None:
    """torch.save to a temporary file in the same folder, then rename over ``path``."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".pt", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str) -> dict[str, Any]:
    """Loads a tpu_utility checkpoint onto the CPU, without unpickling code.

    Example:
        >>> # was: state = torch.load("ckpt.pt")   (fails off-TPU if it holds XLA tensors)
        >>> state = load_checkpoint("checkpoints/last.pt")     # doctest: +SKIP
        >>> model.load_state_dict(state["model"])              # doctest: +SKIP
    """
    if os.path.isdir(path):
        path = os.path.join(path, CHECKPOINT_NAME)
    return torch.load(path, map_location="cpu", weights_only=True)
