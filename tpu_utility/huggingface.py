"""Hugging Face models on XLA without a host read per forward: attention masks built on the device.

transformers' SDPA mask code asks the host whether a batch has any padding
(``padding_mask.all()`` in ``masking_utils``) so that it may pass no mask at all. On
XLA that read is a host sync in every forward: the host waits for the device instead
of tracing the next step. ``static_masks(model)`` switches the model to the same SDPA
attention under a name registered through transformers' own ``AttentionInterface``
and ``AttentionMaskInterface``, whose mask is always built (an all-ones mask gives
the same attention as none). ``one_cycle_fit``, ``evaluate``, ``predict`` and
``find_lr`` do this on XLA for the run and put the model's own implementation back
after it; in a hand loop it is one line.

Example:
    >>> model = AutoModelForSequenceClassification.from_config(config).to(device)   # doctest: +SKIP
    >>> static_masks(model)   # was: nothing; each forward read padding_mask.all() on the host  # doctest: +SKIP
    'sdpa'
"""

from __future__ import annotations

import re
import sys
import warnings
from functools import partial
from typing import Any

import torch
from torch import nn

from .backend.versions import installed_version

STATIC_SDPA = "tpu_utility_static_sdpa"
# the transformers releases tpu_utility supports and tests: from the floor (the Kaggle lane) to the newest (the
# pinned stack), Colab's TPU runtime (5.15) between them; pyproject's [llm] extra states the same range
TRANSFORMERS_FLOOR = (5, 0)
_told_version: list[str] = []


def _release(version: str) -> tuple[int, ...]:
    """``"5.15.0"`` -> ``(5, 15, 0)``; a pre-release's letters end its number (``"5.0.0rc1"`` -> ``(5, 0, 0)``)."""
    return tuple(int(re.match(r"\d*", part).group() or 0) for part in version.split(".")[:3])


def transformers_too_old(version: str | None) -> str | None:
    """What to tell a user whose transformers (``version``, None: not installed) is below the floor; None if
    it is supported or absent."""
    if version is None or _release(version) >= TRANSFORMERS_FLOOR:
        return None
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    return (f"transformers {version} is installed, but tpu_utility supports transformers {floor} and later (tested: "
            f"{floor}, Colab's 5.15 and the newest); below it LoRA with gradient checkpointing fails and generate "
            f"is untested. Upgrade with: pip install -U "
            f"'transformers>={floor}'")  # fmt: skip


def check_transformers() -> None:
    """Warns once, before any work, when the installed transformers is older than the supported range."""
    version = installed_version("transformers")
    told = transformers_too_old(version)
    if told is not None and version not in _told_version:
        _told_version.append(version)
        warnings.warn(told, stacklevel=3)


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers ``PreTrainedModel`` (found without importing transformers)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, getattr(transformers, "PreTrainedModel", ()))


def base_model(model: Any) -> Any:
    """The model inside a peft wrapper (LoRA, prompt tuning: ``get_base_model()``), else ``model`` itself."""
    return model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model


def is_causal_lm(model: Any) -> bool:
    """Whether a transformers model (or a peft model around one) is a causal LM, whose own loss pairs
    position t's logits with label t + 1 (found without importing transformers)."""
    base = base_model(model)
    if not is_transformers_model(base):
        return False
    if getattr(base, "loss_type", None) == "ForCausalLM":
        return True
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    return type(base).__name__ in names


def use_checkpoint_function(model: nn.Module, function: Any) -> list[tuple[nn.Module, Any]]:
    """Gives every module that transformers checkpoints (``gradient_checkpointing_enable()``) ``function``
    in place of torch's ``checkpoint``, its keyword arguments kept; returns what to give back.

    Example:
        >>> found = use_checkpoint_function(model, backend.current().compute.checkpoint_function())   # doctest: +SKIP
    """
    found = []
    for module in model.modules():
        current = module.__dict__.get("_gradient_checkpointing_func")
        if current is None or getattr(current, "func", current) is function:
            continue
        found.append((module, current))
        keywords = getattr(current, "keywords", None) or {}
        module._gradient_checkpointing_func = partial(function, **keywords) if keywords else function
    return found


def device_checkpointing(model: nn.Module, **kwargs: Any) -> None:
    """``model.gradient_checkpointing_enable(**kwargs)`` that also works in a hand loop on XLA.

    transformers checkpoints each block with torch's ``checkpoint``, which fails on XLA tensors (it looks up
    ``torch.xla``, a device module torch_xla does not register); on XLA the blocks get the backend's checkpoint
    function (torch_xla's) in its place, the keyword arguments kept. Elsewhere it is the model's own call.
    ``one_cycle_fit`` does this itself; the port writes it for ``gradient_checkpointing_enable()`` lines.

    Args:
        model: A transformers model, or a peft model around one.
        **kwargs: ``gradient_checkpointing_enable``'s (``gradient_checkpointing_kwargs={...}``).

    Example:
        >>> device_checkpointing(model)   # was: model.gradient_checkpointing_enable()   # doctest: +SKIP
    """
    from . import backend

    model.gradient_checkpointing_enable(**kwargs)
    chosen = backend.current()
    if chosen.lazy:
        use_checkpoint_function(model, chosen.compute.checkpoint_function())


def give_back_checkpoint_functions(found: list[tuple[nn.Module, Any]]) -> None:
    """Undoes ``use_checkpoint_function``."""
    for module, function in found:
        module._gradient_checkpointing_func = function


class SavedThroughCpu:
    """A model's own ``save_pretrained``, handed the model's state dict copied to the CPU.

    safetensors reads each tensor's storage pointer, which XLA tensors do not have:
    ``save_pretrained`` of a model (or a peft model) on XLA fails with "Attempted to
    access the data pointer on an invalid python storage". transformers' and peft's
    ``save_pretrained`` take ``state_dict=``; this passes the weights copied to the CPU
    in one transfer (as Hugging Face's Trainer does on XLA), unless the caller gave one.
    """

    def __init__(self, model: nn.Module, save: Any) -> None:
        self.model, self.save = model, save

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("state_dict") is None:
            from . import backend

            state = self.model.state_dict()
            kwargs["state_dict"] = dict(zip(state, backend.current().devices.state_to_cpu(list(state.values()))))
        return self.save(*args, **kwargs)


def save_through_cpu(model: nn.Module) -> None:
    """Makes ``model.save_pretrained(...)`` work while the model lives on XLA (``SavedThroughCpu``); once.

    Every module inside that has one gets it too: peft's ``merge_and_unload()`` returns the transformers
    model inside the peft model, and ``merged.save_pretrained(folder)`` is peft's own idiom after a run.
    """
    for module in model.modules():
        save = getattr(module, "save_pretrained", None)
        if callable(save) and not isinstance(save, SavedThroughCpu):
            module.__dict__["save_pretrained"] = SavedThroughCpu(module, save)


def _always_built_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False  # each skip test reads the mask on the host
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _register() -> bool:
    """Registers the static-mask SDPA once; False where transformers has no mask interface (before 4.53)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    if STATIC_SDPA not in AttentionMaskInterface._global_mapping:
        AttentionInterface.register(STATIC_SDPA, ALL_ATTENTION_FUNCTIONS["sdpa"])
        AttentionMaskInterface.register(STATIC_SDPA, _always_built_sdpa_mask)
    return True


def static_masks(model: nn.Module) -> str | None:
    """Switches a transformers model's SDPA attention to masks that are never read on the host.

    The attention computed is the same (the SDPA kernel, an explicit mask where
    transformers would have passed none); only the host's ``padding_mask.all()``
    test goes. Other models, and other attention implementations (eager, flash),
    are left as they are.

    Args:
        model: Any module; only a transformers ``PreTrainedModel`` using "sdpa" changes, or the
            one inside a peft model (LoRA, prompt tuning), which peft calls as it is.

    Returns:
        The implementation replaced ("sdpa"), to give to ``restore_masks``; None when
        nothing changed.

    Example:
        >>> static_masks(model)   # was: nothing (a host sync in every forward on XLA)  # doctest: +SKIP
        'sdpa'
    """
    model = base_model(model)
    if not is_transformers_model(model):
        return None
    found = getattr(model.config, "_attn_implementation", None)
    if found != "sdpa" or not _register():
        return None
    model.set_attn_implementation(STATIC_SDPA)
    return found


def restore_masks(model: nn.Module, implementation: str | None) -> None:
    """Puts back the attention implementation ``static_masks`` replaced (nothing for None)."""
    if implementation is not None:
        base_model(model).set_attn_implementation(implementation)


# ------------------------------------------------------------ packed rows (PackedDataset)
PACKED_HOOK = "_tpu_utility_packed_attention"
_MASKED_IMPLEMENTATIONS = ("sdpa", STATIC_SDPA, "eager")  # take a 4-D mask; flash_attention_* read position_ids themselves


def packed_segments(position_ids: torch.Tensor) -> torch.Tensor:
    """Which sample each token of a packed row belongs to, from its positions, on the device.

    A new sample starts wherever a position is not the previous one + 1 (it restarts), the
    rule transformers' own ``find_packed_sequence_indices`` uses, without its host read.

    Example:
        >>> packed_segments(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist()
        [[0, 0, 0, 1, 1, 2]]
    """
    first = position_ids[:, :1] - 1
    return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)


def packed_masks(position_ids: torch.Tensor, sliding_window: int | None = None) -> dict[str, torch.Tensor]:
    """The block-diagonal causal masks of packed rows, ``(batch, 1, length, length)`` bool (True: attend).

    A token attends to the tokens before it in its own sample only; ``sliding_window`` adds
    the window of a sliding-attention layer (a query sees the ``sliding_window`` keys ending
    at itself, as transformers' ``sliding_window_overlay``). Static shapes, no host read.

    Returns:
        ``{"full_attention": mask}``, and ``"sliding_attention"`` with a window.

    Example:
        >>> packed_masks(torch.tensor([[0, 1, 0]]))["full_attention"][0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    segments = packed_segments(position_ids)
    index = torch.arange(segments.shape[-1], device=segments.device)
    behind = index[:, None] - index[None, :]  # query - key
    full = ((segments[:, :, None] == segments[:, None, :]) & (behind >= 0))[:, None]
    masks = {"full_attention": full}
    if sliding_window is not None:
        masks["sliding_attention"] = full & (behind < sliding_window)
    return masks


def _packed_attention_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Gives a transformers decoder called with ``position_ids`` and no ``attention_mask`` (a packed row) its
    block-diagonal masks, built on the device, so that transformers' own packed detection (a host read) never runs."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or position_ids.dim() != 2:
        return None
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:  # decoding: not packed
        return None
    config = module.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _MASKED_IMPLEMENTATIONS:
        if str(implementation).startswith("flash_attention"):
            return None  # transformers' varlen kernels read the positions themselves
        raise ValueError(f"packed rows (position_ids without attention_mask) need attention_implementation 'sdpa' or "
                         f"'eager' (or a flash_attention kernel), but {type(module).__name__} uses {implementation!r}; "
                         f"model.set_attn_implementation('sdpa')")  # fmt: skip
    layer_types = getattr(config, "layer_types", None) or ()
    sliding = "sliding_attention" in layer_types
    masks = packed_masks(position_ids, getattr(config, "sliding_window", None) if sliding else None)
    if implementation == "eager":  # added to the scores: 0 where seen, the dtype's lowest where not
        dtype = module.dtype
        masks = {k: torch.zeros((), dtype=dtype, device=m.device).masked_fill(~m, torch.finfo(dtype).min)
                 for k, m in masks.items()}  # fmt: skip
    kwargs["attention_mask"] = masks if sliding else masks["full_attention"]
    return args, kwargs


def packed_attention(model: nn.Module) -> Any:
    """Makes a transformers model (or the model inside a peft wrapper) attend within each sample of packed rows.

    A packed row (``PackedDataset``) holds several samples and ``position_ids`` that restart
    at each; without a mask its attention would cross from one sample into the one before.
    After this, a forward given ``position_ids`` and no ``attention_mask`` gets the rows'
    block-diagonal causal masks (and sliding-window ones for Gemma 2/3's and Qwen2's sliding
    layers), built on the device from the positions through transformers' own 4-D mask
    argument: static shapes, no host read (transformers' own packed detection reads the host,
    and is skipped when the model keeps a cache). Other forwards are left as they are.
    ``one_cycle_fit``, ``evaluate`` and ``predict`` do this for the run; in a hand loop it is
    one line.

    Args:
        model: Any module; only a transformers causal LM (or a peft model around one) changes.

    Returns:
        A handle to give to ``restore_packed_attention`` (``.remove()``), or None when nothing changed.

    Example:
        >>> handle = packed_attention(model)   # was: nothing, and packed samples attended to each other  # doctest: +SKIP
        >>> loss = model(**packed_rows[:8]).loss                                                         # doctest: +SKIP
    """
    base = base_model(model)
    if not is_causal_lm(base):  # an encoder's attention is not causal: packed rows are a causal LM's
        return None
    decoder = getattr(base, "base_model", base)  # the module whose forward builds the masks (LlamaModel, GPT2Model)
    if getattr(decoder, PACKED_HOOK, None) is not None:
        return None
    handle = decoder.register_forward_pre_hook(_packed_attention_hook, with_kwargs=True)
    setattr(decoder, PACKED_HOOK, handle)
    return _PackedHandle(decoder, handle)


class _PackedHandle:
    def __init__(self, decoder: nn.Module, handle: Any) -> None:
        self.decoder, self.handle = decoder, handle

    def remove(self) -> None:
        self.handle.remove()
        self.decoder.__dict__.pop(PACKED_HOOK, None)


def restore_packed_attention(handle: Any) -> None:
    """Undoes ``packed_attention`` (nothing for None)."""
    if handle is not None:
        handle.remove()
