"""The one-cycle schedule and the step count, as plain numbers."""

import math

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from tpu_utility.training.schedule import one_cycle, one_cycle_curve, steps_per_epoch, total_optimizer_steps


@pytest.mark.parametrize("total, pct", [(100, 0.25), (37, 0.3), (1000, 0.1)])
def test_one_cycle_matches_torch_onecyclelr(total, pct):
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=3e-3, total_steps=total, pct_start=pct, div_factor=25, final_div_factor=1e4
    )
    for step in range(total):
        lr, mom = one_cycle(step, total, 3e-3, pct_start=pct)
        assert lr == pytest.approx(opt.param_groups[0]["lr"], rel=1e-12)
        assert mom == pytest.approx(opt.param_groups[0]["momentum"], rel=1e-12)
        opt.step()
        sched.step()


def test_one_cycle_shape():
    lrs, moms = one_cycle_curve(200, 1e-2, pct_start=0.25)
    peak = lrs.index(max(lrs))
    assert lrs[0] == pytest.approx(1e-2 / 25)
    assert max(lrs) == pytest.approx(1e-2, rel=1e-3) and 45 <= peak <= 50
    assert lrs[-1] == pytest.approx(1e-2 / (25 * 1e4))
    assert moms[0] == pytest.approx(0.95) and moms[peak] == pytest.approx(0.85, abs=1e-3)
    assert moms[-1] == pytest.approx(0.95)
    assert all(a <= b for a, b in zip(lrs[:peak], lrs[1 : peak + 1]))  # rises, then
    assert all(a >= b for a, b in zip(lrs[peak:], lrs[peak + 1 :]))  # falls


def test_one_cycle_rejects_a_step_outside_the_run():
    with pytest.raises(ValueError, match=r"step must be between 0 and 9, but given 10"):
        one_cycle(10, 10, 1e-3)


@pytest.mark.parametrize("n, batch, replicas", [(1000, 32, 8), (1797, 64, 1), (1001, 16, 4), (100, 8, 3)])
def test_steps_per_epoch_is_what_each_core_iterates(n, batch, replicas):
    sampler = DistributedSampler(range(n), num_replicas=replicas, rank=replicas - 1, shuffle=True)
    loader = DataLoader(range(n), batch_size=batch, sampler=sampler, drop_last=True)
    assert steps_per_epoch(n, batch, replicas) == len(loader)


def test_total_steps_counts_per_core_batches():
    # The old Kaggle helper counted 1000 // 32 = 31 steps per epoch on 8 cores,
    # so its schedule never reached the peak; each core really takes 3.
    per_core = steps_per_epoch(1000, 32, 8)
    assert per_core == 3
    assert total_optimizer_steps(per_core, epochs=10, accumulate_steps=1) == 30
    assert total_optimizer_steps(steps_per_epoch(1000, 32, 1), epochs=10, accumulate_steps=2) == 150
    assert not math.isclose(per_core, 1000 // 32)


BAD_SCHEDULES = [
    ({"total_steps": 0}, ValueError, r"total_steps must be between 1 and \d+, but given 0"),
    ({"total_steps": 10**400}, ValueError, r"total_steps must be between 1 and \d+, but given 1000"),
    ({"total_steps": 10.0}, TypeError, r"total_steps must be an int, but given 10.0 of type float"),
    ({"total_steps": True}, TypeError, r"total_steps must be an int, but given True"),
    ({"max_lr": 0.0}, ValueError, r"max_lr must be finite and > 0, but given 0.0"),
    ({"max_lr": float("nan")}, ValueError, r"max_lr must be finite and > 0, but given nan"),
    ({"max_lr": float("inf")}, ValueError, r"max_lr must be finite and > 0, but given inf"),
    ({"max_lr": "3e-3"}, TypeError, r"max_lr must be a real number, but given '3e-3' of type str"),
    ({"pct_start": 0.0}, ValueError, r"pct_start must be between 0 and 1 \(exclusive\), but given 0.0"),
    ({"pct_start": 1.0}, ValueError, r"pct_start must be between 0 and 1 \(exclusive\), but given 1.0"),
    ({"div_factor": 0}, ValueError, r"div_factor must be finite and > 0, but given 0"),
    ({"div_factor": -25.0}, ValueError, r"div_factor must be finite and > 0, but given -25.0"),
    ({"final_div_factor": 0.0}, ValueError, r"final_div_factor must be finite and > 0, but given 0.0"),
    ({"final_div_factor": float("inf")}, ValueError, r"final_div_factor must be finite and > 0, but given inf"),
    ({"base_momentum": 1.0}, ValueError, r"base_momentum must be in \[0, 1\), but given 1.0"),
    ({"max_momentum": -0.1}, ValueError, r"max_momentum must be in \[0, 1\), but given -0.1"),
    ({"max_momentum": None}, TypeError, r"max_momentum must be a real number, but given None"),
    ({"max_lr": 1e300, "div_factor": 1e-300}, ValueError, r"max_lr / div_factor / final_div_factor must be a finite"),
    ({"max_lr": 1e-300, "final_div_factor": 1e300}, ValueError, r"max_lr / div_factor / final_div_factor must be a finite"),
]


@pytest.mark.parametrize("bad, error, message", BAD_SCHEDULES)
def test_every_schedule_argument_is_checked_with_its_range(bad, error, message):
    args = {"total_steps": 100, "max_lr": 3e-3, **bad}
    with pytest.raises(error, match=message):
        one_cycle(0, **args)
    with pytest.raises(error, match=message):
        one_cycle_curve(**args)  # before today's fix, total_steps=0 gave an empty curve


def test_edge_schedules_stay_finite():
    lr, momentum = one_cycle(2**53 - 1, 2**53, 1e-3, pct_start=0.9999999999999999)
    assert math.isfinite(lr) and 0 < lr <= 1e-3 and 0.85 <= momentum <= 0.95
    assert one_cycle_curve(1, 1e-3) == ([pytest.approx(1e-3 / 25 / 1e4)], [0.95])
