"""A causal LM's loss computed over chunks of tokens, so the ``tokens x vocab`` fp32 logits are never whole.

A 256k vocabulary (Gemma) makes the logits, upcast to fp32, and their gradient the largest tensors of a LoRA
step: 2 x 1024 tokens x 256,000 x 4 bytes x 2 = 4.2 GB. ``ChunkedLoss`` takes the decoder's final hidden states
(the LM head's input) and runs the head and the cross-entropy one chunk of tokens at a time, each chunk
recomputed in the backward (activation checkpointing), so a step holds one chunk's logits.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .. import backend
from ..data.loaders import IGNORE_INDEX
from ..huggingface import base_model, is_causal_lm
from .events import Callback, TrainerLoop
from .steps import LossStep, call_model, split_batch, without_labels


def chunked_causal_lm_loss(hidden: torch.Tensor, labels: torch.Tensor, head: nn.Module, chunk_tokens: int,
                           softcap: float | None = None, recompute: bool = True) -> torch.Tensor:  # fmt: skip
    """A causal LM's own loss from its final hidden states: the mean cross-entropy over the labels that are not
    -100, position t predicting label t + 1, the head (and Gemma 2's final logit soft-cap) applied per chunk.

    Args:
        hidden: ``(batch, seq, hidden)``: the LM head's input.
        labels: ``(batch, seq)`` token ids, -100 where no loss counts (shifted here, as the model shifts them).
        head: The LM head (``get_output_embeddings()``), called on ``(chunk_tokens, hidden)`` rows.
        chunk_tokens: Rows of logits computed at a time.
        softcap: ``config.final_logit_softcapping`` (``tanh(logits / c) * c``), or None.
        recompute: Recompute each chunk's logits in the backward (the backend's activation checkpointing; on
            XLA the chunks are also ordered by optimization barriers, else its scheduler runs them side by side);
            False keeps every chunk's logits for the backward.

    Example:
        >>> head = nn.Linear(8, 11, bias=False)
        >>> h, y = torch.randn(2, 5, 8), torch.randint(0, 11, (2, 5))
        >>> expected = F.cross_entropy(head(h)[:, :-1].reshape(-1, 11), y[:, 1:].reshape(-1))
        >>> torch.allclose(chunked_causal_lm_loss(h, y, head, chunk_tokens=3), expected)
        True
    """
    rows = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    targets = labels[:, 1:].reshape(-1)
    chosen = backend.current()
    lazy = chosen.devices.is_lazy(rows.device)
    # torch's own checkpoint without reentry (it works with autograd.grad); torch_xla's is reentrant only
    checkpoint = chosen.compute.checkpoint_function() if lazy else torch.utils.checkpoint.checkpoint
    barrier = chosen.compute.optimization_barrier() if lazy else None

    def summed(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = head(h).float()
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        return F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX, reduction="sum")

    total = rows.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.shape[0], chunk_tokens):
        h, y = rows[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if not (recompute and h.requires_grad):
            total = total + summed(h, y)
            continue
        if barrier is not None:  # this chunk after the last one's loss; in the backward, the last one's after this
            h, total = _Ordered.apply(barrier, h, total)
        total = total + checkpoint(summed, h, y, use_reentrant=lazy)
    return total / (targets != IGNORE_INDEX).sum()  # on the device: no host read


class _Ordered(torch.autograd.Function):
    """The identity on two tensors whose values (forward) and gradients (backward) pass an optimization barrier
    together: neither is used before both are computed."""

    @staticmethod
    def forward(ctx: Any, barrier: Callable[[list[torch.Tensor]], None], a: torch.Tensor, b: torch.Tensor) -> Any:
        ctx.barrier = barrier
        a, b = a.clone(), b.clone()
        barrier([a, b])
        return a, b

    @staticmethod
    def backward(ctx: Any, grad_a: torch.Tensor, grad_b: torch.Tensor) -> Any:
        grad_a, grad_b = grad_a.clone(), grad_b.clone()
        ctx.barrier([grad_a, grad_b])
        return None, grad_a, grad_b


class ChunkedLoss(Callback):
    """A causal LM's default loss computed in chunks of tokens: the full ``tokens x vocab`` fp32 logits and their
    gradient are never held, one chunk's are (each recomputed in the backward).

    The loss is the model's own (the mean over labels that are not -100, shifted by one; Gemma's final logit
    soft-cap applied where its config has one), from the decoder's final hidden states, for the cost of one more
    head matmul per step. Give it to ``memory_plan(chunked_loss=...)`` too: the plan then counts one chunk's
    logits instead of all of them. Validation and ``evaluate`` compute no gradient and are left as they are.

    Args:
        chunk_tokens: Tokens whose logits are computed at a time (of batch x (seq_len - 1)).

    Example:
        >>> # was: Gemma 7B's 2 x 1024 tokens did not fit one 16 GB chip for its 256k vocabulary's logits
        >>> one_cycle_fit(model, train_ds, epochs=1, max_lr=2e-4,       # doctest: +SKIP
        ...               callbacks=[GradientCheckpointing(), ChunkedLoss(512)])
    """

    def __init__(self, chunk_tokens: int = 512) -> None:
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be an int >= 1, but given {chunk_tokens!r}")
        self.chunk_tokens = chunk_tokens
        self._replaced: Any = None

    def __repr__(self) -> str:
        return f"ChunkedLoss({self.chunk_tokens})"

    def traced_loss(self) -> Callable[[nn.Module, torch.Tensor], torch.Tensor]:
        """``(model, token_ids) -> loss`` as this callback computes it, for ``memory_plan``'s traced step
        (``trace_step(loss=...)``); the head's forward is called directly, as torch's ``MemTracker`` refuses a
        module called more than once a step."""
        chunk_tokens = self.chunk_tokens

        class Traced(ChunkedLossStep):
            def head_function(self, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
                return head.forward

        return lambda model, ids: Traced(chunk_tokens)(model, {"input_ids": ids, "labels": ids})

    def on_fit_start(self, loop: TrainerLoop) -> None:
        step = loop.train_step
        if not (isinstance(step, LossStep) and step.model_loss):
            raise ValueError("ChunkedLoss computes the default loss of a causal LM, but this run is given its own "
                             "train_step or loss_fn; leave them out, or chunk the loss in your train_step")  # fmt: skip
        if not is_causal_lm(loop.model):
            raise TypeError(f"ChunkedLoss needs a Hugging Face causal LM (or a peft model around one), but the model is "
                            f"{type(loop.model).__name__}")  # fmt: skip
        self._replaced = step
        loop.train_step = ChunkedLossStep(self.chunk_tokens, step.labels)

    def on_fit_end(self, loop: TrainerLoop) -> None:
        if self._replaced is not None:
            loop.train_step, self._replaced = self._replaced, None


class ChunkedLossStep:
    """The train step ``ChunkedLoss`` puts in place of ``LossStep``: the model is called without its labels, its
    head's forward replaced for the call by one that keeps its input (and returns no logits)."""

    def __init__(self, chunk_tokens: int, labels: Any = None) -> None:
        self.chunk_tokens, self.labels = chunk_tokens, labels

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, target = split_batch(batch, "train_step")
        if not isinstance(inputs, Mapping) or not isinstance(target, torch.Tensor):
            raise TypeError(f"ChunkedLoss reads a causal LM's dict batches with their 'labels' (input_ids, labels, "
                            f"...), but a batch is {type(batch).__name__}")  # fmt: skip
        inner = base_model(model)
        head = inner.get_output_embeddings()
        kept: list[torch.Tensor] = []

        def keep(h: torch.Tensor) -> torch.Tensor:
            kept.append(h)
            return h[..., :0]

        head.__dict__["forward"] = keep
        try:
            call_model(model, {"use_cache": False, **without_labels(inputs)}, "train_step")  # training keeps no cache
        finally:
            del head.__dict__["forward"]
        if kept[-1].shape[:2] != target.shape:  # peft's prompt tuning prepends virtual tokens: not paired here
            raise ValueError(f"ChunkedLoss pairs each position with the next label, but the head's input is "
                             f"{tuple(kept[-1].shape[:2])} positions and the labels {tuple(target.shape)}")  # fmt: skip
        if self.labels is not None:  # the label check learns the vocabulary from the head, not from logits
            self.labels.see(torch.empty(1, 1, head.weight.shape[0], device="meta"), target, own_loss=True)
        softcap = getattr(inner.config.get_text_config(decoder=True), "final_logit_softcapping", None)
        return chunked_causal_lm_loss(kept[-1], target, self.head_function(head), self.chunk_tokens, softcap)

    def head_function(self, head: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """What each chunk's logits are computed with: the head module itself (``ChunkedLoss.traced_loss`` calls
        its ``forward`` directly)."""
        return head


__all__ = ["ChunkedLoss", "ChunkedLossStep", "chunked_causal_lm_loss"]
