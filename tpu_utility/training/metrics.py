"""Validation metrics summed on the device, exact on any number of cores.

A metric is a name ("accuracy"), a function ``(output, target) -> values`` that
returns one value per sample or one value per batch (its mean), a torchmetrics
``Metric`` (updated on the device, computed once per evaluation), or an
``EpochMetric``: a function of every output and target of the evaluation at once
(quadratic weighted kappa, ROC AUC), run on the host once per evaluation.
Padded samples never count: per-sample values are masked, per-batch functions
and torchmetrics see only the real samples of a padded batch, and an
``EpochMetric`` sees each sample once, in dataset order.
"""

from __future__ import annotations

import copy
import inspect
import math
from functools import partial
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import backend
from ..data.loaders import IGNORE_INDEX, class_dim

MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CrossEntropy(nn.CrossEntropyLoss):
    """``nn.CrossEntropyLoss`` that also takes ``(N, T, C)`` scores against ``(N, T)`` targets.

    The default loss of ``one_cycle_fit``, ``evaluate`` and ``find_lr``: the class
    dimension is chosen by ``class_dim``, so a token classifier's or a language model's
    logits need no ``transpose(1, 2)``; targets equal to ``ignore_index`` (-100) count
    in no mean, as in torch.
    """

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if input.dim() >= 3 and class_dim(input.shape, target.shape) != 1:
            input = input.movedim(-1, 1)
        return super().forward(input, target)


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample (per-token, for sequences) correctness of the arg-max class (1.0 or 0.0)."""
    return (output.argmax(dim=class_dim(output.shape, target.shape)) == target).float()


METRICS: dict[str, MetricFn] = {"accuracy": accuracy}


def is_torchmetric(metric: Any) -> bool:
    """A torchmetrics ``Metric`` (recognised without importing torchmetrics)."""
    return any(cls.__module__.startswith("torchmetrics") and cls.__name__ == "Metric" for cls in type(metric).__mro__)


def metric_name(metric: Any) -> str:
    if is_torchmetric(metric):
        return type(metric).__name__
    return getattr(metric, "__name__", type(metric).__name__)


class EpochMetric:
    """A metric of the whole evaluation at once: ``fn(outputs, targets)`` on the CPU.

    Some figures are not a mean over batches: quadratic weighted kappa, ROC AUC, F1
    over the set (the Kaggle metrics). ``fn`` gets every validation output and
    target of the evaluation as CPU tensors, in dataset order, padding removed,
    gathered from every core and replica, and returns a number. sklearn's and
    torchmetrics' functional metrics take these as they are.

    The outputs stay on the device during the evaluation and move to the host in
    one transfer at its end (none per step; on all cores in graphs compiled once,
    so a repeated evaluation compiles nothing); before training, ``fn`` is tried
    once on the first validation batch, so a wrong signature fails at once.

    Args:
        fn: ``(outputs, targets) -> number``; ``outputs`` is ``(N, ...)`` float32,
            ``targets`` ``(N, ...)`` as the loader gives them.
        higher_is_better: Which way is better, for ``monitor`` with ``mode="auto"``;
            None leaves it to the metric's name.

    Example:
        >>> # was: preds = np.concatenate(all_outputs).argmax(1); cohen_kappa_score(all_targets, preds, weights="quadratic")
        >>> from sklearn.metrics import cohen_kappa_score
        >>> qwk = EpochMetric(lambda out, y: cohen_kappa_score(y, out.argmax(1), weights="quadratic"),
        ...                   higher_is_better=True)
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=5, max_lr=3e-3,  # doctest: +SKIP
        ...                         metrics={"accuracy": "accuracy", "qwk": qwk}, monitor="qwk")
    """

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], Any], higher_is_better: bool | None = None) -> None:
        if not callable(fn):
            raise TypeError(f"EpochMetric takes a function (outputs, targets) -> number, but given {fn!r}")
        if higher_is_better is not None and not isinstance(higher_is_better, bool):
            raise TypeError(f"higher_is_better must be True, False or None, but given {higher_is_better!r}")
        self.fn, self.higher_is_better = fn, higher_is_better
        self.__name__ = getattr(fn, "__name__", type(fn).__name__)

    def __repr__(self) -> str:
        return f"EpochMetric({self.__name__})"

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> float:
        """``fn`` on the whole evaluation; its value as a float.

        Raises:
            TypeError: ``fn`` returned something that is not one number.
        """
        value = self.fn(outputs, targets)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        try:
            return float(value)
        except (TypeError, ValueError):
            raise TypeError(f"{self!r} returned {value!r}; it must return one number") from None


# the columns History and the monitor already use, and evaluate's "loss"
RESERVED_NAMES = ("epoch", "train_loss", "valid_loss", "loss", "lr", "seconds", "samples_per_s", "compiles", "host_syncs",
                  "transfers", "tokens_per_s", "mfu")  # fmt: skip


def resolve_metrics(metrics: Any, default_loss: bool) -> dict[str, Any]:
    """Names, functions and torchmetrics objects as an ordered ``{name: metric}``.

    Raises:
        ValueError: an unknown name, or two metrics with one name.
        TypeError: something that is neither.
    """
    if metrics is None:
        metrics = ["accuracy"] if default_loss else []
    if isinstance(metrics, (str, dict)) or callable(metrics):
        metrics = metrics.items() if isinstance(metrics, dict) else [metrics]
    table: dict[str, Any] = {}
    for item in metrics:
        name, metric = item if isinstance(item, tuple) else (None, item)
        if isinstance(metric, str):
            if metric not in METRICS:
                raise ValueError(f"metric {metric!r} is unknown; allowed names: {sorted(METRICS)}, functions or torchmetrics")
            name, metric = name or metric, METRICS[metric]
        elif not callable(metric) and not isinstance(metric, EpochMetric):
            raise TypeError(
                f"metrics must be names, functions, torchmetrics Metrics or EpochMetric(fn), but given {metric!r}"
            )
        name = name or metric_name(metric)
        if name in RESERVED_NAMES:
            raise ValueError(f"a metric may not be named {name!r}: that is one of the run's own figures {RESERVED_NAMES}")
        if name in table:
            raise ValueError(
                f"two metrics are named {name!r}; give them distinct names as a dict, "
                f"for example metrics={{'top1': ..., 'top5': ...}}"
            )
        table[name] = metric
    return table


def check_loss_fn(loss_fn: Any) -> None:
    """``loss_fn`` is None or a callable ``(output, target) -> loss``; a loss's name is refused naming the callable.

    Raises:
        TypeError: naming the value given and a loss to give instead.
    """
    if loss_fn is None or callable(loss_fn):
        return
    if isinstance(loss_fn, str):
        known = hasattr(torch.nn.functional, loss_fn) and not loss_fn.startswith("_")
        named = f"torch.nn.functional.{loss_fn}" if known else "torch.nn.functional.cross_entropy"
        raise TypeError(
            f"loss_fn must be a callable (output, target) -> loss, but given the string {loss_fn!r}; give the "
            f"function or module itself, for example loss_fn={named} or nn.CrossEntropyLoss() (names are taken "
            f"by metrics=, not by loss_fn)"
        )
    raise TypeError(
        f"loss_fn must be a callable (output, target) -> loss, such as nn.CrossEntropyLoss(), but given "
        f"{loss_fn!r} of type {type(loss_fn).__name__}"
    )


def per_sample_loss(loss_fn: Callable) -> Callable:
    """The same loss with reduction='none', so padded samples can be masked out."""
    if hasattr(loss_fn, "reduction"):
        unreduced = copy.copy(loss_fn)
        unreduced.reduction = "none"
        return unreduced
    try:
        accepts = "reduction" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        raise TypeError(
            f"loss_fn {loss_fn!r} has no 'reduction' argument, so validation cannot leave padded "
            f"samples out. Give a torch loss (nn.CrossEntropyLoss(), F.cross_entropy, ...) or an "
            f"eval_step that returns (output, target) for a loss that accepts reduction='none'."
        )
    return partial(loss_fn, reduction="none")


class MetricSet:
    """The loss and metrics of one evaluation: device sums, read once.

    ``update`` adds a batch (its real-sample count known on the host);
    ``figures`` gives the device scalars to read, in one transfer with the
    rest; ``values`` turns them into ``(loss, {name: value})``.
    """

    def __init__(self, metrics: dict[str, Any], loss_fn: Callable | None, device: torch.device) -> None:
        self.loss = per_sample_loss(loss_fn) if loss_fn is not None else None
        # targets equal to it count in no figure (the loss's own ignore_index, else torch's -100)
        self.ignore_index = getattr(loss_fn, "ignore_index", IGNORE_INDEX)
        self.functions = {k: m for k, m in metrics.items() if not is_torchmetric(m) and not isinstance(m, EpochMetric)}
        self.whole = {k: m for k, m in metrics.items() if isinstance(m, EpochMetric)}
        # each batch's [output, target] and dataset index (-1: padding), kept on the device for the EpochMetrics
        self.outputs: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        self.whole_values: dict[str, float] = {}
        self.torchmetrics = {k: copy.deepcopy(m).to(device) for k, m in metrics.items() if is_torchmetric(m)}
        self.names = list(metrics)
        self.device = device
        for metric in self.torchmetrics.values():
            metric.reset()
            sync_fn = backend.current().processes.metric_sync_fn()
            if sync_fn is not None:  # one process per core on XLA: sync their states over XLA collectives
                metric.dist_sync_fn = sync_fn
                metric.distributed_available_fn = lambda: True
        self.sums = self.counts = None  # created by reset(), at the start of each evaluation

    def reset(self) -> None:
        width = 1 + len(self.functions)
        self.sums = torch.zeros(width, device=self.device)
        self.counts = torch.zeros(width, device=self.device)  # what each sum is over: samples, or counted targets
        self.outputs, self.whole_values = [], {}
        for metric in self.torchmetrics.values():
            metric.reset()

    def update(self, output: torch.Tensor, target: Any, index: torch.Tensor, real: int) -> None:
        """Adds one batch; ``index`` is -1 for padding, ``real`` the real samples (host-known)."""
        weight = (index >= 0).float()
        rows = [self._sum("the loss", self.loss, output, target, weight, real) if self.loss is not None
                else (torch.zeros((), device=output.device), weight.sum())]  # fmt: skip
        rows += [self._sum(f"metric {k!r}", fn, output, target, weight, real) for k, fn in self.functions.items()]
        self.sums = self.sums + torch.stack([total for total, _ in rows])
        self.counts = self.counts + torch.stack([count for _, count in rows])
        for metric in self.torchmetrics.values():
            if real == output.shape[0]:
                metric.update(output, target)
            elif real:
                metric.update(output[:real], _head(target, real))
        if self.whole:
            self.outputs.append(([output, target], index))

    def finish(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        """The EpochMetrics on the evaluation's every output and target (on the host, in dataset order)."""
        for name, metric in self.whole.items():
            try:
                self.whole_values[name] = metric(outputs, targets)
            except Exception as error:
                kind = type(error) if type(error) in (ValueError, TypeError, RuntimeError, IndexError) else RuntimeError
                raise kind(f"metric {name!r} failed on the evaluation's outputs (shape {tuple(outputs.shape)}) "
                           f"and targets ({_describe(targets)}): {error}") from error  # fmt: skip

    def _sum(self, what: str, fn: Callable, output: torch.Tensor, target: Any, weight: torch.Tensor,
             real: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The sum of ``fn``'s values over one batch's real samples, and what it is a sum over.

        Values shaped like an integer target (one per sample, or per token) count where the
        target is not ``ignore_index``, as torch's loss counts them; other per-sample values
        (a sample's mean) count once per real sample.
        """
        values = fn(output, target)
        batch = output.shape[0]
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{what} returned {type(values).__name__}; it must return a tensor")
        if values.dim() == 0:  # a per-batch mean: exact when computed on the real samples only
            if 0 < real < batch:
                values = fn(output[:real], _head(target, real))
            return values.float() * real, weight.sum()
        if values.shape[0] != batch:
            raise ValueError(
                f"{what} returned shape {tuple(values.shape)}; it must give one value per sample "
                f"(first dimension {batch}) or one value per batch (a 0-d tensor)"
            )
        if isinstance(target, torch.Tensor) and values.shape == target.shape and not target.is_floating_point():
            counted = (target != self.ignore_index) & (weight.reshape(batch, *[1] * (target.dim() - 1)) > 0)
            return torch.where(counted, values.float(), 0.0).sum(), counted.sum().float()
        return (values.reshape(batch, -1).float().mean(dim=1) * weight).sum(), weight.sum()

    def figures(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Device scalars, not read: sums to add over replicas (the loss's and the functions', then
        what each is over), and each torchmetric's value (already the same on every replica)."""
        computed = [m.compute().float().reshape(()) for m in self.torchmetrics.values()]
        return [*self.sums.unbind(0), *self.counts.unbind(0)], computed

    def values(self, sums: Sequence[float], computed: Sequence[float]) -> tuple[float | None, dict[str, float]]:
        """(mean loss or None, {name: value}) from the read figures; a figure over no counted target is NaN."""
        width = len(sums) // 2
        means = [total / count if count else math.nan for total, count in zip(sums[:width], sums[width:])]
        by_name = dict(zip(self.functions, means[1:]))
        by_name.update(zip(self.torchmetrics, computed))
        by_name.update(self.whole_values)
        loss = means[0] if self.loss is not None else None
        return loss, {name: float(by_name[name]) for name in self.names}

    def check(self, output: Any, target: Any) -> None:
        """Runs the loss and every metric on one batch (traced, not run); errors name the culprit."""
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"the model or eval_step returned {type(output).__name__} as output; metrics need a tensor")
        batch = output.shape[0]
        weight = torch.ones(batch, device=output.device)
        checks: list[tuple[str, Callable[[], Any]]] = []
        if self.loss is not None:
            checks.append(("the loss", partial(self._sum, "the loss", self.loss, output, target, weight, batch)))
        for name, fn in self.functions.items():
            checks.append((f"metric {name!r}", partial(self._sum, f"metric {name!r}", fn, output, target, weight, batch)))
        for name, metric in self.torchmetrics.items():
            checks.append((f"metric {name!r}", partial(metric.update, output, target)))
        for name, metric in self.whole.items():  # on the host: one transfer of the first batch, before training
            checks.append((f"metric {name!r}", partial(_try_on_host, metric, output, target)))
        for what, run in checks:
            try:
                run()
            except Exception as error:
                message = (
                    f"{what} failed on the first validation batch (output shape {tuple(output.shape)}, "
                    f"target {_describe(target)}): {error}"
                )
                kind = type(error) if type(error) in (ValueError, TypeError, RuntimeError, IndexError) else RuntimeError
                raise kind(message) from error
        for metric in self.torchmetrics.values():
            metric.reset()


def _try_on_host(metric: EpochMetric, output: torch.Tensor, target: Any) -> None:
    if not isinstance(target, torch.Tensor) or target.dim() == 0 or target.shape[0] != output.shape[0]:
        raise TypeError(f"an EpochMetric needs a batch-first tensor target, but the target is {_describe(target)}")
    cpu_output, cpu_target = backend.current().devices.to_cpu([output, target])
    metric(cpu_output, cpu_target)


def _head(target: Any, n: int) -> Any:
    return target[:n] if isinstance(target, torch.Tensor) else target


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {value.dtype}"
    return type(value).__name__
