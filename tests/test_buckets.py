"""BucketCollate: variable-length batches padded to a few bucket lengths, so XLA compiles
at most once per bucket; the math (choose_buckets, padding_waste) with plain numbers."""

import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import run_python
from tpu_utility import BucketCollate, choose_buckets, get_device, one_cycle_fit, padding_waste, step_optimizer, xla
from tpu_utility.demo import MarkerClassifier, marker_sequences, masked_eval_step, masked_train_step, pad_to_longest

BATCH = 32


# ------------------------------------------------------------ pure math
def test_choose_buckets_takes_quantiles_rounded_up_to_a_multiple():
    lengths = [5, 7, 9, 12, 30, 31, 60, 120]
    assert choose_buckets(lengths, num_buckets=4, multiple_of=8) == [8, 16, 32, 120]
    assert choose_buckets(lengths, num_buckets=2, multiple_of=16) == [16, 128]
    assert choose_buckets(lengths, num_buckets=1, multiple_of=1) == [120]
    assert choose_buckets([10] * 50, num_buckets=4, multiple_of=8) == [16]  # equal buckets merge


def test_choose_buckets_for_shuffled_batches_follows_the_batch_maximum():
    lengths = list(range(1, 101))
    # The longest of 16 uniform draws is below x with probability (x/100)**16: the median
    # batch pads to ~96, so the buckets crowd at the top.
    assert choose_buckets(lengths, num_buckets=2, multiple_of=1) == [50, 100]
    assert choose_buckets(lengths, num_buckets=2, multiple_of=1, batch_size=16) == [96, 100]


def test_choose_buckets_names_bad_arguments():
    with pytest.raises(ValueError, match="lengths is empty"):
        choose_buckets([], 4, 8)
    with pytest.raises(ValueError, match="num_buckets must be an int >= 1, but given 0"):
        choose_buckets([3, 4], 0, 8)
    with pytest.raises(TypeError, match="multiple_of must be an int, but given 8.0"):
        choose_buckets([3, 4], 4, 8.0)
    with pytest.raises(ValueError, match="lengths must be >= 0, but given -2"):
        choose_buckets([3, -2], 4, 8)


def test_padding_waste_counts_padded_over_total_tokens():
    assert padding_waste([3, 8, 10], [8, 16]) == pytest.approx(11 / 32)
    assert padding_waste([8, 16], [8, 16]) == 0.0
    with pytest.raises(ValueError, match="a length of 17 exceeds the largest bucket 16"):
        padding_waste([3, 17], [8, 16])
    with pytest.raises(ValueError, match=r"strictly increasing, but given \[16, 8\]"):
        padding_waste([3], [16, 8])


# ------------------------------------------------------------ the collate
def test_collate_pads_to_the_smallest_bucket_with_a_mask_of_real_tokens():
    collate = BucketCollate([4, 8, 16], pad_value=-1)
    tokens, mask, target = collate([(torch.tensor([5, 6, 7, 8, 9]), 1), ([2, 3], 0)])
    assert tokens.tolist() == [[5, 6, 7, 8, 9, -1, -1, -1], [2, 3, -1, -1, -1, -1, -1, -1]]
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == [5, 2]
    assert target.tolist() == [1, 0]
    tokens, mask, _ = collate([([1, 2, 3, 4], 0)])
    assert tokens.shape == (1, 4)
    assert collate.bucket_batches == {4: 1, 8: 1, 16: 0}
    assert collate.waste == pytest.approx(9 / 20)  # 9 of 16 tokens padded, then 0 of 4
    assert "padding waste" in collate.summary()


def test_collate_takes_dict_samples_and_feature_dimensions():
    collate = BucketCollate([4])
    tokens, mask, target = collate([{"input_ids": [1, 2], "label": 3}, {"input_ids": [4], "label": 5}])
    assert tokens.tolist() == [[1, 2, 0, 0], [4, 0, 0, 0]] and target.tolist() == [3, 5]
    frames, mask, _ = collate([(torch.ones(3, 2), 0.5), (torch.ones(1, 2), 1.5)])  # e.g. audio frames
    assert frames.shape == (2, 4, 2) and frames[1, 1:].abs().sum() == 0
    with pytest.raises(KeyError, match=r"lacks \['label'\]"):
        collate([{"input_ids": [1]}])


def test_a_too_long_sequence_is_an_error_or_truncated_with_a_warning():
    with pytest.raises(ValueError, match=r"length 9 is longer than the largest bucket 8 \(buckets \[4, 8\]\)"):
        BucketCollate([4, 8])([(list(range(9)), 0)])
    collate = BucketCollate([4, 8], overflow="truncate")
    with pytest.warns(UserWarning, match="truncating sequences longer than 8"):
        tokens, mask, _ = collate([(list(range(10)), 0)])
    assert tokens.shape == (1, 8) and mask.all() and collate.truncated_tokens == 2
    assert "2 tokens truncated" in collate.summary()
    with pytest.raises(ValueError, match="overflow must be one of \\('error', 'truncate'\\), but given 'drop'"):
        BucketCollate([4], overflow="drop")
    with pytest.raises(ValueError, match=r"pad_value=0.5 cannot fill torch.int64 sequences"):
        BucketCollate([4], pad_value=0.5)([([1, 2], 0)])
    with pytest.raises(TypeError, match="sample 0 of the batch is Tensor"):
        BucketCollate([4])([torch.arange(3)])


def test_from_lengths_reports_waste_and_pickles():
    lengths = [len(s) for s, _ in marker_sequences(256)]
    collate = BucketCollate.from_lengths(lengths, num_buckets=4, multiple_of=8)
    assert len(collate.buckets) <= 4 and collate.buckets[-1] >= max(lengths)
    assert all(b % 8 == 0 for b in collate.buckets)
    assert collate.data_waste == pytest.approx(padding_waste(lengths, collate.buckets))
    copy = pickle.loads(pickle.dumps(collate))  # DataLoader workers and spawn pickle it
    assert copy.buckets == collate.buckets


# --------------------------------------------------- the ported text loop
def _train_hand_loop(device, collate, train, epochs=3):
    """A CUDA text classifier's loop; returns (model, compile count after each epoch)."""
    torch.manual_seed(0)
    model = MarkerClassifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=collate, drop_last=True)
    compiles, before = [], xla.compile_count()
    for _ in range(epochs):
        for tokens, mask, y in loader:
            tokens, mask, y = tokens.to(device), mask.to(device), y.to(device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(tokens, mask), y).backward()
            step_optimizer(optimizer)  # was: optimizer.step()
        compiles.append(xla.compile_count() - before)
    return model, compiles


def _accuracy(model, device, valid, collate):
    correct = torch.zeros((), device=device)
    with torch.no_grad():
        for tokens, mask, y in DataLoader(valid, batch_size=64, collate_fn=collate):
            correct += (model(tokens.to(device), mask.to(device)).argmax(1) == y.to(device)).sum()
    return correct.item() / len(valid)


@pytest.fixture(scope="module")
def text_task():
    """Train and validation sets, and the accuracy of the unported loop on plain CPU."""
    # torch's autograd engine sizes its device queues at the first backward: start the XLA
    # device before a CPU backward, as a notebook that ran on XLA first would have.
    get_device()
    train, valid = marker_sequences(1024, seed=0), marker_sequences(512, seed=1)
    model, _ = _train_hand_loop(torch.device("cpu"), pad_to_longest, train)
    return train, valid, _accuracy(model, torch.device("cpu"), valid, pad_to_longest)


def test_bucketed_hand_loop_compiles_once_per_bucket_and_matches_the_cpu_run(text_task):
    train, valid, cpu_accuracy = text_task
    # The port: 3 edited lines (the device line, the collate in the DataLoader line, the
    # step line), plus the import.
    collate = BucketCollate.from_lengths([len(s) for s, _ in train], num_buckets=4, batch_size=BATCH)
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, compiles = _train_hand_loop(device, collate, train)
    assert device.type == "xla"
    # One graph per bucket, plus the first step's, which creates Adam's state.
    assert compiles[0] <= len(collate.buckets) + 1, (compiles, collate.summary())
    assert compiles[0] == compiles[1] == compiles[2], f"compiles after each epoch {compiles}"
    accuracy = _accuracy(model, device, valid, collate)
    assert cpu_accuracy > 0.9, cpu_accuracy
    assert accuracy == pytest.approx(cpu_accuracy, abs=0.03)
    assert 0.0 < collate.waste < 1.0


def _fit(model, task, collate, epochs, **kwargs):
    """one_cycle_fit over bucketed loaders; the history and the compile count after each epoch."""
    train, valid, _ = task
    before = xla.compile_count()
    history = one_cycle_fit(
        model, DataLoader(train, batch_size=BATCH, collate_fn=collate),
        valid_data=DataLoader(valid, batch_size=64, collate_fn=collate), epochs=epochs, max_lr=1e-2,
        progress=False, **kwargs,
    )  # fmt: skip
    return history, [r.compiles - before for r in history.records]


def test_one_cycle_fit_with_buckets_through_train_step_and_eval_step(text_task):
    collate = BucketCollate.from_lengths([len(s) for s, _ in text_task[0]], num_buckets=4, batch_size=BATCH)
    steps = {"train_step": masked_train_step, "eval_step": masked_eval_step}
    # One shape first (one bucket): what one_cycle_fit compiles for one shape, including
    # the graphs every run shares. A different width keeps the model's graphs apart.
    _, one_shape = _fit(MarkerClassifier(width=24), text_task, BucketCollate([120]), 1, **steps)
    torch.manual_seed(0)
    history, compiles = _fit(MarkerClassifier(), text_task, collate, 3, **steps)
    # each further bucket adds at most a training and an evaluation graph
    assert compiles[0] <= one_shape[0] + 2 * (len(collate.buckets) - 1), (compiles, one_shape, collate)
    assert compiles[0] == compiles[1] == compiles[2], compiles
    assert history.records[-1].metrics["accuracy"] == pytest.approx(text_task[2], abs=0.03)


def test_one_cycle_fit_default_step_takes_tokens_mask_target(text_task):
    collate = BucketCollate.from_lengths([len(s) for s, _ in text_task[0]], num_buckets=4, batch_size=BATCH)
    torch.manual_seed(0)
    history, compiles = _fit(MarkerClassifier(), text_task, collate, 3)
    assert compiles[0] == compiles[1] == compiles[2], compiles
    assert history.records[-1].metrics["accuracy"] == pytest.approx(text_task[2], abs=0.03)


SPMD_SCRIPT = """
import warnings; warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader
from tpu_utility import BucketCollate, one_cycle_fit
from tpu_utility.demo import MarkerClassifier, marker_sequences, masked_eval_step, masked_train_step

train, valid = marker_sequences(1024, seed=0), marker_sequences(512, seed=1)
collate = BucketCollate.from_lengths([len(s) for s, _ in train], num_buckets=4, batch_size=32)
def fit(model, collate, epochs):
    return one_cycle_fit(model, DataLoader(train, batch_size=8, collate_fn=collate),
                         valid_data=DataLoader(valid, batch_size=16, collate_fn=collate), epochs=epochs,
                         max_lr=1e-2, cores="all", train_step=masked_train_step, eval_step=masked_eval_step,
                         progress=False)

one_shape = fit(MarkerClassifier(width=24), BucketCollate([120]), 1)  # see the single-core test
print("one shape", one_shape.records[0].compiles)
torch.manual_seed(0)
history = fit(MarkerClassifier(), collate, 3)
print(history.summary)
print("buckets", len(collate.buckets))
for r in history.records:
    print("epoch", r.epoch, "compiles", r.compiles - one_shape.records[0].compiles, "accuracy", r.metrics["accuracy"])
"""


def test_spmd_on_four_devices_with_buckets(text_task):
    _, _, cpu_accuracy = text_task
    r = run_python(SPMD_SCRIPT, env={"CPU_NUM_DEVICES": "4"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "spmd on 4 CPU core(s) | batch 8 per core, 32 global" in r.stdout
    epochs = [line.split() for line in r.stdout.splitlines() if line.startswith("epoch")]
    one_shape = int(r.stdout.split("one shape ")[1].split()[0])
    buckets = int(r.stdout.split("buckets ")[1].split()[0])
    assert int(epochs[0][3]) <= one_shape + 2 * (buckets - 1), r.stdout
    assert len({e[3] for e in epochs}) == 1, f"compile count changed across epochs: {epochs}"
    assert float(epochs[-1][5]) == pytest.approx(cpu_accuracy, abs=0.03)
