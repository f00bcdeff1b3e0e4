"""Epoch bars: a widget in a notebook with ipywidgets, one line per epoch everywhere else;
while the first steps compile, the bar (or, without one, a line) says so."""

import io
import os
import re
import subprocess
import sys

import nbformat
import pytest

from conftest import ROOT, blocking, run_python
from tpu_utility.progress import CompileProgress, bar_kind, format_duration, progress_bar, run_eta

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


# ------------------------------------------------------------- the first epoch, while XLA compiles
class _Bar:
    """A stand-in for a tqdm bar: records the labels it is given."""

    def __init__(self, live):
        self.disable, self.labels = not live, []

    def set_description_str(self, text, refresh=True):
        self.labels.append(text)


def _steps(notice, counts, graphs):
    for n in counts:
        graphs[0] = n
        notice.after_step()


@pytest.mark.parametrize("live", [True, False], ids=["live-bar", "log"])
def test_the_first_steps_say_they_are_compiling(live, capsys):
    graphs = [5]  # an earlier find_lr compiled 5 graphs in this process
    bar = _Bar(live)
    notice = CompileProgress(bar, "epoch 1/3", lambda: graphs[0], expect=True, speak=True)
    # batch 1 traced; batch 1's graph compiles as batch 2 is fetched, batch 2's as batch 3 is; then none
    _steps(notice, [5, 6, 7, 7, 7], graphs)
    notice.close()
    lines = capsys.readouterr().out.splitlines()
    if live:
        assert bar.labels == ["epoch 1/3 compiling graphs", "epoch 1/3 compiling graphs (1 graph so far)",
                              "epoch 1/3 compiling graphs (2 graphs so far)", "epoch 1/3"]  # fmt: skip
        assert lines == []  # the bar says it; no line to break it
    else:
        assert bar.labels == []
        assert lines[0] == "epoch 1/3: compiling graphs for the first steps (slow once; later steps reuse them)"
        assert re.fullmatch(r"epoch 1/3: compiled 2 graph\(s\) in \d+s; training at full speed", lines[1]), lines
        assert len(lines) == 2
    assert notice.compile_seconds > 0


def test_a_later_epoch_is_quiet_unless_it_compiles(capsys):
    graphs = [7]
    quiet = CompileProgress(_Bar(False), "epoch 2/3", lambda: graphs[0], expect=False, speak=True)
    _steps(quiet, [7, 7, 7], graphs)
    assert capsys.readouterr().out == "" and quiet.compile_seconds == 0
    bar = _Bar(True)
    shape = CompileProgress(bar, "epoch 3/3", lambda: graphs[0], expect=False, speak=True)
    _steps(shape, [7, 8, 8], graphs)  # a new batch shape: one more graph
    assert bar.labels == ["epoch 3/3 compiling graphs (1 graph so far)", "epoch 3/3"]
    silent = CompileProgress(_Bar(False), "epoch 1/3", lambda: graphs[0], expect=True, speak=False)  # progress=False
    _steps(silent, [8, 9, 9], graphs)
    assert capsys.readouterr().out == ""


def test_durations_and_the_run_eta():
    assert [format_duration(s) for s in (0.4, 45, 185.2, 7620)] == ["0s", "45s", "3m05s", "2h07m"]
    assert run_eta([40.0, 12.0], epochs_left=3) == 36.0  # at the latest epoch's pace
    assert run_eta([12.0], epochs_left=0) == 0.0


# The first epoch's line gives its compile time only from 0.5 s up (builtins.py). A 2-layer MLP's graphs compiled
# in under that on a fast hour of this host, and the tests below failed; 24 hidden layers compile in 1.5-2 s at the
# suite's level 0 on the same host. The tests read the text, not the training: the loss barely moves.
FIT = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import one_cycle_fit
g = torch.Generator().manual_seed(0)
x = torch.randn(1000, 16, generator=g); y = (x[:, 0] > 0).long()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), *[m for _ in range(24) for m in (nn.Linear(32, 32), nn.ReLU())], nn.Linear(32, 2))
one_cycle_fit(model, TensorDataset(x, y), valid_data=TensorDataset(x[:200], y[:200]), epochs=3, max_lr=1e-2, batch_size=64)
"""
EPOCH_LINE = re.compile(r"epoch (\d)/3  train_loss .*  lr \S+  ([\d.]+)s  ([\d,]+) samples/s(  \(compiling (\d+)s\))?(  ETA (\S+))?")


def _check_first_epoch_text(lines, told=True):
    """The lines that stay: where compiling starts and ends (told: no live bar says it), then
    epoch lines with the compile time and the run's ETA."""
    starts = [i for i, line in enumerate(lines) if line.startswith("epoch 1/3: compiling graphs")]
    ends = [i for i, line in enumerate(lines) if re.match(r"epoch 1/3: compiled \d+ graph\(s\) in \d+s", line)]
    epochs = [(i, EPOCH_LINE.fullmatch(line)) for i, line in enumerate(lines) if EPOCH_LINE.fullmatch(line)]
    assert len(starts) == len(ends) == int(told) and len(epochs) == 3, lines
    assert not told or starts[0] < ends[0] < epochs[0][0]
    first, later, last = (m for _, m in epochs)
    seconds, per_s, compiling = float(first[2]), float(first[3].replace(",", "")), float(first[5])
    assert compiling > 0 and later[5] is None and last[5] is None  # only the first epoch compiled
    # samples/s leaves the compile out: 960 samples (15 batches of 64) in the epoch's other seconds
    assert per_s > 960 / seconds * 1.5, (per_s, seconds, compiling)
    assert first[7] and later[7] and last[7] is None  # the run's ETA, until the last epoch


def test_a_log_is_told_when_compiling_starts_and_ends():
    r = run_python(FIT)  # stdout a pipe: a log, `make demo | tee`, CI
    assert r.returncode == 0, r.stderr[-3000:]
    _check_first_epoch_text(r.stdout.splitlines())
    assert "dropping" not in r.stderr  # 40 samples left out, reshuffled: said in the summary line
    assert "| 40 sample(s) an epoch left out to keep one batch shape" in r.stdout.splitlines()[0]


def test_a_terminal_bar_says_it_is_compiling():
    pty, fcntl, termios, struct = (pytest.importorskip(m) for m in ("pty", "fcntl", "termios", "struct"))
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # a real terminal's size
    env = {**os.environ, "PYTHONPATH": ROOT}
    p = subprocess.Popen([sys.executable, "-c", FIT], stdout=child, stderr=child, env=env, cwd=ROOT)
    os.close(child)
    chunks = []
    while True:
        try:
            data = os.read(main, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=300) == 0, b"".join(chunks)[-3000:]
    frames = [re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", f).strip() for f in re.split(r"[\r\n]", b"".join(chunks).decode())]
    labels = [f.split(":")[0] for f in frames if "batch/s" in f or "s/batch" in f]
    assert "epoch 1/3 compiling graphs" in labels and "epoch 1/3 compiling graphs (1 graph so far)" in labels
    assert labels[-1] == "epoch 3/3" and not [label for label in labels if label.startswith(("epoch 2/3 ", "epoch 3/3 "))]
    _check_first_epoch_text([f for f in frames if f and "batch/s" not in f and "s/batch" not in f], told=False)


def test_a_notebook_without_widgets_is_told_when_compiling_starts_and_ends(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    from nbclient import NotebookClient

    monkeypatch.setenv("PYTHONPATH", ROOT)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in (blocking("ipywidgets"), FIT)])
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[-1].outputs
    stdout = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    _check_first_epoch_text(stdout.splitlines())
    assert "".join(o.get("text", "") for o in outputs if o.get("name") == "stderr") == ""  # no pink box
