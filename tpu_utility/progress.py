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
"""

from __future__ import annotations

import importlib.util
import sys
from typing import IO, Any, Literal

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
