"""Nothing a user gives is dropped or trains silently on the wrong thing; bad input
fails before an epoch is spent, with the value and what is allowed."""

import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, SubsetRandomSampler, TensorDataset

from conftest import flat_digits, run_python, small_mlp
from test_readme import one_call_block
from tpu_utility import find_lr, get_device, one_cycle_fit
from tpu_utility.data.loaders import ShardedSampler

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 1, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


class _Recording(Dataset):
    def __init__(self, base):
        self.base, self.seen = base, set()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.seen.add(i)
        return self.base[i]


def test_a_dataloaders_own_sampler_is_kept():
    data = _Recording(flat_digits())
    train_idx = list(range(0, 1000))
    loader = DataLoader(data, batch_size=32, sampler=SubsetRandomSampler(train_idx))
    fit(small_mlp(), loader, epochs=2)
    touched = {i for i in data.seen}
    data.seen.clear()
    assert touched <= set(train_idx)  # never the held-out samples (the usual train/valid split)
    assert len(touched) > 900


def test_a_user_sampler_is_sharded_the_same_way_on_every_replica():
    sampler = SubsetRandomSampler(list(range(0, 100, 2)))
    shards = [list(ShardedSampler(sampler, 4, rank, seed=7)) for rank in range(4)]
    drawn = [i for s in shards for i in s]
    assert sorted(set(drawn)) == list(range(0, 100, 2)) and len(drawn) == 52  # all of it, 2 repeated to pad
    assert {len(s) for s in shards} == {13}
    again = ShardedSampler(sampler, 4, 0, seed=7)
    assert list(again) == shards[0]  # every replica draws the same permutation
    again.set_epoch(1)
    assert list(again) != shards[0]  # and a new one each epoch
    assert sampler.generator is None  # the user's sampler is left as it was


def test_pin_memory_on_xla_is_said_once_and_other_settings_are_kept():
    seeds = []
    loader = DataLoader(flat_digits(), batch_size=32, shuffle=True, pin_memory=True,
                        worker_init_fn=lambda i: seeds.append(i))  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import tpu_utility.data.loaders as data

        data._PIN_MEMORY_WARNED = False
        fit(small_mlp(), loader, epochs=1, valid_data=loader)
    pin = [w for w in caught if "pin_memory" in str(w.message)]
    assert len(pin) == 1 and pin[0].filename == __file__  # once, at the user's line


def test_a_dropped_tail_that_is_reshuffled_is_said_in_the_summary_not_warned():
    data = TensorDataset(torch.randn(111, 1, 8, 8), torch.randint(0, 10, (111,)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = fit(small_mlp(), data)
        find_lr(small_mlp(), data, batch_size=32, num_steps=5)
    assert not [w for w in caught if "dropping" in str(w.message) or "left out" in str(w.message)]
    assert "| 15 sample(s) an epoch left out to keep one batch shape" in history.summary


def test_a_tail_never_trained_on_is_warned_once_at_the_users_line():
    loader = DataLoader(TensorDataset(torch.randn(111, 1, 8, 8), torch.randint(0, 10, (111,))), batch_size=32)
    with pytest.warns(UserWarning, match=r"dropping the last 15 sample\(s\) .* does not shuffle, so they are never trained on") as caught:
        history = fit(small_mlp(), loader, epochs=2)
    drops = [w for w in caught if "dropping" in str(w.message)]
    assert len(drops) == 1 and drops[0].filename == __file__
    assert "15 sample(s) an epoch left out" in history.summary


def test_labels_outside_the_models_classes_fail_on_the_host():
    x, y = flat_digits().tensors
    y = y.clone()
    y[100] = 10  # the model has 10 outputs: classes 0..9
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 10\) .* holds \[10\]"):
        fit(small_mlp(), TensorDataset(x, y))
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 10\)"):
        fit(small_mlp(), flat_digits(), valid_data=TensorDataset(x, y))


COUNTING = """
import sys, warnings; warnings.simplefilter("ignore")
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import one_cycle_fit, backend

class Counting(nn.Module):
    # forward has a side effect on the device, as a step counter or a running statistic would
    def __init__(self, count):
        super().__init__()
        self.net, self.count, self.sizes = nn.Linear(8, 3), count, []
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.sizes.append(x.shape[0])
        if self.count:
            self.calls += 1
        return self.net(x)

torch.manual_seed(0)
data = TensorDataset(torch.randn(160, 8), torch.randint(0, 3, (160,)))
model = Counting(count=sys.argv[1] == "counting")
compiles = backend.compile_count()
h = one_cycle_fit(model, data, epochs=1, max_lr=1e-2, batch_size=32, progress=False)
print("sizes", sorted(set(model.sizes)), "calls", len(model.sizes), "buffer", int(model.calls))
print("epoch 1 compiles", h.records[0].compiles - compiles)
"""


def test_the_label_check_costs_no_forward_and_no_compile_of_its_own(tmp_path):
    # the check reads the class count from the first real batch's output: the model runs on the
    # loader's batches only, and a forward with side effects adds no graph (it did with a probe batch)
    runs = {kind: run_python(f"import sys; sys.argv[1:] = [{kind!r}]\n" + COUNTING) for kind in ("counting", "plain")}
    for r in runs.values():
        assert r.returncode == 0, r.stderr[-3000:]
    assert "sizes [32] calls 5 buffer 5" in runs["counting"].stdout  # 160 samples: 5 batches of 32, no probe
    assert "sizes [32] calls 5 buffer 0" in runs["plain"].stdout
    compiles = [int(r.stdout.split("epoch 1 compiles")[1].split()[0]) for r in runs.values()]
    assert compiles[0] == compiles[1], compiles  # the side effect adds no graph of its own


def test_batches_of_several_inputs_and_a_target_use_model_star_inputs():
    class TwoInputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = small_mlp()

        def forward(self, image, scale):
            return self.net(image * scale[:, None, None, None])

    x, y = flat_digits().tensors
    history = fit(TwoInputs(), TensorDataset(x, torch.ones(len(x)), y), epochs=3, max_lr=1e-2,
                  valid_data=TensorDataset(x[:200], torch.ones(200), y[:200]))  # fmt: skip
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    assert history.records[-1].metrics["accuracy"] > 0.9


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"div_factor": 0}, ValueError, r"div_factor must be finite and > 0, but given 0"),
        ({"final_div_factor": -1.0}, ValueError, r"final_div_factor must be finite and > 0, but given -1.0"),
        ({"base_momentum": 1.0}, ValueError, r"base_momentum must be in \[0, 1\), but given 1.0"),
        ({"max_momentum": -0.1}, ValueError, r"max_momentum must be in \[0, 1\), but given -0.1"),
        ({"pct_start": 1.0}, ValueError, r"pct_start must be between 0 and 1 \(exclusive\), but given 1.0"),
        ({"seed": 2**70}, ValueError, r"seed must be an int in \[0, 2\*\*63\), but given"),
        ({"seed": 1.5}, ValueError, r"seed must be an int in \[0, 2\*\*63\), but given 1.5"),
        ({"weight_decay": -1}, ValueError, r"weight_decay must be a number in \[0, ∞\), but given -1"),
        ({"time_limit": "soon"}, ValueError, r"time_limit must be seconds or a duration like '8h30m'"),
        ({"early_stopping": 0}, ValueError, r"early_stopping must be a positive int, but given 0"),
        ({"monitor": "f1"}, ValueError, r"monitor='f1' is not a figure of this run; it has \['train_loss'\]"),
        ({"mode": "up"}, ValueError, r"mode must be one of \('auto', 'min', 'max'\), but given 'up'"),
        ({"train_step": lambda m, b: 1.0}, TypeError, r"train_step must return the loss as a tensor .* returned float 1.0"),
    ],
)
def test_one_cycle_fit_refuses_bad_values(kwargs, error, message):
    with pytest.raises(error, match=message):
        fit(small_mlp(), flat_digits(), **kwargs)


def test_tuple_data_frozen_model_and_a_checkpoint_dir_that_is_a_file(tmp_path):
    x, y = flat_digits().tensors
    with pytest.raises(TypeError, match=r"train_data is a tuple of tensors \(x, y\); give a Dataset, for example .*TensorDataset"):
        fit(small_mlp(), (x, y))
    frozen = small_mlp().requires_grad_(False)
    with pytest.raises(ValueError, match=r"the model has no trainable parameters"):
        fit(frozen, flat_digits())
    not_a_folder = tmp_path / "ckpt"
    not_a_folder.write_text("")
    with pytest.raises(ValueError, match=r"checkpoint_dir='.*ckpt' is a file, not a folder"):
        fit(small_mlp(), flat_digits(), checkpoint_dir=str(not_a_folder))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"end_lr": float("inf")}, r"end_lr must be a number in \(0, ∞\), but given inf"),
        ({"smooth": 1.0}, r"smooth must be a number in \[0, 1\), but given 1.0"),
        ({"seed": -1}, r"seed must be an int in \[0, 2\*\*63\), but given -1"),
        ({"num_steps": 1}, r"num_steps must be an int of at least 2, but given 1"),
    ],
)
def test_find_lr_refuses_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        find_lr(small_mlp(), flat_digits(), **kwargs)


def test_find_lr_leaves_device_mode_and_global_rng_as_found():
    model = nn.Sequential(small_mlp(), nn.Dropout(0.2)).eval()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    find_lr(model, flat_digits(), batch_size=32, num_steps=20)
    assert torch.equal(torch.rand(3), expected)  # not reseeded, not advanced
    assert not model.training and next(model.parameters()).device.type == "cpu"
    device = get_device()
    model.to(device).train()
    find_lr(model, flat_digits(), batch_size=32, num_steps=20)
    assert model.training and next(model.parameters()).device == device


README_PRELUDE = """
import warnings; warnings.simplefilter("ignore")
import os, re, torch
from torch.utils.data import TensorDataset
from tpu_utility.demo import digits_datasets, small_cnn
os.chdir({tmp!r})
train_ds, valid_ds = digits_datasets()
test_ds = TensorDataset(valid_ds.tensors[0])
test_ids = torch.arange(len(test_ds))
torch.manual_seed(0)
model = small_cnn()
"""


@pytest.mark.multidevice
def test_the_readme_block_runs_as_written_on_four_devices(tmp_path):
    block = one_call_block()  # the README's "Train with one call" block, its find_lr sweep 30 steps, not 100
    code = README_PRELUDE.format(tmp=str(tmp_path)) + block + """
rows = open("submission.csv").read().splitlines()
print("rows", len(rows) - len(test_ds), rows[0], "stop:", history.stop_reason)
print("test accuracy", (preds.argmax(1) == valid_ds.tensors[1]).float().mean().item())
"""
    r = run_python(code, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "SPMD on: one process drives all 4 devices" in r.stdout
    assert "one_cycle_fit: spmd on 4 CPU core(s)" in r.stdout
    assert "rows 1 id,label" in r.stdout  # a header, then one row per test sample
    assert (tmp_path / "ckpt" / "best.pt").exists() and (tmp_path / "ckpt" / "history.csv").exists()
    accuracy = float(r.stdout.split("test accuracy ")[1].split()[0])
    assert accuracy > 0.9


@pytest.mark.multidevice
def test_cores_all_after_the_device_was_touched_is_a_clear_error_not_a_crash():
    r = run_python("""
import warnings; warnings.simplefilter("ignore")
import torch
from tpu_utility import find_lr, one_cycle_fit, setup_tpu, backend
from tpu_utility.demo import digits_datasets, small_cnn
info = setup_tpu(spmd=False, verbose=False)  # as for strategy="multiprocess": SPMD stays off
print("spmd:", info.spmd, backend.is_spmd(), "runtime:", backend.runtime_started())
train, _ = digits_datasets()
model = small_cnn()
find_lr(model, train, num_steps=5)
try:
    one_cycle_fit(model, train, epochs=1, max_lr=1e-3, cores="all", progress=False)
except RuntimeError as e:
    print("RuntimeError:", e)
""", env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]  # no SIGSEGV
    assert "spmd: False False runtime: False" in r.stdout
    assert "RuntimeError: cores='all' needs SPMD, but the XLA runtime already started without it" in r.stdout
    assert "Call setup_tpu() first thing" in r.stdout


def test_num_workers_defaults_to_the_suggestion_and_a_loaders_own_is_kept():
    import os

    from tpu_utility.environment import suggest_num_workers

    suggested = suggest_num_workers(os.cpu_count() or 1)
    assert f"| {suggested} loader worker(s)" in fit(small_mlp(), _Recording(flat_digits())).summary
    assert "| 0 loader worker(s)" in fit(small_mlp(), flat_digits()).summary  # tensors in memory: no workers
    own = DataLoader(flat_digits(), batch_size=32, shuffle=True, num_workers=0)
    assert "| 0 loader worker(s)" in fit(small_mlp(), own, batch_size=None).summary


def _init_worker(worker_id):
    torch.manual_seed(worker_id)


def test_a_dataloaders_settings_reach_the_loaders_the_runner_builds():
    from tpu_utility.data.loaders import eval_loader, train_loader, unpack_loader

    generator = torch.Generator().manual_seed(5)
    user = DataLoader(flat_digits(), batch_size=32, shuffle=True, num_workers=2, prefetch_factor=4,
                      worker_init_fn=_init_worker, generator=generator, timeout=30)  # fmt: skip
    spec = unpack_loader(user, None, "train_data")
    for built in (train_loader(spec, 32, replicas=2, rank=1, seed=0), eval_loader(spec, 32, replicas=2, rank=1)):
        assert (built.num_workers, built.prefetch_factor, built.timeout) == (2, 4, 30)
        assert built.worker_init_fn is _init_worker and built.generator is generator


def test_weight_decay_reaches_the_named_optimizer_and_is_refused_for_a_factory():
    x = fit(small_mlp(), flat_digits(), optimizer="sgd", max_lr=0.05, weight_decay=0.5)
    y = fit(small_mlp(), flat_digits(), optimizer="sgd", max_lr=0.05)
    decayed = sum(p.detach().abs().sum().item() for p in x.model.parameters())
    plain = sum(p.detach().abs().sum().item() for p in y.model.parameters())
    assert decayed < 0.9 * plain
    with pytest.raises(ValueError, match=r"weight_decay=0.1 applies to a named optimizer"):
        fit(small_mlp(), flat_digits(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), weight_decay=0.1)


def test_a_tensor_datasets_labels_are_checked_at_once_and_its_batches_are_not_looked_at():
    """A TensorDataset holds every label in one tensor: checked together as the class count is learnt
    (before the first loss), so the loop does no label work per step; a Subset's are checked per batch,
    as only the samples it draws count."""
    from torch.utils.data import Subset

    from tpu_utility.data.loaders import LabelCheck, LabelCheckedLoader

    data = TensorDataset(torch.randn(8, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0, 5]))
    labels = LabelCheck()
    whole = DataLoader(data, batch_size=4, shuffle=True)
    assert labels.loader(whole) is whole
    with pytest.raises(ValueError, match=r"in \[0, 3\) .* but the dataset holds \[5\]"):
        labels.see(torch.zeros(4, 3))
    labels = LabelCheck()
    part = labels.loader(DataLoader(Subset(data, range(7)), batch_size=4))  # sample 7 (label 5) never drawn
    assert isinstance(part, LabelCheckedLoader)
    assert sum(len(y) for _, y in part) == 7 and labels.see(torch.zeros(4, 3)) is None
    x, y = flat_digits().tensors
    y = y.clone()
    y[-1] = 10
    with pytest.raises(ValueError, match=r"but the dataset holds \[10\]"):
        fit(small_mlp(), TensorDataset(x, y))


def test_the_label_check_reads_the_class_dimension_of_a_per_pixel_model():
    x = torch.randn(96, 1, 8, 8)
    y = (x[:, 0] > 0).long() + (x[:, 0] > 1).long()  # 3 classes per pixel, a (N, 8, 8) target
    segmenter = nn.Conv2d(1, 3, kernel_size=1)  # (N, 3, 8, 8): classes on dim 1, not the last
    history = fit(segmenter, TensorDataset(x, y), epochs=2, max_lr=1e-1, metrics=[], batch_size=16)
    assert history.records[-1].train_loss < history.records[0].train_loss
    with pytest.raises(ValueError, match=r"labels must be class indices in \[0, 3\)"):
        fit(segmenter, TensorDataset(x, y + 1), batch_size=16)
