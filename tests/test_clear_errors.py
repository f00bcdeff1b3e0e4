"""Cases that failed late or misleadingly now fail at once, naming the value and the way on."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from conftest import flat_digits, small_mlp
from tpu_utility import one_cycle_fit
from tpu_utility.buckets import BucketCollate

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 1, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


def test_a_monitored_figure_that_does_not_exist_is_named_as_missing():
    with pytest.raises(ValueError, match=r"monitor='val_acc' is not a figure of this run; it has "
                                         r"\['train_loss', 'valid_loss', 'accuracy'\]"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), valid_data=flat_digits(64), monitor="val_acc")
    with pytest.raises(ValueError, match=r"monitor='accuracy' is not a figure of this run; it has \['train_loss'\] "
                                         r"\(metrics are computed on valid_data, and none was given\)"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), monitor="accuracy")


@pytest.mark.parametrize("value", ["no", 1, None])
def test_restore_best_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"restore_best must be True or False, but given {value!r}"):
        fit(small_mlp(), flat_digits(64), restore_best=value)


class _Counted(Dataset):
    def __init__(self, samples):
        self.samples, self.reads = samples, 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads += 1
        return self.samples[i]


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(50, 8), nn.Linear(8, 2)

    def forward(self, tokens, mask):
        return self.out((self.embed(tokens) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


def test_a_validation_sequence_longer_than_the_largest_bucket_fails_before_training():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 17, (64,), generator=g).tolist()
    train = _Counted([(torch.randint(1, 50, (n,), generator=g), n % 2) for n in lengths])
    valid = [(torch.randint(1, 50, (n,), generator=g), n % 2) for n in [8] * 20 + [40]]
    collate = BucketCollate.from_lengths([len(s) for s, _ in train.samples], num_buckets=2)
    assert collate.buckets[-1] < 40
    loader = DataLoader(train, batch_size=8, collate_fn=collate, drop_last=True)
    args = {"loss_fn": nn.CrossEntropyLoss(), "batch_size": None}
    with pytest.raises(ValueError, match=rf"valid_data sample 20 has a sequence of length 40, longer than the largest "
                                         rf"bucket {collate.buckets[-1]} of its BucketCollate"):  # fmt: skip
        fit(_Bag(), loader, valid_data=DataLoader(valid, batch_size=8, collate_fn=collate), **args)
    assert train.reads == 0  # refused before any training sample was read
    truncating = BucketCollate(collate.buckets, overflow="truncate")  # the way on the message names
    with pytest.warns(UserWarning, match="truncating sequences longer than 16 tokens"):
        fit(_Bag(), loader, valid_data=DataLoader(valid, batch_size=8, collate_fn=truncating), **args)


def test_a_batch_of_three_parts_names_the_layout_and_the_way_on():
    x, y = flat_digits(64).tensors
    weighted = TensorDataset(x, y, torch.ones(64))  # (inputs, targets, weights): not (*inputs, targets)
    for kwargs in ({}, {"loss_fn": nn.CrossEntropyLoss()}, {"loss_fn": nn.CrossEntropyLoss(), "valid_data": weighted}):
        with pytest.raises(TypeError, match=r"a batch has 3 parts, which the default (train|eval)_step reads as "
                                            r"\(\*inputs, targets\): model\(\*batch\[:-1\]\) with 2 inputs, but "
                                            r"Sequential.forward\(input\) does not take 2\. For batches such as "
                                            r"\(inputs, targets, weights\), pass (train|eval)_step="):  # fmt: skip
            fit(small_mlp(), weighted, **kwargs)
