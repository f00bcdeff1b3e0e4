"""get_device(): one-for-one for torch.accelerator's device choice, and no quiet CPU fallback."""

import pytest
import torch

from conftest import BLOCK_TORCH_XLA, run_python
from tpu_utility import get_device

# pytorch/examples' device choice (mnist/main.py and others), as users copy it.
EXAMPLES_IDIOM = """
import torch
use_accel = torch.accelerator.is_available()
expected = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
"""


def test_get_device_stands_in_for_torch_accelerator_without_xla():
    r = run_python(BLOCK_TORCH_XLA + EXAMPLES_IDIOM + """
from tpu_utility import get_device
device = get_device()
print("types", type(device).__name__, type(expected).__name__)
print("same", device.type == expected.type, "accel", use_accel == (device.type != "cpu"))
print("moved", torch.ones(2).to(device).device.type == torch.ones(2).to(expected).device.type)
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr
    assert "types device device" in r.stdout
    assert "same True accel True" in r.stdout
    assert "moved True" in r.stdout


def test_get_device_gives_the_xla_device_that_torch_accelerator_does_not_know():
    device = get_device()
    assert isinstance(device, torch.device) and device.type == "xla"
    assert torch.ones(2, device=device).device.type == "xla"
    # the examples' idiom would quietly train on the CPU here: that is what the port fixes
    assert not torch.accelerator.is_available() or torch.accelerator.current_accelerator().type != "xla"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_get_device_matches_torch_accelerator_on_cuda():
    r = run_python(BLOCK_TORCH_XLA + EXAMPLES_IDIOM + """
from tpu_utility import get_device
print("same", get_device().type == expected.type == "cuda")
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr
    assert "same True" in r.stdout


def test_pjrt_device_without_torch_xla_is_an_error_not_a_quiet_cpu():
    r = run_python(BLOCK_TORCH_XLA + """
from tpu_utility import get_device, setup_tpu
for fn in (get_device, setup_tpu):
    try:
        print("returned", fn())
    except ModuleNotFoundError as e:
        print(fn.__name__, "error:", e)
""", env={"PJRT_DEVICE": "CPU"})
    assert r.returncode == 0, r.stderr
    assert "returned" not in r.stdout
    lines = dict(line.split(" error: ") for line in r.stdout.splitlines())
    assert lines["get_device"] == lines["setup_tpu"]  # the same clear error as setup_tpu()
    assert "PJRT_DEVICE='CPU' needs torch_xla" in lines["get_device"] and "pip install" in lines["get_device"]


def test_get_device_index_errors_name_the_value():
    with pytest.raises(TypeError, match=r"index must be an int or None, but given '0'"):
        get_device("0")
    with pytest.raises(ValueError, match=r"index must be between 0 and 0 .*, but given 3"):
        get_device(3)
