"""A full disk while saving: one clear error (file, free space, size needed, what is intact), then resume."""

import contextlib
import errno
import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from conftest import flat_digits, small_mlp
from tpu_utility import cache_dataset, load_checkpoint, one_cycle_fit, save_checkpoint
from tpu_utility.files import TEMP_SUFFIX, WriteError

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


class _FullDisk:
    """A file whose writes fail with ENOSPC once ``budget`` bytes went in, as on a full disk."""

    def __init__(self, raw, budget):
        self.raw, self.budget = raw, budget

    def write(self, data):
        if len(data) > self.budget:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.budget -= len(data)
        return self.raw.write(data)

    def __getattr__(self, name):
        return getattr(self.raw, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.raw.__exit__(*exc)


def full_after(monkeypatch, opened, budget=1000):
    """Files opened by the shared writer after the first ``opened`` fail after ``budget`` bytes."""
    real, count = os.fdopen, [0]

    def fdopen(fd, *args, **kwargs):
        count[0] += 1
        f = real(fd, *args, **kwargs)
        return _FullDisk(f, budget) if count[0] > opened else f

    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_full_disk_while_saving_names_the_file_the_space_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "last.pt")
    save_checkpoint(path, weights=torch.ones(1000), epoch=1)
    full_after(monkeypatch, opened=0)
    with pytest.raises(WriteError) as e:
        save_checkpoint(path, weights=torch.ones(256, 1024), epoch=2)  # 1 MiB of tensors
    assert e.value.errno == errno.ENOSPC
    assert str(e.value).startswith(f"[Errno 28] cannot write {path}: the disk is full (")
    assert re.search(r"\(\d+\.\d (KiB|MiB|GiB) free on its filesystem, about 1\.0 MiB needed\)\. Nothing was "
                     r"replaced: the previous last\.pt is intact\. Free some space", str(e.value))  # fmt: skip
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1 and os.listdir(tmp_path) == ["last.pt"]  # no temporary left


def test_a_full_disk_during_training_stops_with_the_resume_call_and_the_folder_resumes(tmp_path, monkeypatch):
    args = {"epochs": 3, "max_lr": 1e-2, "batch_size": 32, "progress": False, "checkpoint_dir": str(tmp_path)}
    full_after(monkeypatch, opened=3)  # epoch 1's last.pt, best.pt, history.csv; then epoch 2's last.pt fails
    with pytest.raises(WriteError, match=r"cannot write .*last.pt: the disk is full \(.*needed\)\. Nothing was "
                                         r"replaced: the previous last.pt is intact\. Free some space or write to a larger "
                                         r"disk, then continue this run with the same call and resume=True$"):  # fmt: skip
        one_cycle_fit(small_mlp(), flat_digits(128), **args)
    monkeypatch.undo()  # space freed
    assert load_checkpoint(str(tmp_path))["epoch"] == 1
    assert not [n for n in os.listdir(tmp_path) if n.endswith(TEMP_SUFFIX)]
    history = one_cycle_fit(small_mlp(), flat_digits(128), resume=True, **args)
    assert [r.epoch for r in history.records] == [1, 2, 3]


def test_the_cache_and_presize_writers_give_the_same_error(tmp_path, monkeypatch):
    from PIL import Image

    from tpu_utility.data import presize

    data = TensorDataset(torch.zeros(64, 32, 32), torch.zeros(64, dtype=torch.long))
    full_after(monkeypatch, opened=1)  # the build plan is written, then the first shard fails
    with pytest.raises(WriteError, match=r"cannot write .*\.npy: the disk is full \(.*about 256\.0 KiB needed\)\. "
                                         r"Nothing was replaced: no .*\.npy existed before"):  # fmt: skip
        cache_dataset(data, str(tmp_path / "cache"), progress=False)
    src, dst = tmp_path / "images" / "a.png", tmp_path / "small" / "a.png"
    src.parent.mkdir()
    Image.new("RGB", (64, 64), "red").save(src)
    full_after(monkeypatch, opened=0, budget=50)
    with pytest.raises(WriteError, match=r"cannot write .*a.png: the disk is full \(.*(at least \d+ bytes|size) "):
        presize._resize_one((str(src), str(dst), 32, "crop", 90, False))  # a disk problem, not an "unreadable" image


@contextlib.contextmanager
def small_tmpfs(folder):
    """A 1 MiB tmpfs at ``folder``; skips the test where this process may not mount one."""
    folder.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_real_full_filesystem_gives_the_clear_error(tmp_path):
    with small_tmpfs(tmp_path / "disk") as disk:
        path = str(disk / "last.pt")
        save_checkpoint(path, weights=torch.ones(1000), epoch=1)
        full = r"the disk is full \(\d.* free on its filesystem, about 4.0 MiB needed\)\. Nothing was replaced"
        with pytest.raises(WriteError, match=full + r": the previous last.pt is intact"):
            save_checkpoint(path, weights=torch.ones(1024, 1024), epoch=2)
        assert load_checkpoint(path)["epoch"] == 1 and os.listdir(disk) == ["last.pt"]
        with pytest.raises(WriteError, match=r"cannot write .*\.npy: the disk is full"):
            cache_dataset(TensorDataset(torch.from_numpy(np.ones((8, 256, 256), np.float32))), str(disk / "c"),
                          progress=False)  # fmt: skip
