"""BucketCollate: variable-length batches padded to a few bucket lengths, so XLA compiles
at most once per bucket; BucketBatchSampler: batches of similar lengths, so they pad
little; the math (choose_buckets, padding_waste, group_batches) with plain numbers."""

import bisect
import textwrap
import pickle

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import run_python
from tpu_utility import (
    BucketBatchSampler, BucketCollate, choose_buckets, get_device, group_batches, masked_loader, one_cycle_fit,
    padding_waste, step_optimizer, backend,
)  # fmt: skip
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
    assert collate([{"input_ids": [1]}])["input_ids"].tolist() == [[1, 0, 0, 0]]  # no label: a dict batch (keys="auto")
    with pytest.raises(KeyError, match=r"lacks \['label'\]"):
        BucketCollate([4], keys=("input_ids", "label"))([{"input_ids": [1]}])


def test_dict_batches_pad_every_sequence_with_its_own_value():
    collate = BucketCollate([4, 8], pad_value=9, keys=None)  # 9: the tokenizer's pad_token_id
    batch = collate([{"input_ids": [1, 2, 3], "attention_mask": [1, 1, 1], "labels": [5, 6, 7], "id": 3},
                     {"input_ids": [4], "attention_mask": [1], "labels": [8], "id": 4}])  # fmt: skip
    assert list(batch) == ["attention_mask", "id", "input_ids", "labels"]
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9], [4, 9, 9, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[5, 6, 7, -100], [8, -100, -100, -100]]  # token labels: ignored padding
    assert batch["id"].tolist() == [3, 4]  # scalars collated
    assert collate.real_tokens == 4 and collate.padded_tokens == 4 and collate.bucket_batches == {4: 1, 8: 0}
    # no attention_mask in the samples: one is added, since padding the model sees would change its outputs
    batch = collate([{"input_ids": [1, 2, 3, 4, 5], "labels": 0}])
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0]] and batch["labels"].tolist() == [0]
    collate.check_fits([{"input_ids": [1] * 8, "labels": 0}], "valid_data")
    with pytest.raises(ValueError, match="valid_data sample 0 has a sequence of length 9"):
        collate.check_fits([{"input_ids": [1] * 9, "labels": 0}], "valid_data")
    with pytest.raises(ValueError, match=r"sample 0's sequences differ in length \{'input_ids': 2, 'attention_mask': 1\}"):
        collate([{"input_ids": [1, 2], "attention_mask": [1], "labels": 0}])
    with pytest.raises(ValueError, match=r"sample 1 of the batch has the keys \['input_ids'\], sample 0 \['input_ids', 'labels'\]"):
        collate([{"input_ids": [1], "labels": 0}, {"input_ids": [2]}])
    with pytest.raises(TypeError, match=r"BucketCollate\(keys=None\) expects dict samples, but sample 0 .* is tuple"):
        collate([([1, 2], 0)])


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


def test_collate_fills_exactly_what_it_is_given():
    big = 2**53 + 1  # not a double: a fill through float would round it
    tokens, mask, _ = BucketCollate([4], pad_value=big)([(torch.tensor([5, 6]), 0), (torch.tensor([], dtype=torch.long), 1)])
    assert tokens.tolist() == [[5, 6, big, big], [big] * 4] and mask.sum(1).tolist() == [2, 0]


def test_from_lengths_reports_waste_and_pickles():
    lengths = [len(s) for s, _ in marker_sequences(256)]
    collate = BucketCollate.from_lengths(lengths, num_buckets=4, multiple_of=8)
    assert len(collate.buckets) <= 4 and collate.buckets[-1] >= max(lengths)
    assert all(b % 8 == 0 for b in collate.buckets)
    assert collate.data_waste == pytest.approx(padding_waste(lengths, collate.buckets))
    copy = pickle.loads(pickle.dumps(collate))  # DataLoader workers and spawn pickle it
    assert copy.buckets == collate.buckets


# ------------------------------------------- grouping batches by length
def _bucket_of(lengths, buckets):
    return [min(bisect.bisect_left(buckets, n), len(buckets) - 1) for n in lengths]


def test_group_batches_uses_every_sample_once_and_pads_far_less_than_shuffled_batches():
    lengths = [len(s) for s, _ in marker_sequences(1000)]
    buckets = choose_buckets(lengths, num_buckets=4)
    g = torch.Generator().manual_seed(0)
    batches = group_batches(lengths, buckets, 32, drop_last=False, generator=g)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert [len(b) for b in batches].count(32) == 1000 // 32 and len(batches) == 1000 // 32 + 1
    # only a bucket's remainder, moved up to the next bucket, mixes buckets
    of = _bucket_of(lengths, buckets)
    mixed = [b for b in batches if len({of[i] for i in b}) > 1]
    assert len(mixed) <= len(buckets) - 1, mixed

    def waste(batches):
        padded = sum(len(b) * buckets[max(of[i] for i in b)] for b in batches)
        return 1 - sum(lengths[i] for b in batches for i in b) / padded

    shuffled = torch.randperm(1000, generator=g).tolist()
    random_waste = waste([shuffled[k : k + 32] for k in range(0, 1000, 32)])
    assert waste(batches) < padding_waste(lengths, buckets) + 0.02 < random_waste / 2, (waste(batches), random_waste)


def test_group_batches_drops_only_the_short_batch_and_keeps_index_order_without_a_generator():
    lengths = [3, 9, 4, 10, 2, 11, 5]
    assert group_batches(lengths, [4, 16], 2) == [[0, 2], [4, 1], [3, 5]]  # 6 (length 5) left over
    assert group_batches(lengths, [4, 16], 2, drop_last=False)[-1] == [6]
    assert group_batches([40, 50], [16], 1) == [[0], [1]]  # longer than every bucket: the largest
    # without carry every batch is of one bucket; the remainders sit out
    assert group_batches(lengths, [4, 16], 2, carry=False) == [[0, 2], [1, 3], [5, 6]]  # 4 sits out


def test_group_batches_names_bad_arguments():
    with pytest.raises(ValueError, match="buckets is empty"):
        group_batches([3], [], 1)
    with pytest.raises(ValueError, match=r"strictly increasing, but given \[8, 4\]"):
        group_batches([3], [8, 4], 1)
    with pytest.raises(ValueError, match="lengths must be >= 0, but given -1"):
        group_batches([3, -1], [8], 1)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, but given 0"):
        group_batches([3], [8], 1, generator=0)
    with pytest.raises(ValueError, match="drop_last=False needs carry=True"):
        group_batches([3], [8], 1, carry=False, drop_last=False)


def test_bucket_batch_sampler_reshuffles_each_pass_and_set_epoch_replays_one():
    lengths = [len(s) for s, _ in marker_sequences(300)]
    sampler = BucketBatchSampler(lengths, [16, 32, 64, 120], batch_size=16, seed=3)
    first, second = list(sampler), list(sampler)
    assert len(first) == len(sampler) == 300 // 16 and all(len(b) == 16 for b in first)
    assert first != second and sorted(map(sorted, first)) != sorted(map(sorted, second))
    sampler.set_epoch(0)
    assert list(sampler) == first
    unshuffled = BucketBatchSampler(lengths, [16, 32, 64, 120], batch_size=16, shuffle=False)
    assert list(unshuffled) == list(unshuffled) == group_batches(lengths, [16, 32, 64, 120], 16)


def _check_shares(shares, lengths, buckets, size):
    """Equal numbers of full batches, disjoint, and every replica padding to the same bucket at each step."""
    of = _bucket_of(lengths, buckets)
    assert len({len(s) for s in shares}) == 1 and all(len(b) == size for s in shares for b in s)
    seen = [i for s in shares for b in s for i in b]
    assert len(seen) == len(set(seen))
    for step in zip(*shares):
        assert len({max(of[i] for i in b) for b in step}) == 1, step


def test_bucket_batch_sampler_gives_each_replica_its_own_batches_padded_alike():
    lengths = [len(s) for s, _ in marker_sequences(300)]
    buckets = [16, 32, 64, 120]
    whole = BucketBatchSampler(lengths, buckets, batch_size=8, num_replicas=1, rank=0)
    shards = [list(whole.reshard(8, 4, rank)) for rank in range(4)]
    sizes = [len(g) for g in bisect_groups(lengths, buckets)]
    assert len(shards[0]) == sum(n // 32 for n in sizes) > 0
    _check_shares(shards, lengths, buckets, 8)
    assert whole.reshard(8, 4, 0).left_out == 300 - 32 * len(shards[0])
    assert list(whole.reshard(8, 4, 2)) == shards[2]  # every replica draws the same batches


def bisect_groups(lengths, buckets):
    of = _bucket_of(lengths, buckets)
    return [[i for i, k in enumerate(of) if k == b] for b in range(len(buckets))]


def test_bucket_batch_sampler_made_before_launch_shards_inside_it(monkeypatch):
    lengths = [len(s) for s, _ in marker_sequences(300)]
    buckets = [16, 32, 64, 120]
    sampler = BucketBatchSampler(lengths, buckets, batch_size=8, seed=1)  # in the notebook: 1 replica
    assert len(sampler) == 300 // 8
    shares = []
    for rank in range(2):  # what each of 2 launched processes sees
        monkeypatch.setattr(backend.current().processes, "world_size", lambda: 2)
        monkeypatch.setattr(backend.current().processes, "rank", lambda rank=rank: rank)
        sampler.set_epoch(0)
        shares.append(list(sampler))
        assert list(sampler) == shares[-1]  # with several replicas only set_epoch moves the order on
    _check_shares(shares, lengths, buckets, 8)
    assert shares == [list(sampler.reshard(8, 2, rank)) for rank in range(2)]
    with pytest.raises(ValueError, match="drop_last=False needs one replica, but 2 share the data"):
        BucketBatchSampler(lengths, buckets, batch_size=8, drop_last=False)


def test_bucket_batch_sampler_names_bad_arguments():
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, but given 0"):
        BucketBatchSampler([3, 4], [8], batch_size=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\) for num_replicas=2, but given 2"):
        BucketBatchSampler([3, 4], [8], batch_size=1, num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="3 samples make no full batch of 4; lower batch_size"):
        BucketBatchSampler([3, 4, 5], [8], batch_size=4)
    with pytest.raises(ValueError, match=r"of 2 x 2 replicas within one bucket \(samples per bucket \[3, 3\]\)"):
        BucketBatchSampler([3, 4, 5, 9, 9, 9], [8, 16], batch_size=2, num_replicas=2, rank=0)
    with pytest.raises(TypeError, match="shuffle must be True or False, but given 'yes'"):
        BucketBatchSampler([3, 4], [8], batch_size=1, shuffle="yes")
    with pytest.raises(ValueError, match="strictly increasing"):
        BucketBatchSampler([3, 4], [8, 4], batch_size=1)


# --------------------------------------------------- the ported text loop
def _train_hand_loop(device, collate, train, epochs=3, sampler=None):
    """A CUDA text classifier's loop; returns (model, compile count after each epoch)."""
    torch.manual_seed(0)
    model = MarkerClassifier().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    if sampler is None:
        loader = DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=collate, drop_last=True)
    else:
        loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate)
    compiles, before = [], backend.compile_count()
    for _ in range(epochs):
        for tokens, mask, y in loader:
            tokens, mask, y = tokens.to(device), mask.to(device), y.to(device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(tokens, mask), y).backward()
            step_optimizer(optimizer)  # was: optimizer.step()
        compiles.append(backend.compile_count() - before)
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


def test_grouped_batches_compile_once_per_bucket_pad_less_and_match_the_cpu_run(text_task):
    train, valid, cpu_accuracy = text_task
    # The port: 4 edited lines (the device line, the sampler, the DataLoader line, the step line).
    lengths = [len(s) for s, _ in train]
    collate = BucketCollate.from_lengths(lengths, num_buckets=4)
    shuffled = BucketCollate(collate.buckets)
    _train_hand_loop(get_device(), shuffled, train, epochs=1)
    sampler = BucketBatchSampler(lengths, collate.buckets, batch_size=BATCH)
    model, compiles = _train_hand_loop(get_device(), collate, train, sampler=sampler)
    assert compiles[0] <= len(collate.buckets) + 1 and compiles[0] == compiles[2], (compiles, collate.summary())
    assert collate.waste < shuffled.waste / 2, (collate.summary(), shuffled.summary())
    assert _accuracy(model, get_device(), valid, collate) == pytest.approx(cpu_accuracy, abs=0.03)


def test_masked_loader_over_a_bucket_batch_sampler_counts_every_sample_once(text_task):
    valid = text_task[1]
    lengths = [len(s) for s, _ in valid]
    collate = BucketCollate.from_lengths(lengths)
    loader = DataLoader(valid, batch_sampler=BucketBatchSampler(lengths, collate.buckets, 64), collate_fn=collate)
    seen, labels = 0, 0
    with pytest.warns(UserWarning, match=r"drop_last=True is not used \(BucketBatchSampler\)"):
        masked = masked_loader(loader)
    for (tokens, mask, y), real in masked:
        assert tokens.shape[0] == 64
        seen, labels = seen + int(real.sum()), labels + int(y[real].sum())
    assert (seen, labels) == (len(valid), sum(y for _, y in valid))  # the sampler's dropped batch too


def _fit(model, task, collate, epochs, sampler=None, valid_collate=None, **kwargs):
    """one_cycle_fit over bucketed loaders; the history and the compile count after each epoch."""
    train, valid, _ = task
    before = backend.compile_count()
    if sampler is None:
        train_loader = DataLoader(train, batch_size=BATCH, collate_fn=collate)
    else:
        train_loader = DataLoader(train, batch_sampler=sampler, collate_fn=collate)
    history = one_cycle_fit(
        model, train_loader,
        valid_data=DataLoader(valid, batch_size=64, collate_fn=valid_collate or collate), epochs=epochs, max_lr=1e-2,
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
    history, compiles = _fit(MarkerClassifier(width=20), text_task, collate, 3)  # a width of its own: no graph
    # another test compiled already (torch_xla reuses those in the process, and History lists only what compiled)
    assert compiles[0] == compiles[1] == compiles[2], compiles
    assert history.records[-1].metrics["accuracy"] == pytest.approx(text_task[2], abs=0.03)
    # issue 59: each bucket's train graph in History, timed and sized, the later ones caused by their new shapes
    train = [g for g in history.graphs if g.graph == "train step"]
    shapes = {str(g.shapes) for g in train}
    assert len(shapes) >= 2 and {g.epoch for g in history.graphs} <= {0, 1}, history.graphs  # none after epoch 1
    assert all(g.seconds > 0 and g.nodes > 0 for g in train), train
    assert sum(g.cause.startswith("new input shapes") for g in train) == len(shapes) - 1, train


def test_one_cycle_fit_keeps_a_bucket_batch_sampler(text_task):
    lengths = [len(s) for s, _ in text_task[0]]
    collate = BucketCollate.from_lengths(lengths, num_buckets=4)
    sampler = BucketBatchSampler(lengths, collate.buckets, batch_size=BATCH)
    torch.manual_seed(0)
    history, compiles = _fit(MarkerClassifier(), text_task, collate, 3, sampler=sampler,
                             valid_collate=BucketCollate(collate.buckets))  # fmt: skip
    assert compiles[0] == compiles[1] == compiles[2], compiles
    assert history.records[-1].metrics["accuracy"] == pytest.approx(text_task[2], abs=0.03)
    # the training batches came from the sampler: full, grouped by length, so padded little
    assert sum(collate.bucket_batches.values()) >= 3 * len(sampler), collate.summary()
    assert collate.waste < collate.data_waste + 0.05, collate.summary()


def test_one_cycle_fit_names_a_sampler_that_does_not_fit_the_run(text_task):
    train = text_task[0]
    lengths = [len(s) for s, _ in train]

    def fit(sampler, collate=BucketCollate([120]), **kwargs):
        one_cycle_fit(MarkerClassifier(), DataLoader(train, batch_sampler=sampler, collate_fn=collate),
                      epochs=1, max_lr=1e-2, progress=False, **kwargs)  # fmt: skip

    with pytest.raises(ValueError, match=r"train_data.batch_sampler has 1019 lengths but train_data.dataset has 1024"):
        fit(BucketBatchSampler(lengths[:-5], [120], batch_size=BATCH))
    with pytest.raises(ValueError, match="batch_size=16 differs from train_data.batch_sampler.batch_size=32"):
        fit(BucketBatchSampler(lengths, [120], batch_size=BATCH), batch_size=16)
    with pytest.raises(ValueError, match="seed=0 differs from train_data.batch_sampler.seed=7"):
        fit(BucketBatchSampler(lengths, [120], batch_size=BATCH, seed=7))
    with pytest.raises(ValueError, match="train_data.batch_sampler has num_replicas=2, but the data is shared out"):
        fit(BucketBatchSampler(lengths, [120], batch_size=BATCH, num_replicas=2, rank=0))
    longest = max(lengths)
    with pytest.raises(ValueError, match=f"a sequence of length {longest} .*longer than its collate's largest bucket 64"):
        fit(BucketBatchSampler(lengths, [64], batch_size=BATCH), BucketCollate([64]))


def test_resume_refuses_a_sampler_that_draws_other_batches(text_task, tmp_path):
    train = text_task[0]
    lengths = [len(s) for s, _ in train]

    def fit(buckets, epochs, **kwargs):
        sampler = BucketBatchSampler(lengths, buckets, batch_size=BATCH)
        return one_cycle_fit(MarkerClassifier(), DataLoader(train, batch_sampler=sampler, collate_fn=BucketCollate([120])),
                             epochs=epochs, max_lr=1e-2, progress=False, checkpoint_dir=str(tmp_path), **kwargs)  # fmt: skip

    fit([32, 120], 1)
    with pytest.raises(ValueError, match=r"written by a different run(.|\n)*batch_sampler: checkpoint .*buckets \[32, 120\]"):
        fit([64, 120], 1, resume=True)


SPMD_SCRIPT = """
import warnings; warnings.simplefilter("ignore")
import torch
from torch.utils.data import DataLoader
from tpu_utility import BucketBatchSampler, BucketCollate, one_cycle_fit
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

# batches grouped by length: the sampler's batch_size is per core, as the DataLoader's is
lengths = [len(s) for s, _ in train]
grouped = BucketCollate.from_lengths(lengths, num_buckets=4)
sampler = BucketBatchSampler(lengths, grouped.buckets, batch_size=8)
torch.manual_seed(0)
start = history.records[-1].compiles
history = one_cycle_fit(MarkerClassifier(), DataLoader(train, batch_sampler=sampler, collate_fn=grouped),
                        valid_data=DataLoader(valid, batch_size=16, collate_fn=BucketCollate(grouped.buckets)),
                        epochs=3, max_lr=1e-2, cores="all", progress=False)
print("grouped-run steps", history.steps_per_epoch, "waste", grouped.waste, grouped.data_waste, "buckets", len(grouped.buckets))
for r in history.records:
    print("grouped-epoch", r.epoch, "compiles", r.compiles - start, "accuracy", r.metrics["accuracy"])
"""


@pytest.mark.multidevice
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
    run = r.stdout.split("grouped-run ")[1].split()
    grouped = [line.split() for line in r.stdout.splitlines() if line.startswith("grouped-epoch ")]
    assert run[1] == str(1024 // 32), r.stdout  # global batches of 4 x 8, grouped
    assert float(run[3]) < float(run[4]) + 0.05, r.stdout  # padded about as little as it can
    assert int(grouped[0][3]) <= one_shape + 2 * (int(run[6]) - 1), r.stdout
    assert len({g[3] for g in grouped}) == 1, f"compile count changed across epochs: {grouped}"
    assert float(grouped[-1][5]) == pytest.approx(cpu_accuracy, abs=0.03)


# ------------------------------------------------------------ advice that runs (issue 62, item 4)
def _hf_split(n=24):
    """A tokenized Hugging Face causal-LM split before padding: its text column still in it."""
    import datasets

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 40, (int(k),), generator=g).tolist() for k in torch.randint(4, 15, (n,), generator=g)]
    return datasets.Dataset.from_dict({"text": [" ".join(map(str, t)) for t in ids], "input_ids": ids,
                                       "attention_mask": [[1] * len(t) for t in ids], "labels": ids})  # fmt: skip


def test_the_variable_length_refusals_snippet_runs_on_the_split_that_raised_it():
    from llm_models import causal_lm

    train_data, model = _hf_split(), causal_lm("llama")
    with pytest.raises(ValueError, match="cannot be stacked") as refused:
        one_cycle_fit(model, train_data, epochs=1, max_lr=1e-3, batch_size=8, progress=False)
    snippet = str(refused.value).split(":\n", 1)[1]
    assert "BucketCollate(" in snippet and snippet.rstrip().endswith("...)"), snippet
    run = {"train_data": train_data, "model": model, "DataLoader": DataLoader, "BucketCollate": BucketCollate,
           "one_cycle_fit": one_cycle_fit}  # fmt: skip
    exec(textwrap.dedent(snippet).rstrip()[:-4] + "epochs=1, max_lr=1e-3, progress=False, schedule='constant')", run)
    # the docs' form (keys=None, pad_value=) takes the same split: its text column is left out, as one_cycle_fit does
    batch = BucketCollate([16], pad_value=0, keys=None)([train_data[0], train_data[1]])
    assert sorted(batch) == ["attention_mask", "input_ids", "labels"] and batch["input_ids"].shape == (2, 16)


def test_a_hand_loops_sampler_with_another_count_of_lengths_than_samples_is_refused():
    data = [(torch.arange(1, 5 + i % 7), 0) for i in range(40)]
    lengths, collate = [len(s) for s, _ in data], BucketCollate([8, 16])
    for given, what in ((lengths[:30], r"30 lengths but loader.dataset has 40 samples \(samples 30 to 39 would never "
                                       r"be drawn\)"), (lengths + [5] * 10, r"50 lengths .* \(indices 40 to 49 are not")):  # fmt: skip
        loader = DataLoader(data, batch_sampler=BucketBatchSampler(given, collate.buckets, batch_size=4),
                            collate_fn=collate)  # fmt: skip
        with pytest.raises(ValueError, match=rf"loader.batch_sampler has {what}"):
            list(loader)  # a plain torch loop: no tpu_utility call between the loader and its batches
    loader = DataLoader(data, batch_sampler=BucketBatchSampler(lengths, collate.buckets, batch_size=4), collate_fn=collate)
    assert sorted(i for b in loader.batch_sampler for i in b) == list(range(40)) and len(list(loader)) == 10
