"""save_checkpoint / load_checkpoint for hand loops, damaged files, kill -9 during a save,
file permissions, and the folder lock."""

import os
import signal
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import torch
from torch import nn

from conftest import BLOCK_TORCH_XLA, ROOT, flat_digits, run_python, small_mlp
from tpu_utility import get_device, load_checkpoint, save_checkpoint, step_optimizer
from tpu_utility.files import LOCK_NAME, TEMP_SUFFIX, folder_lock

# The hand loop every process below runs: Adam on 4 fixed digits batches.
LOOP = """
import torch
from torch import nn
from conftest import flat_digits, small_mlp
from tpu_utility import step_optimizer

def train(model, opt, device, steps):
    x, y = flat_digits(256).tensors
    for i in range(steps):
        xb, yb = x[i % 4 * 64:][:64].to(device), y[i % 4 * 64:][:64].to(device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        step_optimizer(opt)
"""
_loop: dict = {}
exec(LOOP, _loop)


def _fresh(device):
    torch.manual_seed(0)
    model = small_mlp().to(device)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _params(model):
    return [p.detach().cpu() for p in model.parameters()]


def test_save_on_xla_load_on_cpu_without_torch_xla_and_on_xla_again_resumes_equally(tmp_path):
    device = get_device()
    path = str(tmp_path / "ckpt.pt")
    model, opt = _fresh(device)
    _loop["train"](model, opt, device, 3)
    save_checkpoint(path, model=model, optimizer=opt, epoch=1, note="halfway")  # was: torch.save(...)
    _loop["train"](model, opt, device, 3)
    straight = _params(model)
    torch.save(straight, str(tmp_path / "straight.pt"))

    # A machine without torch_xla: plain torch.load works, and so does load_checkpoint into CPU objects.
    code = BLOCK_TORCH_XLA + f"sys.path.insert(0, {os.path.join(ROOT, 'tests')!r})\n" + LOOP + f"""
from tpu_utility import load_checkpoint
plain = torch.load({path!r}, weights_only=True)
assert plain["epoch"] == 1 and plain["note"] == "halfway", plain.keys()
assert all(t.device.type == "cpu" for t in plain["model"].values())
torch.manual_seed(0)
model = small_mlp()
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
state = load_checkpoint({path!r}, model=model, optimizer=opt)
train(model, opt, torch.device("cpu"), 3)
straight = torch.load({str(tmp_path / 'straight.pt')!r}, weights_only=True)
worst = max((a - b).abs().max().item() for a, b in zip(model.parameters(), straight))
print("torch_xla loaded", "torch_xla" in sys.modules, "epoch", state["epoch"], "worst", worst)
"""
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert "torch_xla loaded False epoch 1" in r.stdout
    assert float(r.stdout.split("worst ")[1]) < 1e-4  # the same training, on another backend

    model, opt = _fresh(device)
    state = load_checkpoint(path, model=model, optimizer=opt)
    assert state["epoch"] == 1
    moments = [s["exp_avg"] for s in opt.state.values()]
    assert moments and all(m.device == model[1].weight.device for m in moments)  # state followed its parameters
    _loop["train"](model, opt, device, 3)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), straight))  # bitwise, resumed on XLA


def _flip(path, offset_from_record_start=40):
    with zipfile.ZipFile(path) as archive:
        record = next(r for r in archive.infolist() if "/data/" in r.filename)
    data = bytearray(open(path, "rb").read())
    name_len, extra_len = int.from_bytes(data[record.header_offset + 26 :][:2], "little"), int.from_bytes(
        data[record.header_offset + 28 :][:2], "little"
    )  # the local header's own lengths: torch pads its extra field to align the data
    start = record.header_offset + 30 + name_len + extra_len
    data[start + offset_from_record_start] ^= 0x01  # one bit of one weight
    open(path, "wb").write(bytes(data))


def test_a_flipped_bit_in_the_weights_is_detected(tmp_path):
    path = str(tmp_path / "ckpt.pt")
    save_checkpoint(path, model=small_mlp())
    _flip(path)
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged \(the bytes of record .*data/0.* checksum"):
        load_checkpoint(path)


def _truncate(n):
    return lambda data: data[:n]


DAMAGE = {
    "empty file": lambda data: b"",
    "first 10 bytes": _truncate(10),
    "first 100 bytes": _truncate(100),
    "half": lambda data: data[: len(data) // 2],
    "last 10 bytes cut": lambda data: data[:-10],
    "binary garbage": lambda data: bytes(range(7, 256)) * 2,  # a text file is not damaged: test_silent_inputs.py
    "zeros in the middle": lambda data: data[:200] + bytes(400) + data[600:],
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_checkpoint_names_the_file(tmp_path, damage):
    path = tmp_path / "last.pt"
    save_checkpoint(str(path), model=small_mlp(), optimizer=None, epoch=3)
    path.write_bytes(DAMAGE[damage](path.read_bytes()))
    with pytest.raises(ValueError, match=rf"checkpoint {path} is damaged .*Delete it"):
        load_checkpoint(str(tmp_path))  # the folder, as one_cycle_fit(resume=True) gives it


def test_save_refuses_what_weights_only_cannot_load_and_load_names_a_missing_entry(tmp_path):
    path = str(tmp_path / "c.pt")
    with pytest.raises(TypeError, match=r"the checkpoint\['mean'\] is a numpy.ndarray.*weights_only=True.*torch.from_numpy"):
        save_checkpoint(path, model=small_mlp(), mean=np.zeros(3))
    with pytest.raises(TypeError, match=r"the checkpoint\['log'\]\[1\] is a builtins.object"):
        save_checkpoint(path, log=[1, object()])
    with pytest.raises(TypeError, match=r"model must be a torch.nn.Module, but given str"):
        save_checkpoint(path, model="net")
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer, but given Sequential"):
        save_checkpoint(path, optimizer=small_mlp())
    assert not os.path.exists(path)
    torch.save(small_mlp().state_dict(), path)  # a bare state_dict, as CUDA loops write
    with pytest.raises(ValueError, match=r"has no 'model' entry .*model.load_state_dict\(load_checkpoint\(path\)\)"):
        load_checkpoint(path, model=small_mlp())
    assert set(load_checkpoint(path)) == set(small_mlp().state_dict())  # load_checkpoint(path) still works
    with pytest.raises(FileNotFoundError, match=r"checkpoint .*nope.pt does not exist"):
        load_checkpoint(str(tmp_path / "nope.pt"))


def test_files_get_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        save_checkpoint(str(tmp_path / "c.pt"), epoch=1)
    finally:
        os.umask(old)
    assert oct(os.stat(tmp_path / "c.pt").st_mode & 0o777) == oct(0o644)


KILLED_SAVE = """
import os, signal, sys, torch
import tpu_utility.checkpoint as ckpt
import tpu_utility.files as files
from tpu_utility import save_checkpoint
folder, epoch, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
real_save = torch.save
def half_save(obj, f, *a, **k):
    f.write(b"PK half a checkpoint")
    f.flush()
    die()
if kill_at == "write":
    ckpt.torch.save = half_save
elif kill_at == "rename":
    files.os.replace = die
elif kill_at == "folder sync":
    files._fsync_folder = die
weights = torch.full((256, 256), float(epoch))
save_checkpoint(os.path.join(folder, "last.pt"), weights=weights, epoch=epoch)
"""


def _save_in_subprocess(folder, epoch, kill_at="never"):
    code = f"import sys; sys.argv = ['save', {str(folder)!r}, '{epoch}', {kill_at!r}]\n" + KILLED_SAVE
    return run_python(code)


def test_kill_9_during_a_save_loses_nothing_and_the_next_save_removes_the_temporaries(tmp_path):
    assert _save_in_subprocess(tmp_path, 1).returncode == 0
    committed = 1
    for epoch, kill_at in enumerate(["write", "rename", "folder sync"], start=2):
        r = _save_in_subprocess(tmp_path, epoch, kill_at)
        assert r.returncode == -signal.SIGKILL, r.stderr
        state = load_checkpoint(str(tmp_path))  # the previous checkpoint, whole (or the new one, once renamed)
        committed = epoch if kill_at == "folder sync" else committed  # killed after the rename
        assert state["epoch"] == committed
        assert torch.equal(state["weights"], torch.full((256, 256), float(committed)))
        leftovers = [n for n in os.listdir(tmp_path) if n != "last.pt"]
        assert len(leftovers) <= 1 and all(n.startswith(".") and n.endswith(TEMP_SUFFIX) for n in leftovers)
    (tmp_path / ".tmp-abcd1234.pt").write_bytes(b"half")  # what today's code leaves after a kill
    (tmp_path / ".tmp-notes.txt").write_bytes(b"the user's")  # not ours: kept
    assert _save_in_subprocess(tmp_path, 9).returncode == 0
    assert sorted(os.listdir(tmp_path)) == [".tmp-notes.txt", "last.pt"]  # every temporary a killed save left is gone
    assert load_checkpoint(str(tmp_path))["epoch"] == 9


HOLDER = """
import sys, time
from tpu_utility.files import folder_lock
with folder_lock(sys.argv[1], "training"):
    print("locked", flush=True)
    time.sleep(60)
"""


def test_folder_lock_refuses_a_second_writer_and_a_killed_holder_frees_it(tmp_path):
    folder = str(tmp_path / "checkpoints")
    holder = subprocess.Popen(
        [sys.executable, "-c", f"import sys; sys.argv = ['h', {folder!r}]\n" + textwrap.dedent(HOLDER)],
        env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RuntimeError, match=rf"'{folder}' is in use by another process \(pid {holder.pid} .*training\)"):
            with folder_lock(folder, "training"):
                pass
        with pytest.raises(RuntimeError, match=r"is in use"):
            with folder_lock(folder, "training", timeout=0.5):  # waits, then refuses
                pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folder_lock(folder, "training") as lock:  # the OS released the dead holder's lock
        assert os.path.basename(lock) == LOCK_NAME
        with pytest.raises(RuntimeError, match=rf"pid {os.getpid()} "):
            with folder_lock(folder, "training"):  # not re-entrant, even in one process
                pass
    assert os.listdir(folder) == []  # released: no lock file left behind


def test_checkpoint_of_an_xla_model_is_cpu_only(tmp_path):
    model = nn.Linear(3, 2).to(get_device())
    save_checkpoint(str(tmp_path / "c.pt"), model=model, step=torch.tensor(5, device=get_device()))
    state = torch.load(str(tmp_path / "c.pt"), weights_only=True, map_location=None)
    assert {t.device.type for t in [*state["model"].values(), state["step"]]} == {"cpu"}


def test_resume_from_a_damaged_checkpoint_names_the_file(tmp_path):
    from tpu_utility import one_cycle_fit

    (tmp_path / "last.pt").write_bytes(b"PK\x03\x04 cut short by a full disk")
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'last.pt'} is damaged"):
        one_cycle_fit(small_mlp(), flat_digits(64), epochs=1, max_lr=1e-2, batch_size=32,
                      checkpoint_dir=str(tmp_path), resume=True, progress=False)  # fmt: skip


def test_only_the_master_writes_and_every_process_meets_after(tmp_path, monkeypatch):
    from tpu_utility import checkpoint, backend

    met, copied = [], []
    monkeypatch.setattr(backend, "barrier", met.append)
    real_to_cpu = checkpoint.to_cpu
    monkeypatch.setattr(checkpoint, "to_cpu", lambda tree: copied.append(1) or real_to_cpu(tree))
    save_checkpoint(str(tmp_path / "master.pt"), model=small_mlp(), epoch=1)  # one device: this is the master
    assert load_checkpoint(str(tmp_path / "master.pt"))["epoch"] == 1
    assert (met, copied) == (["tpu_utility.save_checkpoint"], [1])

    monkeypatch.setattr(backend, "rank", lambda: 1)  # what a second process of a launch sees
    save_checkpoint(str(tmp_path / "replica.pt"), model=small_mlp(), epoch=1)
    assert not (tmp_path / "replica.pt").exists() and os.listdir(tmp_path) == ["master.pt"]
    assert (met, copied) == (["tpu_utility.save_checkpoint"] * 2, [1])  # no host copy, but it still meets
    with pytest.raises(TypeError, match="numpy"):  # a bad value is an error on every process, not only the master
        save_checkpoint(str(tmp_path / "replica.pt"), mean=np.zeros(3))
