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

import inspect
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
PACKED_PARTS = "packed_parts"  # PackedDataset's key of a parted row's layout (data/packing.py: the same name)
SEGMENT_ATTENTION = "tpu_utility_segment_attention"
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

    A token at position ``p`` attends to itself and the ``p`` tokens before it: the tokens of its
    own sample up to it, since a packed row's positions restart at 0 at each sample (``PackedDataset``
    rows do). A row with positions ``0..T-1`` gets the plain causal mask. ``sliding_window`` adds the
    window of a sliding-attention layer (a query sees the ``sliding_window`` keys ending at itself,
    as transformers' ``sliding_window_overlay``). Static shapes, no host read; read from the
    positions alone, not from ``packed_segments``: XLA fuses the mask into each attention that
    reads it, and a running sum fused there is recomputed for every score (on XLA:CPU a LoRA
    Llama's packed step ran 2.3x slower).

    Returns:
        ``{"full_attention": mask}``, and ``"sliding_attention"`` with a window.

    Example:
        >>> packed_masks(torch.tensor([[0, 1, 0]]))["full_attention"][0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    """
    index = torch.arange(position_ids.shape[-1], device=position_ids.device)
    behind = index[:, None] - index[None, :]  # query - key
    full = ((behind >= 0) & (behind <= position_ids[:, :, None]))[:, None]
    masks = {"full_attention": full}
    if sliding_window is not None:
        masks["sliding_attention"] = full & (behind < sliding_window)
    return masks


def _packed_attention_hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Gives a transformers decoder called with ``position_ids`` and no ``attention_mask`` (a packed row) its
    block-diagonal masks, built on the device, so that transformers' own packed detection (a host read) never runs;
    under the segment-id kernel (``SEGMENT_ATTENTION``) the rows' segment ids in their place."""
    position_ids = kwargs.get("position_ids")
    if position_ids is None or kwargs.get("attention_mask") is not None or position_ids.dim() != 2:
        return None
    if getattr(module.__dict__.get(PACKED_HOOK), "parts", None) is not None:  # parted rows: each part's own, later
        return None
    if kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None:  # decoding: not packed
        return None
    config = module.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation == SEGMENT_ATTENTION:  # a 4-D "mask" reaches every layer as it is: (batch, 1, 1, length) ids
        kwargs["attention_mask"] = packed_segments(position_ids)[:, None, None, :]
        return args, kwargs
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


def reference_segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor,
                                scale: float) -> torch.Tensor:  # fmt: skip
    """Causal attention within segments in plain torch: what a backend's ``segment_attention`` kernel computes.

    Example:
        >>> q = k = v = torch.ones(1, 1, 3, 2)
        >>> reference_segment_attention(q, k, v, torch.tensor([[0, 0, 1]]), 1.0).shape
        torch.Size([1, 1, 3, 2])
    """
    index = torch.arange(segment_ids.shape[-1], device=segment_ids.device)
    mask = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (index[:, None] >= index[None, :])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale)


class _SegmentAttention:
    """transformers' attention function (``AttentionInterface``) of ``SEGMENT_ATTENTION``: a packed row's segment ids
    (the 4-D integer "mask" the hook gives) go to ``kernel``; any other forward runs transformers' SDPA as it is."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel

    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:  # fmt: skip
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if attention_mask is None or attention_mask.dtype.is_floating_point or attention_mask.dtype == torch.bool:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        groups = query.shape[1] // key.shape[1]  # grouped-query attention: each key head serves `groups` query heads
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        scaling = kwargs.get("scaling")
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = self.kernel(query, key, value, attention_mask[:, 0, 0], scale)
        return out.transpose(1, 2).contiguous(), None


def segment_kernel_fits(config: Any) -> str | None:
    """Why a model's attention cannot run as a plain segment-id kernel (sliding windows, soft-capped scores,
    attention dropout, an implementation other than SDPA), or None when it can."""
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in ("sdpa", STATIC_SDPA):
        return f"attention implementation {implementation!r}"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()) or getattr(config, "use_sliding_window", False):
        return "sliding-window layers"
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention scores"
    if getattr(config, "attention_dropout", 0.0) or getattr(config, "attn_pdrop", 0.0):
        return "attention dropout"
    return None


def packed_attention(model: nn.Module, kernel: Any = None) -> Any:
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

    Parted rows (``PackedDataset(..., chunks=...)``) carry ``packed_parts``: the model's call
    takes it off (a pre-hook on ``model``) and the decoder's forward runs each group of equal
    parts as a batch of its own, ``(rows x parts, part length)``, with that group's masks, then
    puts the hidden states back in row order: attention over each part, not the whole row; the
    layout is in the shapes, so one graph and no host read.

    Where the backend has a fused kernel for attention within segments (``segment_attention``:
    torch_xla's flash attention with segment ids, on one TPU) and the model's attention is plain
    (SDPA, no sliding window, soft-cap or attention dropout), packed rows run it instead of the
    dense mask: their attention then costs the samples' own lengths, not the whole row's. The
    handle's ``attention`` says which runs.

    Args:
        model: Any module; only a transformers causal LM (or a peft model around one) changes.
        kernel: A segment-attention function to use (``reference_segment_attention``, or a backend's);
            None: the backend's, where it has one and the model fits.

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
    found = None
    if kernel is None and segment_kernel_fits(base.config) is None:
        from . import backend

        parameter = next(base.parameters(), None)
        kernel = None if parameter is None else backend.current().compute.segment_attention(parameter.device)
    if kernel is not None:
        why_not = segment_kernel_fits(base.config)
        if why_not is not None:
            raise ValueError(f"a segment-id attention kernel runs plain causal attention, but the model has {why_not}")
        from transformers import AttentionInterface

        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(SEGMENT_ATTENTION, _SegmentAttention(kernel))
        AttentionMaskInterface.register(SEGMENT_ATTENTION, _always_built_sdpa_mask)  # other forwards: static SDPA masks
        found = base.config._attn_implementation
        base.set_attn_implementation(SEGMENT_ATTENTION)
    return _PackedHandle(model, decoder, base, found, kernel)


class _PackedHandle:
    """What ``packed_attention`` changed (a pre-hook on the decoder, which gives packed rows their masks; a pre-hook
    on the model, which takes a parted batch's ``packed_parts``; the decoder's forward, which runs parted rows part
    group by part group); ``attention`` names the attention packed rows run."""

    def __init__(self, model: nn.Module, decoder: nn.Module, base: nn.Module, found: str | None, kernel: Any) -> None:
        self.decoder, self.model, self.found = decoder, base, found
        self.parts: list[torch.Tensor] | None = None  # a parted batch's layout, from the model's call to the decoder's
        self.hooks = [decoder.register_forward_pre_hook(_packed_attention_hook, with_kwargs=True),
                      model.register_forward_pre_hook(self._take_parts, with_kwargs=True)]  # fmt: skip
        self.found_forward = decoder.__dict__.get("forward")  # an instance's own forward (accelerate's), else None
        decoder.forward = partial(_parted_forward, decoder, decoder.forward, self)
        setattr(decoder, PACKED_HOOK, self)
        if found is not None:
            self.attention = f"packed rows attend through the segment-id kernel {getattr(kernel, '__name__', kernel)}"
        else:
            implementation = getattr(base.config, "_attn_implementation", None)
            implementation = "sdpa" if implementation == STATIC_SDPA else implementation
            self.attention = f"packed rows attend through {implementation} with block-diagonal masks"

    def _take_parts(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.parts = kwargs.pop(PACKED_PARTS, None)  # the model never sees it: its decoder's forward reads it here
        return args, kwargs

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        self.decoder.__dict__.pop(PACKED_HOOK, None)
        self.decoder.__dict__.pop("forward", None)
        if self.found_forward is not None:
            self.decoder.forward = self.found_forward
        self.parts = None
        if self.found is not None:
            self.model.set_attn_implementation(self.found)


def _parted_forward(decoder: nn.Module, forward: Any, handle: _PackedHandle, *args: Any, **kwargs: Any) -> Any:
    """The decoder's forward on a batch of parted rows (``PackedDataset(..., chunks=...)``): each group of equal
    parts runs as a batch of its own, ``(rows x parts, part length)``, with its packed masks; the hidden states are
    put back in row order. Attention then runs within each part, over the part's length; everything else in a
    decoder is per token, so this is the row's forward, exactly. Any other call runs ``forward`` as it is."""
    parts, handle.parts = handle.parts, None
    if parts is None:
        return forward(*args, **kwargs)
    signature = inspect.signature(forward)
    bound = signature.bind(*args, **kwargs).arguments
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            bound.update(bound.pop(name, {}))
    position_ids = bound.get("position_ids")
    if position_ids is None or bound.get("attention_mask") is not None or bound.get("past_key_values") is not None:
        raise ValueError(f"a batch of parted rows ({PACKED_PARTS}) runs with its position_ids and without an "
                         f"attention_mask or a cache, as PackedDataset(..., chunks=...) gives it")  # fmt: skip
    rows, length = position_ids.shape
    if sum(group.shape[-2] * group.shape[-1] for group in parts) != length:
        raise ValueError(f"{PACKED_PARTS} of shapes {[tuple(g.shape) for g in parts]} do not make rows of {length} "
                         f"tokens")  # fmt: skip
    pieces, outputs, at = [], [], 0
    for group in parts:
        count, size = group.shape[-2:]
        call = {}
        for name, value in bound.items():  # the tokens (ids, embeddings) of this group's parts, one part a row
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (rows, length):
                value = value[:, at : at + count * size].reshape(rows * count, size, *value.shape[2:])
            call[name] = value
        call["position_ids"] = group.reshape(rows * count, size)
        if "cache_position" in call:  # the decoder's own, from 0 to the part's length
            call["cache_position"] = None
        if "use_cache" in signature.parameters:
            call["use_cache"] = False
        masked = _packed_attention_hook(decoder, (), call)
        output = forward(**(masked[1] if masked is not None else call))
        outputs.append(output)
        pieces.append(output[0].reshape(rows, count * size, -1))
        at += count * size
    output = outputs[0]
    hidden = torch.cat(pieces, 1)
    if isinstance(output, tuple):
        return (hidden,) + (None,) * (len(output) - 1)
    output["last_hidden_state"] = hidden
    if getattr(output, "hidden_states", None) is not None:
        output["hidden_states"] = tuple(torch.cat([o.hidden_states[j].reshape(rows, -1, o.hidden_states[j].shape[-1])
                                                   for o in outputs], 1) for j in range(len(output.hidden_states)))  # fmt: skip
    if getattr(output, "attentions", None) is not None:  # each part's own (parts, heads, size, size): no row's
        output["attentions"] = None
    return output


def restore_packed_attention(handle: Any) -> None:
    """Undoes ``packed_attention`` (nothing for None)."""
    if handle is not None:
        handle.remove()
