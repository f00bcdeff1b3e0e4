"""History: what one_cycle_fit returns, one record per epoch, with .plot()."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ..files import check_file_path
from .graphs import CompiledGraph



def closed_figure(figsize: tuple[float, float]) -> Any:
    """A pyplot figure, closed at once: a notebook shows it once, as the cell's value.

    Made by pyplot so that a notebook's inline backend is loaded and renders the
    returned figure as an image (a bare ``Figure`` shows as ``<Figure size ...>``
    text when nothing imported pyplot); closed so the backend does not show it a
    second time at the cell's end, and no figure stays open.
    """
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=figsize)
    plt.close(fig)
    return fig


@dataclass
class EpochRecord:
    """One epoch's figures, read from the device once at the epoch's end.

    ``compiles`` is the process's cumulative graph-compile count after the epoch
    (flat from epoch 2 on when shapes are fixed); ``host_syncs`` counts
    ``.item()``-style reads and ``transfers`` device-to-host copies during the
    epoch (one per epoch is ours: the read of these figures). ``seconds`` is the
    whole epoch; ``samples_per_s`` leaves out the time spent compiling XLA graphs
    (the first epoch's first steps and first validation pass), so epoch 1 compares
    with the rest. For token data that knows its real tokens (``PackedDataset``),
    ``tokens_per_s`` gives the data's (non-pad) tokens per second, on the same clock, and
    ``mfu`` the model FLOPs utilization where the chip's bf16 peak is known
    (``training/throughput.py`` says how both are counted); None otherwise.
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
    tokens_per_s: float | None = None
    mfu: float | None = None

    def line(self, epochs: int) -> str:
        parts = [f"epoch {self.epoch}/{epochs}", f"train_loss {self.train_loss:.4f}"]
        if self.valid_loss is not None:
            parts.append(f"valid_loss {self.valid_loss:.4f}")
        parts += [f"{k} {v:.4f}" for k, v in self.metrics.items()]
        parts += [f"lr {self.lr:.2e}", f"{self.seconds:.1f}s", f"{self.samples_per_s:,.0f} samples/s"]
        if self.tokens_per_s is not None:
            parts.append(f"{self.tokens_per_s:,.0f} tokens/s")
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        return "  ".join(parts)


@dataclass
class History:
    """Per-epoch records of a run, the per-step schedule, why it stopped, and the model.

    On XLA, ``graphs`` lists each graph the run compiled (``CompiledGraph``: the train step, the eval step, each
    bucket's, the epoch's read), with its compile seconds, its size in IR nodes and why it compiled.

    Example:
        >>> history = one_cycle_fit(model, train_ds, epochs=5, max_lr=3e-3)  # doctest: +SKIP
        >>> history.records[-1].metrics["accuracy"]                          # doctest: +SKIP
        >>> history.to_csv("history.csv")                                   # doctest: +SKIP
        >>> history.plot("history.png")                                     # doctest: +SKIP
        >>> print(*history.graphs, sep="\n")                                # doctest: +SKIP
    """

    records: list[EpochRecord] = field(default_factory=list)
    summary: str = ""
    model: Any = field(default=None, repr=False)
    stop_reason: str = ""
    best_epoch: int | None = None
    step_lrs: list[float] = field(default_factory=list, repr=False)
    step_momenta: list[float] = field(default_factory=list, repr=False)
    momentum_name: str = "momentum"  # the optimizer's own name for it: "beta1" for Adam-likes
    steps_per_epoch: int = 0
    graphs: list[CompiledGraph] = field(default_factory=list, repr=False)  # XLA's, each with its seconds and cause

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> EpochRecord:
        return self.records[i]

    def to_dicts(self) -> list[dict[str, Any]]:
        """The records as nested dicts (metrics in a dict), as checkpoints store them."""
        return [asdict(r) for r in self.records]

    @classmethod
    def from_dicts(cls, rows: list[dict[str, Any]]) -> History:
        """A History from ``to_dicts()``'s rows (a checkpoint's ``"history"``).

        Raises:
            TypeError: a row that is not a dict.
            ValueError: a row with a key EpochRecord lacks, or without one it needs, named
                with the fields it takes.
        """
        fields = {f.name: f for f in dataclasses.fields(EpochRecord)}
        needed = [name for name, f in fields.items() if f.default is dataclasses.MISSING]
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"History.from_dicts takes dicts (to_dicts()'s rows), but row {i} is {row!r}")
            unknown, missing = [k for k in row if k not in fields], [k for k in needed if k not in row]
            if unknown or missing:
                wrong = f"has {unknown}, which EpochRecord does not take" if unknown else f"lacks {missing}"
                raise ValueError(
                    f"History.from_dicts: row {i} {wrong}; a row holds {list(fields)}, with each metric inside "
                    f"its 'metrics' dict, as History.to_dicts() writes it (to_rows() flattens them for a CSV)"
                )
        return cls([EpochRecord(**row) for row in rows])

    def to_rows(self) -> list[dict[str, Any]]:
        """Flat rows, one per epoch, each metric a column of its own."""
        rows = []
        for record in self.records:
            row = asdict(record)
            row.update(row.pop("metrics"))
            rows.append(row)
        return rows

    def to_csv(self, path: str) -> None:
        """Writes the flat rows to ``path`` (atomically: a crash leaves the previous file)."""
        import csv
        import io

        from ..files import atomic_write

        rows = self.to_rows()
        columns = list(dict.fromkeys(k for row in rows for k in row)) or ["epoch"]
        with atomic_write(path, durable=False) as raw, io.TextIOWrapper(raw, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)

    def to_pandas(self) -> Any:
        """The flat rows as a pandas DataFrame (needs pandas)."""
        try:
            import pandas as pd
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError("History.to_pandas needs pandas: pip install pandas (or use to_rows())") from error
        return pd.DataFrame(self.to_rows())

    def plot(self, path: str | None = None) -> Any:
        """Losses and metrics per epoch, and the learning rate (and momentum) per step.

        Saved to ``path`` if given. Returns the matplotlib Figure, which a notebook
        shows once, as the cell's value (``history.plot()``, without a semicolon).
        """
        from matplotlib.ticker import MaxNLocator

        epochs = [r.epoch for r in self.records]
        metric_names = list(dict.fromkeys(k for r in self.records for k in r.metrics))
        panels = 2 + bool(metric_names)
        if path is not None:  # before drawing; matplotlib would write a folder "x" as "x.png" beside it
            check_file_path(path, "plot path")
        fig = closed_figure(figsize=(5 * panels, 3.5))
        axes = fig.subplots(1, panels)
        axes[0].plot(epochs, [r.train_loss for r in self.records], "o-", label="train")
        valid = [r.valid_loss if r.valid_loss is not None else math.nan for r in self.records]
        if any(not math.isnan(v) for v in valid):
            axes[0].plot(epochs, valid, "o-", label="valid")
        if self.best_epoch:
            axes[0].axvline(self.best_epoch, color="tab:green", linestyle=":", label=f"best (epoch {self.best_epoch})")
        axes[0].set(title="loss", xlabel="epoch")
        axes[0].legend()
        self._plot_schedule(axes[1])
        if metric_names:
            for name in metric_names:
                axes[2].plot(epochs, [r.metrics.get(name, math.nan) for r in self.records], "o-", label=name)
            axes[2].set(title="validation metrics", xlabel="epoch")
            axes[2].legend()
        for ax in axes:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def _plot_schedule(self, ax: Any) -> None:
        """The per-step learning rate and, on a second axis, the momentum (named as the optimizer names it)."""
        if self.step_lrs and self.steps_per_epoch:
            x = [(i + 1) / self.steps_per_epoch for i in range(len(self.step_lrs))]
            ax.plot(x, self.step_lrs, color="tab:blue", label="learning rate")
            ax.set(xlabel="epoch", ylabel="learning rate")
            ax.set_title("schedule per optimizer step", pad=22)  # room for the legend above the curves
            lines = ax.get_lines()
            if self.step_momenta:
                twin = ax.twinx()
                lines += twin.plot(x, self.step_momenta, color="tab:orange", label=self.momentum_name)
                twin.set_ylabel(self.momentum_name)
            ax.legend(lines, [line.get_label() for line in lines], loc="lower center", bbox_to_anchor=(0.5, 1.0),
                      ncol=2, frameon=False, borderaxespad=0.1)  # fmt: skip
            return
        ax.plot([r.epoch for r in self.records], [r.lr for r in self.records], "o-")
        ax.set(title="learning rate (end of epoch)", xlabel="epoch", yscale="log")
