"""Checkpoint folders at URLs: fsspec's memory:// filesystem stands in for gs:// and s3://."""

import os
import sys
import uuid

import pytest
import torch
from torch import nn

from conftest import flat_digits, small_mlp
from test_fit import _StopAfter  # the default train_step, raising KeyboardInterrupt after `limit` calls
from tpu_utility import History, load_checkpoint, one_cycle_fit, save_checkpoint

fsspec = pytest.importorskip("fsspec")


def _url():
    return f"memory://run-{uuid.uuid4().hex[:8]}"  # one folder per test: memory:// lives as long as the process


def _fit(model, data, **kwargs):
    args = {"epochs": 3, "max_lr": 3e-3, "batch_size": 32, "progress": False, "seed": 3, **kwargs}
    return one_cycle_fit(model, data, **args)


def _mlp():
    torch.manual_seed(1)
    return small_mlp()


def test_a_run_into_a_url_writes_its_files_there_and_resumes_bitwise_as_a_local_run():
    data, url = flat_digits(480), _url()
    straight = _fit(_mlp(), data, train_step=_StopAfter(10**9))
    with pytest.raises(KeyboardInterrupt):
        _fit(_mlp(), data, train_step=_StopAfter(len(data) // 32 + 3), checkpoint_dir=url)  # in epoch 2
    fs, folder = fsspec.core.url_to_fs(url)
    assert sorted(os.path.basename(p) for p in fs.ls(folder, detail=False)) == ["best.pt", "history.csv", "last.pt"]
    assert load_checkpoint(url)["epoch"] == 1  # the folder's last.pt, on the CPU
    assert not os.path.exists("memory:") and not os.path.exists("memory:/")

    resumed = _fit(_mlp(), data, train_step=_StopAfter(10**9), checkpoint_dir=url, resume=True)
    assert [r.epoch for r in resumed.records] == [1, 2, 3]
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # bitwise, as a local resume
    state = load_checkpoint(url + "/best.pt")
    assert state["epoch"] == resumed.best_epoch and all(t.device.type == "cpu" for t in state["model"].values())
    assert fs.cat_file(folder + "/history.csv").decode().splitlines()[0].startswith("epoch")
    assert len(fs.cat_file(folder + "/history.csv").decode().splitlines()) == 4  # a header and 3 epochs

    with pytest.raises(ValueError, match=r"holds another run's last.pt \(epoch 3 of 3\).*resume=True.*overwrite=True"):
        _fit(_mlp(), data, checkpoint_dir=url)  # the re-run cell: refused, nothing overwritten
    assert load_checkpoint(url)["epoch"] == 3


def test_save_checkpoint_load_checkpoint_and_history_to_csv_at_a_url():
    url = _url()
    model = nn.Linear(3, 2)
    save_checkpoint(url + "/model.pt", model=model, epoch=7)
    fresh = nn.Linear(3, 2)
    state = load_checkpoint(url + "/model.pt", model=fresh)
    assert state["epoch"] == 7 and torch.equal(fresh.weight, model.weight)
    with pytest.raises(FileNotFoundError, match="model2.pt"):
        load_checkpoint(url + "/model2.pt")

    fs, folder = fsspec.core.url_to_fs(url)
    fs.pipe_file(folder + "/damaged.pt", fs.cat_file(folder + "/model.pt")[:-40])
    with pytest.raises(ValueError, match="damaged.pt"):
        load_checkpoint(url + "/damaged.pt")  # checked as a local file is

    history = History(records=[], best_epoch=None, model=None)
    history.to_csv(url + "/history.csv")
    assert fs.cat_file(folder + "/history.csv").decode().strip() == "epoch"


def test_a_url_whose_filesystem_is_missing_is_refused_before_training_with_the_pip_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as on a machine without gcsfs
    calls = []

    def step(model, batch):
        calls.append(1)
        return model(batch[0]).sum()

    with pytest.raises(ModuleNotFoundError, match=r"'gs://bucket/run' needs the gcsfs package.*pip install gcsfs"):
        _fit(small_mlp(), flat_digits(64), checkpoint_dir="gs://bucket/run", train_step=step)
    assert calls == [] and os.listdir(tmp_path) == []  # no epoch spent, no local folder named gs:

    monkeypatch.setitem(sys.modules, "fsspec", None)
    with pytest.raises(ModuleNotFoundError, match=r"'gs://bucket/run' is a URL.*pip install fsspec"):
        _fit(small_mlp(), flat_digits(64), checkpoint_dir="gs://bucket/run", train_step=step)
    with pytest.raises(ModuleNotFoundError, match="pip install fsspec"):
        save_checkpoint("gs://bucket/run/model.pt", model=small_mlp())
    assert os.listdir(tmp_path) == []


def test_an_unknown_scheme_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"'nosuch://x/run': fsspec has no filesystem for nosuch://.*memory://"):
        _fit(small_mlp(), flat_digits(64), checkpoint_dir="nosuch://x/run")
