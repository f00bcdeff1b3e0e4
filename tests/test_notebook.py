"""The quickstart notebook runs top to bottom on XLA:CPU, and stays in git without outputs."""

import os

import nbformat
import pytest

from conftest import ROOT

NOTEBOOK = os.path.join(ROOT, "notebooks", "kaggle_quickstart.ipynb")


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and (c.outputs or c.execution_count)]
    assert not dirty, f"cells {dirty} keep outputs; clear them before committing (Kernel > Restart & Clear Output)"


def test_notebook_runs_end_to_end(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel uses the notebook's inline backend

    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the cell if any cell fails
    text = "\n".join(
        o.get("text", "") + str(o.get("data", {}).get("text/plain", "")) + str(o.get("data", {}).get("text/markdown", ""))
        for c in nb.cells if c.cell_type == "code" for o in c.outputs
    )  # fmt: skip
    assert "tpu_utility on" in text and "via XLA" in text
    assert "clean: no recompiles" in text  # doctor on the ported loop
    assert "[host_sync]" in text and "logged.append(train_step(batch).item())" in text
    assert "validation accuracy:" in text
    images = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) >= 2  # the LR finder and history plots, inline
    assert (tmp_path / "checkpoints" / "last.pt").exists()


pytest.importorskip("nbclient")
