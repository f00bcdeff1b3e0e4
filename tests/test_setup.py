"""setup_tpu: platform, TPU detection without a runtime, compile cache, summary."""

import os

from conftest import run_python
from tpu_utility.environment import default_cache_dir, detect_platform, suggest_num_workers
from tpu_utility.xla import detect_tpu


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


def test_setup_tpu_twice_is_harmless_and_the_cache_fills(tmp_path):
    r = run_python(f"""
        import os, torch
        from tpu_utility import setup_tpu, get_device, xla
        first = setup_tpu(cache_dir={str(tmp_path)!r}, compile_cache=True)
        second = setup_tpu(cache_dir={str(tmp_path)!r}, compile_cache=True)
        print("same:", first == second, "runtime:", xla.runtime_started())
        x = torch.arange(6.0, device=get_device()).reshape(2, 3)
        c = x.cpu()
        print("matches cpu:", (x @ x.T).sum().item() == (c @ c.T).sum().item())
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("tpu_utility on local: CPU XLA:CPU x 1 via XLA") == 1  # printed once
    assert "suggested DataLoader num_workers=" in r.stdout
    assert f"compile cache: {tmp_path}" in r.stdout
    assert "same: True runtime: False" in r.stdout  # setup_tpu never starts the runtime
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
