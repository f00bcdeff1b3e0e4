"""A checkpoint folder that is never wrong: kills between writes, damaged or foreign best.pt, history.csv."""

import csv
import json
import multiprocessing
import os
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import BLOCK_TORCH_XLA, run_python
from tpu_utility import load_checkpoint, one_cycle_fit
from tpu_utility.demo import digits_datasets

# Plain CPU (torch_xla hidden), one thread: every run of this script is bitwise the same. With
# monitor="accuracy" the figure improves at epochs 1, 2, 3 and 5 of 6, so the kills land both
# where last.pt holds the best epoch and where best.pt is older than last.pt.
KILLS = """
import json, os, sys
import torch
torch.set_num_threads(1)
from torch import nn
from torch.utils.data import TensorDataset
import tpu_utility.files as files
from tpu_utility import OneCycle, load_checkpoint, one_cycle_fit
from tpu_utility.demo import digits_datasets

root = sys.argv[1]
train, valid = digits_datasets()
x, y = train.tensors
train = TensorDataset(x[:160], y[:160])


def fit(folder, resume=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    history = one_cycle_fit(model, train, valid_data=valid, epochs=6, max_lr=0.03, batch_size=16, schedule=OneCycle(pct_start=0.5),
                            monitor="accuracy", restore_best=True, checkpoint_dir=folder, resume=resume,
                            progress=False)
    return model, history


def in_child(job):
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            job()
            code = 0
        except BaseException:
            __import__("traceback").print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def commits_then_die(k):
    real, done = os.replace, [0]
    def replace(src, dst):
        if done[0] == k:
            os._exit(9)  # as kill -9: the (k+1)-th file is written under its temporary name, not committed
        done[0] += 1
        real(src, dst)
    return replace


def report(folder, name):
    def job():
        model, history = fit(folder, resume=True)
        best = load_checkpoint(os.path.join(folder, "best.pt"))
        same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), best["model"].values()))
        with open(os.path.join(folder, "history.csv")) as f:
            rows = [(int(r["epoch"]), r["accuracy"]) for r in __import__("csv").DictReader(f)]
        json.dump({"best_epoch": best["epoch"], "restored_is_best": same, "history": rows,
                   "weights": [t.tolist() for t in best["model"].values()], "stop": history.stop_reason,
                   "left": sorted(os.listdir(folder))}, open(os.path.join(root, name), "w"))
    return job


# One fit here first: its lazy imports and first-call set-up (about a second of CPU) are then done once,
# in the process every run below forks from, not again in each of the 34 children.
fit(os.path.join(root, "warm-up"))
reference = os.path.join(root, "reference")
commits = []
def count():
    real = os.replace
    files.os.replace = lambda src, dst: commits.append(dst) or real(src, dst)
    fit(reference)
    json.dump(commits, open(os.path.join(root, "commits.json"), "w"))
assert in_child(count) == 0
assert in_child(report(reference, "reference.json")) == 0  # resume=True of a finished run: nothing to train
commits = json.load(open(os.path.join(root, "commits.json")))
for k in range(len(commits)):
    folder = os.path.join(root, f"kill{k}")
    def killed():
        files.os.replace = commits_then_die(k)
        fit(folder)
    assert in_child(killed) == 9, k
    assert in_child(report(folder, f"kill{k}.json")) == 0, k
print(json.dumps([os.path.basename(c) for c in commits]))
"""


def test_a_kill_between_any_two_writes_then_resume_ends_with_the_true_best_checkpoint(tmp_path):
    r = run_python(BLOCK_TORCH_XLA + KILLS.replace("sys.argv[1]", repr(str(tmp_path))), env={"PJRT_DEVICE": None},
                   timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    commits = json.loads(r.stdout.strip().splitlines()[-1])
    # per epoch: last.pt, then best.pt when the figure improved, then history.csv
    assert commits == ["last.pt", "best.pt", "history.csv"] * 3 + ["last.pt", "history.csv"] \
        + ["last.pt", "best.pt", "history.csv"] + ["last.pt", "history.csv"]
    reference = json.loads((tmp_path / "reference.json").read_text())
    assert reference["best_epoch"] == 5 and reference["restored_is_best"]
    assert [e for e, _ in reference["history"]] == [1, 2, 3, 4, 5, 6]
    wrong = []
    for k in range(len(commits)):  # killed after k files were committed, before the (k+1)-th
        got = json.loads((tmp_path / f"kill{k}.json").read_text())
        if (got["best_epoch"], got["weights"], got["history"]) != (5, reference["weights"], reference["history"]) \
                or not got["restored_is_best"] or "restored the best weights (epoch 5)" not in got["stop"] \
                or got["left"] != reference["left"]:  # fmt: skip
            wrong.append((k, commits[k], got["best_epoch"], got["stop"]))
    print(f"{len(commits)} kills injected, {len(wrong)} checkpoints wrong after resume")
    assert wrong == []


class _FakeClock:
    """The time-limit clock: 100 s per reading, so time_limit="4m10s" stops a run after epoch 2."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        self.now += 100.0
        return self.now


class _Epochs(torch.utils.data.Dataset):
    """Training data that records the epochs started (one_cycle_fit calls set_epoch)."""

    def __init__(self, base):
        self.base, self.started = base, []

    def set_epoch(self, epoch):
        self.started.append(epoch + 1)

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return self.base[i]


@pytest.fixture(scope="module")
def data():
    train, valid = digits_datasets()
    x, y = train.tensors
    return TensorDataset(x[:128], y[:128]), valid


def _fit(folder, data, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    args = {"valid_data": data[1], "epochs": 4, "max_lr": 1e-2, "batch_size": 32, "progress": False,
            "monitor": "train_loss", "mode": "max", "checkpoint_dir": str(folder), **kwargs}  # best: epoch 1
    return one_cycle_fit(model, data[0], **args)


def test_a_missing_damaged_or_foreign_best_pt_is_found_before_the_first_resumed_epoch(tmp_path, monkeypatch, data):
    from tpu_utility.training import trainer

    monkeypatch.setattr(trainer, "_clock", _FakeClock())
    children = set(multiprocessing.active_children())
    run = tmp_path / "run"
    stopped = _fit(run, data, time_limit="4m10s")
    assert [r.epoch for r in stopped.records] == [1, 2] and stopped.best_epoch == 1
    good = (run / "best.pt").read_bytes()
    other = tmp_path / "other"
    _fit(other, data, epochs=4, time_limit="4m10s")  # the same arguments: another run all the same
    _fit(tmp_path / "seed", data, seed=7, time_limit="4m10s")

    def resume_fails(match, **kwargs):
        train = _Epochs(data[0])
        with pytest.raises(ValueError, match=match) as e:
            _fit(run, (train, data[1]), time_limit="4m10s", resume=True, restore_best=True, **kwargs)
        assert train.started == []  # refused before the first resumed epoch
        # the validation loader's worker, started to check eval_step, is stopped: not left for a garbage
        # collection to wait out (5 s a worker) once the queues it listens on are finalized
        assert set(multiprocessing.active_children()) <= children
        assert load_checkpoint(str(run))["epoch"] == 2
        return str(e.value)

    (run / "best.pt").unlink()
    text = resume_fails(r"best.pt is missing, but .*last.pt records epoch 1 as the best")
    for way in ("put back this run's best.pt (epoch 1)", "restore_best=False", "another checkpoint_dir"):
        assert way in text
    (run / "best.pt").write_bytes(good[: len(good) // 2])
    resume_fails(r"best.pt is damaged \(truncated")
    (run / "best.pt").write_bytes((other / "best.pt").read_bytes())
    resume_fails(r"best.pt was written by another run \(run [0-9a-f]{16}, this run [0-9a-f]{16}\)")
    (run / "best.pt").write_bytes((tmp_path / "seed" / "best.pt").read_bytes())
    resume_fails(r"best.pt was written by a run with other arguments \(they differ in seed\)")
    (run / "best.pt").write_bytes((run / "last.pt").read_bytes())  # this run's, but epoch 2
    resume_fails(r"best.pt holds epoch 2, not epoch 1")

    (run / "best.pt").unlink()
    with pytest.warns(UserWarning, match=r"best.pt is missing, so epoch 1's weights are lost"):
        resumed = _fit(run, data, time_limit="4m10s", resume=True)  # restore_best=False: a note, then on
    assert [r.epoch for r in resumed.records] == [1, 2, 3, 4]


def test_resume_rewrites_best_pt_from_last_pt_when_that_holds_the_best_epoch_and_history_csv_whole(tmp_path, data):
    folder = tmp_path / "run"
    _fit(folder, data, epochs=2, monitor="valid_loss", mode="min")  # improves every epoch: last.pt holds the best
    (folder / "best.pt").unlink()  # as a kill between last.pt and best.pt leaves it
    (folder / "history.csv").write_text("epoch\n1\n")  # as a kill before history.csv leaves it
    with pytest.warns(UserWarning, match=r"repaired .*best.pt: it is missing; rewritten from .*last.pt, which holds "
                                         r"the best epoch \(2\)"):  # fmt: skip
        history = _fit(folder, data, epochs=2, monitor="valid_loss", mode="min", resume=True, restore_best=True)
    assert history.stop_reason.endswith("restored the best weights (epoch 2)")
    assert load_checkpoint(str(folder / "best.pt"))["epoch"] == 2
    with open(folder / "history.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2]


def test_resume_with_another_monitor_is_refused_naming_both(tmp_path, data):
    _fit(tmp_path, data, epochs=2)
    with pytest.raises(ValueError, match=r"watching monitor='train_loss' \(mode='max'\), but this call watches "
                                         r"monitor='valid_loss' \(mode='min'\)"):  # fmt: skip
        _fit(tmp_path, data, epochs=2, monitor="valid_loss", mode="min", resume=True)


def test_a_rerun_into_a_folder_holding_another_runs_last_pt_is_refused_until_told(tmp_path, data):
    _fit(tmp_path, data, epochs=2)
    last = (tmp_path / "last.pt").read_bytes()
    with pytest.raises(ValueError, match=r"checkpoint_dir='.*' holds another run's last.pt \(epoch 2 of 2\); this call "
                                         r"would overwrite it. Continue that run with resume=True, or start afresh in a "
                                         r"new checkpoint_dir or with overwrite=True"):  # fmt: skip
        _fit(tmp_path, data, epochs=3)
    assert (tmp_path / "last.pt").read_bytes() == last  # untouched
    with pytest.raises(ValueError, match="resume=True continues the run in checkpoint_dir and overwrite=True replaces"):
        _fit(tmp_path, data, epochs=3, resume=True, overwrite=True)
    history = _fit(tmp_path, data, epochs=3, overwrite=True)
    assert [r.epoch for r in history.records] == [1, 2, 3]
    new_last, best = load_checkpoint(str(tmp_path)), load_checkpoint(str(tmp_path / "best.pt"))
    assert new_last["epoch"] == 3 and best["run"] == new_last["run"]  # nothing of the old run is left
    with open(tmp_path / "history.csv") as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3]


class _Interrupt:
    """The default train step, with a Ctrl-C after ``limit`` steps."""

    def __init__(self, limit):
        self.calls, self.limit = 0, limit

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls > self.limit:
            raise KeyboardInterrupt
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)


def test_ctrl_c_ends_with_one_line_saying_what_is_saved_and_the_call_that_continues(tmp_path, data):
    with pytest.raises(KeyboardInterrupt) as e:
        _fit(tmp_path, data, epochs=3, train_step=_Interrupt(6))  # 4 steps per epoch: in epoch 2
    assert str(e.value) == (
        f"one_cycle_fit interrupted in epoch 2 of 3; {tmp_path / 'last.pt'} holds epoch 1: continue with the same "
        f"call and resume=True"
    )
    assert e.value.__suppress_context__ and e.value.__cause__ is None  # no second traceback above it
    resumed = _fit(tmp_path, data, epochs=3, train_step=_Interrupt(10**9), resume=True)
    assert [r.epoch for r in resumed.records] == [1, 2, 3]
    with pytest.raises(KeyboardInterrupt, match=r"^one_cycle_fit interrupted in epoch 1 of 3; nothing was saved "
                                                r"\(no checkpoint_dir\), so it cannot be continued$"):  # fmt: skip
        _fit(tmp_path, data, epochs=3, train_step=_Interrupt(2), checkpoint_dir=None)
