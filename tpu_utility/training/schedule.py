"""Learning-rate schedules as pure functions of the step: no device, no optimizer.

The one-cycle policy (``one_cycle_fit``'s default): the learning rate rises from
``max_lr / div_factor`` to ``max_lr`` over ``pct_start`` of the optimizer steps, then
falls to ``max_lr / (div_factor * final_div_factor)``; both halves are cosine (fastai's
shape, torch's ``OneCycleLR(anneal_strategy="cos")``). Momentum (Adam's beta1) moves
the other way, ``max_momentum -> base_momentum -> max_momentum``.

The others are a multiplier of ``max_lr`` per step, ``schedule=`` of one_cycle_fit:
``linear_with_warmup`` and ``cosine_with_warmup`` (Hugging Face's ``get_scheduler("linear")``
and ``get_scheduler("cosine")``; the cosine is also timm's ``CosineLRScheduler`` with
``warmup_prefix=True``), ``constant_with_warmup``, or the user's own
``(step, total_steps) -> multiplier`` (``LrSchedule``). They leave momentum alone.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Callable, Literal, Union

from ..arguments import check_keywords, parameter_names

_MAX_STEPS = 2**53  # beyond this a step count is no longer exact as a float


@functools.lru_cache(maxsize=256)  # a constant schedule (or a plateau) writes one value every step
def unround(value: float) -> float:
    """``value``, or the next float32 above it where its float32 is a round number (0.9, 1e-3, 0.999).

    torch_xla uploads a Python-float hyperparameter as a scalar shared, by value, with every
    equal scalar of the step's graph: one-cycle's momentum passes exactly 0.9 (the middle of
    0.85 -> 0.95) and meets dropout's keep probability 0.9, the two inputs become one, and the
    step compiles a graph of its own mid-run. Models hold round numbers; one float32 step up
    (6e-8 at 0.9) keeps a schedule's value apart from them. 0 and 1 are left alone (torch_xla
    writes them into the graph as constants).

    Example:
        >>> unround(0.9) > 0.9 and unround(0.9) - 0.9 < 1e-7
        True
        >>> unround(0.8999123456789) == 0.8999123456789
        True
    """
    if not (0 < value < 3.4e38):
        return value
    single = _float32(value)
    if single == 1.0 or single != _float32(float(f"{single:.6g}")):  # not a number of 6 significant digits
        return value
    bits = struct.unpack("<I", struct.pack("<f", single))[0]
    return struct.unpack("<f", struct.pack("<I", bits + 1))[0]


def _float32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


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


def _check_total_steps(total_steps: object) -> None:
    if isinstance(total_steps, bool) or not isinstance(total_steps, int):
        raise TypeError(f"total_steps must be an int, but given {total_steps!r} of type {type(total_steps).__name__}")
    if not 1 <= total_steps <= _MAX_STEPS:
        raise ValueError(f"total_steps must be between 1 and {_MAX_STEPS}, but given {total_steps}")


class Default(float):
    """A one-cycle default as a signature holds it: equal to the number, but told apart from the same number given.

    ``one_cycle_fit(schedule=OneCycle(pct_start=0.3), pct_start=0.25)`` gives 0.25 (the default's value) beside a
    schedule that sets it too; only a default left unwritten is a ``Default``, so the given one is refused.

    Example:
        >>> OneCycle().pct_start == 0.25, is_default(OneCycle().pct_start), is_default(OneCycle(pct_start=0.25).pct_start)
        (True, True, False)
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return float.__repr__(self)


def is_default(value: object) -> bool:
    """Whether ``value`` is a default no caller wrote (``Default``)."""
    return isinstance(value, Default)


@dataclass(frozen=True)
class OneCycle:
    """The one-cycle policy's settings as one value, checked once when made: the arguments of
    ``torch.optim.lr_scheduler.OneCycleLR``, and whether ``max_lr`` is multiplied by the cores.

    ``one_cycle_fit`` takes one as ``schedule=OneCycle(pct_start=0.3)`` (``max_lr`` left out:
    the call's ``max_lr`` fills it) and hands it to its schedule callback; ``one_cycle`` and
    ``one_cycle_curve`` make one from their arguments. Its defaults are the only ones
    written: those functions' signatures read them (``OneCycle.pct_start`` is 0.25).

    Raises:
        ValueError: a setting outside its range (``max_lr``, ``div_factor`` and
            ``final_div_factor`` finite and > 0, ``pct_start`` in (0, 1), momenta in [0, 1)).
        TypeError: a setting that is not a number.

    Example:
        >>> # was: OneCycleLR(opt, max_lr=3e-3, total_steps=100, pct_start=0.3)
        >>> # one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3, schedule=OneCycle(pct_start=0.3))
        >>> lrs, momenta = OneCycle(3e-3, pct_start=0.3).curve(100)
        >>> round(max(lrs), 6), momenta[0]
        (0.003, 0.95)
    """

    max_lr: float | None = None  # None: filled by one_cycle_fit's max_lr
    pct_start: float = Default(0.25)
    div_factor: float = Default(25.0)
    final_div_factor: float = Default(1e4)
    base_momentum: float = Default(0.85)
    max_momentum: float = Default(0.95)
    scale_lr_by_cores: bool = False

    def __post_init__(self) -> None:
        _in_range("pct_start", self.pct_start, 0.0, 1.0, "between 0 and 1 (exclusive)")
        _in_range("div_factor", self.div_factor, 0.0, math.inf, "finite and > 0")
        _in_range("final_div_factor", self.final_div_factor, 0.0, math.inf, "finite and > 0")
        for name in ("base_momentum", "max_momentum"):
            if not 0.0 <= _number(name, getattr(self, name)) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), but given {getattr(self, name)!r}")
        if not isinstance(self.scale_lr_by_cores, bool):
            raise TypeError(f"scale_lr_by_cores must be True or False, but given {self.scale_lr_by_cores!r}")
        if self.max_lr is None:
            return
        _in_range("max_lr", self.max_lr, 0.0, math.inf, "finite and > 0")
        lowest = float(self.max_lr) / float(self.div_factor) / float(self.final_div_factor)
        if not (math.isfinite(float(self.max_lr) / float(self.div_factor)) and lowest > 0.0):
            raise ValueError(
                f"max_lr / div_factor / final_div_factor must be a finite learning rate > 0, but given "
                f"{self.max_lr!r} / {self.div_factor!r} / {self.final_div_factor!r}"
            )

    def curve(self, total_steps: int) -> tuple[list[float], list[float]]:
        """Learning rates and momenta of every step of a ``total_steps`` run.

        Raises:
            ValueError: ``total_steps`` not in [1, 2**53]; TypeError: not an int.
        """
        _check_total_steps(total_steps)
        if self.max_lr is None:
            raise ValueError("OneCycle() has no max_lr to draw a curve of: give OneCycle(max_lr, ...), or give it as "
                             "one_cycle_fit's schedule=, whose max_lr fills it")  # fmt: skip
        pairs = [_one_cycle(step, total_steps, self) for step in range(total_steps)]
        return [lr for lr, _ in pairs], [m for _, m in pairs]


def _cos(start: float, end: float, pct: float) -> float:
    return end + (start - end) / 2.0 * (math.cos(math.pi * pct) + 1)


def one_cycle(
    step: int,
    total_steps: int,
    max_lr: float,
    pct_start: float = OneCycle.pct_start,
    div_factor: float = OneCycle.div_factor,
    final_div_factor: float = OneCycle.final_div_factor,
    base_momentum: float = OneCycle.base_momentum,
    max_momentum: float = OneCycle.max_momentum,
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
    _check_total_steps(total_steps)
    cycle = OneCycle(max_lr=max_lr, pct_start=pct_start, div_factor=div_factor, final_div_factor=final_div_factor,
                     base_momentum=base_momentum, max_momentum=max_momentum)  # fmt: skip
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, but given {step!r} of type {type(step).__name__}")
    if not 0 <= step < total_steps:
        raise ValueError(f"step must be between 0 and {total_steps - 1}, but given {step}")
    return _one_cycle(step, total_steps, cycle)


def _one_cycle(step: int, total_steps: int, cycle: OneCycle) -> tuple[float, float]:
    """``one_cycle`` of a checked cycle and step count."""
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
    check_keywords(kwargs, parameter_names(one_cycle, ("step", "total_steps", "max_lr")), "one_cycle_curve")
    _check_total_steps(total_steps)  # first, as one_cycle does
    return OneCycle(max_lr, **kwargs).curve(total_steps)


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


# ------------------------------------------------------- schedules beside one-cycle
ScheduleName = Literal["one_cycle", "linear", "cosine", "constant"]


def linear_with_warmup(step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """Multiplier of ``max_lr`` at optimizer step ``step``: 0 to 1 over the warm-up, then linearly down to 0.

    Hugging Face's ``get_linear_schedule_with_warmup`` (``get_scheduler("linear")``),
    the default for fine-tuning transformers: it reaches 0 at ``total_steps``, so the
    last step still moves.

    Example:
        >>> # was: sched = get_scheduler("linear", opt, num_warmup_steps=10, num_training_steps=100)
        >>> [round(linear_with_warmup(s, 100, 10), 3) for s in (0, 5, 10, 55, 99)]
        [0.0, 0.5, 1.0, 0.5, 0.011]
    """
    if step < warmup_steps:
        return step / warmup_steps
    return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))


def cosine_with_warmup(step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """Multiplier of ``max_lr``: 0 to 1 over the warm-up, then half a cosine down to 0 at ``total_steps``.

    Hugging Face's ``get_cosine_schedule_with_warmup`` (``get_scheduler("cosine")``), and
    timm's ``CosineLRScheduler(t_initial=total_steps - warmup_steps, warmup_t=warmup_steps,
    warmup_prefix=True, t_in_epochs=False)`` (``lr_min`` and ``warmup_lr_init`` 0).

    Example:
        >>> # was: sched = get_cosine_schedule_with_warmup(opt, num_warmup_steps=10, num_training_steps=110)
        >>> [round(cosine_with_warmup(s, 110, 10), 3) for s in (0, 5, 10, 60, 109)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """
    if step < warmup_steps:
        return step / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def constant_with_warmup(step: int, total_steps: int, warmup_steps: int = 0) -> float:
    """Multiplier of ``max_lr``: 0 to 1 over the warm-up, then 1 (``get_scheduler("constant_with_warmup")``).

    Example:
        >>> # was: sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=4)
        >>> [constant_with_warmup(s, 100, 4) for s in (0, 2, 4, 99)]
        [0.0, 0.5, 1.0, 1.0]
    """
    return step / warmup_steps if step < warmup_steps else 1.0


MULTIPLIERS: dict[str, Callable[[int, int, int], float]] = {
    "linear": linear_with_warmup,
    "cosine": cosine_with_warmup,
    "constant": constant_with_warmup,
}


def check_warmup(warmup: object) -> None:
    """``warmup`` is a fraction of the steps (a float in [0, 1)) or a number of steps (an int >= 0).

    The convention of Hugging Face's ``TrainingArguments(warmup_steps=...)``.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, Real):
        raise TypeError(f"warmup must be a fraction of the optimizer steps (a float in [0, 1)) or a number of "
                        f"steps (an int >= 0), but given {warmup!r} of type {type(warmup).__name__}")  # fmt: skip
    if isinstance(warmup, Integral):
        if warmup < 0:
            raise ValueError(f"warmup must be a number of steps >= 0 or a fraction in [0, 1), but given {warmup!r}")
        return
    if not (math.isfinite(warmup) and 0.0 <= warmup < 1.0):
        raise ValueError(f"warmup must be a fraction of the optimizer steps in [0, 1) (a float) or a number of "
                         f"steps (an int), but given {warmup!r}")  # fmt: skip


def warmup_steps(warmup: float | int, total_steps: int) -> int:
    """A checked ``warmup`` (``check_warmup``) as optimizer steps of a ``total_steps`` run.

    A fraction rounds up, as Hugging Face's ``TrainingArguments.get_warmup_steps`` does;
    a step count must leave at least one step after the warm-up.

    Example:
        >>> warmup_steps(0.1, 95), warmup_steps(0.0, 95), warmup_steps(20, 95)
        (10, 0, 20)
    """
    if not isinstance(warmup, Integral):
        return math.ceil(total_steps * warmup)
    if warmup >= total_steps:
        raise ValueError(f"warmup={warmup!r} steps must be fewer than this run's {total_steps} optimizer steps; "
                         f"give fewer, or a fraction of the steps (warmup=0.1)")  # fmt: skip
    return int(warmup)


Shape = Union[str, Callable[[int, int], float], None]


@dataclass(repr=False)
class LrSchedule:
    """``max_lr`` times a multiplier per optimizer step: every ``schedule=`` of one_cycle_fit but one-cycle.

    ``shape`` is "linear", "cosine" or "constant" (with ``warmup``), a function
    ``(step, total_steps) -> multiplier of max_lr``, or None: no curve, the lr is the
    optimizer's own (set by the user's callbacks or a scheduler they step), starting
    at ``max_lr``.
    """

    shape: Shape
    max_lr: float
    warmup: float | int = 0
    scale_lr_by_cores: bool = False

    def check(self) -> None:
        """Raises a ValueError/TypeError naming a bad ``max_lr`` or ``warmup``."""
        _in_range("max_lr", self.max_lr, 0.0, math.inf, "finite and > 0")
        check_warmup(self.warmup)
        if self.warmup and not isinstance(self.shape, str):
            given = "schedule=None" if self.shape is None else f"schedule={self.name}"
            raise ValueError(f"warmup={self.warmup!r} shapes schedule='linear', 'cosine' or 'constant'; with "
                             f"{given} the warm-up is yours to give (leave warmup out)")  # fmt: skip

    @property
    def name(self) -> str:
        """The shape's name, or the function's (``module.qualname``): the same for the same code, run to run."""
        if self.shape is None or isinstance(self.shape, str):
            return str(self.shape)
        qualname = getattr(self.shape, "__qualname__", type(self.shape).__name__)
        return f"{getattr(self.shape, '__module__', '')}.{qualname}"

    def multipliers(self, total_steps: int) -> list[float]:
        """The multiplier of ``max_lr`` at each of ``total_steps`` steps; a function's values are checked."""
        if isinstance(self.shape, str):
            curve, warm = MULTIPLIERS[self.shape], warmup_steps(self.warmup, total_steps)
            return [curve(step, total_steps, warm) for step in range(total_steps)]
        values = [self.shape(step, total_steps) for step in range(total_steps)]
        for step, value in enumerate(values):
            if isinstance(value, bool) or not isinstance(value, Real) or not (math.isfinite(value) and value >= 0):
                raise ValueError(f"schedule={self.name} must return a finite multiplier of max_lr >= 0 for every "
                                 f"step, but schedule({step}, {total_steps}) returned {value!r}")  # fmt: skip
        return [float(v) for v in values]

    def __repr__(self) -> str:  # a checkpoint's fingerprint: no memory address
        return (f"LrSchedule(shape={self.name!r}, max_lr={self.max_lr!r}, warmup={self.warmup!r}, "
                f"scale_lr_by_cores={self.scale_lr_by_cores!r})")  # fmt: skip
