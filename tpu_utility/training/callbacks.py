"""Callbacks that ship with one_cycle_fit: EMA of the weights, and loggers.

Give them as ``one_cycle_fit(..., callbacks=[EMA(), TensorBoardLogger("runs/exp1")])``.
Any other logger is a few lines of your own (see ``Callback``): its
``on_epoch_end(loop, record)`` gets the epoch's figures as Python floats.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from .. import backend
from ..files import check_file_path
from ..huggingface import give_back_checkpoint_functions, use_checkpoint_function
from .events import Callback, Loop, TrainerLoop


class EMA(Callback):
    """An exponential moving average of the weights, evaluated and checkpointed in their place.

    The average is a ``torch.optim.swa_utils.AveragedModel`` (its state and
    checkpoints as torch's), updated on the device after every optimizer step
    (floating-point buffers such as batch-norm statistics averaged too, as
    torchvision's recipe does; integer ones, a step counter or position ids,
    copied, as timm's ``ModelEmaV3`` does) by the update of
    ``get_ema_multi_avg_fn(decay)``, ``avg.lerp_(weights,
    1 - decay)`` over all tensors at once, without ``update_parameters``' per-step
    regrouping of the tensors. After each epoch's training the averaged weights go into the
    model, so validation, the monitored figure, the best epoch, ``best.pt`` and
    ``last.pt``'s ``"model"`` are the averaged model's; the training weights are
    put back before the next epoch (``last.pt`` keeps them too, for ``resume``).

    Under ``precision="bf16"`` the average is kept in the model's bf16, which
    rounds away updates smaller than 1/256 of a weight: prefer fp32 with EMA.

    On XLA the update is traced into the step: on a TPU, where the host's
    tracing is the step time for small and medium models, that is host time
    every step. There it is torch's lerp out of place, its weight a device
    tensor made once (a Python float would be uploaded as device data at every
    step): the new average is kept as the lerp's outputs and written into
    ``averaged`` when that is read (after each epoch's training, or by you),
    as in-place ops cost torch_xla several times as much to trace. For a
    4-tensor MLP the update is about a fifth of a fused hand loop's step on the
    host (docs/benchmarks.md). ``every=k`` updates every k-th step (as
    Lightning's ``EMAWeightAveraging(update_every_n_steps=k)`` does) with
    ``decay ** k``: the same span in steps, 1/k of the cost, and one more step
    graph to compile.

    Args:
        decay: Weight of the old average at each step, in (0, 1). The average
            spans about ``1 / (1 - decay)`` steps: 0.999 suits a few thousand steps
            or more; use less for a short run.
        restore: At the end, leave the averaged weights in the model (True) or
            the last training weights (False). ``restore_best=True`` loads the best
            epoch's averaged weights either way.
        every: Update the average every this many optimizer steps (1: every step).

    Example:
        >>> # was: ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999)) and
        >>> #      ema.update_parameters(model) after every opt.step(), evaluating ema.module
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=5,  # doctest: +SKIP
        ...                         max_lr=3e-3, callbacks=[EMA(decay=0.999)])
        >>> # on a TPU with a host-bound step: the same average's span, updated every 4th step
        >>> history = one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3,  # doctest: +SKIP
        ...                         callbacks=[EMA(decay=0.999, every=4)])
    """

    def __init__(self, decay: float = 0.999, restore: bool = True, every: int = 1) -> None:
        ok = isinstance(decay, (int, float)) and not isinstance(decay, bool) and 0 < decay < 1
        if not ok:
            raise ValueError(f"EMA decay must be a number in (0, 1), but given {decay!r}")
        if not isinstance(restore, bool):
            raise TypeError(f"EMA restore must be True or False, but given {restore!r}")
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"EMA every must be a whole number of steps, 1 or more, but given {every!r}")
        self.decay, self.restore, self.every = float(decay), restore, every
        self.update_decay = self.decay**every  # per update: the span in steps stays decay's
        self.since = 0  # steps since the last update
        self.lazy = False  # whether the model is on a lazy (XLA) device, known at the fit's start
        self.model: torch.nn.Module | None = None
        self._averaged: AveragedModel | None = None
        self.training_weights: dict[str, torch.Tensor] | None = None  # while the average is in the model
        self.pairs: tuple[list[torch.Tensor], ...] | None = None  # (averaged, model) floats, then the rest
        self.pending: list[torch.Tensor] | None = None  # on XLA: the average's floats, not yet in `averaged`
        self.lerp_weights: list[torch.Tensor] | None = None  # on XLA: 1 - decay ** every per float, on the device

    @property
    def averaged(self) -> AveragedModel | None:
        """The ``AveragedModel`` (None before the fit), the latest update in it."""
        self._write_back()
        return self._averaged

    def __repr__(self) -> str:
        return f"EMA(decay={self.decay}, restore={self.restore}" + (f", every={self.every})" if self.every > 1 else ")")

    def on_fit_start(self, loop: Loop) -> None:
        self.model, self.since = loop.model, 0
        self.lazy = any(backend.current().devices.is_lazy(p.device) for p in self.model.parameters())
        self._averaged = AveragedModel(self.model, multi_avg_fn=get_ema_multi_avg_fn(self.decay), use_buffers=True)
        # AveragedModel tests `n_averaged == 0` in Python at every update: kept on the device, that
        # test would wait for the device every step. On the host it costs nothing.
        self._averaged.n_averaged = self._averaged.n_averaged.cpu()
        self.training_weights = None
        self.pairs = self.pending = self.lerp_weights = None

    def on_step_end(self, loop: Loop) -> None:
        self.since += 1
        if self.since < self.every:  # between updates nothing is traced (nor a no_grad entered)
            return
        self.since = 0
        with torch.no_grad():
            self._update()

    def _update(self) -> None:
        if self.pairs is None:
            self.pairs = self._pairs()
        averaged, weights, other_averaged, other_weights = self.pairs
        if int(self._averaged.n_averaged) == 0:  # the first update copies, as AveragedModel's does
            torch._foreach_copy_(averaged + other_averaged, weights + other_weights)
        else:
            if self.lazy:  # out of place (torch_xla's lerp_ is a Python decomposition); written back when read
                if self.lerp_weights is None:
                    made = {t.dtype: torch.tensor(1 - self.update_decay, dtype=t.dtype, device=t.device) for t in averaged}
                    self.lerp_weights = [made[t.dtype] for t in averaged]
                start = averaged if self.pending is None else self.pending
                self.pending = torch._foreach_lerp(start, weights, self.lerp_weights)
            else:
                torch._foreach_lerp_(averaged, weights, 1 - self.update_decay)
            # integer buffers (batch-norm's step counter, a transformer's position ids) are not averaged but
            # copied, as timm's ModelEmaV3 does: torch's EMA truncates a mean of integers into them, and on XLA
            # writing such a mean into an expanded buffer (BERT's position_ids) deleted a buffer still in use
            if other_averaged:
                torch._foreach_copy_(other_averaged, other_weights)
        self._averaged.n_averaged += 1

    def _write_back(self) -> None:
        """Puts the latest average (XLA's lerp outputs) into the AveragedModel's own tensors."""
        if self.pending is not None:
            with torch.no_grad():
                torch._foreach_copy_(self.pairs[0], self.pending)
            self.pending = None

    def _pairs(self) -> tuple[list[torch.Tensor], ...]:
        """The averaged model's tensors and the model's, in AveragedModel's order (parameters, then buffers),
        floating-point ones first; taken once per epoch, as loading weights between epochs keeps the tensors."""
        pairs = zip(itertools.chain(self._averaged.module.parameters(), self._averaged.module.buffers()),
                    itertools.chain(self.model.parameters(), self.model.buffers()))  # fmt: skip
        floats, other = [], []
        for mine, theirs in pairs:
            (floats if mine.is_floating_point() else other).append((mine, theirs))
        return tuple(list(side) for group in (floats, other) for side in (zip(*group) if group else ((), ())))

    def on_train_epoch_end(self, loop: Loop) -> None:
        self._average_in()

    def on_train_epoch_start(self, loop: Loop, epoch: int) -> None:
        self._training_in()
        self._write_back()
        self.pairs = None  # a resume or a restore between epochs may have given the model new tensors

    def on_fit_end(self, loop: Loop) -> None:
        if self.restore:
            self._average_in()
        else:
            self._training_in()

    def state_dict(self) -> dict[str, Any]:
        """The training weights (the model holds the average when a checkpoint is written), the update
        count, and the steps since the last update (so a resumed run updates at the same steps)."""
        held = self.training_weights if self.training_weights is not None else None
        return {"training_weights": held, "n_averaged": int(self._averaged.n_averaged), "since": self.since}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the checkpoint's ``"model"`` (the average) was loaded into the model: back to training weights."""
        self.pending = None  # the checkpoint's average replaces any in the making
        self._averaged.module.load_state_dict(self.model.state_dict())
        self._averaged.n_averaged.fill_(int(state["n_averaged"]))
        self.since = int(state.get("since", 0))  # checkpoints before `every` had none: every step updated
        if state["training_weights"] is not None:
            self.model.load_state_dict(state["training_weights"])

    def _average_in(self) -> None:
        if self.training_weights is None:
            self.training_weights = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(self.averaged.module.state_dict())

    def _training_in(self) -> None:
        if self.training_weights is not None:
            self.model.load_state_dict(self.training_weights)
            self.training_weights = None


def _figures(record: Any) -> dict[str, float]:
    figures = {"train_loss": record.train_loss, **record.metrics, "lr": record.lr, "samples_per_s": record.samples_per_s}
    if record.valid_loss is not None:
        figures["valid_loss"] = record.valid_loss
    for name in ("tokens_per_s", "mfu"):
        if getattr(record, name, None) is not None:
            figures[name] = getattr(record, name)
    return {k: v for k, v in figures.items() if isinstance(v, (int, float)) and math.isfinite(v)}


class GradientCheckpointing(Callback):
    """Activation (gradient) checkpointing of a Hugging Face model's layers for the run.

    Each layer's activations are recomputed in the backward pass instead of kept: the
    memory of a long sequence or a large batch for about a third more compute. It calls
    the model's own ``gradient_checkpointing_enable()`` at the start and switches it off
    again at the end if it was off. On XLA the checkpoint is torch_xla's (torch's fails
    there, and XLA would merge its recomputation away); a model whose
    ``gradient_checkpointing_enable()`` you called yourself gets torch_xla's too, with or
    without this callback.

    Args:
        every_n_layers: Checkpoint every n-th layer only (``activation_checkpointing_enable``,
            transformers 5.23 and later); 1: all of them, on every supported transformers.

    Example:
        >>> # was: model.gradient_checkpointing_enable() before a CUDA loop
        >>> one_cycle_fit(model, train_ds, epochs=1, max_lr=2e-4,       # doctest: +SKIP
        ...               callbacks=[GradientCheckpointing()])
    """

    def __init__(self, every_n_layers: int = 1) -> None:
        if isinstance(every_n_layers, bool) or not isinstance(every_n_layers, int) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be an int >= 1, but given {every_n_layers!r}")
        self.every_n_layers = every_n_layers
        self._switched_on = False
        self._found: list[Any] = []

    def __repr__(self) -> str:
        every = f"every_n_layers={self.every_n_layers}" if self.every_n_layers > 1 else ""
        return f"GradientCheckpointing({every})"

    def on_fit_start(self, loop: TrainerLoop) -> None:
        model = loop.model
        enable = getattr(model, "activation_checkpointing_enable", None)
        kwargs = {"every_n_layers": self.every_n_layers} if self.every_n_layers > 1 else {}
        if enable is None and not kwargs:
            enable = getattr(model, "gradient_checkpointing_enable", None)
        if not callable(enable):
            needs = ("activation_checkpointing_enable (transformers 5.23 and later; pip install -U 'transformers>=5.23')"
                     if kwargs else "gradient_checkpointing_enable()")  # fmt: skip
            raise TypeError(
                f"GradientCheckpointing needs a Hugging Face model with {needs}, but the model is "
                f"{type(model).__name__}; for a model of your own, wrap its blocks' forward in "
                f"torch.utils.checkpoint.checkpoint (torch_xla.utils.checkpoint.checkpoint on XLA)"
            )
        if not _checkpointing(model):
            enable(**kwargs)
            self._switched_on = True
        if loop.runner.lazy:
            self._found = use_checkpoint_function(model, backend.current().compute.checkpoint_function())

    def on_fit_end(self, loop: Loop) -> None:
        if self._switched_on:
            disable = getattr(loop.model, "activation_checkpointing_disable", None)
            (disable or loop.model.gradient_checkpointing_disable)()
            self._switched_on = False
        give_back_checkpoint_functions(self._found)
        self._found = []


def _checkpointing(model: Any) -> bool:
    """Whether a transformers model checkpoints its layers already."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


class CSVLogger(Callback):
    """Writes the history so far to a CSV file after every epoch (the master process only).

    ``checkpoint_dir`` already gets a ``history.csv``; this one goes wherever you
    like (a local path or a URL, written whole each epoch, never half-written).

    Example:
        >>> # was: rows.append(...); pd.DataFrame(rows).to_csv("log.csv") after each epoch
        >>> one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3, callbacks=[CSVLogger("log.csv")])  # doctest: +SKIP
    """

    def __init__(self, path: str | os.PathLike) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"CSVLogger path must be a file path, but given {path!r}")
        check_file_path(path, "CSVLogger path")  # now, not at the end of the first epoch
        self.path = os.fspath(path)

    def __repr__(self) -> str:
        return f"CSVLogger({self.path!r})"

    def on_epoch_end(self, loop: Loop, record: Any) -> None:
        if loop.master:
            loop.history.to_csv(self.path)


class TensorBoardLogger(Callback):
    """Logs every epoch's figures (losses, metrics, lr, samples/s) to TensorBoard.

    Uses ``torch.utils.tensorboard.SummaryWriter``, which needs the ``tensorboard``
    package (``pip install tensorboard``); only the master process writes. The
    figures are the epoch's, already read: logging adds no device read.

    Example:
        >>> # was: writer = SummaryWriter("runs/exp1"); writer.add_scalar("loss", loss.item(), step)
        >>> one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3,          # doctest: +SKIP
        ...               callbacks=[TensorBoardLogger("runs/exp1")])
        >>> # then: tensorboard --logdir runs
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        try:
            import tensorboard  # noqa: F401  (torch.utils.tensorboard imports it)
        except ModuleNotFoundError:
            raise ModuleNotFoundError(
                "TensorBoardLogger needs the tensorboard package, which is not installed: pip install tensorboard"
            ) from None
        if not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"TensorBoardLogger log_dir must be a folder path, but given {log_dir!r}")
        self.log_dir = os.fspath(log_dir)
        self.writer: Any = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger({self.log_dir!r})"

    def __getstate__(self) -> dict[str, Any]:  # a spawned launch pickles it before any writer exists
        return {**self.__dict__, "writer": None}

    def on_fit_start(self, loop: Loop) -> None:
        if loop.master:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.log_dir)

    def on_epoch_end(self, loop: Loop, record: Any) -> None:
        if self.writer is not None:
            for name, value in _figures(record).items():
                self.writer.add_scalar(name, value, record.epoch)
            self.writer.flush()

    def on_fit_end(self, loop: Loop) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None
