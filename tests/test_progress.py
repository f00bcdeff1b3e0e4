"""Epoch bars: a widget in a notebook with ipywidgets, one line per epoch everywhere else."""

import io

import nbformat
import pytest

from conftest import ROOT, blocking, run_python
from tpu_utility.progress import bar_kind, progress_bar

EPOCHS = """
from tpu_utility.progress import bar_kind, progress_bar, write_line
print("kind:", bar_kind())
for epoch in range(3):
    bar = progress_bar(40, f"epoch {epoch + 1}/3")
    for _ in range(40):
        bar.update(1)
    bar.close()
    write_line(f"epoch {epoch + 1}/3: train_loss 0.5")
"""


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_terminal_gets_a_live_bar_and_a_log_gets_none():
    assert bar_kind(_Tty()) == "terminal"
    assert bar_kind(io.StringIO()) == "none"
    silent = progress_bar(10, "epoch 1/1", enabled=False)
    assert silent.disable


def test_outside_a_terminal_each_epoch_leaves_one_line():
    r = run_python(EPOCHS)  # stdout and stderr are pipes, as in CI or `make demo | tee log`
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["kind: none"] + [f"epoch {e}/3: train_loss 0.5" for e in (1, 2, 3)]
    assert r.stderr == ""  # no redrawn bar lines


@pytest.mark.parametrize("widgets", [True, False], ids=["ipywidgets", "no-ipywidgets"])
def test_in_a_notebook(widgets, tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel imports this tree's tpu_utility
    if widgets:
        pytest.importorskip("ipywidgets")
    from nbclient import NotebookClient

    cells = ([] if widgets else [blocking("ipywidgets")]) + [EPOCHS]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[-1].outputs
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    stderr = "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr")
    widget_views = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert stdout.splitlines()[0] == f"kind: {'widget' if widgets else 'none'}"
    assert [line for line in stdout.splitlines()[1:]] == [f"epoch {e}/3: train_loss 0.5" for e in (1, 2, 3)]
    assert stderr == ""  # no text bar redrawn into the cell, no "IProgress not found" warning
    assert len(widget_views) == (3 if widgets else 0)  # one widget bar per epoch
