"""The quickstart notebook runs top to bottom on XLA:CPU, and stays in git without outputs."""

import os
import re

import nbformat
import pytest

from conftest import ROOT, xla_flags

NOTEBOOK = os.path.join(ROOT, "notebooks", "kaggle_quickstart.ipynb")


def _code_cells():
    return [c for c in nbformat.read(NOTEBOOK, as_version=4).cells if c.cell_type == "code"]


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"cells {dirty} keep outputs; clear them before committing (Kernel > Restart & Clear Output)"


def test_notebook_uses_only_the_public_api():
    private = re.compile(r"tpu_utility\.(xla|backend|_\w+)\b|from tpu_utility import[^\n]*\b(xla|backend)\b|\b(xla|backend)\.\w+\(")
    bad = [c.source for c in _code_cells() if private.search(c.source)]
    assert not bad, f"cells use the private package tpu_utility.backend: {bad}"


def test_sections_are_numbered_in_order():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    numbers = [int(m.group(1)) for c in nb.cells if c.cell_type == "markdown" for m in [re.match(r"## (\d+)\. ", c.source)] if m]
    assert numbers == list(range(1, len(numbers) + 1)), numbers


def _outputs_text(nb) -> str:
    return "\n".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) + str(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )  # fmt: skip


@pytest.mark.multidevice
def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel uses the notebook's inline backend
    monkeypatch.setenv("PYTHONPATH", ROOT)  # the kernel imports this tree's tpu_utility
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")  # the kernel's cores="all" cell trains on 4 XLA:CPU devices
    # the kernel compiles at XLA's default level, as a user's: its time is the convnet's steps (find_lr's 80, up
    # to 5 epochs on 4 devices), which level 0 runs slowly (59 CPU-s against 47)
    monkeypatch.setenv("XLA_FLAGS", xla_flags())

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    text = _outputs_text(nb)
    assert "tpu_utility on" in text and "via XLA" in text
    assert "clean: no recompiles" in text  # doctor on the ported loop
    assert "[host_sync]" in text and "logged.append(train_step(batch).item())" in text
    assert "one_cycle_fit: spmd on 4 CPU core(s)" in text  # the cores="all" cell ran on every device
    assert "validation accuracy:" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the LR finder and history plots, inline
    assert (tmp_path / "checkpoints" / "last.pt").exists() and (tmp_path / "checkpoints" / "best.pt").exists()
    rows = (tmp_path / "submission.csv").read_text().splitlines()
    assert rows[0] == "id,label" and [r.split(",")[0] for r in rows[1:]] == [str(i) for i in range(len(rows) - 1)]
    accuracy = float(text.split("accuracy against the held-out labels: ")[1].split("%")[0])
    assert accuracy > 90  # predictions in dataset order: shuffled rows would score about 10%
    assert re.search(r"best\.pt \(epoch \d\) reloaded: the same predictions", text)  # reloading for inference, shown
    stderr = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []) if o.get("name") == "stderr")
    assert "IProgress not found" not in stderr  # ipywidgets is there, so bars are widgets


pytest.importorskip("nbclient")
