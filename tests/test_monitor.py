"""Best epoch, early stop, time limit, metrics (torchmetrics and functions), History files."""

import csv
import os

import pytest
import torch
from torch import nn

from conftest import TINY_CNN, flat_digits, run_python, small_mlp
from tpu_utility import evaluate, load_checkpoint, one_cycle_fit
from tpu_utility.training import trainer
from tpu_utility.training.monitor import StopRule, Watch, out_of_time, parse_duration

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 3, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


class _EpochAware(torch.utils.data.Dataset):
    """Training data that knows the epoch (one_cycle_fit calls set_epoch)."""

    def __init__(self, base):
        self.base, self.epoch = base, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        return self.base[i]


def test_best_epoch_is_kept_training_stops_early_and_the_best_weights_return(tmp_path, digits):
    train = _EpochAware(digits[0])

    def score(output, target):  # a per-batch figure that is best after epoch 2, then worsens
        return torch.tensor(float(abs(train.epoch - 1)), device=output.device)

    history = fit(small_mlp(), train, valid_data=digits[1], epochs=8, metrics=["accuracy", score],
                  monitor="score", mode="min", early_stopping=2, restore_best=True,
                  checkpoint_dir=str(tmp_path))  # fmt: skip
    assert [r.epoch for r in history.records] == [1, 2, 3, 4]  # 2 epochs without improvement after epoch 2
    assert history.best_epoch == 2
    assert "early stopping: score did not improve for 2 epoch(s); best 0 at epoch 2" in history.stop_reason
    best = load_checkpoint(str(tmp_path / "best.pt"))
    assert best["epoch"] == 2 and load_checkpoint(str(tmp_path))["epoch"] == 4
    for name, value in history.model.state_dict().items():
        assert torch.equal(value.cpu(), best["model"][name]), name  # the best weights were restored
    with open(tmp_path / "history.csv") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert float(rows[1]["score"]) == 0.0 and "accuracy" in rows[0]


def test_restore_best_on_a_plain_cpu_restores_the_best_epochs_weights():
    # On the CPU a host copy of the weights was the weights themselves: the "best" snapshot
    # trained on with the model, and restore_best gave back the last epoch's weights.
    r = run_python(TINY_CNN + """
import warnings; warnings.simplefilter("ignore")
import torch
from tpu_utility import evaluate, one_cycle_fit
from tpu_utility.demo import digits_datasets
train, valid = digits_datasets()
torch.manual_seed(0)
model = tiny_cnn()
h = one_cycle_fit(model, train, valid_data=valid, epochs=3, max_lr=3e-3, restore_best=True,
                  monitor="accuracy", mode="min", progress=False)   # the worst epoch is the "best": epoch 1
print("device", next(h.model.parameters()).device.type, "best", h.best_epoch)
print("accuracies", *[r.metrics["accuracy"] for r in h.records], "restored", evaluate(h.model, valid)["accuracy"])
""", env={"TPU_UTILITY_BACKEND": "native"})  # the plain CPU by name: the warm interpreter, not a fresh one
    assert r.returncode == 0, r.stderr[-3000:]
    assert "device cpu best 1" in r.stdout
    first, *_, last, restored = map(float, r.stdout.split("accuracies ")[1].replace("restored", "").split())
    assert first < last - 0.1, r.stdout  # epoch 1 is clearly worse than the last
    assert restored == pytest.approx(first, abs=1e-6), r.stdout


def test_watch_and_time_decisions_are_pure():
    rule = StopRule("valid_loss", "min", patience=2)
    watch = Watch()
    assert [watch.update(rule, e, {"valid_loss": v}) for e, v in enumerate([3.0, 2.0, 2.5, float("nan")], 1)] == [
        True, True, False, False,
    ]  # fmt: skip
    assert watch.best_epoch == 2 and "did not improve for 2" in watch.early_stop(rule)
    with pytest.raises(ValueError, match=r"monitor='f1' is not among this run's figures \['valid_loss'\]"):
        Watch().update(StopRule("f1"), 1, {"valid_loss": 1.0})
    assert out_of_time(250, 100, 1) is None  # 100s + about 100s more <= 250s
    assert out_of_time(250, 200, 2).startswith("time limit: 200s of 250s used")
    assert parse_duration("8h30m") == 8.5 * 3600
    assert parse_duration(" 1h 5m 30s") == 3930 and parse_duration(90) == 90
    for bad in ("8 hours", "-5m", "", 0, float("inf")):
        with pytest.raises(ValueError, match="time_limit must be"):
            parse_duration(bad)


class _FakeClock:
    """Each epoch 'takes' 100 seconds."""

    def __init__(self):
        self.now = -100.0

    def __call__(self):
        self.now += 100.0
        return self.now


def _dropout_mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def test_time_limit_stops_before_an_epoch_that_would_not_finish_and_resumes_bitwise(tmp_path, monkeypatch, digits):
    train, valid = digits
    straight = fit(_dropout_mlp(), train, valid_data=valid, epochs=4, seed=3)
    monkeypatch.setattr(trainer, "_clock", _FakeClock())
    stopped = fit(_dropout_mlp(), train, valid_data=valid, epochs=4, seed=3, time_limit="4m10s",
                  checkpoint_dir=str(tmp_path))  # fmt: skip
    assert [r.epoch for r in stopped.records] == [1, 2]
    assert stopped.stop_reason.startswith("time limit: 200s of 250s used")
    assert "resume=True" in stopped.stop_reason
    resumed = fit(_dropout_mlp(), train, valid_data=valid, epochs=4, seed=3, checkpoint_dir=str(tmp_path), resume=True)
    assert [r.epoch for r in resumed.records] == [1, 2, 3, 4]
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # bitwise
    assert resumed.records[-1].valid_loss == straight.records[-1].valid_loss


def test_resume_refuses_a_checkpoint_of_another_run(tmp_path):
    fit(small_mlp(), flat_digits(), epochs=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"written by a different run(.|\n)*schedule: checkpoint") as e:
        fit(small_mlp(), flat_digits(), epochs=2, max_lr=1e-2, seed=5, checkpoint_dir=str(tmp_path), resume=True)
    assert "seed: checkpoint 0, this run 5" in str(e.value)
    with pytest.raises(ValueError, match=r"optimizer steps: checkpoint 88, this run 132(.|\n)*changing epochs"):
        fit(small_mlp(), flat_digits(), epochs=3, checkpoint_dir=str(tmp_path), resume=True)


def test_torchmetrics_on_xla_equal_plain_cpu(digits):
    from torchmetrics.classification import MulticlassAccuracy, MulticlassF1Score

    torch.manual_seed(0)
    model = small_mlp()
    _, valid = digits  # 360 samples: the last batch of 64 is padded
    metrics = {"acc": MulticlassAccuracy(num_classes=10), "f1": MulticlassF1Score(num_classes=10)}
    got = evaluate(model, valid, metrics=metrics, batch_size=64)
    x, y = valid.tensors
    with torch.no_grad():
        out = model(x)
    assert got["acc"] == pytest.approx(MulticlassAccuracy(num_classes=10)(out, y).item(), abs=1e-6)
    assert got["f1"] == pytest.approx(MulticlassF1Score(num_classes=10)(out, y).item(), abs=1e-6)
    assert metrics["acc"].update_count == 0  # the user's objects are left untouched


def test_per_batch_metric_functions_are_weighted_by_the_real_count(digits):
    _, valid = digits
    model = small_mlp()

    def batch_accuracy(output, target):  # one value per batch (a mean)
        return (output.argmax(1) == target).float().mean()

    got = evaluate(model, valid, metrics=["accuracy", batch_accuracy], batch_size=64)
    assert got["batch_accuracy"] == pytest.approx(got["accuracy"], abs=1e-6)


def test_a_bad_metric_fails_before_training_and_names_it(digits):
    calls = []

    def train_step(model, batch):
        calls.append(1)
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    def top_class(output, target):
        return output.argmax(1)[:3]  # wrong: three values for a batch of 32

    with pytest.raises(ValueError, match=r"metric 'top_class' failed on the first validation batch .* returned shape \(3,\)"):
        fit(small_mlp(), digits[0], valid_data=digits[1], metrics=[top_class], train_step=train_step)
    assert calls == []  # no epoch was spent
    with pytest.raises(ValueError, match=r"two metrics are named '<lambda>'"):
        fit(small_mlp(), digits[0], metrics=[lambda o, t: o[:, 0], lambda o, t: o[:, 1]])
    with pytest.raises(TypeError, match=r"eval_step must return \(output, target\), but returned Tensor"):
        fit(small_mlp(), digits[0], valid_data=digits[1], eval_step=lambda m, b: m(b[0]), train_step=train_step)
    assert calls == []


def test_history_csv_rows_and_plot_of_the_per_step_schedule(tmp_path, digits):
    import matplotlib.pyplot as plt

    history = fit(small_mlp(), digits[0], valid_data=digits[1], epochs=2, optimizer="sgd", max_lr=0.05)
    rows = history.to_rows()
    assert list(rows[0])[:3] == ["epoch", "train_loss", "valid_loss"] and "accuracy" in rows[0]
    history.to_csv(str(tmp_path / "h.csv"))
    assert (tmp_path / "h.csv").read_text().splitlines()[0].startswith("epoch,train_loss,valid_loss")
    per_epoch = len(digits[0]) // 32
    assert len(history.step_lrs) == 2 * per_epoch and len(history.step_momenta) == 2 * per_epoch
    assert max(history.step_lrs) == pytest.approx(0.05, rel=1e-3)  # the warm-up peak is visible
    before = plt.get_fignums()
    fig = history.plot(str(tmp_path / "h.png"))
    assert plt.get_fignums() == before  # not a pyplot figure: a notebook shows it once
    ticks = fig.axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    assert os.path.getsize(tmp_path / "h.png") > 0


def test_a_second_fit_into_a_checkpoint_dir_in_use_is_refused_before_training(tmp_path):
    from tpu_utility.files import folder_lock

    with folder_lock(str(tmp_path), "another notebook's one_cycle_fit"):
        with pytest.raises(RuntimeError, match="is in use by another process") as e:
            fit(small_mlp(), flat_digits(), epochs=1, checkpoint_dir=str(tmp_path))
    assert str(tmp_path) in str(e.value) and "another notebook's one_cycle_fit" in str(e.value)
    assert not (tmp_path / "last.pt").exists()  # nothing of the refused run was written
    fit(small_mlp(), flat_digits(), epochs=1, checkpoint_dir=str(tmp_path))  # free again: trains
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "history.csv", "last.pt"]  # and leaves no lock file


def test_auto_mode_asks_the_metric_then_its_name_and_refuses_to_guess():
    from torchmetrics.regression import MeanSquaredError

    from tpu_utility.training.monitor import resolve_mode

    assert resolve_mode("valid_loss", "auto") == "min" and resolve_mode("top1_accuracy", "auto") == "max"
    assert resolve_mode("mae", "auto") == "min" and resolve_mode("perplexity", "auto") == "min"
    assert resolve_mode("mse_metric", "auto", MeanSquaredError().higher_is_better) == "min"
    with pytest.raises(ValueError, match=r"mode='auto' cannot tell whether monitor='score' should rise or fall"):
        resolve_mode("score", "auto")


def test_the_time_estimate_leaves_the_first_epochs_compile_out():
    # limit 3600 s; epoch 1 took 1500 s (1000 of them compiling), the next ones 500 s each
    assert out_of_time(3600, 3000, 4, last_epoch=500) is None  # a fifth epoch ends at 3500 s
    assert out_of_time(3600, 3500, 5, last_epoch=500).startswith("time limit")


def test_a_metric_may_not_take_a_figures_name(digits):
    with pytest.raises(ValueError, match=r"a metric may not be named 'train_loss'"):
        fit(small_mlp(), digits[0], valid_data=digits[1], metrics={"train_loss": lambda o, t: o.sum(1)})
