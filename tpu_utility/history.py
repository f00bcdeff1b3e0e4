"""History: what one_cycle_fit returns, one record per epoch, with .plot()."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EpochRecord:
    """One epoch's figures, read from the device once at the epoch's end.

    ``compiles`` is the process's cumulative graph-compile count after the epoch
    (flat from epoch 2 on when shapes are fixed); ``host_syncs`` counts
    ``.item()``-style reads and ``transfers`` device-to-host copies during the
    epoch (one per epoch is ours: the read of these figures).
    """

    epoch: int
    train_loss: float
    valid_loss: float | None
    metrics: dict[str, float]
    lr: float
    seconds: float
    samples_per_s: float
    compiles: int = 0
    host_syncs: int = 0
    transfers: int = 0

    def line(self, epochs: int) -> str:
        parts = [f"epoch {self.epoch}/{epochs}", f"train_loss {self.train_loss:.4f}"]
        if self.valid_loss is not None:
            parts.append(f"valid_loss {self.valid_loss:.4f}")
        parts += [f"{k} {v:.4f}" for k, v in self.metrics.items()]
        parts += [f"lr {self.lr:.2e}", f"{self.seconds:.1f}s", f"{self.samples_per_s:,.0f} samples/s"]
        return "  ".join(parts)


@dataclass
class History:
    """Per-epoch records of a run, plus the trained model.

    Example:
        >>> history = one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3)  # doctest: +SKIP
        >>> history.records[-1].metrics["accuracy"]                          # doctest: +SKIP
        >>> history.plot("history.png")                                     # doctest: +SKIP
    """

    records: list[EpochRecord] = field(default_factory=list)
    summary: str = ""
    model: Any = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> EpochRecord:
        return self.records[i]

    def to_dicts(self) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.records]

    @classmethod
    def from_dicts(cls, rows: list[dict[str, Any]]) -> History:
        return cls([EpochRecord(**row) for row in rows])

    def plot(self, path: str | None = None) -> Any:
        """Losses, metrics and learning rate per epoch; saved to ``path`` if given.

        Returns the matplotlib Figure (shown inline in a notebook).
        """
        import matplotlib.pyplot as plt

        epochs = [r.epoch for r in self.records]
        metric_names = sorted({k for r in self.records for k in r.metrics})
        fig, axes = plt.subplots(1, 2 + bool(metric_names), figsize=(5 * (2 + bool(metric_names)), 3.5))
        axes[0].plot(epochs, [r.train_loss for r in self.records], "o-", label="train")
        valid = [r.valid_loss if r.valid_loss is not None else math.nan for r in self.records]
        if any(not math.isnan(v) for v in valid):
            axes[0].plot(epochs, valid, "o-", label="valid")
        axes[0].set(title="loss", xlabel="epoch")
        axes[0].legend()
        axes[1].plot(epochs, [r.lr for r in self.records], "o-")
        axes[1].set(title="learning rate (end of epoch)", xlabel="epoch", yscale="log")
        if metric_names:
            for name in metric_names:
                axes[2].plot(epochs, [r.metrics.get(name, math.nan) for r in self.records], "o-", label=name)
            axes[2].set(title="validation metrics", xlabel="epoch")
            axes[2].legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig
