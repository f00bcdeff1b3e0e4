"""predict and evaluate: dataset order, few transfers, one compile, exact figures,
the model left as found; on 1 device, 4 SPMD devices, in a launch, without torch_xla."""

import math

import pytest
import torch
from torch import nn
from torch.utils.data import (DataLoader, Dataset, RandomSampler, Subset, SubsetRandomSampler, TensorDataset,
                              WeightedRandomSampler)

from conftest import BLOCK_TORCH_XLA, flat_digits, run_python, run_script, small_mlp
from tpu_utility import evaluate, predict, backend

INDEXED = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

def indexed(n=1001):
    # the target is the sample's own index; feature 0 is the index too
    x = torch.zeros(n, 4)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    x[:, 1:] = torch.randn(n, 3)
    return TensorDataset(x, torch.arange(n))

def echo():
    model = nn.Linear(4, 1)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
        model.bias.zero_()
    return model
"""
exec(INDEXED)


def test_predict_returns_every_sample_in_order_with_few_transfers_and_one_compile():
    model, data = echo().to(backend.device()), indexed()  # on the device already: no weights move back
    compiles0, transfers0 = backend.compile_count(), backend.transfer_from_device_count()
    preds = predict(model, data, batch_size=64)
    compiles, transfers = backend.compile_count() - compiles0, backend.transfer_from_device_count() - transfers0
    assert torch.equal(preds.squeeze(1), torch.arange(1001, dtype=torch.float32))
    assert transfers == 1, transfers  # 16 batches (the last one padded): one transfer
    assert compiles == 1, compiles  # padded batches all have one shape
    transfers0 = backend.transfer_from_device_count()
    preds = predict(model, data, batch_size=16)
    batches = math.ceil(1001 / 16)
    transfers = backend.transfer_from_device_count() - transfers0
    assert transfers <= math.ceil(batches / 16), (transfers, batches)  # never one per batch
    assert torch.equal(preds.squeeze(1), torch.arange(1001, dtype=torch.float32))
    again0 = backend.compile_count()
    predict(model, data, batch_size=16)
    assert backend.compile_count() == again0  # the same graph serves a second call


def test_predict_leaves_the_model_as_found_and_keeps_output_structure():
    model = echo().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    class TwoHeads(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            y = self.inner(x)
            return {"value": y, "double": (y * 2, y * 3)}

    wrapped = TwoHeads(model)
    out = predict(wrapped, indexed(100), batch_size=16)
    assert torch.equal(out["value"].squeeze(1), torch.arange(100, dtype=torch.float32))
    assert torch.equal(out["double"][1].squeeze(1), 3 * torch.arange(100, dtype=torch.float32))
    assert model.training and next(model.parameters()).device.type == "cpu"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_predict_inputs_alone_a_loader_sampler_predict_step_and_tta():
    data = indexed(300)
    inputs_only = TensorDataset(data.tensors[0])
    plain = predict(echo(), inputs_only, batch_size=32)
    assert torch.equal(plain.squeeze(1), torch.arange(300, dtype=torch.float32))
    picked = [5, 17, 250, 3]
    chosen = predict(echo(), Subset(data, picked), batch_size=2).squeeze(1)
    assert chosen.tolist() == [float(i) for i in picked]  # row k is model(data[picked[k]])
    stepped = predict(echo(), data, batch_size=32, predict_step=lambda m, b: m(b[0]) + 1)
    assert torch.equal(stepped.squeeze(1), torch.arange(1, 301, dtype=torch.float32))
    both = predict(echo(), data, batch_size=32, tta=[lambda b: b, lambda b: (b[0] * 3, b[1])])
    assert torch.allclose(both.squeeze(1), 2 * torch.arange(300, dtype=torch.float32))


def test_evaluate_is_exact_and_matches_a_plain_cpu_loop(digits):
    torch.manual_seed(0)
    model = small_mlp()
    _, valid = digits
    figures = evaluate(model, valid, batch_size=64)
    x, y = valid.tensors
    with torch.no_grad():
        out = model(x)
    assert figures["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)
    assert figures["accuracy"] == pytest.approx((out.argmax(1) == y).float().mean().item(), abs=1e-6)
    assert next(model.parameters()).device.type == "cpu"


class _Broken(Dataset):
    """Sample 70 raises, as a corrupt file in a user's Dataset would."""

    def __len__(self):
        return 200

    def __getitem__(self, i):
        if i == 70:
            raise OSError(f"cannot read sample {i}: corrupt file")
        return torch.randn(1, 8, 8), i % 10


@pytest.mark.filterwarnings("ignore:dropping the last")
def test_a_dataset_error_reaches_the_caller_in_training_validation_and_prediction():
    from tpu_utility import one_cycle_fit

    with pytest.raises(OSError, match="cannot read sample 70"):
        one_cycle_fit(small_mlp(), _Broken(), epochs=1, max_lr=1e-3, batch_size=16, progress=False)
    with pytest.raises(OSError, match="cannot read sample 70"):
        one_cycle_fit(small_mlp(), flat_digits(), valid_data=_Broken(), epochs=1, max_lr=1e-3,
                      batch_size=16, progress=False)  # fmt: skip
    with pytest.raises(OSError, match="cannot read sample 70"):
        predict(small_mlp(), _Broken(), batch_size=16)


SPMD_SCRIPT = INDEXED + """
import warnings; warnings.simplefilter("ignore")
from torch.utils.data import Dataset
from tpu_utility import evaluate, predict, backend
from tpu_utility.demo import digits_datasets

model, data = echo(), indexed()
preds = predict(model, data, batch_size=16, cores="all")
print("in order:", torch.equal(preds.squeeze(1), torch.arange(1001, dtype=torch.float32)))
print("devices:", backend.global_device_count(), "spmd:", backend.is_spmd())
print("model back on:", next(model.parameters()).device.type)

_, valid = digits_datasets()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
got = evaluate(net, valid, batch_size=16, cores="all")
x, y = valid.tensors
with torch.no_grad():
    out = net(x)
print("loss", got["loss"], torch.nn.functional.cross_entropy(out, y).item())
print("accuracy", got["accuracy"], (out.argmax(1) == y).float().mean().item())

class Broken(Dataset):
    def __len__(self):
        return 200
    def __getitem__(self, i):
        if i in (150, 151, 152, 153, 154):  # any training order draws some of them
            raise OSError(f"cannot read sample {i}")
        return torch.randn(1, 8, 8), i % 10
try:
    predict(net, Broken(), batch_size=8, cores="all")
except OSError as e:
    print("raised:", e)

from torchmetrics.classification import MulticlassAccuracy
from tpu_utility import one_cycle_fit
train, valid = digits_datasets()
torch.manual_seed(0)
h = one_cycle_fit(net, train, valid_data=valid, epochs=6, max_lr=1e-2, batch_size=16, cores="all",
                  metrics={"acc": MulticlassAccuracy(num_classes=10, average="micro"), "accuracy": "accuracy"},
                  monitor="acc", early_stopping=1, restore_best=True, progress=False)
print("epochs", len(h.records), "best", h.best_epoch, "|", h.stop_reason)
print("torchmetrics", h.records[-1].metrics["acc"], "ours", h.records[-1].metrics["accuracy"])
final = evaluate(h.model, valid, cores="all")
print("restored", final["accuracy"], h.records[h.best_epoch - 1].metrics["accuracy"])
try:
    one_cycle_fit(net, Broken(), epochs=1, max_lr=1e-3, batch_size=8, cores="all", progress=False)
except OSError as e:
    print("training raised:", e)
"""


@pytest.mark.multidevice
def test_predict_and_evaluate_on_four_spmd_devices():
    r = run_python(SPMD_SCRIPT, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in order: True" in r.stdout
    assert "devices: 4 spmd: True" in r.stdout
    assert "model back on: cpu" in r.stdout
    for key in ("loss", "accuracy"):
        (_, got, want), = [line.split() for line in r.stdout.splitlines() if line.startswith(key)]
        assert float(got) == pytest.approx(float(want), rel=1e-5, abs=1e-6), key
    assert "raised: cannot read sample 150" in r.stdout
    training_error = r.stdout.split("training raised:", 1)[1]  # from a loader worker: with its traceback
    assert "cannot read sample 15" in training_error
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("epochs")]
    epochs, best = int(line.split()[1]), int(line.split()[3])
    assert epochs == 6 or f"did not improve for 1 epoch(s)" in line
    (_, tm, _, ours), = [x.split() for x in r.stdout.splitlines() if x.startswith("torchmetrics")]
    assert float(tm) == pytest.approx(float(ours), abs=1e-6)  # micro accuracy: both count every sample once
    (_, now, then), = [x.split() for x in r.stdout.splitlines() if x.startswith("restored")]
    assert float(now) == pytest.approx(float(then), abs=1e-6)  # the best epoch's weights came back


SPMD_COMPILES = """
import warnings; warnings.simplefilter("ignore")
import torch
from sklearn.metrics import cohen_kappa_score
from tpu_utility import EpochMetric, backend, evaluate, one_cycle_fit, predict
from tpu_utility.demo import digits_datasets

nn = torch.nn
train, valid = digits_datasets()  # 359 validation samples: 6 global batches of 64, the last one padded
kappa = lambda out, y: cohen_kappa_score(y, out.argmax(1), weights="quadratic")
qwk = EpochMetric(kappa, higher_is_better=True)
torch.manual_seed(0)
before = backend.compile_count()
history = one_cycle_fit(nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)), train,
                        valid_data=valid, epochs=3, max_lr=3e-3, batch_size=16, cores="all", restore_best=False,
                        metrics={"accuracy": "accuracy", "qwk": qwk}, progress=False)
counts = [before] + [r.compiles for r in history.records]
print("epochs", *[b - a for a, b in zip(counts, counts[1:])], "uncounted", backend.compile_count() - counts[-1])
model = history.model
x, y = valid.tensors
with torch.no_grad():
    on_cpu = model.cpu().eval()(x)
print("fit_kappa", history.records[-1].metrics["qwk"], kappa(on_cpu, y))

def compiles(call):
    before = backend.compile_count()
    result = call()
    return backend.compile_count() - before, result

for k in range(2):
    n, got = compiles(lambda: evaluate(model, valid, batch_size=16, cores="all", metrics={"qwk": qwk}))
    print(f"evaluate{k}", n, got["qwk"], kappa(on_cpu, y))
for k in range(2):  # 23 batches of 16: a chunk of 16 moves to the host, then the last 7
    n, preds = compiles(lambda: predict(model, valid, batch_size=4, cores="all", progress=False))
    print(f"predict{k}", n, preds.shape == on_cpu.shape and torch.allclose(preds, on_cpu, atol=1e-5))
print("devices:", backend.global_device_count(), "spmd:", backend.is_spmd())
"""


@pytest.mark.multidevice
def test_on_four_spmd_devices_repeated_evaluation_and_prediction_compile_nothing_new():
    """A batch-sharded tensor's own transfer compiles a graph at every call (torch_xla gathers its shards anew):
    moved one batch at a time, an EpochMetric cost 3 compiles per validation batch in every epoch, and each
    evaluate or predict call compiled again. Gathered in a graph compiled once, epochs 2 and 3 compile nothing."""
    r = run_python(SPMD_COMPILES, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "devices: 4 spmd: True" in r.stdout, r.stdout
    said = {line.split()[0]: line.split()[1:] for line in r.stdout.splitlines()}
    first, second, third, _, uncounted = said["epochs"]
    assert int(uncounted) == 0, r.stdout  # the records count every graph: validation and the EpochMetric's gather too
    assert (int(second), int(third)) == (0, 0) and int(first) <= 12, r.stdout  # was 24, 18, 18 (5, 0, 0 without it)
    fit_kappa, cpu_kappa = said["fit_kappa"]
    assert float(fit_kappa) == pytest.approx(float(cpu_kappa), abs=1e-9)
    for k, most in ((0, 6), (1, 0)):  # a first call compiles a few graphs; a second one nothing
        n, got, want = said[f"evaluate{k}"]
        assert int(n) <= most and float(got) == pytest.approx(float(want), abs=1e-9), r.stdout  # was 22, then 18 a call
        n, equal = said[f"predict{k}"]
        assert int(n) <= most // 2 and equal == "True", r.stdout  # was 2 per batch at every call


MP_SCRIPT = INDEXED + """
import warnings; warnings.simplefilter("ignore")
import torch_xla
from tpu_utility import predict, backend

class Broken(torch.utils.data.Dataset):
    def __len__(self):
        return 100
    def __getitem__(self, i):
        if i == 70:
            raise OSError(f"cannot read sample {i}")
        return torch.randn(4)

def worker(index):
    preds = predict(echo(), indexed(), batch_size=64)
    print("replica", backend.world_size(), "launched", backend.in_launched_process(),
          "in order:", torch.equal(preds.squeeze(1), torch.arange(1001, dtype=torch.float32)))
    try:
        predict(echo(), Broken(), batch_size=16)
    except OSError as e:
        print("raised in the launch:", e)

if __name__ == "__main__":
    torch_xla.launch(worker, args=())
"""


def test_predict_inside_a_multiprocess_launch_with_one_device(tmp_path):
    r = run_script(tmp_path, "predict_mp.py", MP_SCRIPT, env={"CPU_NUM_DEVICES": "1"})
    assert "replica 1 launched True in order: True" in r.stdout
    assert "raised in the launch: cannot read sample 70" in r.stdout


def test_predict_and_evaluate_without_torch_xla():
    r = run_python(BLOCK_TORCH_XLA + INDEXED + """
from tpu_utility import evaluate, predict
preds = predict(echo(), indexed(), batch_size=64)
print("in order:", torch.equal(preds.squeeze(1), torch.arange(1001, dtype=torch.float32)))
print("figures:", sorted(evaluate(echo(), indexed(), loss_fn=torch.nn.functional.l1_loss, metrics=[]) ))
""", env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "in order: True" in r.stdout
    assert "figures: ['loss']" in r.stdout


def test_bf16_predict_leaves_fp32_weights_exactly_as_they_were():
    torch.manual_seed(0)
    model = small_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = predict(model, flat_digits(200), batch_size=32, precision="bf16")
    assert out.shape == (200, 10)
    for k, v in model.state_dict().items():
        assert v.dtype == torch.float32 and torch.equal(v, before[k]), k


def test_evaluate_checks_labels_on_the_host_as_training_does():
    ds = TensorDataset(torch.randn(40, 4), torch.full((40,), 7))  # a 3-class model, labels 7
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 3\)"):
        evaluate(nn.Linear(4, 3), ds, batch_size=8)


def test_predict_over_a_shuffling_sampler_returns_rows_in_dataset_order():
    ds = TensorDataset(torch.arange(100.0).unsqueeze(1))
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=generator))
    out = predict(nn.Identity(), loader, predict_step=lambda model, batch: model(batch[0]))
    assert out.flatten().tolist() == [float(i) for i in range(100)]  # row i is sample i, whatever the draw


@pytest.mark.parametrize("sampler, drawn", [
    (SubsetRandomSampler([5, 3, 90, 1]), "draws 4 of the 100 samples"),
    (WeightedRandomSampler(torch.ones(100), 64, generator=torch.Generator().manual_seed(0)), "draws 64 indices with"),
    (RandomSampler(range(100), replacement=True, generator=torch.Generator().manual_seed(0)), "draws 100 indices with"),
])  # fmt: skip
def test_predict_refuses_a_sampler_that_does_not_draw_every_sample_once(sampler, drawn):
    ds = TensorDataset(torch.arange(100.0).unsqueeze(1))
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    with pytest.raises(ValueError, match=rf"row i = model\(dataset\[i\]\).*{type(sampler).__name__} {drawn}.*Subset"):
        predict(nn.Identity(), loader, predict_step=lambda model, batch: model(batch[0]))


def test_a_model_of_mixed_dtypes_comes_back_in_its_own_dtypes():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].to(torch.bfloat16).requires_grad_(False)  # a frozen bf16 head
    predict(model, TensorDataset(torch.randn(8, 4)), predict_step=lambda m, b: m[0](b[0]))
    assert (model[0].weight.dtype, model[1].weight.dtype) == (torch.float32, torch.bfloat16)


def test_a_bf16_fit_on_xla_cpu_gives_the_model_back_in_float32_for_predict():
    from tpu_utility import one_cycle_fit

    train = flat_digits(256)
    history = one_cycle_fit(small_mlp(), train, epochs=1, max_lr=3e-3, batch_size=32, precision="bf16", progress=False)
    assert {p.dtype for p in history.model.parameters()} == {torch.float32}  # trained by casting; given back as found
    out = predict(history.model, train)  # fp32, after a bf16 run: one graph of one precision
    assert out.shape == (256, 10) and out.dtype == torch.float32


SHAPES = """
import torch
from torch import nn
from torch.utils.data import TensorDataset

class Tagger(nn.Module):
    # a batch-first LSTM; `kind` picks what forward returns
    def __init__(self, kind):
        super().__init__()
        torch.manual_seed(0)
        self.lstm, self.head, self.kind = nn.LSTM(3, 4, num_layers=2, batch_first=True), nn.Linear(4, 2), kind

    def forward(self, x):
        seq, (h, c) = self.lstm(x)
        logits = self.head(seq[:, -1])
        return {"lstm": (seq, (h, c)), "transposed": logits.T, "reduced": logits.mean(0), "scalar": logits.sum(),
                "nested": {"seq": seq, "last": (logits, [logits.argmax(1)])}}[self.kind]

torch.manual_seed(1)
x = torch.randn(100, 7, 3)
data = TensorDataset(x, torch.zeros(100, dtype=torch.long))
"""


def _shape_cases(cores):
    """What predict gives or refuses for each kind of output, as printed lines."""
    from tpu_utility import predict

    exec(SHAPES, scope := {})
    lines = []
    for kind in ("lstm", "transposed", "reduced", "scalar"):
        try:
            out = predict(scope["Tagger"](kind), scope["data"], batch_size=16, cores=cores, progress=False)
            lines.append(f"{kind}: returned {out!r:.60}")
        except ValueError as e:
            lines.append(f"{kind}: {e}")
    model = scope["Tagger"]("nested")
    got = predict(model, scope["data"], batch_size=16, cores=cores, progress=False)
    with torch.no_grad():
        want = model(scope["x"])
    same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(torch.utils._pytree.tree_leaves(got),
                                                                   torch.utils._pytree.tree_leaves(want)))  # fmt: skip
    lines.append(f"nested: same structure {torch.utils._pytree.tree_structure(got) == torch.utils._pytree.tree_structure(want)} "
                 f"same values {same}")
    return lines


def _check_shape_cases(lines, batch):
    """``batch``: the batch the model sees (16 per core; under SPMD, the global batch over all cores)."""
    by_kind = dict(line.split(": ", 1) for line in lines)
    assert f"output[1][0] has shape (2, {batch}, 4) for a batch of {batch} samples" in by_kind["lstm"]  # h: (layers, N, H)
    assert f"output has shape (2, {batch}) for a batch of {batch}" in by_kind["transposed"]
    assert f"output has shape (2,) for a batch of {batch}" in by_kind["reduced"]
    assert f"output has shape () for a batch of {batch}" in by_kind["scalar"]
    assert all("batch-first" in by_kind[k] for k in ("lstm", "transposed", "reduced", "scalar"))
    assert by_kind["nested"] == "same structure True same values True"  # against the model on the CPU, whole


def test_predict_takes_batch_first_outputs_and_refuses_the_rest_by_name():
    _check_shape_cases(_shape_cases(cores=1), batch=16)


@pytest.mark.multidevice
def test_predict_takes_batch_first_outputs_and_refuses_the_rest_on_four_spmd_devices():
    import inspect

    code = f"import torch, warnings; warnings.simplefilter('ignore')\nSHAPES = {SHAPES!r}\n" + inspect.getsource(_shape_cases) + """
for line in _shape_cases(cores="all"):
    print(line)
from tpu_utility import backend
print("devices:", backend.global_device_count(), "spmd:", backend.is_spmd())
"""
    r = run_python(code, env={"CPU_NUM_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "devices: 4 spmd: True" in r.stdout
    _check_shape_cases([line for line in r.stdout.splitlines() if not line.startswith("devices")], batch=64)


def test_evaluate_refuses_a_metric_named_loss_as_one_cycle_fit_does():
    from tpu_utility import one_cycle_fit

    fn = lambda output, target: torch.full((output.shape[0],), 123.0)  # noqa: E731
    with pytest.raises(ValueError, match=r"may not be named 'loss'"):
        evaluate(small_mlp(), flat_digits(64), metrics={"loss": fn})
    with pytest.raises(ValueError, match=r"may not be named 'valid_loss'"):
        evaluate(small_mlp(), flat_digits(64), metrics={"valid_loss": fn})
    with pytest.raises(ValueError, match=r"may not be named 'loss'"):
        one_cycle_fit(small_mlp(), flat_digits(64), epochs=1, max_lr=1e-3, metrics={"loss": fn}, progress=False)


def test_a_tta_that_does_not_fit_the_batch_or_changes_the_output_is_named():
    data = indexed(40)
    with pytest.raises(AttributeError, match=r"tta\[1\] failed on a batch \[Tensor\(16, 4\), Tensor\(16,\)\]: .*flip"):
        predict(echo(), data, batch_size=16, tta=[lambda b: b, lambda x: x.flip(-1)])
    with pytest.raises(ValueError, match=r"tta\[1\] gives the output Tensor\(8, 1\), but tta\[0\] gives Tensor\(16, 1\)"):
        predict(echo(), data, batch_size=16, tta=[lambda b: b, lambda b: (b[0][:8], b[1][:8])])
    flipped = predict(echo(), data, batch_size=16, tta=[lambda b: b, lambda b: (b[0].flip(-1), *b[1:])])
    x = data.tensors[0]
    assert torch.allclose(flipped.squeeze(1), (x[:, 0] + x[:, 3]) / 2)  # the documented form works
