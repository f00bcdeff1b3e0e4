"""shard_model(): the line that shards a hand loop's model over all cores (FSDP), and ``FSDP``, the options
that both it and ``one_cycle_fit(strategy=FSDP(...))`` take.

    model = shard_model(model)                 # was: model = FSDP(model, auto_wrap_policy=...) on CUDA
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)   # after: on the sharded parameters

Each parameter is sharded over all cores on its largest dimension; the model's blocks (a transformers
model's ``_no_split_modules``, else the class repeated most in its largest ``ModuleList``/``Sequential``) are
gathered one at a time and, by default, recompute their activations in the backward. The model keeps its
own modules and key names (no wrapper, no ``_orig_module.`` prefix), so its ``state_dict`` loads anywhere.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from . import backend
from .device import get_device, move_model

# parameters that shard_model replaced by moving the model to the device: an optimizer built on them
# before the call would step tensors no forward reads (its model trains nothing)
_REPLACED: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> the replaced tensor


@dataclass(frozen=True)
class FSDP:
    """Options of the sharded strategy: parameters, gradients and optimizer state split over all cores.

    ``strategy="fsdp"`` is ``strategy=FSDP()``. On XLA it is torch_xla's FSDPv2 sharding on the SPMD mesh.

    Args:
        wrap: The block classes gathered (and checkpointed) one at a time: a class, its name, or several.
            None: a transformers model's ``_no_split_modules``, else the class repeated most in the model's
            largest ``ModuleList``/``Sequential``.
        checkpoint: Recompute each block's activations in the backward (gradient checkpointing with
            torch_xla's checkpoint on XLA): the activations of one block kept instead of all, for about a
            third more compute. On by default when sharding.
        shard_output: Shard the model's output (a tensor, a ``ModelOutput``'s logits, a tuple's first) on
            its batch dimension, so the compiler never holds the whole batch's logits on one chip. False
            for a model whose output has no batch dimension.

    Raises:
        TypeError: ``wrap`` is not a class, a name or a sequence of them; a flag is not a bool.

    Example:
        >>> # was: FSDP(model, auto_wrap_policy=partial(transformer_auto_wrap_policy, ...)) on CUDA
        >>> FSDP(wrap="LlamaDecoderLayer", checkpoint=False)
        FSDP(wrap=('LlamaDecoderLayer',), checkpoint=False, shard_output=True)
        >>> one_cycle_fit(model, train_ds, epochs=1, max_lr=2e-5, cores="all", strategy=FSDP())  # doctest: +SKIP
    """

    wrap: Any = None
    checkpoint: bool = True
    shard_output: bool = True

    def __post_init__(self) -> None:
        wrap = self.wrap
        if wrap is not None:
            listed = (wrap,) if isinstance(wrap, (str, type)) else wrap
            ok = isinstance(listed, (list, tuple)) and listed and all(isinstance(w, (str, type)) for w in listed)
            if not ok:
                raise TypeError(f"FSDP(wrap=...) takes a block class, its name, or a list of them, but given {wrap!r}")
            object.__setattr__(self, "wrap", tuple(listed))
        for name in ("checkpoint", "shard_output"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"FSDP({name}=...) must be True or False, but given {getattr(self, name)!r}")


# ------------------------------------------------------------------ blocks
def _no_split_names(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():  # a peft model's base, a model inside a wrapper: each may name its own
        names.update(getattr(module, "_no_split_modules", None) or ())
    return names


def repeated_class(model: nn.Module) -> type | None:
    """The class repeated most in the model's largest ``ModuleList``/``Sequential`` (by children), or None.

    Example:
        >>> repeated_class(nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])))
        <class 'torch.nn.modules.linear.Linear'>
    """
    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1]
    if not lists:
        return None
    largest = max(lists, key=len)
    cls, count = Counter(type(child) for child in largest).most_common(1)[0]
    return cls if count > 1 else None


def block_classes(model: nn.Module, wrap: Any = None) -> tuple[type, ...]:
    """The classes of ``model``'s blocks: ``wrap`` (names or classes) if given, else the model's own
    ``_no_split_modules``, else ``repeated_class``.

    Raises:
        ValueError: a ``wrap`` name that no module of the model has (the candidates listed), or a model
            with no repeated blocks to find (say ``wrap=``).

    Example:
        >>> from transformers import LlamaConfig, LlamaForCausalLM                    # doctest: +SKIP
        >>> block_classes(LlamaForCausalLM(LlamaConfig(num_hidden_layers=2)))         # doctest: +SKIP
        (<class '...LlamaDecoderLayer'>,)
    """
    present = {type(m).__name__: type(m) for m in model.modules()}
    if wrap is not None:
        wanted = [wrap] if isinstance(wrap, (str, type)) else list(wrap)
        found, missing = [], []
        for w in wanted:
            name = w if isinstance(w, str) else w.__name__
            (found.append(present[name]) if name in present else missing.append(name))
        if missing:
            candidates = sorted(n for n, c in present.items() if _repeats(model, c))
            raise ValueError(f"wrap={missing} names no module of {type(model).__name__}; its repeated classes: "
                             f"{candidates}")  # fmt: skip
        return tuple(found)
    named = [present[n] for n in sorted(_no_split_names(model)) if n in present]
    if named:
        return tuple(named)
    cls = repeated_class(model)
    if cls is None:
        raise ValueError(
            f"{type(model).__name__} has no repeated blocks to shard one at a time (no _no_split_modules, no "
            f"ModuleList/Sequential of one class); name them with strategy=FSDP(wrap='MyBlock')"
        )
    return (cls,)


def _repeats(model: nn.Module, cls: type) -> bool:
    return sum(1 for m in model.modules() if type(m) is cls) > 1


# ------------------------------------------------------------------ output
def check_batch(rows: int, cores: int) -> None:
    """A batch of ``rows`` splits evenly over ``cores`` (each core its rows of every block's activations).

    Raises:
        ValueError: naming the rows, the cores and the batch sizes that divide.

    Example:
        >>> check_batch(8, 4)
    """
    if rows % cores:
        raise ValueError(f"strategy='fsdp' splits every batch over the {cores} cores, but a batch has {rows} rows; "
                         f"give a global batch that is a multiple of {cores} (drop_last=True for a short last one)")  # fmt: skip


def output_scores(output: Any, rows: int, model: str) -> torch.Tensor:
    """The tensor of a model's output to shard on its batch dimension: the tensor itself, a ``ModelOutput``'s
    (or dict's) logits, a tuple's first.

    Raises:
        ValueError: no such tensor with ``rows`` rows first (what to pass instead is named).

    Example:
        >>> output_scores((torch.zeros(4, 3), torch.zeros(2)), 4, "Net").shape
        torch.Size([4, 3])
    """
    scores = output
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping):
        scores = output.get("logits")
    elif isinstance(output, (tuple, list)) and output:
        scores = output[0]
    if isinstance(scores, torch.Tensor) and scores.dim() > 0 and scores.shape[0] == rows:
        return scores
    what = f"Tensor{tuple(scores.shape)}" if isinstance(scores, torch.Tensor) else type(scores).__name__
    raise ValueError(
        f"strategy='fsdp' shards the model's output on its batch dimension, but {model}'s output (its scores: {what}) "
        f"has no tensor with the batch's {rows} rows first. Return the scores batch-first (a tensor, a dict's "
        f"'logits', or a tuple's first), or pass strategy=FSDP(shard_output=False) to leave the output as it is"
    )


def _rows(args: tuple, kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return value.shape[0]
    return None


def _shard_output(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
    rows = _rows(args, kwargs)
    if rows is None or not backend.is_spmd():  # natively each process holds its own rows: nothing to split
        return
    cores = backend.global_device_count()
    check_batch(rows, cores)
    backend.shard_batch([output_scores(output, rows, type(module).__name__)])


def _full_mask(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Without a cache, transformers looks for packed sequences in the position ids of a batch given no attention
    mask, which reads the device (a host sync every forward on XLA). A batch given neither gets the all-ones mask:
    the same attention (its positions are 0..T-1, never packed), and no read."""
    if kwargs.get("attention_mask") is not None or kwargs.get("position_ids") is not None:
        return None
    tokens = kwargs.get("input_ids", args[0] if args and isinstance(args[0], torch.Tensor) else None)
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        return None
    return args, {**kwargs, "attention_mask": torch.ones_like(tokens)}


# --------------------------------------------------------------- applying
def fsdp_blocks(model: nn.Module, options: FSDP) -> list[nn.Module]:
    """The modules FSDP gathers one at a time (``block_classes`` of ``options.wrap``), in the model's order."""
    classes = block_classes(model, options.wrap)
    return [m for m in model.modules() if isinstance(m, classes)]


def around_blocks(model: nn.Module, blocks: list[nn.Module], options: FSDP) -> list[Callable[[], None]]:
    """What FSDP does besides sharding the parameters (the backend's sharding group does that): each block
    checkpointed, the output sharded on its batch dimension, a KV cache switched off; returns the undos, in order."""
    chosen = backend.current()
    undo: list[Callable[[], None]] = []
    if options.checkpoint:  # a block already checkpointed by transformers (gradient_checkpointing_enable) once
        undo += [chosen.compute.checkpoint_module(b) for b in blocks if not getattr(b, "gradient_checkpointing", False)]
    if options.shard_output:
        undo.append(model.register_forward_hook(_shard_output, with_kwargs=True).remove)
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):  # a checkpointed block would append its recomputed keys to a KV cache
        config.use_cache = False
        undo.append(lambda: setattr(config, "use_cache", True))
        undo.append(model.register_forward_pre_hook(_full_mask, with_kwargs=True).remove)
    return undo


def largest_block(model: nn.Module, wrap: Any = None) -> list[nn.Parameter]:
    """The parameters of the largest module of the block classes FSDP wraps (``block_classes`` of ``wrap``), or []
    where the model has none to find.

    Example:
        >>> [tuple(p.shape) for p in largest_block(nn.Sequential(nn.Linear(2, 3), nn.Linear(2, 2)))]
        [(3, 2), (3,)]
    """
    try:
        classes = block_classes(model, wrap)
    except ValueError:
        return []
    blocks = [m for m in model.modules() if isinstance(m, classes)]
    return max((list(m.parameters()) for m in blocks), key=lambda ps: sum(p.numel() for p in ps), default=[])


def blocks_of(model: nn.Module, options: FSDP) -> str:
    """The blocks ``options`` pick, as the summary line says them: "2 LlamaDecoderLayer blocks"."""
    classes = block_classes(model, options.wrap)
    count = sum(1 for m in model.modules() if isinstance(m, classes))
    return f"{count} {'/'.join(c.__name__ for c in classes)} blocks"


def refuse_replaced(params: Sequence[torch.Tensor]) -> None:
    """Refuses an optimizer holding parameters that ``shard_model`` replaced (built before the call).

    Raises:
        RuntimeError: naming the count and the order that works.

    Example:
        >>> refuse_replaced(list(nn.Linear(2, 2).parameters()))
    """
    stale = sum(1 for p in params if _REPLACED.get(id(p)) is p)
    if stale:
        raise RuntimeError(
            f"the optimizer holds {stale} of its {len(params)} parameters as they were before shard_model(model), "
            f"which moved and sharded the model's parameters: it would step tensors no forward reads, and the model "
            f"would train nothing. Build the optimizer after the call:\n"
            f"    model = shard_model(model)\n"
            f"    optimizer = torch.optim.AdamW(model.parameters(), lr=...)"
        )


def shard_model(model: nn.Module, options: FSDP | None = None, *, optimizer: Any = None) -> nn.Module:
    """Shards ``model``'s parameters over all cores (FSDP), on the device, for a hand loop; call it before the
    optimizer is built, then train as before with ``device_loader`` and ``step_optimizer``.

    On XLA this switches the process to SPMD (one process, every core; call it before anything else touches
    the XLA device), moves the model to the device if it is not there, and shards each parameter on its largest
    dimension (torch_xla's FSDPv2 sharding); gradients and the optimizer's state follow their parameters. The
    model keeps its own modules and key names. Natively (CUDA with nccl, the CPU with gloo) call it in each
    process of a job (``torchrun``, ``launch``): torch's FSDP2 ``fully_shard`` over all the job's processes, each
    block then the root; each process trains on its own batches and the gradients are reduce-scattered to their
    mean, so ``step_optimizer`` (or ``optimizer.step()``) steps one model.

    Args:
        model: The model, on the CPU or already on the device; sharded in place.
        options: ``FSDP(wrap=..., checkpoint=..., shard_output=...)``; default ``FSDP()``.
        optimizer: An optimizer already built, to check now: it must hold the sharded parameters.

    Returns:
        The same model, for ``model = shard_model(model)``.

    Raises:
        RuntimeError: ``optimizer`` holds the parameters as they were before the call; the XLA runtime already
            started without SPMD.
        ValueError: a ``wrap`` class the model does not have; a backend with no sharded strategy.

    Example:
        >>> # was: model = FSDP(model.cuda(), auto_wrap_policy=...) (torch.distributed.fsdp on CUDA)
        >>> model = shard_model(model)                               # doctest: +SKIP
        >>> optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model takes an nn.Module, but given {model!r}")
    options = FSDP() if options is None else options
    if not isinstance(options, FSDP):
        raise TypeError(f"options must be FSDP(...), but given {options!r}")
    if backend.current().lazy:  # XLA: one process over every core (natively, one process per device already)
        backend.use_spmd()
    else:  # natively: the job's processes hold the shards (a torchrun job joined here, as one_cycle_fit joins it)
        backend.join_job()
    before = list(model.parameters())
    device = get_device()
    if any(p.device != device for p in before):
        move_model(model, device)
    blocks = fsdp_blocks(model, options)
    backend.current().sharding.shard_parameters(model, blocks)
    around_blocks(model, blocks, options)
    kept = {id(p) for p in model.parameters()}  # natively FSDP2 replaces each parameter by its sharded one
    _REPLACED.update({id(p): p for p in before if id(p) not in kept})
    if optimizer is not None:
        refuse_replaced([p for group in optimizer.param_groups for p in group["params"]])
    return model


__all__ = ["FSDP", "shard_model", "block_classes", "repeated_class", "check_batch",
           "output_scores", "fsdp_blocks", "around_blocks", "refuse_replaced", "blocks_of", "largest_block"]  # fmt: skip
