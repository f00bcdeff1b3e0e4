"""Keep the best epoch, stop early, end before a time budget runs out.

Pure decisions over per-epoch figures. Every replica feeds them the same
all-reduced figures (and the same all-reduced elapsed time), so every replica
decides the same thing at the same epoch: no replica waits alone at the next
collective.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

Mode = Literal["auto", "min", "max"]

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([dhms])")
_UNIT = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration(value: float | int | str | None) -> float | None:
    """Seconds from a number of seconds or a string like ``"8h30m"``, ``"90m"``, ``"1h 5m 30s"``.

    Raises:
        ValueError: a string that is not such a duration, or a value <= 0.
        TypeError: neither a number nor a string.
    """
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip().lower()
        parts = _DURATION.findall(text)
        if not parts or _DURATION.sub("", text).strip():
            raise ValueError(f"time_limit must be seconds or a duration like '8h30m' or '45m', but given {value!r}")
        seconds = sum(float(n) * _UNIT[u] for n, u in parts)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(f"time_limit must be seconds (a number) or a string like '8h30m', but given {value!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"time_limit must be a positive duration, but given {value!r}")
    return seconds


_LOWER_IS_BETTER = ("loss", "error", "mse", "mae", "rmse", "mape", "perplexity", "distance", "wer", "cer")
_HIGHER_IS_BETTER = ("accuracy", "f1", "fbeta", "auroc", "auc", "precision", "recall", "r2", "iou", "jaccard", "dice")


def resolve_mode(monitor: str, mode: str, higher_is_better: bool | None = None) -> str:
    """"min" or "max". "auto" asks the metric (torchmetrics' ``higher_is_better``), then its name.

    Raises:
        ValueError: ``mode`` is not allowed, or "auto" cannot tell from the name which way is better.
    """
    if mode not in get_args(Mode):
        raise ValueError(f"mode must be one of {get_args(Mode)}, but given {mode!r}")
    if mode != "auto":
        return mode
    if higher_is_better is not None:
        return "max" if higher_is_better else "min"
    name = monitor.lower()
    if any(word in name for word in _LOWER_IS_BETTER):
        return "min"
    if any(word in name for word in _HIGHER_IS_BETTER):
        return "max"
    raise ValueError(
        f"mode='auto' cannot tell whether monitor={monitor!r} should rise or fall; give mode='min' or mode='max'"
    )


@dataclass
class StopRule:
    """What the user asked for: the figure to watch, patience and a time budget."""

    monitor: str = "valid_loss"
    mode: str = "min"
    patience: int | None = None
    time_limit: float | None = None
    restore_best: bool = False


@dataclass
class Watch:
    """The best epoch so far and the epochs since; saved in checkpoints to resume."""

    best: float | None = None
    best_epoch: int = 0
    waited: int = 0

    def update(self, rule: StopRule, epoch: int, figures: dict[str, float]) -> bool:
        """Records epoch ``epoch``'s figures; True when the monitored one improved."""
        if rule.monitor not in figures:
            raise ValueError(f"monitor={rule.monitor!r} is not among this run's figures {sorted(figures)}")
        value = figures[rule.monitor]
        better = math.isfinite(value) and (
            self.best is None or (value < self.best if rule.mode == "min" else value > self.best)
        )
        if better:
            self.best, self.best_epoch, self.waited = value, epoch, 0
        else:
            self.waited += 1
        return better

    def early_stop(self, rule: StopRule) -> str | None:
        """Why to stop now, or None."""
        if rule.patience is not None and self.waited >= rule.patience:
            best = f"best {self.best:.4g} at epoch {self.best_epoch}" if self.best_epoch else ""
            best = best or f"no epoch had a finite {rule.monitor}"  # NaN every epoch so far
            return f"early stopping: {rule.monitor} did not improve for {self.waited} epoch(s); {best}"
        return None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def out_of_time(limit: float | None, elapsed: float, epochs_run: int, last_epoch: float | None = None) -> str | None:
    """Why not to start another epoch, or None: it would not end within ``limit`` seconds.

    The next epoch is estimated at the last one once two have run (the first also
    compiles, so it overstates a steady epoch), else at the first.
    """
    if limit is None or epochs_run == 0:
        return None
    per_epoch = last_epoch if epochs_run >= 2 and last_epoch is not None else elapsed / epochs_run
    if elapsed + per_epoch <= limit:
        return None
    return (
        f"time limit: {elapsed:.0f}s of {limit:.0f}s used and an epoch takes about {per_epoch:.0f}s, "
        f"so the next one would not finish"
    )
