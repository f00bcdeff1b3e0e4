"""Progress bars that read clean wherever training runs.

In a notebook with ipywidgets (Kaggle, Colab, Jupyter) a bar is a widget; in a
terminal it is a live text bar; anywhere else (a notebook without ipywidgets, a log file,
CI) there is no live bar, so each epoch leaves only its one summary line instead of
dozens of redrawn bar lines. tqdm.auto would fall back to the text bar in a notebook
without ipywidgets and warn "IProgress not found"; this module never does.

    from tpu_utility.progress import progress_bar, write_line
    bar = progress_bar(len(loader), "epoch 1/5")
    for batch in loader:
        ...
        bar.update(1)
    bar.close()
    write_line("epoch 1/5: train_loss 0.41 ...")   # stays, above any live bar

XLA (and torch.compile) compiles a graph the first time it meets it, so an epoch's first steps can take
half a minute each. ``CompileProgress`` says so while it happens: on the live bar's
label (``epoch 1/5 compiling (2 graphs so far)``), or, where there is no live bar, as
a line when compilation starts and one when it ends.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from typing import IO, Any, Callable, Literal

BarKind = Literal["widget", "terminal", "none"]


def _in_notebook() -> bool:
    """True inside a Jupyter kernel (the test tqdm.auto uses)."""
    ipython = sys.modules.get("IPython")
    if ipython is None:
        return False
    try:
        shell = ipython.get_ipython()
        return shell is not None and "IPKernelApp" in shell.config
    except Exception:  # an odd IPython: treat as no notebook
        return False


def _widgets_installed() -> bool:
    try:
        return importlib.util.find_spec("ipywidgets") is not None
    except (ImportError, ValueError):
        return False


def bar_kind(stream: IO[str] | None = None) -> BarKind:
    """Which bar fits here: "widget", "terminal" or "none" (no live bar, one line per epoch).

    Args:
        stream: Where a text bar would be written (default ``sys.stderr``).
    """
    if _in_notebook():
        return "widget" if _widgets_installed() else "none"
    stream = sys.stderr if stream is None else stream
    try:
        return "terminal" if stream.isatty() else "none"
    except (AttributeError, ValueError):  # a closed or file-like stream without isatty
        return "none"


def progress_bar(total: int, desc: str, enabled: bool = True, unit: str = "batch") -> Any:
    """A tqdm bar (an epoch's batches, files being cached) that disappears when closed.

    Args:
        total: Steps the bar counts, e.g. the batches of an epoch.
        desc: The bar's label, e.g. ``"epoch 1/5"``.
        enabled: False gives a silent bar (e.g. on every process but the master).
        unit: What one ``update(1)`` counts.

    Returns:
        A ``tqdm.notebook.tqdm`` (widget) or ``tqdm.std.tqdm`` (terminal, or disabled
        where no live bar fits); use ``update``, ``set_postfix`` and ``close`` as usual.

    Example:
        >>> # was: bar = tqdm(loader)   (dozens of lines per epoch in a saved notebook)
        >>> from tpu_utility.progress import progress_bar
        >>> bar = progress_bar(3, "epoch 1/5")
        >>> for _ in range(3):
        ...     bar.update(1)
        >>> bar.close()
    """
    kind = bar_kind() if enabled else "none"
    if kind == "widget":
        from tqdm.notebook import tqdm
    else:
        from tqdm.std import tqdm
    options: dict[str, Any] = {"total": total, "desc": desc, "unit": unit, "leave": False}
    if kind == "terminal":
        options["dynamic_ncols"] = True
    return tqdm(disable=kind == "none", **options)


def write_line(line: str) -> None:
    """Prints a line that stays (an epoch's summary) without breaking a live text bar."""
    from tqdm.std import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()  # a log piped to a file or `tee` gets the line now, not at exit


def format_duration(seconds: float) -> str:
    """``"45s"``, ``"3m05s"`` or ``"2h07m"``: a duration as a person reads it.

    Example:
        >>> format_duration(185.2)
        '3m05s'
    """
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def run_eta(epoch_seconds: list[float], epochs_left: int) -> float:
    """Seconds the run still needs: the epochs left at the pace of the latest epoch.

    Args:
        epoch_seconds: Each finished epoch's duration, compile time left out.
        epochs_left: Epochs still to run.

    Example:
        >>> run_eta([40.0, 12.0], epochs_left=3)   # epoch 1 compiled; 12 s an epoch since
        36.0
    """
    return epoch_seconds[-1] * epochs_left if epoch_seconds and epochs_left > 0 else 0.0


class CompileProgress:
    """Tells the user that XLA or torch.compile is compiling, while it is, instead of a bar that looks hung.

    Call ``after_step()`` once per batch. A batch during which the compile count rose
    was compiling: the live bar's label says so, with the graphs compiled so far; with
    no live bar (a log, a notebook without ipywidgets) a line marks where compilation
    starts and where it ends. The time of compiling batches is kept apart
    (``compile_seconds``), so a throughput can leave it out.

    Args:
        bar: The epoch's bar, from ``progress_bar`` (a disabled one means no live bar).
        desc: The bar's label, e.g. ``"epoch 1/5"``.
        count: Graphs compiled so far in this process (``backend.compile_count``).
        expect: True when the first steps will compile (the run's first epoch on XLA):
            the notice shows from the start, before the first batch's compile.
        speak: False keeps it silent (``progress=False``, or not the master process).

    Example:
        >>> from tpu_utility import backend
        >>> from tpu_utility.progress import CompileProgress, progress_bar
        >>> bar = progress_bar(3, "epoch 1/5")
        >>> notice = CompileProgress(bar, "epoch 1/5", backend.compile_count, expect=False, speak=True)
        >>> for _ in range(3):
        ...     bar.update(1)           # was: bar.update(1) alone, and a bar frozen at 2/44
        ...     notice.after_step()
        >>> bar.close()
    """

    def __init__(self, bar: Any, desc: str, count: Callable[[], int], expect: bool, speak: bool) -> None:
        self.bar, self.desc, self.count, self.speak = bar, desc, count, speak
        self.first = count()
        self.graphs = 0  # compiled during this epoch
        self.compile_seconds = 0.0
        self.steps = 0
        self.compiling = False
        self.started = time.perf_counter()
        self.last = self.started
        if expect:
            self._start()

    def after_step(self) -> None:
        """Records one batch: whether graphs were compiled during it, and how long it took."""
        now = time.perf_counter()
        graphs = self.count() - self.first
        took, self.last = now - self.last, now
        self.steps += 1
        if graphs > self.graphs:
            self.graphs = graphs
            self.compile_seconds += took
            self._show() if self.compiling else self._start()
            return
        if self.compiling and self.steps == 1:  # the first batch's graph compiles while the second is fetched
            self.compile_seconds += took
            return
        if self.compiling:
            self._end()

    def close(self) -> None:
        """Ends a notice still showing (an epoch that compiled until its last batch)."""
        if self.compiling:
            self._end()

    def _start(self) -> None:
        self.compiling = True
        if self.speak and self.bar.disable:
            write_line(f"{self.desc}: compiling graphs for the first steps (slow once; later steps reuse them)")
        self._show()

    def _show(self) -> None:
        if self.speak and not self.bar.disable:
            so_far = f" ({self.graphs} graph{'s' if self.graphs != 1 else ''} so far)" if self.graphs else ""
            self.bar.set_description_str(f"{self.desc} compiling graphs{so_far}", refresh=True)

    def _end(self) -> None:
        self.compiling = False
        if not self.speak:
            return
        if self.bar.disable:
            write_line(f"{self.desc}: compiled {self.graphs} graph(s) in {format_duration(self.compile_seconds)}; "
                       f"training at full speed")  # fmt: skip
        else:
            self.bar.set_description_str(self.desc, refresh=True)
