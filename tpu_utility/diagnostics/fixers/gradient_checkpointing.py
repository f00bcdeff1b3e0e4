"""``model.gradient_checkpointing_enable(...)`` in a hand loop: ``device_checkpointing(model, ...)``.

transformers checkpoints each block with torch's ``checkpoint``, which fails on XLA tensors (``module 'torch'
has no attribute 'xla'``); ``device_checkpointing`` makes the same call and gives the blocks torch_xla's
checkpoint on XLA. QLoRA recipes call it before ``prepare_model_for_kbit_training``; ``one_cycle_fit`` makes the
swap itself, and a model given to it after ``device_checkpointing`` is left as it is.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import libcst


@fixes("Call", order=97)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``X.gradient_checkpointing_enable(args)`` -> ``device_checkpointing(X, args)``."""
    cst = libcst()
    func = updated.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "gradient_checkpointing_enable"):
        return None
    args = [cst.Arg(func.value, comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))) if updated.args
            else cst.Arg(func.value), *updated.args]  # fmt: skip
    porter.need("device_checkpointing")
    new = updated.with_changes(func=cst.Name("device_checkpointing"), args=args)
    porter.change("gradient_checkpointing", original, new)
    return new
