"""Which modules are a model's blocks: the units a sharded strategy wraps (and checkpoints) one at a time.

A transformers model names them (``_no_split_modules``: ``LlamaDecoderLayer``); any other model's are
the class repeated most in its largest ``ModuleList``/``Sequential``. No configuration for common models.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from torch import nn


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


def block_classes(model: nn.Module, wrap: str | type | Sequence[str | type] | None = None) -> tuple[type, ...]:
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
