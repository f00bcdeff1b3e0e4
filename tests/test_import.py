"""import tpu_utility never imports torch_xla, and everything falls back to CPU without it."""

from conftest import BLOCK_TORCH_XLA, run_python


def test_import_does_not_import_torch_xla():
    r = run_python("""
        import sys, tpu_utility
        print("loaded:", "torch_xla" in sys.modules)
        print("runtime:", tpu_utility.backend.runtime_started())
    """)
    assert r.returncode == 0, r.stderr
    assert "loaded: False" in r.stdout
    assert "runtime: False" in r.stdout


def test_everything_falls_back_without_torch_xla():
    r = run_python(BLOCK_TORCH_XLA + """
import torch
import tpu_utility
from tpu_utility import get_device, setup_tpu, step_optimizer, make_sampler
assert not tpu_utility.backend.XLA_INSTALLED
print("device:", get_device())
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
before = model.weight.detach().clone()
model(torch.ones(2, 3)).sum().backward()
step_optimizer(opt, max_grad_norm=1.0)
print("stepped:", not torch.equal(before, model.weight))
print("sampler:", make_sampler(list(range(10))))
info = setup_tpu()
print("xla:", info.xla, info.device_type)
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr
    assert "device: cpu" in r.stdout
    assert "stepped: True" in r.stdout
    assert "sampler: None" in r.stdout
    assert "no XLA: torch_xla is not installed" in r.stdout
    assert "xla: False cpu" in r.stdout


def test_pjrt_device_without_torch_xla_names_the_install_command():
    r = run_python(BLOCK_TORCH_XLA + """
from tpu_utility import setup_tpu
try:
    setup_tpu()
except ModuleNotFoundError as e:
    print("error:", e)
""", env={"PJRT_DEVICE": "CPU"})
    assert r.returncode == 0, r.stderr
    assert "error: PJRT_DEVICE='CPU' needs torch_xla" in r.stdout
    assert "pip install" in r.stdout


def test_one_cycle_fit_runs_without_torch_xla():
    r = run_python(BLOCK_TORCH_XLA + """
import warnings; warnings.simplefilter("ignore")
import torch
from tpu_utility import one_cycle_fit
from tpu_utility.demo import digits_datasets
train, valid = digits_datasets()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
history = one_cycle_fit(model, train, valid_data=valid, epochs=3, max_lr=1e-2, batch_size=32, progress=False)
print(history.summary)
print("losses", [round(r.train_loss, 3) for r in history.records])
print("accuracy", history.records[-1].metrics["accuracy"])
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr
    assert "one_cycle_fit: single on 1 cpu core(s)" in r.stdout
    losses = eval(r.stdout.split("losses ")[1].splitlines()[0])
    assert losses[-1] < 0.5 * losses[0]
    assert float(r.stdout.split("accuracy ")[1]) > 0.9
