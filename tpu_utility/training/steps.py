"""Steps: what the trainer and the inference loops call on a batch.

A batch split into inputs and target (``split_batch``), the model called on them (``call_model``), the
default loss step (``LossStep``, which trusts a model's own loss), evaluation (``EvalStep``: a causal
LM's logits paired with the next token) and prediction (``default_predict_step``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

import torch
from torch import nn

from ..data.loaders import IGNORE_INDEX, LABELS, LabelCheck

Batch = Any
Step = Callable[[nn.Module, Batch], Any]


# ----------------------------------------------------------------- batches
def split_batch(batch: Batch, what: str) -> tuple[Any, Any]:
    """``(inputs, target)`` of a default batch.

    ``(*inputs, target)`` gives ``(inputs, target)``: ``model(*inputs)`` is compared with
    ``target``. A dict batch (a tokenized Hugging Face dataset) is passed as keyword
    arguments: ``(batch, batch["labels"])`` (None without labels), the labels left in
    so that a Hugging Face model computes its own loss.
    """
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:  # the common case first: no Mapping check
        return tuple(batch[:-1]), batch[-1]
    if isinstance(batch, Mapping):
        return batch, batch.get(LABELS)
    size = f" of length {len(batch)}" if hasattr(batch, "__len__") else ""
    fix = "give find_lr a Dataset of (inputs, target) samples" if what == "find_lr" else f"pass {what}=... to handle this batch structure"
    raise TypeError(
        f"the default {what} expects batches of (inputs, targets), (*inputs, targets) or a dict of model "
        f"arguments, but a batch is {type(batch).__name__}{size}; {fix}"
    )


def without_labels(inputs: Any) -> Any:
    """A dict batch's model arguments less its labels (the model's own loss is not wanted); tuples as they are."""
    return {k: v for k, v in inputs.items() if k != LABELS} if isinstance(inputs, Mapping) else inputs


def call_model(model: nn.Module, inputs: Any, what: str) -> Any:
    """``model(**inputs)`` for a dict, ``model(*inputs)`` for a tuple; a forward that cannot take
    that many inputs is named with the batch's layout."""
    if not isinstance(inputs, tuple) and isinstance(inputs, Mapping):  # a tuple first: no Mapping check
        return model(**inputs)
    try:
        return model(*inputs)
    except TypeError as error:
        if len(inputs) < 2:
            raise
        try:
            inspect.signature(model.forward).bind(*inputs)
        except (TypeError, ValueError):
            raise TypeError(
                f"a batch has {len(inputs) + 1} parts, which the default {what} reads as (*inputs, targets): "
                f"model(*batch[:-1]) with {len(inputs)} inputs, but {type(model).__name__}.forward"
                f"{inspect.signature(model.forward)} does not take {len(inputs)}. For batches such as "
                f"(inputs, targets, weights), pass {what}=lambda model, batch: ..."
            ) from error
        raise


def logits_of(output: Any) -> Any:
    """The scores in a model's output: the tensor itself, or the ``logits`` of a Hugging Face
    ``ModelOutput`` or any dict that has them; other outputs as they are."""
    if not isinstance(output, torch.Tensor) and isinstance(output, Mapping) and output.get("logits") is not None:
        return output["logits"]
    return output


def _no_labels(what: str, batch: Mapping) -> TypeError:
    return TypeError(
        f"the default {what} needs the targets: a dict batch must hold them under '{LABELS}' (as a tokenized "
        f"Hugging Face dataset does), but this one has {sorted(batch)}; rename the key, or pass "
        f"{what}=lambda model, batch: ..."
    )


class LossStep:
    """The default train step: ``loss_fn(model(*inputs).float(), target)``.

    A dict batch is passed as keyword arguments. With the default loss and a model
    that computes its own (a Hugging Face model given ``labels``), the loss is its
    ``output.loss``; otherwise ``loss_fn(logits, batch["labels"])``, the labels
    kept out of the model's arguments. The scores are shown to ``labels`` (a
    LabelCheck) first, so a bad label fails before the loss.
    """

    def __init__(self, loss_fn: Callable, labels: LabelCheck | None = None, model_loss: bool = False) -> None:
        self.loss_fn, self.labels, self.model_loss = loss_fn, labels, model_loss

    def __call__(self, model: nn.Module, batch: Any) -> torch.Tensor:
        inputs, target = split_batch(batch, "train_step")
        if target is None and isinstance(inputs, Mapping):
            raise _no_labels("train_step", inputs)
        output = call_model(model, inputs if self.model_loss else without_labels(inputs), "train_step")
        scores = logits_of(output)
        own = None
        if self.model_loss and not isinstance(output, torch.Tensor) and isinstance(output, Mapping):  # a ModelOutput's own loss
            own = output.get("loss")
        if self.labels is not None:
            self.labels.see(scores, target, own_loss=own is not None)
        if own is not None:
            return own
        return self.loss_fn(scores if scores.dtype == torch.float32 else scores.float(), target)


def default_eval_step(model: nn.Module, batch: Batch) -> tuple[Any, Any]:
    inputs, target = split_batch(batch, "eval_step")
    if isinstance(inputs, Mapping) and target is None:
        raise _no_labels("eval_step", inputs)
    return logits_of(call_model(model, without_labels(inputs), "eval_step")), target


def next_token_targets(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's scores and targets paired as its own loss pairs them: position t predicts label t + 1.

    Logits longer than the labels (peft's prompt tuning prepends virtual tokens) get the labels
    right-aligned, the virtual positions ignored (-100), as peft and transformers do.

    Example:
        >>> logits, labels = torch.zeros(2, 5, 11), torch.arange(5).repeat(2, 1)
        >>> [tuple(t.shape) for t in next_token_targets(logits, labels)]
        [(2, 4, 11), (2, 4)]
    """
    extra = logits.shape[1] - labels.shape[1]
    if extra > 0:
        labels = torch.cat([labels.new_full((labels.shape[0], extra), IGNORE_INDEX), labels], dim=1)
    return logits[:, :-1], labels[:, 1:]


class EvalStep:
    """``default_eval_step`` whose scores and targets are paired as the default loss reads them.

    ``causal``: a causal LM's (``next_token_targets``), so the validation loss is the
    model's own. ``labels``: a LabelCheck shown each output (it learns the class count
    from the first).
    """

    def __init__(self, labels: LabelCheck | None = None, causal: bool = False) -> None:
        self.labels, self.causal = labels, causal

    def __call__(self, model: nn.Module, batch: Batch) -> tuple[Any, Any]:
        output, target = default_eval_step(model, batch)
        if self.causal and isinstance(output, torch.Tensor) and isinstance(target, torch.Tensor):
            output, target = next_token_targets(output, target)
        if self.labels is not None:
            self.labels.see(output, target)
        return output, target


def default_predict_step(model: nn.Module, batch: Batch) -> Any:
    """``model(x)`` for a tensor, ``model(*inputs)`` for ``(*inputs, target)`` (the target is ignored),
    ``model(**batch)`` less its labels for a dict; a ``ModelOutput``'s (or dict's) logits."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return logits_of(model(**without_labels(batch)))
    if isinstance(batch, (list, tuple)) and batch:
        return logits_of(model(*batch[:-1]) if len(batch) > 1 else model(batch[0]))
    raise TypeError(
        f"the default predict_step expects batches of inputs, (*inputs, target) or a dict of model arguments, "
        f"but a batch is {type(batch).__name__}; pass predict_step=lambda model, batch: ... to handle it"
    )
