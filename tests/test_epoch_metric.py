"""EpochMetric: a figure of the whole evaluation (quadratic weighted kappa), equal to sklearn on CPU outputs.

The Kaggle metrics are not means over batches. An EpochMetric sees every validation
output and target once, in dataset order with padding removed, on 1 device and on 4
SPMD devices (the gloo replicas run it in test_native.py), and ``monitor`` can name it.
"""

import pytest
import torch

from conftest import run_python, small_mlp
from tpu_utility import EpochMetric, evaluate, one_cycle_fit


def cohen_kappa_score(*args, **kwargs):
    """sklearn's, imported at the first use: collecting this file in every pytest worker would import sklearn (2.4 CPU-s)."""
    from sklearn.metrics import cohen_kappa_score as kappa

    return kappa(*args, **kwargs)


def qwk(outputs, targets):
    return cohen_kappa_score(targets, outputs.argmax(1), weights="quadratic")


def cpu_qwk(model, dataset):
    """The same figure computed by hand on the plain CPU: the model's outputs, sklearn's kappa."""
    x, y = dataset.tensors
    with torch.no_grad():
        return cohen_kappa_score(y, model.cpu().eval()(x).argmax(1), weights="quadratic")


def test_evaluate_gives_sklearns_kappa_on_every_sample_in_dataset_order(digits, mlp):
    _, valid = digits  # 359 samples: the last batch of 64 is padded
    seen = {}

    def spy(outputs, targets):
        seen.update(n=len(targets), targets=targets.clone())
        return 0.0

    figures = evaluate(mlp, valid, batch_size=64, metrics={"qwk": EpochMetric(qwk), "spy": EpochMetric(spy)})
    assert figures["qwk"] == pytest.approx(cpu_qwk(mlp, valid), abs=1e-9)
    assert seen["n"] == len(valid) and torch.equal(seen["targets"], valid.tensors[1])  # padding out, in order


def test_one_cycle_fit_reports_and_monitors_the_kappa_with_compiles_flat(digits):
    train, valid = digits
    torch.manual_seed(0)
    history = one_cycle_fit(small_mlp(), train, valid_data=valid, epochs=3, max_lr=1e-2, batch_size=32, progress=False,
                            metrics={"accuracy": "accuracy", "qwk": EpochMetric(qwk, higher_is_better=True)},
                            monitor="qwk")  # fmt: skip
    kappas = [r.metrics["qwk"] for r in history.records]
    assert kappas[-1] > 0.85  # the digits are learnt (0.91 here; accuracy 0.95)
    assert history.best_epoch == max(range(3), key=lambda i: kappas[i]) + 1  # higher is better, from the metric
    assert history.records[-1].compiles == history.records[0].compiles  # the gather adds no graph after epoch 1
    assert [r.host_syncs for r in history.records] == [0, 0, 0]
    assert kappas[-1] == pytest.approx(cpu_qwk(history.model, valid), abs=1e-9)


def test_an_epoch_metric_that_fails_is_named_before_any_epoch(digits, mlp):
    train, valid = digits
    calls = []

    def broken(outputs, targets):
        calls.append(len(targets))
        return cohen_kappa_score(targets, outputs, weights="quadratic")  # outputs are scores, not labels

    with pytest.raises(ValueError, match="metric 'kappa' failed on the first validation batch"):
        one_cycle_fit(mlp, train, valid_data=valid, epochs=2, max_lr=1e-3, batch_size=64, progress=False,
                      metrics={"kappa": EpochMetric(broken)})  # fmt: skip
    assert calls == [64]  # tried once, on the first validation batch, before training

    with pytest.raises(TypeError, match=r"EpochMetric\(<lambda>\) returned \[1, 2\]; it must return one number"):
        evaluate(mlp, valid, batch_size=64, metrics={"pair": EpochMetric(lambda o, t: [1, 2])})
    with pytest.raises(TypeError, match="EpochMetric takes a function"):
        EpochMetric("cohen_kappa")
    with pytest.raises(TypeError, match="higher_is_better must be True, False or None"):
        EpochMetric(qwk, higher_is_better="yes")


SPMD = """
import torch
from sklearn.metrics import cohen_kappa_score
from tpu_utility import EpochMetric, evaluate, one_cycle_fit
from tpu_utility.demo import digits_datasets

nn = torch.nn
small_mlp = lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))  # conftest's
train, valid = digits_datasets()
qwk = EpochMetric(lambda out, y: cohen_kappa_score(y, out.argmax(1), weights="quadratic"), higher_is_better=True)
torch.manual_seed(0)
history = one_cycle_fit(small_mlp(), train, valid_data=valid, epochs=2, max_lr=3e-3, batch_size=16, cores="all",
                        metrics={"qwk": qwk}, monitor="qwk", restore_best=False, progress=False)
x, y = valid.tensors
model = history.model.cpu().eval()
with torch.no_grad():
    on_cpu = cohen_kappa_score(y, model(x).argmax(1), weights="quadratic")
on_four = evaluate(model, valid, batch_size=16, cores="all", metrics={"qwk": qwk})["qwk"]
print("fit:", abs(history.records[-1].metrics["qwk"] - on_cpu) < 1e-9, "evaluate:", abs(on_four - on_cpu) < 1e-9,
      "kappa:", round(on_cpu, 3), "cores:", history.summary.split(" on ")[1].split(",")[0])
"""


@pytest.mark.multidevice
def test_kappa_on_four_spmd_devices_equals_sklearn_on_the_cpu_predictions():
    r = run_python(SPMD, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "fit: True evaluate: True" in r.stdout, r.stdout
    assert "cores: 4 CPU core(s)" in r.stdout, r.stdout
