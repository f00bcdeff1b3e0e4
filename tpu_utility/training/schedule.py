"""The one-cycle policy as pure functions of the step: no device, no optimizer.

Learning rate rises from ``max_lr / div_factor`` to ``max_lr`` over ``pct_start``
of the optimizer steps, then falls to ``max_lr / (div_factor * final_div_factor)``;
both halves are cosine (fastai's shape, torch's ``OneCycleLR(anneal_strategy="cos")``).
Momentum (Adam's beta1) moves the other way, ``max_momentum -> base_momentum ->
max_momentum``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from numbers import Real

_MAX_STEPS = 2**53  # beyond this a step count is no longer exact as a float


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, but given {value!r} of type {type(value).__name__}")
    return float(value)


def _in_range(name: str, value: object, low: float, high: float, allowed: str) -> float:
    """``value`` as a float, or a ValueError naming it and the range; ``low``/``high`` are exclusive."""
    number = _number(name, value)
    if not (math.isfinite(number) and low < number < high):
        raise ValueError(f"{name} must be {allowed}, but given {value!r}")
    return number


def check_one_cycle(total_steps: int, max_lr: float, pct_start: float, div_factor: float, final_div_factor: float,
           momenta: tuple[float, float]) -> None:  # fmt: skip
    """Raises a ValueError/TypeError naming any one-cycle argument outside its range.

    ``one_cycle``, ``one_cycle_curve`` and ``one_cycle_fit`` (before any epoch) check with it.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int):
        raise TypeError(f"total_steps must be an int, but given {total_steps!r} of type {type(total_steps).__name__}")
    if not 1 <= total_steps <= _MAX_STEPS:
        raise ValueError(f"total_steps must be between 1 and {_MAX_STEPS}, but given {total_steps}")
    _in_range("max_lr", max_lr, 0.0, math.inf, "finite and > 0")
    _in_range("pct_start", pct_start, 0.0, 1.0, "between 0 and 1 (exclusive)")
    _in_range("div_factor", div_factor, 0.0, math.inf, "finite and > 0")
    _in_range("final_div_factor", final_div_factor, 0.0, math.inf, "finite and > 0")
    for name, value in zip(("base_momentum", "max_momentum"), momenta):
        if not 0.0 <= _number(name, value) < 1.0:
            raise ValueError(f"{name} must be in [0, 1), but given {value!r}")
    lowest = float(max_lr) / float(div_factor) / float(final_div_factor)
    if not (math.isfinite(float(max_lr) / float(div_factor)) and lowest > 0.0):
        raise ValueError(
            f"max_lr / div_factor / final_div_factor must be a finite learning rate > 0, but given "
            f"{max_lr!r} / {div_factor!r} / {final_div_factor!r}"
        )


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

    Raises:
        ValueError: an argument outside its range (``total_steps`` >= 1, ``step`` in
            [0, total_steps), ``max_lr``, ``div_factor`` and ``final_div_factor``
            finite and > 0, ``pct_start`` in (0, 1), momenta in [0, 1)).
        TypeError: a step count that is not an int, or a value that is not a number.

    Example:
        >>> # was: sched = OneCycleLR(opt, max_lr=3e-3, total_steps=100); sched.step()
        >>> lr, momentum = one_cycle(0, 100, max_lr=3e-3)
        >>> round(lr, 6), momentum
        (0.00012, 0.95)
    """
    check_one_cycle(total_steps, max_lr, pct_start, div_factor, final_div_factor, (base_momentum, max_momentum))
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, but given {step!r} of type {type(step).__name__}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be between 0 and {total_steps - 1}, but given {step}")
    cycle = OneCycle(max_lr, pct_start, div_factor, final_div_factor, base_momentum, max_momentum)
    return _one_cycle(step, total_steps, cycle)


@dataclass
class OneCycle:
    """The schedule's arguments, as in ``torch.optim.lr_scheduler.OneCycleLR``."""

    max_lr: float
    pct_start: float = 0.25
    div_factor: float = 25.0
    final_div_factor: float = 1e4
    base_momentum: float = 0.85
    max_momentum: float = 0.95
    scale_lr_by_cores: bool = False

    def check(self) -> None:
        """Raises a ValueError/TypeError naming any argument outside its range."""
        momenta = (self.base_momentum, self.max_momentum)
        check_one_cycle(1, self.max_lr, self.pct_start, self.div_factor, self.final_div_factor, momenta)

    def curve(self, total_steps: int, max_lr: float) -> tuple[list[float], list[float]]:
        """Learning rates and momenta of ``total_steps`` steps peaking at ``max_lr`` (``self.max_lr``, maybe scaled)."""
        shape = {k: v for k, v in asdict(self).items() if k not in ("max_lr", "scale_lr_by_cores")}
        return one_cycle_curve(total_steps, max_lr, **shape)


def _one_cycle(step: int, total_steps: int, cycle: OneCycle) -> tuple[float, float]:
    """``one_cycle`` without its checks, for a whole curve checked once."""
    initial_lr = cycle.max_lr / cycle.div_factor
    min_lr = initial_lr / cycle.final_div_factor
    peak = float(cycle.pct_start * total_steps) - 1
    high, low = cycle.max_momentum, cycle.base_momentum
    if step <= peak:
        pct = step / peak if peak > 0 else 1.0
        return _cos(initial_lr, cycle.max_lr, pct), _cos(high, low, pct)
    pct = min(1.0, (step - peak) / max(total_steps - 1 - peak, 1e-300))  # no 0/0 when pct_start rounds to 1
    return _cos(cycle.max_lr, min_lr, pct), _cos(low, high, pct)


def one_cycle_curve(total_steps: int, max_lr: float, **kwargs: float) -> tuple[list[float], list[float]]:
    """The whole schedule, ready to plot before training.

    Example:
        >>> # was: lrs = [sched.get_last_lr()[0] for _ in range(total) if not sched.step()]
        >>> lrs, momenta = one_cycle_curve(100, max_lr=3e-3)
        >>> len(lrs), round(max(lrs), 6)
        (100, 0.003)
    """
    one_cycle(0, total_steps, max_lr, **kwargs)  # checks the arguments once, even for total_steps=0
    cycle = OneCycle(max_lr, **kwargs)
    pairs = [_one_cycle(s, total_steps, cycle) for s in range(total_steps)]
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


def peak_ratios(group_lrs: list[float], optimizer_lr: float | None) -> list[float]:
    """Each parameter group's share of ``max_lr``: its own lr over the optimizer's ``lr``.

    fastai's ``fit_one_cycle`` takes a peak per group; here the optimizer says it.
    A group built with ``{"params": backbone, "lr": 1e-4}`` in an optimizer made
    with ``lr=1e-3`` peaks at a tenth of ``max_lr``. One group always peaks at ``max_lr``.

    Example:
        >>> peak_ratios([1e-4, 1e-3], 1e-3)
        [0.1, 1.0]
        >>> peak_ratios([5e-4], 1e-3)
        [1.0]
    """
    if len(group_lrs) == 1:
        return [1.0]
    if not optimizer_lr or not math.isfinite(optimizer_lr) or optimizer_lr < 0:
        raise ValueError(f"the optimizer's lr must be a positive number to scale its {len(group_lrs)} parameter "
                         f"groups' peaks by, but it is {optimizer_lr!r}")  # fmt: skip
    return [lr / optimizer_lr for lr in group_lrs]
