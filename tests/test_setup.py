"""setup_tpu: platform, TPU detection without a runtime, compile cache, summary."""

import os

import pytest

from conftest import BLOCK_TORCH_XLA, ROOT, run_python
from tpu_utility.environment import default_cache_dir, detect_platform, suggest_num_workers, usable_cpus
from tpu_utility.backend.versions import XLA_RELEASES, check_versions, fix_command
from tpu_utility.backend.hardware import detect_tpu


def test_detect_platform_from_the_environment():
    assert detect_platform({"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, tpu_chips=4) == "kaggle"
    assert detect_platform({"COLAB_RELEASE_TAG": "release"}, tpu_chips=0) == "colab"
    assert detect_platform({}, tpu_chips=4) == "tpu-vm"
    assert detect_platform({"TPU_ACCELERATOR_TYPE": "v4-8"}, tpu_chips=0) == "tpu-vm"
    assert detect_platform({}, tpu_chips=0) == "local"


def test_cache_dir_survives_restarts_and_splits_per_process():
    assert default_cache_dir("kaggle", None) == "/kaggle/working/xla_cache"
    assert default_cache_dir("local", None, {"XDG_CACHE_HOME": "/c"}) == "/c/tpu_utility/xla_cache"
    assert default_cache_dir("colab", 3, {"XDG_CACHE_HOME": "/c"}) == "/c/tpu_utility/xla_cache/process_3"
    assert default_cache_dir("kaggle", 1, base="/mine") == "/mine/process_1"


def _fake_pci(root, devices):
    for i, (vendor, device) in enumerate(devices):
        d = root / f"0000:00:0{i}.0"
        d.mkdir()
        (d / "vendor").write_text(vendor + "\n")
        (d / "device").write_text(device + "\n")


def test_detect_tpu_reads_the_pci_bus(tmp_path):
    _fake_pci(tmp_path, [("0x1ae0", "0x0027")] * 4 + [("0x8086", "0x1234"), ("0x1ae0", "0x9999")])
    tpu = detect_tpu(str(tmp_path))
    assert (tpu.chips, tpu.kind, tpu.devices) == (4, "v2/v3", 8)
    assert detect_tpu(str(tmp_path / "missing")).chips == 0


def test_suggested_workers_leave_a_cpu_per_process():
    assert suggest_num_workers(2) == 1
    assert suggest_num_workers(96, processes=4) == 8
    assert suggest_num_workers(4, processes=4) == 0


def test_workers_never_exceed_the_cpus_a_container_may_use(tmp_path):
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # cgroup v2: a quota of 1.5 CPUs
    assert usable_cpus(str(tmp_path)) == min(2, len(os.sched_getaffinity(0)))
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no quota: the CPUs this process may run on
    assert usable_cpus(str(tmp_path)) == len(os.sched_getaffinity(0))
    v1 = tmp_path / "v1" / "cpu"
    v1.mkdir(parents=True)
    (v1 / "cpu.cfs_quota_us").write_text("100000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert usable_cpus(str(tmp_path / "v1")) == 1
    assert suggest_num_workers(usable_cpus(str(tmp_path / "v1"))) == 0


def _release_of(version: str) -> str:
    return ".".join(version.split(".")[:2])


def test_the_fix_command_installs_one_real_release():
    for torch_pin, xla_pin, vision_pin in XLA_RELEASES.values():
        assert _release_of(torch_pin) == _release_of(xla_pin)
        assert int(vision_pin.split(".")[1]) == int(torch_pin.split(".")[1]) + 15  # torchvision's numbering
    newest_torch, newest_xla, newest_vision = XLA_RELEASES[max(XLA_RELEASES, key=lambda r: int(r.split(".")[1]))]
    # the installed torch_xla's release is kept, torchvision included
    old_torch, old_xla, old_vision = XLA_RELEASES[min(XLA_RELEASES, key=lambda r: int(r.split(".")[1]))]
    command = fix_command(newest_torch, old_xla)
    assert command == f'pip install "torch=={old_torch}" "torch_xla[tpu]=={old_xla}" "torchvision=={old_vision}"'
    # a torch newer than torch_xla's last release: no such torch_xla exists, so install the last trio
    major, minor = newest_torch.split(".")[:2]
    future = f"{major}.{int(minor) + 3}.0"
    command = fix_command(future)
    assert command.startswith(f'pip install "torch=={newest_torch}" "torch_xla[tpu]=={newest_xla}" '
                              f'"torchvision=={newest_vision}"')  # fmt: skip
    assert f"torch {future} has no torch_xla" in command
    assert f"torch_xla[tpu]=={major}.{int(minor) + 3}" not in command


def test_a_torchvision_of_another_release_is_caught_with_the_fix():
    torch_pin, xla_pin, vision_pin = next(iter(XLA_RELEASES.values()))
    wrong_vision = f"0.{int(vision_pin.split('.')[1]) + 1}.0"
    with pytest.raises(RuntimeError) as e:
        check_versions(torch_pin, xla_pin, wrong_vision)
    assert f"torchvision {wrong_vision} does not match torch {torch_pin}" in str(e.value)
    assert f'"torchvision=={vision_pin}"' in str(e.value)
    check_versions(torch_pin + "+cu128", xla_pin, vision_pin + "+cpu")  # local-version suffixes match


def _fake_torch_tpu(tmp_path, distribution: str = "torch-tpu"):
    """A module named torch_tpu that cannot be imported, installed as ``distribution`` (Google's is torch-tpu).

    An attempt to import it leaves the file ``imported`` in tmp_path (a failed import leaves no trace in sys.modules).
    """
    pkg = tmp_path / "torch_tpu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').close()\n"
                                     "raise ImportError('torch_tpu needs a TPU and torch 2.11+')\n")  # fmt: skip
    info = tmp_path / f"{distribution.replace('-', '_')}-0.2.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 0.2.0\n")
    (info / "top_level.txt").write_text("torch_tpu\n")
    return {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}


def _on_path(env: dict) -> str:
    """The line that puts the fake on sys.path as env's PYTHONPATH would: the script then starts from the warm
    interpreter (which holds no torch_tpu and no tpu_utility) instead of a fresh one."""
    return f"import sys; sys.path.insert(1, {env['PYTHONPATH'].split(os.pathsep)[1]!r})\n"


def test_a_torch_tpu_module_from_another_distribution_is_not_torchtpu(tmp_path):
    r = run_python(_on_path(_fake_torch_tpu(tmp_path, distribution="sophgo-torch-tpu")) + """
from tpu_utility import backend
print("torchtpu:", backend.torch_tpu_installed())
""")
    assert "torchtpu: False" in r.stdout, r.stderr


def test_setup_tpu_says_plainly_that_it_runs_on_torch_xla_beside_torch_tpu(tmp_path):
    r = run_python(_on_path(_fake_torch_tpu(tmp_path)) + """
import warnings
from tpu_utility import setup_tpu
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    info = setup_tpu(verbose=False)
print("warned:", [str(w.message) for w in caught])
print("xla:", info.xla)
""")
    assert r.returncode == 0, r.stderr
    assert "torch_tpu (TorchTPU, device 'tpu') is installed, but tpu_utility runs on torch_xla" in r.stdout
    assert "xla: True" in r.stdout
    assert not (tmp_path / "imported").exists()  # found, never imported (not even tried)
    r = run_python(BLOCK_TORCH_XLA + """
import warnings
warnings.simplefilter("ignore")
from tpu_utility import setup_tpu
try:
    setup_tpu()
except ModuleNotFoundError as e:
    print("error:", e)
""", env={**_fake_torch_tpu(tmp_path / "again"), "PJRT_DEVICE": "CPU"})
    assert "needs torch_xla (torch_tpu is installed: unset PJRT_DEVICE to run on TorchTPU instead)" in r.stdout, r.stderr
    assert 'pip install "torch==' in r.stdout


def test_no_torch_tpu_no_word_about_it():
    r = run_python("""
        import warnings
        warnings.simplefilter("error")
        from tpu_utility import setup_tpu
        setup_tpu()
    """)
    assert r.returncode == 0, r.stderr
    assert "torch_tpu" not in r.stdout + r.stderr


def test_setup_tpu_twice_is_harmless_and_the_cache_fills(tmp_path):
    r = run_python(f"""
        import os, torch
        from tpu_utility import setup_tpu, get_device, backend
        first = setup_tpu(cache_dir={str(tmp_path)!r}, compile_cache=True)
        second = setup_tpu(cache_dir={str(tmp_path)!r}, compile_cache=True)
        print("same:", first == second, "runtime:", backend.runtime_started())
        x = torch.arange(6.0, device=get_device()).reshape(2, 3)
        c = x.cpu()
        print("matches cpu:", (x @ x.T).sum().item() == (c @ c.T).sum().item())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tpu_utility on local: CPU XLA:CPU x 1 via XLA") == 1  # printed once
    assert "suggested DataLoader num_workers=" in r.stdout
    assert f"compile cache: {tmp_path}" in r.stdout
    assert "same: True runtime: True" in r.stdout  # one device: setup_tpu starts the runtime (pytorch/xla#4174)
    assert "matches cpu: True" in r.stdout
    assert os.listdir(tmp_path), "the persistent compile cache wrote nothing"


def test_compile_cache_is_off_by_default_on_xla_cpu_and_says_why():
    r = run_python("""
        import os
        from tpu_utility import setup_tpu
        info = setup_tpu()
        print("cache:", info.cache_dir, "env:", os.environ.get("XLA_PERSISTENT_CACHE_PATH"))
    """)
    assert r.returncode == 0, r.stderr
    assert "compile cache: off (XLA:CPU cannot reload compiled programs)" in r.stdout
    assert "cache: None env: None" in r.stdout


def test_training_prints_nothing_about_jax_on_any_torch_xla():
    # torch_xla 2.8's loader traces warned "requires jax/pallas" several times per batch without jax
    r = run_python("""
        import torch
        from torch.utils.data import TensorDataset
        from tpu_utility import one_cycle_fit
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        one_cycle_fit(torch.nn.Linear(4, 2), data, epochs=2, max_lr=1e-2, batch_size=16, progress=False)
        print("trained")
    """)
    assert r.returncode == 0, r.stderr
    assert "trained" in r.stdout
    assert "jax" not in r.stderr.lower(), r.stderr[-2000:]


def test_the_backend_is_chosen_by_name_and_the_summary_says_why():
    # issue 29: `from transformers import ...` imports torch_xla, which sets PJRT_DEVICE=CPU on a machine
    # without a TPU; the package then ran on XLA:CPU, and nothing said so or offered CUDA/CPU
    r = run_python("""
        from tpu_utility import setup_tpu, get_device, backend
        import torch_xla  # what `from transformers import ...` does where torch_xla is installed
        info = setup_tpu(backend="native")
        print("native:", get_device(), backend.current().name, backend.runtime_started())
        info = setup_tpu()
        print("auto:", get_device().type, backend.runtime_started())
        for bad in ("native", "gpu"):
            try:
                setup_tpu(backend=bad)
            except (RuntimeError, ValueError) as e:
                print(type(e).__name__ + ":", e)
    """, env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "backend: native (cpu), because setup_tpu(backend='native'); PJRT_DEVICE=CPU was set by torch_xla " \
           "when it was imported, ignored" in out
    assert "native: cpu cpu False" in out  # torch's CPU, the XLA runtime never started
    assert "backend: xla, because PJRT_DEVICE=CPU was set by torch_xla when it was imported " \
           "(TPU_UTILITY_BACKEND=native or setup_tpu(backend='native') for torch's own devices)" in out
    assert "auto: xla True" in out
    assert "RuntimeError: setup_tpu(backend='native') cannot switch this process to the cpu backend: the xla " \
           "backend already runs here" in out
    assert "ValueError: setup_tpu(backend=...) must be one of ('auto', 'native', 'xla', 'tpu'), but given 'gpu'" in out


def test_the_environment_variable_chooses_the_backend_before_anything_runs():
    r = run_python("""
        import os, sys
        from tpu_utility import setup_tpu, get_device, backend
        print("device:", get_device(), "torch_xla loaded:", "torch_xla" in sys.modules)
        setup_tpu()
        for value, call in (("tpu", lambda: setup_tpu()), ("bogus", get_device)):
            os.environ["TPU_UTILITY_BACKEND"] = value
            try:
                call()
            except (RuntimeError, ValueError) as e:
                print(type(e).__name__ + ":", e)
    """, env={"TPU_UTILITY_BACKEND": "native", "PJRT_DEVICE": "CPU"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "device: cpu torch_xla loaded: False" in out  # PJRT_DEVICE=CPU set, and still torch's CPU
    assert "backend: native (cpu), because TPU_UTILITY_BACKEND=native; PJRT_DEVICE=CPU is set, ignored" in out
    assert "RuntimeError: TPU_UTILITY_BACKEND=tpu asks for TorchTPU (device 'tpu'), but torch_tpu is not " \
           "installed. Allowed here: 'native', 'xla', 'auto'" in out
    assert "ValueError: TPU_UTILITY_BACKEND must be one of ('auto', 'native', 'xla', 'tpu'), but given 'bogus'" in out


CPU_CHECK_FIRST = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import one_cycle_fit, setup_tpu
torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
"""


def test_setup_tpu_first_makes_a_cpu_check_of_the_model_safe():
    r = run_python(CPU_CHECK_FIRST.replace("torch.manual_seed(0)", "setup_tpu(verbose=False)\ntorch.manual_seed(0)") + """
x, y = data[:32]
nn.functional.cross_entropy(model(x), y).backward()  # the notebook's CPU check of the model
history = one_cycle_fit(model, data, epochs=2, max_lr=1e-2, batch_size=32, progress=False)
from tpu_utility import backend
losses = [r.train_loss for r in history.records]
print("trained on xla:", backend.compile_count() > 0, "loss falls:", losses[-1] < losses[0])
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "trained on xla: True loss falls: True" in r.stdout


def test_a_cpu_backward_before_the_xla_runtime_is_a_clear_error_naming_the_fix():
    # pytorch/xla#4174: torch's autograd engine sized its device queues at the CPU backward, and every XLA
    # backward after it failed with "device_ready_queues_ ... INTERNAL ASSERT FAILED ... report a bug to PyTorch"
    r = run_python(CPU_CHECK_FIRST + """
x, y = data[:32]
nn.functional.cross_entropy(model(x), y).backward()  # the CPU check, before anything touched XLA
for call in (lambda: one_cycle_fit(model, data, epochs=1, max_lr=1e-2, progress=False), setup_tpu):
    try:
        call()
    except RuntimeError as e:
        print("RuntimeError:", e)
""")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("RuntimeError: A backward pass ran on the CPU before torch_xla's runtime started") == 2
    assert "call setup_tpu() first, in the first cell" in r.stdout
    assert "INTERNAL ASSERT" not in r.stdout.replace("'device_ready_queues_ ... INTERNAL ASSERT FAILED'", "")
    assert "epoch 1" not in r.stdout.lower()  # refused before an epoch


def test_on_the_host_cpu_a_dataset_gets_no_loader_workers_by_default_and_the_summary_says_why():
    # issue 29: on the native CPU backend a worker competes with torch's compute threads for the same cores
    r = run_python("""
        import torch
        from torch.utils.data import Dataset
        from tpu_utility import one_cycle_fit, setup_tpu
        info = setup_tpu()
        class Halves(Dataset):  # not a TensorDataset: one_cycle_fit chooses the workers
            def __len__(self): return 64
            def __getitem__(self, i): return torch.tensor([i / 64.0]), int(i >= 32)
        history = one_cycle_fit(torch.nn.Linear(1, 2), Halves(), epochs=1, max_lr=1e-2, batch_size=16, progress=False)
        print("workers:", info.num_workers, "|", history.summary)
    """, env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "suggested DataLoader num_workers=0 (the model trains on these CPUs: a worker would take cores" in r.stdout
    assert "workers: 0 |" in r.stdout and "| 0 loader worker(s)" in r.stdout, r.stdout
