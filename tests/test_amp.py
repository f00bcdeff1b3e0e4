"""autocast and grad_scaler: the right mixed precision per device, and step_optimizer with a scaler."""

import copy
import warnings

import pytest
import torch
from torch import nn

from tpu_utility import autocast, get_device, grad_scaler, step_optimizer, backend
from tpu_utility.amp import PassThroughScaler, plan_autocast


def test_plan_per_device():
    assert plan_autocast("cuda", None) == plan_autocast("cuda", torch.float16)
    assert plan_autocast("cuda", None).dtype == torch.float16  # torch's CUDA default
    assert (plan_autocast("cuda", torch.bfloat16).kind, plan_autocast("cuda", torch.bfloat16).dtype) == ("torch", torch.bfloat16)
    tpu = plan_autocast("xla", torch.float16, "TPU")
    assert (tpu.kind, tpu.dtype) == ("backend", torch.bfloat16) and "float16 was asked for and bfloat16 is used" in tpu.note
    assert plan_autocast("xla", None, "TPU").note is None
    xla_cpu = plan_autocast("xla", torch.bfloat16, "CPU")
    assert xla_cpu.kind == "off" and "on XLA:CPU the loop runs in float32" in xla_cpu.note
    assert plan_autocast("cpu", torch.float16).kind == "off"


def test_float32_means_no_autocast_as_torch_autocast_takes_it():
    # nanoGPT's dtype='float32' option: torch.autocast warns and runs without autocast; so does the kit's (issue 39)
    for device_type, hardware in [("cuda", None), ("xla", "TPU"), ("xla", "CPU"), ("cpu", None)]:
        plan = plan_autocast(device_type, torch.float32, hardware)
        assert plan.kind == "off" and "dtype=torch.float32" in plan.note, (device_type, plan)
    with autocast("cpu", dtype=torch.float32):
        assert not torch.is_autocast_enabled("cpu")


def test_bad_dtype_names_the_value():
    with pytest.raises(ValueError, match=r"dtype must be None, torch.float16, torch.bfloat16 or torch.float32, but given torch.int8"):
        autocast("cpu", torch.int8)
    with pytest.raises(ValueError, match=r"but given torch.int8"):
        grad_scaler("cpu", torch.int8)
    with pytest.raises(TypeError, match=r"enabled must be a bool, but given 1"):
        autocast("cpu", enabled=1)


def test_autocast_on_xla_cpu_is_off_and_says_so_once(monkeypatch):
    from tpu_utility import amp

    monkeypatch.setattr(amp, "_SAID", set())  # as in a fresh process: nothing said yet
    device = get_device()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            with autocast(device, torch.bfloat16):
                out = nn.Linear(4, 2).to(device)(torch.ones(3, 4, device=device))
    assert out.dtype == torch.float32
    said = [w for w in caught if "autocast" in str(w.message)]
    assert len(said) == 1 and "on XLA:CPU the loop runs in float32" in str(said[0].message)  # once, not per step


def test_pass_through_scaler_is_a_gradscaler_that_does_not_scale():
    scaler = grad_scaler(get_device())
    assert isinstance(scaler, PassThroughScaler) and isinstance(scaler, torch.amp.GradScaler)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    real_state = torch.amp.GradScaler("cpu").state_dict()
    scaler.load_state_dict(real_state)  # a CUDA run's checkpoint loads; there is no scale to restore
    assert scaler.state_dict() == {}
    assert isinstance(grad_scaler("cuda", torch.bfloat16), PassThroughScaler)  # bf16 needs no scaling


def test_pass_through_scaler_step_is_step_optimizer_on_xla():
    torch.manual_seed(0)
    device = get_device()
    model = nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = grad_scaler(device)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    losses, compiles = [], []
    for _ in range(30):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x.to(device)), y.to(device))
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # all-reduce (one replica: none) and the graph cut
        scaler.update()
        losses.append(loss.detach())
        compiles.append(backend.compile_count())
    assert losses[-1].item() < 0.1 * losses[0].item()
    assert compiles[10] == compiles[-1], "the step graph should compile once"


def _two_steps(scaler, max_grad_norm=None):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(2):
        optimizer.zero_grad()
        loss = model(torch.ones(3, 4)).pow(2).sum()
        (scaler.scale(loss) if scaler else loss).backward()
        step_optimizer(optimizer, scaler=scaler, max_grad_norm=max_grad_norm)
    return model


def test_step_optimizer_with_a_real_scaler_unscales_before_clipping_and_updates():
    plain = _two_steps(None, max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    scaled = _two_steps(scaler, max_grad_norm=1.0)
    for a, b in zip(plain.parameters(), scaled.parameters()):
        torch.testing.assert_close(a, b)  # clipping saw unscaled gradients
    assert scaler.get_scale() == 4096.0  # update() ran after each of the 2 steps


def test_step_optimizer_with_a_scaler_skips_a_step_with_inf_gradients():
    model = nn.Linear(4, 1)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(model(torch.full((2, 4), float("inf"))).sum()).backward()
    step_optimizer(optimizer, scaler=scaler)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert scaler.get_scale() == 4.0  # backed off


def test_step_optimizer_refuses_a_scaler_of_the_wrong_type():
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"scaler must be a torch.amp.GradScaler .* but given 'yes' of type str"):
        step_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), scaler="yes")
