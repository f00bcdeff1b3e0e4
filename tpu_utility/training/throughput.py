"""Tokens per second and MFU: what share of the chip a run turns into training on the data.

Token data that knows its real (non-pad) tokens gets ``tokens_per_s`` on the epoch line, in
``History`` and in the CSV: the items trained per second (``samples_per_s``, compile time left
out) times the real tokens per item, the mean over the data (``PackedDataset``: ``real_tokens``
over ``len()`` rows; a ``datasets.Dataset`` or a list of dict samples, padded by a collate or
``BucketCollate`` or padded already: each sample's ``attention_mask`` ones, else its
``input_ids``' length, by ``data.packing.real_token_lengths``). Where the chip's bf16 peak is known (``backend.hardware.PEAK_BF16_FLOPS``: TPU v4, v5e,
v5p, v6e; H100, H200, A100, L4, T4; ``TPU_UTILITY_DEVICE_NAME`` names a chip the run cannot
see) it also gets ``mfu``, model FLOPs utilization::

    mfu = tokens_per_s x training_flops_per_token(model, row) / (peak x devices)

The FLOPs of one token (``training_flops_per_token``) count what a step computes per token,
``N`` the parameters that multiply (every weight but the embedding lookups; a tied LM head
counted once as the matrix it is), ``T`` the row length (unpacked samples: each token's own
sample's length, their mean weighted by tokens; the padding's attention is not counted), ``L`` layers, ``A`` the attention
width (heads x head size): forward ``2N``, the backward's activation gradients ``2N``, the
weight gradients ``2`` per trainable parameter, and attention's scores and mix ``4 L A T``
forward and twice that backward. Full training: ``6N + 12 L A T`` (the PaLM count); LoRA:
``4N + 2 N_trainable + 12 L A T``, since the frozen weights get no gradient. Padding is not
work done: the tokens are the data's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from ..backend.hardware import peak_flops
from ..data.packing import real_token_lengths
from ..huggingface import base_model


def _unique(params: Any) -> dict[int, Any]:
    return {id(p): p for p in params}


def training_flops_per_token(model: nn.Module, sequence_length: int) -> float:
    """FLOPs one token of a training step computes (module docstring: the count).

    Args:
        model: The model as trained (a peft model: its frozen weights get no weight gradient).
        sequence_length: The length of the rows attention runs over (a packed row's).

    Example:
        >>> model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
        >>> training_flops_per_token(model, 8)   # 6 x 40 multiplying weights, no attention
        240.0
    """
    params = _unique(model.parameters())
    lookups = _unique(p for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters())
    head = getattr(base_model(model), "get_output_embeddings", lambda: None)()
    tied = head is not None and id(head.weight) in lookups
    multiply = sum(p.numel() for k, p in params.items() if k not in lookups) + (head.weight.numel() if tied else 0)
    trainable = sum(p.numel() for k, p in params.items() if p.requires_grad and k not in lookups)
    trainable += head.weight.numel() if tied and head.weight.requires_grad else 0  # its matmul's weight gradient
    config = getattr(base_model(model), "config", None)
    attention = 0.0
    if config is not None:
        layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0) or 0
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 0) or 0
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0
        head_dim = getattr(config, "head_dim", None) or (hidden // heads if heads else 0)
        attention = 12.0 * layers * heads * head_dim * sequence_length
    return 4.0 * multiply + 2.0 * trainable + attention


@dataclass
class Throughput:
    """What turns an epoch's items per second into real tokens per second and MFU; None where unknown."""

    tokens_per_item: float | None = None
    flops_per_token: float | None = None
    peak: float | None = None  # FLOP/s of all the devices training
    chip: str | None = None

    @classmethod
    def of(cls, dataset: Any, model: nn.Module, chip: str | None, devices: int) -> Throughput:
        """The figures for ``dataset`` (token data: packed rows with ``real_tokens`` and ``length``, or samples whose
        real tokens ``real_token_lengths`` reads) trained by ``model`` on ``devices`` chips called ``chip``."""
        real, length = getattr(dataset, "real_tokens", None), getattr(dataset, "length", None)
        if isinstance(real, int) and isinstance(length, int) and len(dataset):  # packed rows
            per_item = real / len(dataset)
            length = getattr(dataset, "attention_length", length)  # rows of several lengths: their mean, by tokens
        else:  # samples of their own lengths, padded by the collate (or already)
            lengths = real_token_lengths(dataset)
            if not lengths or not sum(lengths):
                return cls()
            per_item = sum(lengths) / len(lengths)
            length = round(sum(n * n for n in lengths) / sum(lengths))  # a token's sample's length, by tokens
        peak = peak_flops(chip)
        return cls(per_item, training_flops_per_token(model, length), peak * devices if peak else None, chip)

    def figures(self, items_per_s: float) -> tuple[float | None, float | None]:
        """``(tokens_per_s, mfu)`` at ``items_per_s``.

        Example:
            >>> Throughput(tokens_per_item=1000.0, flops_per_token=6e9, peak=197e12).figures(10.0)
            (10000.0, 0.30456852791878175)
        """
        if self.tokens_per_item is None:
            return None, None
        tokens = items_per_s * self.tokens_per_item
        mfu = tokens * self.flops_per_token / self.peak if self.peak and self.flops_per_token else None
        return tokens, mfu

    def describe(self) -> str:
        """For the summary line: which peak MFU is taken against, or why there is none."""
        if self.tokens_per_item is None:
            return ""
        if self.peak is None:
            return f"tokens/s of real tokens; no MFU: no bf16 peak known for {self.chip or 'this device'}"
        return f"tokens/s of real tokens, MFU against {self.chip}'s bf16 peak ({self.flops_per_token:,.0f} FLOPs/token)"
