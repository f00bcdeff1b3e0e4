"""TorchTPU (``torch-tpu``, device ``tpu``) as far as a machine without a TPU can show it.

TorchTPU cannot execute without a TPU, so these tests stand in for it: a fake
``torch.tpu`` whose strict-internal functions raise (as they do from user code on
torch >= 2.11), ``torch.accelerator`` answering "tpu" (the privateuse1 device renamed,
as TorchTPU does), and Google's distribution metadata. What they check: the backend is
chosen by the distribution, not the module name; no strict-internal function is called on
the paths a user takes; the launch environment is set before the processes start; the
errors users meet carry their fix. Training itself goes through the native backend, which
tests/test_native.py runs for real with several processes.
"""

import ast
import os

import pytest

from conftest import ROOT, run_python
from tpu_utility.backend import XLA_INSTALLED, installed_version

REAL_TORCHTPU = installed_version("torch-tpu") is not None  # the TorchTPU lane installs it

FAKE_TORCHTPU = """
import sys, types
import torch

CALLS = []
STRICT = ("is_available", "device_count", "current_device", "set_device", "synchronize", "get_rng_state", "initial_seed")


def _strict(name):
    def refuse(*args, **kwargs):
        CALLS.append(name)
        raise RuntimeError(f"torch.tpu.{name} is internal to TorchTPU; use torch.accelerator")
    return refuse


try:
    torch.utils.rename_privateuse1_backend("tpu")
except RuntimeError:  # the real torch_tpu, loaded by import torch, already did
    pass
tpu = types.ModuleType("torch.tpu")
for name in STRICT:
    setattr(tpu, name, _strict(name))
distributed = types.ModuleType("torch.tpu.distributed")
distributed.set_tpu_launch_env = lambda nproc_per_node: CALLS.append(f"set_tpu_launch_env({nproc_per_node})")
tpu.distributed = distributed
sys.modules["torch.tpu"], sys.modules["torch.tpu.distributed"] = tpu, distributed
torch.tpu = tpu
torch.accelerator.is_available = lambda: True
torch.accelerator.current_accelerator = lambda check_available=False: torch.device("tpu", 0)
torch.accelerator.device_count = lambda: 4
torch.accelerator.current_device_index = lambda: 0
torch.accelerator.set_device_index = lambda index: CALLS.append(f"set_device_index({index})")
"""


def _torchtpu_installed(tmp_path, distribution="torch-tpu"):
    """Distribution metadata and an (unimportable) module named torch_tpu on the path."""
    (tmp_path / "torch_tpu").mkdir(parents=True)
    (tmp_path / "torch_tpu" / "__init__.py").write_text("raise ImportError('needs a TPU')\n")
    info = tmp_path / f"{distribution.replace('-', '_')}-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.2.0\n")
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}", "PJRT_DEVICE": None}


def test_torchtpu_backend_is_chosen_by_its_distribution_and_never_calls_strict_torch_tpu(tmp_path):
    r = run_python(FAKE_TORCHTPU + """
from tpu_utility import backend, get_device, make_sampler
from tpu_utility.backend.native import NativeBackend

chosen = backend.current()
print("chosen:", chosen, chosen.dist_backend)
print("device:", get_device(), backend.device(), backend.current().devices.device_count(), backend.world_size(), backend.rank())
print("bf16:", backend.current().compute.bf16_autocast_available(), backend.hardware(torch.device("tpu", 0)))
print("sampler:", make_sampler(torch.utils.data.TensorDataset(torch.zeros(4))))
launched = []
NativeBackend.Processes.launch = lambda self, fn, args, nprocs, method: launched.append((nprocs, method, list(CALLS)))
backend.launch(print, (), 4, "spawn")
print("launched:", launched)
try:
    backend.launch(print, (), 4, "fork")
except RuntimeError as error:
    print("fork:", error)
print("strict calls:", [c for c in CALLS if c in STRICT])
""", env=_torchtpu_installed(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "chosen: TorchTpuBackend() tpu_dist" in r.stdout
    assert "device: tpu:0 tpu:0 4 1 0" in r.stdout
    assert "bf16: True TPU" in r.stdout and "sampler: None" in r.stdout
    assert "launched: [(4, 'spawn', ['set_tpu_launch_env(4)'])]" in r.stdout  # the env is set before the spawn
    assert "fork: TorchTPU cannot fork" in r.stdout
    assert "strict calls: []" in r.stdout


@pytest.mark.skipif(REAL_TORCHTPU, reason="Google's torch-tpu is installed here: its metadata is found")
def test_a_torch_tpu_module_of_another_distribution_leaves_the_native_backend(tmp_path):
    r = run_python(FAKE_TORCHTPU + """
from tpu_utility import backend
print("chosen:", backend.current())
""", env=_torchtpu_installed(tmp_path, distribution="sophgo-torch-tpu"))
    assert "chosen: NativeBackend('tpu', 'gloo')" in r.stdout, r.stderr


def test_no_strict_internal_torch_tpu_function_appears_in_the_package():
    from tpu_utility.backend.tpu import STRICT_INTERNAL

    found = []
    for folder, _, files in os.walk(os.path.join(ROOT, "tpu_utility")):
        for name in (f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.Attribute) and node.attr in STRICT_INTERNAL:
                    inner = node.value
                    if isinstance(inner, ast.Attribute) and inner.attr == "tpu":
                        found.append(f"{path}:{node.lineno}: torch.tpu.{node.attr}")
    assert not found, found


def test_torchtpu_errors_carry_their_fix():
    from tpu_utility.backend.tpu import translate_error

    autoload = RuntimeError(
        "Failed to load the backend extension: torch_tpu. You can disable extension auto-loading with "
        "TORCH_DEVICE_BACKEND_AUTOLOAD=0."
    )
    said = str(translate_error(autoload))
    assert "needs torch 2.11 to 2.15" in said and "pip uninstall torch-tpu" in said
    other = ValueError("unrelated")
    assert translate_error(other) is other


def test_version_gate_for_torchtpu():
    from tpu_utility.backend.versions import torch_supports_torch_tpu

    assert [torch_supports_torch_tpu(v) for v in ("2.9.0", "2.10.1", "2.11.0", "2.13.0+cpu", "2.15.2", "2.16.0")] == [
        False, False, True, True, True, False,
    ]  # fmt: skip


@pytest.mark.skipif(not XLA_INSTALLED or REAL_TORCHTPU, reason="the trap is torch_tpu beside torch 2.8/2.9 + torch_xla")
def test_the_autoload_trap_breaks_import_torch_and_the_documented_switch_restores_it(tmp_path):
    """A torch_tpu beside torch 2.8/2.9 + torch_xla: its torch.backends entry point fails inside import torch."""
    (tmp_path / "torch_tpu").mkdir()
    (tmp_path / "torch_tpu" / "__init__.py").write_text(
        "def _autoload():\n"
        "    raise RuntimeError('torch_tpu 0.2.0: this torch predates the oldest supported release (2.11)')\n"
    )
    info = tmp_path / "torch_tpu-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch-tpu\nVersion: 0.2.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_tpu = torch_tpu:_autoload\n")
    env = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    broken = run_python("import torch", env=env)
    assert broken.returncode != 0
    assert "Failed to load the backend extension: torch_tpu" in broken.stderr, broken.stderr[-2000:]
    assert "predates the oldest supported release" in broken.stderr
    fixed = run_python("""
import warnings
warnings.simplefilter("always")
from tpu_utility import setup_tpu
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    info = setup_tpu(verbose=False)
print("xla:", info.xla, [str(w.message) for w in caught])
""", env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    assert fixed.returncode == 0, fixed.stderr
    assert "xla: True" in fixed.stdout and "is installed, but tpu_utility runs on torch_xla" in fixed.stdout


@pytest.mark.skipif(not REAL_TORCHTPU, reason="runs in the TorchTPU lane, where torch-tpu 0.2.0 is installed")
def test_with_real_torchtpu_installed_and_no_tpu_the_native_cpu_backend_trains():
    r = run_python("""
import torch
from torch.utils.data import TensorDataset
from tpu_utility import backend, one_cycle_fit, setup_tpu
info = setup_tpu(verbose=False)
print("found:", backend.torch_tpu_installed(), backend.current(), info.device_type)
x = torch.randn(64, 4); y = (x[:, 0] > 0).long()
history = one_cycle_fit(torch.nn.Linear(4, 2), TensorDataset(x, y), epochs=2, max_lr=1e-2, batch_size=16, progress=False)
print("loss:", history.records[0].train_loss > history.records[-1].train_loss)
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "found: True NativeBackend('cpu', 'gloo') cpu" in r.stdout and "loss: True" in r.stdout


def test_setup_tpu_reads_torchtpus_devices_and_cache_from_its_backend(monkeypatch):
    """What setup_tpu reports where TorchTPU runs (no TPU here: its backend object answers alone): its chips, one
    process each, and its own compile cache, on only where set before torch started."""
    from tpu_utility.backend.base import Found
    from tpu_utility.backend.hardware import TpuHardware
    from tpu_utility.backend.tpu import CACHE_VARIABLES, TorchTpuBackend

    chosen = TorchTpuBackend()
    monkeypatch.setattr(chosen.devices, "device_count", lambda: 4)
    assert chosen.diagnosis.found(TpuHardware(4, "v5e", 1)) == Found("TPU", "TorchTPU", 4, "tpu (TorchTPU)")
    monkeypatch.delenv(CACHE_VARIABLES[0], raising=False)
    folder, note = chosen.compute.compile_cache("/unused", None, True)  # setup_tpu's folder cannot move it
    assert folder is None and note.startswith(f"off: TorchTPU reads {CACHE_VARIABLES[0]} when torch starts")
    monkeypatch.setenv(CACHE_VARIABLES[0], "/kaggle/working/tpu_cache")
    assert chosen.compute.compile_cache("/unused", None, None) == ("/kaggle/working/tpu_cache", "on")
