"""All cores: SPMD over 4 XLA:CPU devices, and the multi-process launch with one
device (multi-process collectives on CPU hang inside torch_xla 2.9 itself)."""

import pytest

from conftest import TINY_CNN, run_python, run_script
from tpu_utility.environment import choose_start_method
from tpu_utility.backend.native import NativeBackend
from tpu_utility.training.strategies import choose_strategy
from tpu_utility.training.topology import resolve_cores

SPMD_SCRIPT = """
import warnings; warnings.simplefilter("ignore")
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import one_cycle_fit, backend
from tpu_utility.demo import digits_datasets

train, valid = digits_datasets()
# tiny_cnn (conftest) at max_lr 1e-2: the same losses and accuracy as the demo's small_cnn at 3e-3 (0.28 and
# 0.93 after 4 epochs on one device at this global batch), its steps a sixth of the CPU time
torch.manual_seed(0)
model = tiny_cnn()
# 1001 validation samples: not a multiple of 4 devices x 32 per core.
x = torch.cat([valid.tensors[0]] * 3)[:1001]
y = torch.cat([valid.tensors[1]] * 3)[:1001]
y[::7] = (y[::7] + 1) % 10  # labels that padding duplicates would skew
valid = TensorDataset(x, y)

def label_mean(output, target):
    return target.float()

history = one_cycle_fit(model, train, valid_data=valid, epochs=4, max_lr=1e-2, batch_size=32,
                        cores="all", metrics=["accuracy", label_mean], progress=False)
print(history.summary)
model = history.model
with torch.no_grad():
    out = model(x.to(backend.device())).cpu()
exact_acc = (out.argmax(1) == y).float().mean().item()
for r in history.records:
    print("epoch", r.epoch, "loss", r.train_loss, "compiles", r.compiles, "syncs", r.host_syncs)
print("label_mean", history.records[-1].metrics["label_mean"], "true", y.float().mean().item())
print("accuracy", history.records[-1].metrics["accuracy"], "exact", exact_acc)
"""


def _values(stdout, key):
    return [line.split() for line in stdout.splitlines() if line.startswith(key)]


@pytest.mark.multidevice
def test_spmd_on_four_devices_trains_and_counts_1001_validation_samples_once():
    r = run_python(TINY_CNN + SPMD_SCRIPT, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "one_cycle_fit: spmd on 4 CPU core(s) | batch 32 per core, 128 global" in r.stdout
    epochs = _values(r.stdout, "epoch")
    losses = [float(e[3]) for e in epochs]
    compiles = {e[5] for e in epochs}
    assert losses[-1] < 0.3 * losses[0], losses
    assert len(compiles) == 1, f"compile count changed across epochs: {epochs}"
    assert {e[7] for e in epochs} == {"0"}
    (_, mean, _, true), = _values(r.stdout, "label_mean")
    assert float(mean) == pytest.approx(float(true), abs=1e-6)  # each sample exactly once
    (_, acc, _, exact), = _values(r.stdout, "accuracy")
    assert float(acc) == pytest.approx(float(exact), abs=1e-6)
    assert float(acc) > 0.75  # every 7th label was flipped above, so ~86% is the ceiling


MP_SCRIPT = """
import warnings; warnings.simplefilter("ignore")
import torch
from torch import nn
from tpu_utility import one_cycle_fit, backend
from tpu_utility.demo import digits_datasets

def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

if __name__ == "__main__":
    train, valid = digits_datasets()
    before = make_model().state_dict()
    history = one_cycle_fit(make_model, train, valid_data=valid, epochs=3, max_lr=1e-2,
                            cores="all", strategy="multiprocess", progress=False, early_stopping=2,
                            restore_best=True)
    print(history.summary)
    print("runtime started in the parent:", backend.runtime_started())
    changed = any(not torch.equal(a, b) for a, b in zip(before.values(), history.model.state_dict().values()))
    print("weights came back:", changed)
    print("best epoch", history.best_epoch, "|", history.stop_reason)
    print("schedule steps", len(history.step_lrs), history.steps_per_epoch, history.momentum_name)
    for r in history.records:
        print("epoch", r.epoch, "loss", r.train_loss, "acc", r.metrics["accuracy"])
"""


def test_multiprocess_launch_with_one_device(tmp_path):
    r = run_script(tmp_path, "train_mp.py", MP_SCRIPT, env={"CPU_NUM_DEVICES": "1"})
    assert "one_cycle_fit: replica on 1 CPU core(s)" in r.stdout
    assert "runtime started in the parent: False" in r.stdout  # the device was never touched
    assert "weights came back: True" in r.stdout
    assert "| completed 3 of 3 epochs; restored the best weights (epoch 3)" in r.stdout  # decided in the launch
    assert "schedule steps 66 22 beta1" in r.stdout  # the per-step curve comes back for History.plot, its momentum named
    epochs = _values(r.stdout, "epoch")
    assert float(epochs[-1][3]) < 0.5 * float(epochs[0][3])
    assert float(epochs[-1][5]) > 0.9


def test_start_method_fork_in_notebooks_spawn_in_scripts():
    assert choose_start_method(interactive=True) == "fork"
    assert choose_start_method(interactive=False) == "spawn"


def test_strategy_choice():
    def said(*args, **kwargs):
        chosen = choose_strategy(*args, **kwargs)
        return chosen.name, chosen.launches, chosen.may_shard

    assert said("auto", 1, in_launch=False) == ("single", False, False)
    assert said("auto", 8, in_launch=False) == ("spmd", False, True)  # the memory plan may shard it instead
    assert said("spmd", 1, in_launch=False) == ("spmd", False, False)
    assert said("multiprocess", 8, in_launch=False) == ("multiprocess", True, False)
    assert choose_strategy("multiprocess", 8, in_launch=False).replica().name == "replica"
    assert said("auto", 8, in_launch=True) == ("replica", False, False)
    assert said("auto", 8, in_launch=False, on=NativeBackend("cpu", "gloo")) == ("multiprocess", True, False)
    with pytest.raises(ValueError, match=r"strategy must be one of \('auto', 'spmd', 'multiprocess', 'fsdp', 'fsdp-tp'\), but given 'ddp'"):
        choose_strategy("ddp", 8, in_launch=False)


def test_cores_are_one_or_all():
    assert resolve_cores("all", 8) == 8
    assert resolve_cores(1, 8) == 1
    assert resolve_cores(8, 8) == 8
    with pytest.raises(ValueError, match=r"cores must be 1 or 8 \(all cores here\), or 'all', but given 4"):
        resolve_cores(4, 8)
    with pytest.raises(TypeError, match=r"cores must be 1, 'all' or an int, but given 'half'"):
        resolve_cores("half", 8)
