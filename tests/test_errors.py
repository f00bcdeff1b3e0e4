"""Bad input gets a Python error naming the value given and what is allowed."""

import pytest
import torch

from conftest import flat_digits, run_python, small_mlp
from tpu_utility import get_device, make_sampler, one_cycle_fit, setup_tpu, step_optimizer, backend
from tpu_utility.backend import check_versions


def test_get_device_index_out_of_range():
    with pytest.raises(ValueError, match=r"index must be between 0 and 0 .*but given 99"):
        get_device(index=99)


def test_get_device_index_wrong_type():
    with pytest.raises(TypeError, match=r"index must be an int or None, but given '1'"):
        get_device(index="1")


def test_step_optimizer_given_something_else():
    with pytest.raises(TypeError, match=r"optimizer must be a torch.optim.Optimizer.*given 'sgd' of type str"):
        step_optimizer("sgd")


def test_step_optimizer_bad_clip():
    opt = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"max_grad_norm must be a positive number or None, but given -1"):
        step_optimizer(opt, max_grad_norm=-1)


def test_make_sampler_without_len():
    with pytest.raises(TypeError, match=r"map-style Dataset with __len__.*given generator"):
        make_sampler(i for i in range(3))


def test_make_sampler_empty():
    with pytest.raises(ValueError, match=r"dataset is empty \(len\(dataset\) == 0\)"):
        make_sampler([])


def test_version_mismatch_gives_the_pip_command():
    with pytest.raises(RuntimeError) as e:
        check_versions("2.9.0+cu128", "2.8.0")
    assert "torch 2.9.0+cu128 does not match torch_xla 2.8.0" in str(e.value)
    assert 'pip install "torch==2.8.0" "torch_xla[tpu]==2.8.0"' in str(e.value)
    check_versions("2.9.0+cu128", "2.9.0")  # a local-version suffix is not a mismatch


def test_setup_tpu_reports_a_simulated_mismatch(monkeypatch):
    monkeypatch.setattr(backend, "installed_version", lambda name: "2.7.1" if name == "torch_xla" else None)
    with pytest.raises(RuntimeError, match=r"does not match torch_xla 2.7.1"):
        setup_tpu(verbose=False)


def test_pjrt_device_tpu_without_a_tpu():
    r = run_python("""
        from tpu_utility import get_device, setup_tpu
        for call in (setup_tpu, get_device):
            try:
                call()
            except RuntimeError as e:
                print(call.__name__, "->", e)
    """, env={"PJRT_DEVICE": "TPU"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "setup_tpu -> PJRT_DEVICE='TPU' is requested but this machine has no TPU chip" in r.stdout
    assert "get_device -> PJRT_DEVICE='TPU' is requested but this machine has no TPU chip" in r.stdout


def test_setup_tpu_after_the_runtime_started_on_another_device(monkeypatch):
    get_device()  # starts the runtime on CPU
    assert backend.runtime_device_type() == "CPU"
    monkeypatch.delenv("PJRT_DEVICE")
    with pytest.raises(RuntimeError, match=r"already started on 'CPU'.*cannot switch to 'TPU'"):
        setup_tpu(device="TPU", verbose=False)


def test_setup_tpu_bad_choice():
    with pytest.raises(ValueError, match=r"device must be one of \('auto', 'TPU', 'CPU'\), but given 'GPU'"):
        setup_tpu(device="GPU")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"precision": "fp8"}, r"precision must be one of \('fp32', 'bf16', 'fp16'\), but given 'fp8'"),
        ({"cores": 3}, r"cores must be 1 or 1 \(all cores here\), or 'all', but given 3"),
        ({"strategy": "ddp"}, r"strategy must be one of \('auto', 'spmd', 'multiprocess', 'fsdp', 'fsdp-tp'\), but given 'ddp'"),
        ({"optimizer": "lamb"}, r"optimizer must be one of \['adam', 'adamw', 'sgd'\] or a callable, but given 'lamb'"),
        ({"metrics": "f1"}, r"metric 'f1' is unknown; allowed names: \['accuracy'\]"),
        ({"epochs": 0}, r"epochs must be a positive int, but given 0"),
        ({"max_lr": -1.0}, r"max_lr must be finite and > 0, but given -1.0"),
        ({"resume": True}, r"resume=True needs checkpoint_dir"),
        ({"batch_size": 4096}, r"fewer than one batch of 4096"),
    ],
)
def test_one_cycle_fit_bad_arguments(kwargs, message):
    args = {"epochs": 1, "max_lr": 1e-3, "progress": False, **kwargs}
    with pytest.raises((ValueError, TypeError), match=message):
        one_cycle_fit(small_mlp(), flat_digits(), **args)


def test_find_lr_names_an_unknown_optimizer():
    from tpu_utility import find_lr

    with pytest.raises(ValueError, match=r"optimizer must be one of \['adam', 'adamw', 'sgd'\] or a callable, but given 'lamb'"):
        find_lr(small_mlp(), flat_digits(), optimizer="lamb")
