"""Validation metrics summed on the device, exact on any number of cores.

A metric is a name ("accuracy"), a function ``(output, target) -> values`` that
returns one value per sample or one value per batch (its mean), or a
torchmetrics ``Metric`` (updated on the device, computed once per evaluation).
Padded samples never count: per-sample values are masked, and per-batch
functions and torchmetrics see only the real samples of a padded batch.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial
from typing import Any, Callable, Sequence

import torch

from .. import backend

MetricFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-sample correctness of the arg-max class (1.0 or 0.0)."""
    return (output.argmax(dim=-1) == target).float()


METRICS: dict[str, MetricFn] = {"accuracy": accuracy}


def is_torchmetric(metric: Any) -> bool:
    """A torchmetrics ``Metric`` (recognised without importing torchmetrics)."""
    return any(cls.__module__.startswith("torchmetrics") and cls.__name__ == "Metric" for cls in type(metric).__mro__)


def metric_name(metric: Any) -> str:
    if is_torchmetric(metric):
        return type(metric).__name__
    return getattr(metric, "__name__", type(metric).__name__)


# the columns History and the monitor already use, and evaluate's "loss"
RESERVED_NAMES = ("epoch", "train_loss", "valid_loss", "loss", "lr", "seconds", "samples_per_s", "compiles", "host_syncs",
                  "transfers")  # fmt: skip


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
        elif not callable(metric):
            raise TypeError(f"metrics must be names, functions or torchmetrics Metrics, but given {metric!r}")
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
        self.functions = {k: m for k, m in metrics.items() if not is_torchmetric(m)}
        self.torchmetrics = {k: copy.deepcopy(m).to(device) for k, m in metrics.items() if is_torchmetric(m)}
        self.names = list(metrics)
        self.device = device
        for metric in self.torchmetrics.values():
            metric.reset()
            sync_fn = backend.metric_sync_fn()
            if sync_fn is not None:  # one process per core on XLA: sync their states over XLA collectives
                metric.dist_sync_fn = sync_fn
                metric.distributed_available_fn = lambda: True
        self.sums = self.count = None  # created by reset(), at the start of each evaluation

    def reset(self) -> None:
        width = 1 + len(self.functions)
        self.sums = torch.zeros(width, device=self.device)
        self.count = torch.zeros((), device=self.device)
        for metric in self.torchmetrics.values():
            metric.reset()

    def update(self, output: torch.Tensor, target: Any, index: torch.Tensor, real: int) -> None:
        """Adds one batch; ``index`` is -1 for padding, ``real`` the real samples (host-known)."""
        weight = (index >= 0).float()
        rows = [self._sum("the loss", self.loss, output, target, weight, real) if self.loss is not None
                else torch.zeros((), device=output.device)]  # fmt: skip
        rows += [self._sum(f"metric {k!r}", fn, output, target, weight, real) for k, fn in self.functions.items()]
        self.sums = self.sums + torch.stack(rows)
        self.count = self.count + weight.sum()
        for metric in self.torchmetrics.values():
            if real == output.shape[0]:
                metric.update(output, target)
            elif real:
                metric.update(output[:real], _head(target, real))

    @staticmethod
    def _sum(what: str, fn: Callable, output: torch.Tensor, target: Any, weight: torch.Tensor, real: int) -> torch.Tensor:
        """The sum of ``fn``'s values over the real samples of one batch."""
        values = fn(output, target)
        batch = output.shape[0]
        if not isinstance(values, torch.Tensor):
            raise TypeError(f"{what} returned {type(values).__name__}; it must return a tensor")
        if values.dim() == 0:  # a per-batch mean: exact when computed on the real samples only
            if 0 < real < batch:
                values = fn(output[:real], _head(target, real))
            return values.float() * real
        if values.shape[0] != batch:
            raise ValueError(
                f"{what} returned shape {tuple(values.shape)}; it must give one value per sample "
                f"(first dimension {batch}) or one value per batch (a 0-d tensor)"
            )
        return (values.reshape(batch, -1).float().mean(dim=1) * weight).sum()

    def figures(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Device scalars, not read: sums to add over replicas (loss, functions, count),
        and each torchmetric's value (already the same on every replica)."""
        computed = [m.compute().float().reshape(()) for m in self.torchmetrics.values()]
        return [*self.sums.unbind(0), self.count], computed

    def values(self, sums: Sequence[float], computed: Sequence[float]) -> tuple[float | None, dict[str, float]]:
        """(mean loss or None, {name: value}) from the read figures."""
        count = sums[-1]
        by_name = {k: v / count for k, v in zip(self.functions, sums[1:-1])}
        by_name.update(zip(self.torchmetrics, computed))
        loss = sums[0] / count if self.loss is not None else None
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


def _head(target: Any, n: int) -> Any:
    return target[:n] if isinstance(target, torch.Tensor) else target


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} {value.dtype}"
    return type(value).__name__
