"""The schedules and the step count as plain numbers (one-cycle against torch's OneCycleLR, linear and
cosine with warm-up against Hugging Face's get_scheduler and timm's CosineLRScheduler); then each
schedule= of one_cycle_fit on XLA:CPU: the lr of every step, flat compiles and no host syncs, momentum
left alone, per-group ratios, a user's scheduler (reported under a schedule, obeyed with schedule=None),
resume, find_lr, and docs/training.md's scheduler block."""

import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from conftest import flat_digits, small_mlp
from test_fit import _dropout_mlp, _StopAfter
from tpu_utility import EMA, Callback, OneCycle, find_lr, one_cycle_fit
from tpu_utility.training.schedule import (LrSchedule, constant_with_warmup, cosine_with_warmup, linear_with_warmup,
                                           one_cycle, one_cycle_curve, steps_per_epoch, total_optimizer_steps,
                                           warmup_steps)  # fmt: skip


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


def test_unround_moves_round_values_one_float32_step_and_leaves_the_rest():
    from tpu_utility.training.schedule import unround

    for value in (0.9, 0.95, 1e-3, 0.999, 2.5e-5, 0.8999999999999999):
        moved = unround(value)
        assert moved > value and (moved - value) / value < 2e-7, value
        assert unround(moved) == moved  # the moved value is not round: written again, it stays
    for value in (0.0, 1.0, 0.8999123456789, 1 / 3, -0.5):
        assert unround(value) == value


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


@pytest.mark.parametrize("bad, error, message", [case for case in BAD_SCHEDULES if "total_steps" not in case[0]])
def test_the_one_cycle_settings_are_one_frozen_value_checked_when_made(bad, error, message):
    import dataclasses

    from tpu_utility.training.schedule import OneCycle

    with pytest.raises(error, match=message):
        OneCycle(**{"max_lr": 3e-3, **bad})
    cycle = OneCycle(3e-3, pct_start=0.3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cycle.pct_start = 0.5  # a callback cannot change the schedule it was handed
    lrs, moms = cycle.curve(37)
    assert list(zip(lrs, moms)) == [one_cycle(step, 37, 3e-3, pct_start=0.3) for step in range(37)]
    with pytest.raises(ValueError, match=r"total_steps must be between 1 and \d+, but given 0"):
        cycle.curve(0)


def test_one_cycle_fit_carries_its_six_settings_as_one_value_with_the_schedules_defaults():
    import dataclasses
    import inspect

    from tpu_utility.training.fit import resolve_schedule
    from tpu_utility.training.schedule import OneCycle

    defaults = {f.name: f.default for f in dataclasses.fields(OneCycle) if f.name != "max_lr"}
    for function in (one_cycle_fit, one_cycle):
        given = {name: p.default for name, p in inspect.signature(function).parameters.items() if name in defaults}
        assert given == {k: v for k, v in defaults.items() if k in given} and len(given) >= 5, function
    cycle = OneCycle(3e-3, pct_start=0.3, max_momentum=0.9)
    with pytest.warns(FutureWarning, match=r"pct_start=0.3, max_momentum=0.9 are deprecated"):  # given separately
        assert resolve_schedule("one_cycle", 0, cycle) is cycle  # handed on as it is, not taken apart and made again
    with pytest.raises(ValueError, match=r"pct_start=0.3, max_momentum=0.9 shape schedule='one_cycle' only"):
        resolve_schedule("linear", 0, cycle)


def test_schedule_takes_the_one_cycle_settings_as_one_value():
    from tpu_utility.training.fit import resolve_schedule

    separate = OneCycle(3e-3, pct_start=0.3, max_momentum=0.9)
    given = resolve_schedule(OneCycle(pct_start=0.3, max_momentum=0.9), 0, OneCycle(3e-3))
    assert given == separate  # the call's max_lr filled in; the same schedule as the separate arguments make
    assert resolve_schedule(OneCycle(3e-3, scale_lr_by_cores=True), 0, OneCycle(3e-3)).scale_lr_by_cores
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # the one value: no deprecation
        history = _fit(small_mlp(), flat_digits(320), epochs=2, schedule=OneCycle(pct_start=0.3, max_momentum=0.9))
    lrs, momenta = separate.curve(len(history.step_lrs))
    assert history.step_lrs == pytest.approx(lrs, rel=1e-6) and history.step_momenta == pytest.approx(momenta)
    # the separate arguments, deprecated, still give the same schedule, with a warning naming the value to write
    with pytest.warns(FutureWarning, match=r"^pct_start=0.3, max_momentum=0.9 are deprecated: write "
                                           r"schedule=OneCycle\(pct_start=0.3, max_momentum=0.9\)$") as caught:  # fmt: skip
        old = _fit(small_mlp(), flat_digits(320), epochs=2, pct_start=0.3, max_momentum=0.9)
    assert [w.filename for w in caught if w.category is FutureWarning] == [__file__]  # it points at the call
    assert (old.step_lrs, old.step_momenta) == (history.step_lrs, history.step_momenta)
    with pytest.raises(ValueError, match="OneCycle\\(\\) has no max_lr to draw a curve of"):
        OneCycle(pct_start=0.3).curve(10)
    with pytest.raises(TypeError, match="scale_lr_by_cores must be True or False, but given 1"):
        OneCycle(scale_lr_by_cores=1)


def test_edge_schedules_stay_finite():
    lr, momentum = one_cycle(2**53 - 1, 2**53, 1e-3, pct_start=0.9999999999999999)
    assert math.isfinite(lr) and 0 < lr <= 1e-3 and 0.85 <= momentum <= 0.95
    assert one_cycle_curve(1, 1e-3) == ([pytest.approx(1e-3 / 25 / 1e4)], [0.95])


# ------------------------------------------------------- the other shapes, as plain numbers
def _stepped(make, total, base=1.0):
    """The lr a torch-style scheduler gives each of ``total`` optimizer steps, stepped as a hand loop does."""
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base)
    scheduler, seen = make(opt), []
    for step in range(total):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step_update(step + 1) if hasattr(scheduler, "step_update") else scheduler.step()  # timm: updates done
    return seen


@pytest.mark.parametrize("name, ours", [("linear", linear_with_warmup), ("cosine", cosine_with_warmup),
                                        ("constant_with_warmup", constant_with_warmup)])  # fmt: skip
@pytest.mark.parametrize("total, warm", [(100, 10), (37, 0), (60, 6), (5, 4), (1, 0)])
def test_linear_cosine_and_constant_match_hugging_faces_get_scheduler(name, ours, total, warm):
    from transformers import get_scheduler

    theirs = _stepped(lambda opt: get_scheduler(name, opt, num_warmup_steps=warm, num_training_steps=total), total)
    assert [ours(step, total, warm) for step in range(total)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("total, warm", [(100, 10), (60, 0), (7, 3)])
def test_cosine_matches_timms_cosine_scheduler_with_its_warmup_as_a_prefix(total, warm):
    from timm.scheduler import CosineLRScheduler

    theirs = _stepped(lambda opt: CosineLRScheduler(opt, t_initial=total - warm, warmup_t=warm, warmup_prefix=True,
                                                    t_in_epochs=False), total)  # fmt: skip
    assert [cosine_with_warmup(step, total, warm) for step in range(total)] == pytest.approx(theirs, rel=1e-12, abs=1e-15)


def test_warmup_is_a_fraction_rounded_up_or_a_number_of_steps():
    assert [warmup_steps(w, 95) for w in (0.1, 0.0, 0, 20, 94)] == [10, 0, 0, 20, 94]  # ceil(9.5): HF's warmup ratio
    assert warmup_steps(0.999, 3) == 3 and warmup_steps(0.5, 1) == 1
    with pytest.raises(ValueError, match=r"warmup=95 steps must be fewer than this run's 95 optimizer steps"):
        warmup_steps(95, 95)
    assert LrSchedule("linear", 1.0, 0.25).multipliers(8) == [0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]
    assert LrSchedule(lambda step, total: 1 - step / total, 1.0).multipliers(4) == [1.0, 0.75, 0.5, 0.25]


def _fit(model, train, **kwargs):
    args = {"epochs": 3, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


BAD_CHOICES = [
    ({"schedule": "cos"}, ValueError, r"schedule must be one of \('one_cycle', 'linear', 'cosine', 'constant'\), "
     r"OneCycle\(\.\.\.\), a function \(step, total_steps\) -> multiplier of max_lr, or None, but given 'cos'"),
    ({"schedule": OneCycle(pct_start=0.3), "max_momentum": 0.9}, ValueError,
     r"max_momentum=0.9 and schedule=OneCycle\(.*pct_start=0.3.*\) both shape the one-cycle schedule; give the "
     r"settings in OneCycle\(...\) alone"),
    ({"schedule": OneCycle(1e-2)}, ValueError, r"schedule=OneCycle\(max_lr=0.01\) and max_lr=0.003 disagree; leave "
     r"max_lr out of OneCycle"),
    ({"schedule": OneCycle(pct_start=0.3), "warmup": 5}, ValueError, r"warmup=5 shapes .*pct_start of the steps \(now 0.3\)"),
    ({"schedule": 3}, TypeError, r"schedule must be one of .*, or None, but given 3 of type int"),
    ({"schedule": "linear", "warmup": 1.0}, ValueError, r"warmup must be a fraction of the optimizer steps in \[0, 1\) "
     r"\(a float\) or a number of steps \(an int\), but given 1.0"),
    ({"schedule": "linear", "warmup": float("nan")}, ValueError, r"warmup must be a fraction .* but given nan"),
    ({"schedule": "cosine", "warmup": -5}, ValueError, r"warmup must be a number of steps >= 0 or a fraction in \[0, 1\), "
     r"but given -5"),
    ({"schedule": "linear", "warmup": True}, TypeError, r"warmup must be .* but given True of type bool"),
    ({"schedule": "linear", "warmup": "10%"}, TypeError, r"warmup must be .* but given '10%' of type str"),
    ({"warmup": 0.1}, ValueError, r"warmup=0.1 shapes schedule='linear', 'cosine' or 'constant'; schedule='one_cycle' "
     r"warms up over pct_start of the steps \(now 0.25\)"),
    ({"schedule": None, "warmup": 100}, ValueError, r"warmup=100 shapes .*; with schedule=None the warm-up is yours"),
    ({"schedule": "cosine", "pct_start": 0.3}, ValueError, r"pct_start=0.3 shapes schedule='one_cycle' only, but this "
     r"call gives schedule='cosine'; leave it out \(a warm-up is warmup=\)"),
    ({"schedule": None, "max_momentum": 0.9, "div_factor": 10}, ValueError,
     r"div_factor=10, max_momentum=0.9 shape schedule='one_cycle' only, but this call gives schedule=None; leave them out"),
    ({"schedule": "linear", "max_lr": 0.0}, ValueError, r"max_lr must be finite and > 0, but given 0.0"),
    ({"schedule": None, "max_lr": float("inf")}, ValueError, r"max_lr must be finite and > 0, but given inf"),
    ({"schedule": "linear", "warmup": 60}, ValueError, r"warmup=60 steps must be fewer than this run's 60 optimizer steps"),
    ({"schedule": lambda step, total: float("nan") if step == 7 else 1.0}, ValueError,
     r"schedule=test_schedule.<lambda> must return a finite multiplier of max_lr >= 0 for every step, but "
     r"schedule\(7, 60\) returned nan"),
    ({"schedule": lambda step, total: torch.tensor(1.0)}, ValueError, r"schedule\(0, 60\) returned tensor\(1.\)"),
]  # fmt: skip


@pytest.mark.parametrize("bad, error, message", BAD_CHOICES)
def test_a_bad_schedule_choice_is_refused_before_training_naming_the_value(bad, error, message):
    with pytest.raises(error, match=message):
        _fit(small_mlp(), flat_digits(640), **bad)  # 20 batches an epoch x 3: 60 optimizer steps


# ------------------------------------------------------- each schedule in one_cycle_fit
def halving(step, total):
    """A user's schedule: StepLR(step_size=total // 3, gamma=0.5) as a multiplier of max_lr."""
    return 0.5 ** (step // (total // 3))


OPTIMIZERS = {  # torch_xla's fused AdamW (Python floats), SGD (floats), a user's torch AdamW (the lr on the device)
    "adamw": "adamw",
    "sgd": "sgd",
    "own AdamW": lambda params: torch.optim.AdamW(params, lr=1e-3, betas=(0.8, 0.99)),
}
MOMENTA = {"adamw": ("betas", (0.9, 0.999)), "sgd": ("momentum", 0.9), "own AdamW": ("betas", (0.8, 0.99))}


class Momenta(Callback):
    """Each group's betas or momentum at the end of the run, as the optimizer holds them."""

    def on_fit_end(self, loop):
        self.seen = [g.get("betas", g.get("momentum")) for g in loop.optimizer.param_groups]


@pytest.mark.parametrize("schedule, warmup, words", [
    ("linear", 0.1, "schedule 'linear' (warm-up 6 steps), max_lr 3.00e-03"),
    ("cosine", 5, "schedule 'cosine' (warm-up 5 steps), max_lr 3.00e-03"),
    ("constant", 0, "schedule 'constant', max_lr 3.00e-03"),
    (halving, 0, "schedule test_schedule.halving, max_lr 3.00e-03"),
])  # fmt: skip
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_each_schedule_sets_every_steps_lr_with_flat_compiles_no_host_syncs_and_momentum_left_alone(
        schedule, warmup, words, optimizer):  # fmt: skip
    momenta = Momenta()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing else changes the lr: nothing is reported
        history = _fit(small_mlp(), flat_digits(640), optimizer=OPTIMIZERS[optimizer], schedule=schedule, warmup=warmup,
                       callbacks=[momenta])  # fmt: skip
    expected = [3e-3 * m for m in LrSchedule(schedule, 3e-3, warmup).multipliers(60)]
    assert history.step_lrs == pytest.approx(expected, rel=1e-12, abs=1e-18)
    assert [r.lr for r in history.records] == pytest.approx(expected[19::20], rel=1e-12)
    assert words in history.summary
    assert [r.compiles for r in history.records] == [history.records[0].compiles] * 3  # flat after epoch 1
    assert all(r.host_syncs == 0 and r.transfers == 1 for r in history.records)
    assert history.records[-1].train_loss < history.records[0].train_loss
    name, value = MOMENTA[optimizer]
    assert momenta.seen == [value] and history.step_momenta == []  # one-cycle alone cycles momentum
    assert all(not isinstance(v, torch.Tensor) for v in (value if name == "betas" else [value]))


class LrLog(Callback):
    """Every group's lr as the optimizer stepped with it (device tensors cloned, read after the run)."""

    order = 5

    def __init__(self):
        self.lrs = []

    def on_step_end(self, loop):
        self.lrs.append([torch.as_tensor(g["lr"]).detach().clone() for g in loop.optimizer.param_groups])

    def table(self):
        return torch.stack([torch.stack([t.float().cpu() for t in step]) for step in self.lrs])


@pytest.mark.parametrize("schedule", ["linear", None])
@pytest.mark.parametrize("optimizer", ["own AdamW", "sgd"])
def test_each_param_group_gets_its_share_of_the_schedules_lr(schedule, optimizer):
    def factory(model):  # the body at a tenth of the head's lr
        groups = [{"params": model[1].parameters(), "lr": 1e-4}, {"params": model[3].parameters()}]
        return torch.optim.AdamW(groups, lr=1e-3) if optimizer == "own AdamW" else torch.optim.SGD(groups, lr=1e-3, momentum=0.9)

    log = LrLog()
    history = _fit(small_mlp(), flat_digits(640), epochs=2, optimizer=factory, schedule=schedule, warmup=0.25 if schedule else 0,
                   callbacks=[log])  # fmt: skip
    lrs = log.table()
    expected = torch.tensor(LrSchedule("linear", 3e-3, 0.25).multipliers(40) if schedule else [1.0] * 40) * 3e-3
    assert torch.allclose(lrs[:, 0], expected * 0.1, rtol=1e-5, atol=1e-12)
    assert torch.allclose(lrs[:, 1], expected, rtol=1e-5, atol=1e-12)
    assert history.step_lrs == pytest.approx(expected.tolist(), rel=1e-6)
    assert "peak lr per param group x[0.1, 1.0]" in history.summary


# ------------------------------------------------------- a user's scheduler
class StepLROnStepEnd(Callback):
    """A torch StepLR stepped where every hand loop steps its scheduler: after the optimizer step."""

    def __init__(self, step_size=5):
        self.step_size = step_size

    def on_fit_start(self, loop):
        self.scheduler = torch.optim.lr_scheduler.StepLR(loop.optimizer, step_size=self.step_size, gamma=0.5)

    def on_step_end(self, loop):
        self.scheduler.step()


class FixedLrBeforeStep(Callback):
    """A rule of its own, written just before each optimizer step."""

    def on_before_step(self, loop):
        for group in loop.optimizer.param_groups:
            group["lr"] = 1e-3


@pytest.mark.parametrize("callback, hook, then", [
    (StepLROnStepEnd, "on_step_end", "the schedule writes its own value again before the next step, undoing it"),
    (FixedLrBeforeStep, "on_before_step", "the optimizer stepped with that value, not the schedule's"),
])  # fmt: skip
@pytest.mark.parametrize("schedule", ["one_cycle", "cosine"])
@pytest.mark.parametrize("optimizer", ["sgd", "own AdamW"])
def test_a_callback_that_changes_the_lr_under_a_schedule_is_reported_once_naming_it(callback, hook, then, schedule,
                                                                                      optimizer):  # fmt: skip
    # before: the built-in one-cycle undid a scheduler stepped in on_step_end, bit-identically and without a word
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chosen = {} if schedule == "one_cycle" else {"schedule": schedule}  # the default: as every call before it
        _fit(small_mlp(), flat_digits(640), epochs=2, optimizer=OPTIMIZERS[optimizer], callbacks=[EMA(0.9), callback()],
             **chosen)  # EMA has an on_step_end too, and never touches the lr  # fmt: skip
    reports = [str(w.message) for w in caught if "changed the learning rate" in str(w.message)]
    assert len(reports) == 1, reports
    assert reports[0].startswith(f"{callback.__name__}.{hook} changed the learning rate of param group 0 (")
    assert f"while schedule={schedule!r} sets it before every step: {then}" in reports[0]
    assert "give one_cycle_fit schedule=None" in reports[0]


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_with_schedule_none_a_torch_scheduler_stepped_in_on_step_end_sets_the_lr(optimizer):
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        history = _fit(small_mlp(), flat_digits(640), optimizer=OPTIMIZERS[optimizer], schedule=None,
                       callbacks=[StepLROnStepEnd(step_size=20)])  # fmt: skip
    # from max_lr, halved every epoch. (Down to ~1e-6, a torch AdamW's Python-float lr makes
    # 1 - lr * weight_decay round to 1.0 and torch_xla compiles one graph more: docs/training.md says so.)
    expected = [3e-3 * 0.5 ** (step // 20) for step in range(60)]
    assert history.step_lrs == pytest.approx(expected, rel=1e-12)
    assert [r.lr for r in history.records] == pytest.approx(expected[19::20], rel=1e-12)
    assert "schedule None (the lr is yours" in history.summary
    assert [r.compiles for r in history.records] == [history.records[0].compiles] * 3
    assert all(r.host_syncs == 0 for r in history.records)


class Scheduled(Callback):
    """docs/training.md's: a scheduler made by make(optimizer, total_steps), stepped after every optimizer step."""

    def __init__(self, make):
        self.make = make

    def on_fit_start(self, loop):
        self.scheduler = self.make(loop.optimizer, loop.total_steps)

    def on_step_end(self, loop):
        self.scheduler.step()

    def state_dict(self):
        return self.scheduler.state_dict()

    def load_state_dict(self, state):
        self.scheduler.load_state_dict(state)


def _hf(name, warmup):
    from transformers import get_scheduler

    return Scheduled(lambda opt, total: get_scheduler(name, opt, num_warmup_steps=math.ceil(warmup * total),
                                                      num_training_steps=total))  # fmt: skip


@pytest.mark.parametrize("name", ["linear", "cosine"])
def test_the_built_in_shapes_train_as_hugging_faces_scheduler_does(name):
    data = flat_digits(640)
    torch.manual_seed(0)
    ours = _fit(small_mlp(), data, schedule=name, warmup=0.1)
    torch.manual_seed(0)
    theirs = _fit(small_mlp(), data, schedule=None, callbacks=[_hf(name, 0.1)])
    assert ours.step_lrs == theirs.step_lrs  # the same curve, value for value
    # the same training, but for the last float32 digit of a round lr: on XLA the schedule writes such a value one
    # float32 step up (schedule.unround), so that it never merges with an equal scalar of the graph
    for a, b in zip(ours.model.state_dict().values(), theirs.model.state_dict().values()):
        torch.testing.assert_close(a.cpu(), b.cpu(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["cosine", None, halving])
def test_resume_with_each_schedule_matches_an_uninterrupted_run(tmp_path, schedule):
    data = flat_digits()
    per_epoch = len(data) // 32

    def run(limit, **kwargs):
        callbacks = [_hf("cosine", 0.1)] if schedule is None else []  # the user's scheduler state goes in last.pt
        return _fit(_dropout_mlp(), data, epochs=4, seed=3, schedule=schedule, warmup=0.1 if schedule == "cosine" else 0,
                    train_step=_StopAfter(limit), callbacks=callbacks, **kwargs)  # fmt: skip

    straight = run(10**9)
    with pytest.raises(KeyboardInterrupt):
        run(2 * per_epoch + 5, checkpoint_dir=str(tmp_path))
    resumed = run(10**9, checkpoint_dir=str(tmp_path), resume=True)
    assert [r.epoch for r in resumed.records] == [1, 2, 3, 4]
    assert resumed.step_lrs == straight.step_lrs and len(straight.step_lrs) == 4 * per_epoch
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # bitwise


def test_a_resume_with_another_schedule_is_refused_naming_it(tmp_path):
    _fit(small_mlp(), flat_digits(640), epochs=1, schedule="linear", warmup=0.1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"schedule: checkpoint \"LrSchedule\(shape='linear', max_lr=0.003, warmup=0.1, "
                                         r"scale_lr_by_cores=False\)\", this run \"LrSchedule\(shape='cosine'"):  # fmt: skip
        _fit(small_mlp(), flat_digits(640), epochs=1, schedule="cosine", warmup=0.1, checkpoint_dir=str(tmp_path),
             resume=True)  # fmt: skip


def test_find_lrs_suggestion_trains_with_each_schedule():
    data = flat_digits(640)
    model = small_mlp()
    result = find_lr(model, data, num_steps=30, end_lr=1.0)
    for schedule in ("linear", "cosine", "constant", None):
        history = _fit(model, data, epochs=2, max_lr=result.suggested_lr, schedule=schedule)
        assert max(history.step_lrs) == pytest.approx(result.suggested_lr)
        assert history.records[-1].train_loss < history.records[0].train_loss, schedule
