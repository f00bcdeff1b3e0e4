"""The one-cycle policy as pure functions of the step: no device, no optimizer.

Learning rate rises from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start``
of the optimizer steps, then falls to ``max_lr / (div_factor * final_div_factor)``;
both halves are cosine (fastai's shape, torch's ``OneCycleLR(anneal_strategy="cos")``).
Momentum (Adam's beta1) moves the other way, ``max_momentum -> base_momentum ->
max_momentum``.
"""

from __future__ import annotations

import math


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def one_cycle(
    step: int,
    total_steps: int,
    max_lr: float,
    pct_start: float = 0.25,
    div_factor: float = 25.0,
    final_div_factor: float = 1e4,
    base_momentum: float = 0.85,
    max_momentum: float = 0.95,
) -> tuple[float, float]:
    """Learning rate and momentum for optimizer step ``step`` (0-based) of ``total_steps``.

    Matches ``torch.optim.lr_scheduler.OneCycleLR`` with the same arguments.

    Example:
        >>> # was: sched = OneCycleLR(opt, max_lr=3e-3, total_steps=100); sched.step()
        >>> lr, momentum = one_cycle(0, 100, max_lr=3e-3)
        >>> round(lr, 6), momentum
        (0.00012, 0.95)
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be at least 1, but given {total_steps}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be between 0 and {total_steps - 1}, but given {step}")
    if not 0.0 < pct_start < 1.0:
        raise ValueError(f"pct_start must be between 0 and 1 (exclusive), but given {pct_start}")
    initial_lr = max_lr / div_factor
    min_lr = initial_lr / final_div_factor
    peak = float(pct_start * total_steps) - 1
    if step <= peak:
        pct = step / peak if peak > 0 else 1.0
        return _cos(initial_lr, max_lr, pct), _cos(max_momentum, base_momentum, pct)
    pct = (step - peak) / (total_steps - 1 - peak)
    return _cos(max_lr, min_lr, pct), _cos(base_momentum, max_momentum, pct)


def one_cycle_curve(total_steps: int, max_lr: float, **kwargs: float) -> tuple[list[float], list[float]]:
    """The whole schedule, ready to plot before training."""
    pairs = [one_cycle(s, total_steps, max_lr, **kwargs) for s in range(total_steps)]
    return [lr for lr, _ in pairs], [m for _, m in pairs]


def steps_per_epoch(num_samples: int, batch_size: int, replicas: int = 1) -> int:
    """Batches each replica really iterates per epoch.

    A DistributedSampler gives each replica ``ceil(n / replicas)`` samples; the
    short last batch is dropped so shapes stay fixed.
    """
    per_replica = -(-num_samples // replicas)
    return per_replica // batch_size


def total_optimizer_steps(batches_per_epoch: int, epochs: int, accumulate_steps: int = 1) -> int:
    """Optimizer steps in the whole run: the schedule's length on every core."""
    return (batches_per_epoch // accumulate_steps) * epochs
