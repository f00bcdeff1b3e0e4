"""one_cycle_fit's events and callbacks on XLA:CPU: a user's callback, EMA, loggers,
callback state across a resume, per-group learning rates; 1 device and 4 SPMD devices.
(Several processes under gloo: tests/test_native.py.)"""

import sys

import pytest
import torch
from torch import nn

from conftest import TINY_CNN, flat_digits, run_python, tiny_cnn
from test_fit import _StopAfter, _dropout_mlp
from tpu_utility import EMA, Callback, CSVLogger, StopFit, TensorBoardLogger, one_cycle_fit
from tpu_utility import backend
from tpu_utility.checkpoint import load_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 4, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


class Recorder(Callback):
    """Records the events it sees and stops the run once accuracy passes a bar."""

    def __init__(self, bar):
        self.bar, self.seen = bar, []

    def on_fit_start(self, loop):
        self.seen.append("fit_start")

    def on_train_epoch_start(self, loop, epoch):
        self.seen.append(f"train{epoch + 1}")

    def on_step_end(self, loop):
        self.seen.append("step")

    def on_train_epoch_end(self, loop):
        self.seen.append("trained")

    def on_epoch_end(self, loop, record):
        self.seen.append(f"end{record.epoch}")
        if record.metrics["accuracy"] > self.bar:
            loop.stop(f"accuracy {record.metrics['accuracy']:.3f} passed {self.bar}")

    def on_fit_end(self, loop):
        self.seen.append("fit_end")


def test_a_users_callback_sees_every_event_in_order_and_stops_the_run(digits, tmp_path):
    train, valid = digits
    torch.manual_seed(0)
    recorder = Recorder(bar=0.9)
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=6, callbacks=[recorder], checkpoint_dir=str(tmp_path))
    stopped_at = history.records[-1].epoch
    assert 1 < stopped_at < 6, history.stop_reason  # epoch 1 is below the bar, a later one passes it
    assert history.records[-2].metrics["accuracy"] <= 0.9 < history.records[-1].metrics["accuracy"]
    assert history.stop_reason.startswith("accuracy 0.9") and "passed 0.9" in history.stop_reason
    steps = len(train) // 32
    expected = ["fit_start"]
    for epoch in range(1, stopped_at + 1):
        expected += [f"train{epoch}"] + ["step"] * steps + ["trained", f"end{epoch}"]
    assert recorder.seen == expected + ["fit_end"]
    assert load_checkpoint(str(tmp_path))["epoch"] == stopped_at  # the stopping epoch was saved first
    assert all(r.host_syncs == 0 for r in history.records)
    assert len({r.compiles for r in history.records}) == 1  # flat after epoch 1


class StepWatcher(Callback):
    """Sees each optimizer step's learning rate, as a Python float, and the best epoch so far; raises StopFit."""

    def __init__(self, stop_at_step=None):
        self.lrs, self.best_seen, self.stop_at_step, self.ended = [], [], stop_at_step, False

    def on_before_step(self, loop):
        self.lrs.append(loop.lr)  # the schedule (order -40) has already set this step's

    def on_step_end(self, loop):
        if loop.step == self.stop_at_step:
            raise StopFit(f"stopped at step {loop.step}")

    def on_epoch_end(self, loop, record):
        self.best_seen.append(loop.history.best_epoch)  # the best-epoch rule (order -20) has already run

    def on_fit_end(self, loop):
        self.ended = True


def test_a_step_hook_sees_the_schedules_learning_rate_and_an_epoch_hook_the_best_epoch(digits):
    train, valid = digits
    watcher = StepWatcher()
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=3, callbacks=[watcher])
    assert watcher.lrs == history.step_lrs and len(watcher.lrs) == 3 * (len(train) // 32)
    losses = [r.valid_loss for r in history.records]
    assert watcher.best_seen == [1 + losses.index(min(losses[: i + 1])) for i in range(3)]
    assert watcher.best_seen[-1] == history.best_epoch
    assert all(r.host_syncs == 0 for r in history.records)


def test_stopfit_from_a_step_hook_ends_the_run_at_once_and_saves_no_half_epoch(digits, tmp_path, capsys):
    train, valid = digits
    per_epoch = len(train) // 32
    watcher = StepWatcher(stop_at_step=per_epoch + 3)  # three steps into epoch 2
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=4, callbacks=[watcher], restore_best=True,
                  checkpoint_dir=str(tmp_path), progress=True)  # fmt: skip
    assert f"stopped: stopped at step {per_epoch + 3}" in capsys.readouterr().out  # the progress line says why
    assert [r.epoch for r in history.records] == [1]  # the unfinished epoch 2 is not recorded
    assert history.stop_reason.startswith(f"stopped at step {per_epoch + 3}")
    assert "restored the best weights (epoch 1)" in history.stop_reason and watcher.ended
    assert load_checkpoint(str(tmp_path))["epoch"] == 1  # last.pt still holds epoch 1
    assert len(history.step_lrs) == per_epoch + 3


class StopAtEpochEnd(Callback):
    def on_epoch_end(self, loop, record):
        if record.epoch == 2:
            raise StopFit("two epochs are enough")


@pytest.mark.parametrize("checkpoint", [True, False], ids=["checkpoint_dir", "no-checkpoint"])
def test_stopfit_from_an_epoch_hook_ends_the_run_as_loop_stop_does(digits, tmp_path, checkpoint):
    # the epoch is whole: it is saved, and restore_best finds the weights of the best epoch, this one included
    train, valid = digits
    folder = {"checkpoint_dir": str(tmp_path)} if checkpoint else {}
    torch.manual_seed(0)
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=4, callbacks=[StopAtEpochEnd()], restore_best=True,
                  **folder)  # fmt: skip
    assert [r.epoch for r in history.records] == [1, 2]
    assert history.stop_reason.startswith("two epochs are enough; restored the best weights (epoch 2)")
    if checkpoint:
        saved = load_checkpoint(str(tmp_path))
        assert saved["epoch"] == 2
        for name, tensor in history.model.state_dict().items():  # the best epoch (2) is last.pt's
            assert torch.equal(tensor.cpu(), saved["model"][name]), name


@pytest.mark.parametrize("every", [1, 3])
def test_emas_average_is_torchs_averaged_model_with_its_ema_function(every):
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    from tpu_utility import get_device

    device = get_device()  # on the XLA device: a CPU backward first would break this process's XLA backwards
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3)).to(device)  # int buffer
    # every k-th step with decay ** k: the same span in steps
    reference = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9**every), use_buffers=True)
    ema, loop = EMA(decay=0.9, every=every), type("Loop", (), {"model": model})()
    ema.on_fit_start(loop)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 21):
        optimizer.zero_grad()
        x, y = torch.randn(16, 8).to(device), torch.randint(0, 3, (16,)).to(device)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        if step % every == 0:
            reference.update_parameters(model)
            model_ints = {k: v.cpu().clone() for k, v in model.state_dict().items() if not v.is_floating_point()}
        ema.on_step_end(loop)
        backend.sync()  # the step's graph cut, as the trainer makes it: one graph per kind of step, not one per step
    assert int(ema.averaged.n_averaged) == int(reference.n_averaged) == 20 // every
    for (name, ours), theirs in zip(ema.averaged.module.state_dict().items(), reference.module.state_dict().values()):
        if ours.is_floating_point():
            torch.testing.assert_close(ours.cpu(), theirs.cpu(), rtol=1e-6, atol=1e-6, msg=name)  # lerp, as torch's
        else:  # an integer buffer (the step counter) is the model's, as timm's EMA keeps it; torch's truncates a mean
            assert torch.equal(ours.cpu(), model_ints[name]), name  # as the model's was at the last update


def test_ema_scores_as_well_as_a_plain_run_and_its_checkpoints_hold_the_average(digits, tmp_path):
    train, valid = digits
    torch.manual_seed(0)
    # 3 epochs at max_lr 1e-2 (both 0.978 when written): the bars below hold with room, a third of 4 epochs' steps
    plain = fit(tiny_cnn(), train, valid_data=valid, epochs=3, max_lr=1e-2)
    torch.manual_seed(0)
    ema = EMA(decay=0.9)
    averaged = fit(tiny_cnn(), train, valid_data=valid, epochs=3, max_lr=1e-2, callbacks=[ema],
                   checkpoint_dir=str(tmp_path))  # fmt: skip
    # within 4 of the 359 validation samples: which of the two is ahead moves with the last float32 digit of the lr
    assert averaged.records[-1].metrics["accuracy"] >= plain.records[-1].metrics["accuracy"] - 0.011
    assert averaged.records[-1].metrics["accuracy"] >= 0.95
    assert plain.records[0].train_loss == averaged.records[0].train_loss  # the same training, only evaluated apart
    saved = load_checkpoint(str(tmp_path))
    average = {k: v.cpu() for k, v in ema.averaged.module.state_dict().items()}
    for name, tensor in saved["model"].items():  # last.pt's "model" is the average, the model that was scored
        assert torch.equal(tensor, average[name]), name
    training = saved["callbacks"]["EMA"]["training_weights"]
    assert any(not torch.equal(training[k], average[k]) for k in average)  # the training weights, kept for resume
    assert saved["callbacks"]["EMA"]["n_averaged"] == 3 * (len(train) // 32)
    for name, tensor in averaged.model.state_dict().items():  # restore=True: the model ends with the average
        assert torch.equal(tensor.cpu(), average[name]), name


def test_ema_and_tensorboard_make_no_host_syncs_and_log_every_epoch(digits, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, valid = digits
    torch.manual_seed(0)
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=3,
                  callbacks=[EMA(0.95), TensorBoardLogger(tmp_path / "tb"), CSVLogger(tmp_path / "log.csv")])  # fmt: skip
    assert all(r.host_syncs == 0 for r in history.records)
    assert all(r.transfers == 1 for r in history.records)  # still one read per epoch
    assert len({r.compiles for r in history.records}) == 1
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    logged = [(e.step, e.value) for e in events.Scalars("valid_loss")]
    assert logged == [(r.epoch, pytest.approx(r.valid_loss)) for r in history.records]
    assert {"train_loss", "accuracy", "lr", "samples_per_s"} <= set(events.Tags()["scalars"])
    assert (tmp_path / "log.csv").read_text().count("\n") == 4  # a header and a row per epoch


@pytest.mark.parametrize("every", [1, 3])  # 44 steps an epoch: with 3, the resume lands between two updates
def test_ema_state_is_saved_and_a_resumed_run_matches_an_uninterrupted_one_bitwise(tmp_path, every):
    data = flat_digits()
    per_epoch = len(data) // 32
    straight_ema = EMA(0.9, restore=False, every=every)
    straight = fit(_dropout_mlp(), data, train_step=_StopAfter(10**9), seed=3, callbacks=[straight_ema])
    with pytest.raises(KeyboardInterrupt):
        fit(_dropout_mlp(), data, train_step=_StopAfter(2 * per_epoch + 5), seed=3, checkpoint_dir=str(tmp_path),
            callbacks=[EMA(0.9, restore=False, every=every)])  # fmt: skip
    resumed_ema = EMA(0.9, restore=False, every=every)
    resumed = fit(_dropout_mlp(), data, train_step=_StopAfter(10**9), seed=3, checkpoint_dir=str(tmp_path),
                  resume=True, callbacks=[resumed_ema])  # fmt: skip
    assert [r.epoch for r in resumed.records] == [1, 2, 3, 4]
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # restore=False: the training weights, bitwise
    for a, b in zip(straight_ema.averaged.module.state_dict().values(), resumed_ema.averaged.module.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # and the average, bitwise
    assert int(resumed_ema.averaged.n_averaged) == 4 * per_epoch // every


def test_a_resume_with_other_stateful_callbacks_is_refused_naming_them(tmp_path):
    data = flat_digits(320)
    fit(tiny_cnn(), data, epochs=2, checkpoint_dir=str(tmp_path), callbacks=[EMA(0.9)])
    with pytest.raises(ValueError, match=r"callbacks: checkpoint \['EMA'\], this run None"):
        fit(tiny_cnn(), data, epochs=2, checkpoint_dir=str(tmp_path), resume=True)
    history = fit(tiny_cnn(), data, epochs=2, checkpoint_dir=str(tmp_path), resume=True,
                  callbacks=[EMA(0.9), CSVLogger(tmp_path / "again.csv")])  # a logger has no state: it may be added
    assert [r.epoch for r in history.records] == [1, 2]


@pytest.mark.parametrize(
    "callbacks, error, words",
    [
        (EMA(), TypeError, "callbacks must be a list"),
        ([EMA], TypeError, "holds the class EMA, not an instance: write EMA(...)"),
        ([object()], TypeError, "which has none of the events on_fit_start"),
        ("tensorboard", TypeError, "callbacks must be a list of callback objects, but given 'tensorboard'"),
    ],
)
def test_bad_callbacks_are_refused_before_any_epoch(callbacks, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        fit(small_mlp_factory(), flat_digits(64), callbacks=callbacks)


def small_mlp_factory():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def test_bad_callback_arguments_name_the_value(monkeypatch):
    with pytest.raises(ValueError, match=r"EMA decay must be a number in \(0, 1\), but given 1.5"):
        EMA(decay=1.5)
    with pytest.raises(TypeError, match="EMA restore must be True or False, but given 'yes'"):
        EMA(restore="yes")
    for every in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"EMA every must be a whole number of steps, 1 or more, but given {every}"):
            EMA(every=every)
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as on a machine without it
    with pytest.raises(ModuleNotFoundError, match="pip install tensorboard"):
        TensorBoardLogger("runs")


class LrLog(Callback):
    """Every group's lr after each step, kept on the device (read once, after the run)."""

    def __init__(self):
        self.lrs = []

    def on_step_end(self, loop):
        self.lrs.append([torch.as_tensor(g["lr"]).detach().clone() for g in loop.optimizer.param_groups])


def _two_groups(model, lr=1e-3):
    """A head at the optimizer's lr and a body at a tenth of it; no weight decay on biases (as timm does)."""
    body, head = model[:-1], model[-1]
    return torch.optim.AdamW([
        {"params": [p for p in body.parameters() if p.ndim > 1], "lr": lr / 10},
        {"params": [p for p in body.parameters() if p.ndim <= 1], "lr": lr / 10, "weight_decay": 0.0},
        {"params": head.parameters()},
    ], lr=lr)  # fmt: skip


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_each_param_group_peaks_at_its_own_share_of_max_lr(optimizer):
    def factory(model):
        if optimizer == "adamw":
            return _two_groups(model)
        return torch.optim.SGD([{"params": model[1].parameters(), "lr": 0.01}, {"params": model[3].parameters()}],
                               lr=0.1, momentum=0.9)  # fmt: skip

    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    log = LrLog()
    history = fit(model, flat_digits(640), epochs=2, optimizer=factory, callbacks=[log])
    assert "peak lr per param group x[0.1" in history.summary
    lrs = torch.stack([torch.stack([t.float().cpu() for t in step]) for step in log.lrs])
    curve = torch.tensor(history.step_lrs)
    ratios = [0.1, 0.1, 1.0] if optimizer == "adamw" else [0.1, 1.0]
    for group, ratio in enumerate(ratios):
        assert torch.allclose(lrs[:, group], curve * ratio, rtol=1e-5), group
    assert history.records[-1].train_loss < history.records[0].train_loss


def test_an_optimizer_over_tensors_that_are_not_the_models_is_refused():
    stray = nn.Linear(64, 10)
    with pytest.raises(ValueError, match="holds 2 tensor\\(s\\) that are not the model's parameters"):
        fit(small_mlp_factory(), flat_digits(64), optimizer=lambda model: torch.optim.AdamW(stray.parameters()))


SPMD_CALLBACKS = """
import torch
from tpu_utility import EMA, Callback, TensorBoardLogger, one_cycle_fit, setup_tpu
from tpu_utility.demo import digits_datasets

setup_tpu(verbose=False)
train, valid = digits_datasets()

class StopAt(Callback):
    def on_epoch_end(self, loop, record):
        if record.epoch >= 3 and record.metrics["accuracy"] > 0.9:  # three epochs: compiles flat from epoch 2
            loop.stop("accuracy passed 0.9")

torch.manual_seed(0)
model = tiny_cnn()  # at max_lr 1e-2: 0.96 at epoch 3 on one device at this batch
history = one_cycle_fit(model, train, valid_data=valid, epochs=6, max_lr=1e-2, batch_size=16, cores="all",
                        progress=False, callbacks=[EMA(0.9), StopAt(), TensorBoardLogger({tb!r})])
print(history.summary)
print("epochs", [r.epoch for r in history.records])
print("accuracy", [r.metrics["accuracy"] for r in history.records])
print("syncs", [r.host_syncs for r in history.records])
print("compiles", [r.compiles for r in history.records])
print("reason", history.stop_reason)
"""


@pytest.mark.multidevice
def test_callbacks_on_four_spmd_devices(tmp_path):
    r = run_python(TINY_CNN + SPMD_CALLBACKS.format(tb=str(tmp_path / "tb")), env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines() if line.split(" ")[0] in
               ("epochs", "accuracy", "syncs", "compiles", "reason"))  # fmt: skip
    assert "one_cycle_fit: spmd on 4 CPU core(s)" in r.stdout and "callbacks EMA(decay=0.9" in r.stdout
    epochs, accuracy = eval(out["epochs"]), eval(out["accuracy"])
    assert epochs == [1, 2, 3] and accuracy[-1] > 0.9
    assert out["reason"] == "accuracy passed 0.9"
    assert set(eval(out["syncs"])) == {0}
    compiles = eval(out["compiles"])
    assert compiles[1] == compiles[2]  # flat from epoch 2 (epoch 2 compiles putting the training weights back)
    assert len(list((tmp_path / "tb").iterdir())) == 1  # one event file: the one process writes
