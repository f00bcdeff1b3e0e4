"""make_sampler and the padded validation loader: each sample counted once."""

import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tpu_utility import make_sampler, xla
from tpu_utility.data import eval_loader, padded_length, unpack_loader


def test_one_replica_needs_no_sampler():
    assert make_sampler(list(range(10))) is None


def test_several_replicas_get_their_shard(monkeypatch):
    monkeypatch.setattr(xla, "world_size", lambda: 4)
    monkeypatch.setattr(xla, "ordinal", lambda: 1)
    sampler = make_sampler(list(range(10)), shuffle=False)
    assert isinstance(sampler, DistributedSampler)
    assert (sampler.num_replicas, sampler.rank) == (4, 1)
    assert list(sampler) == [1, 5, 9]


def test_validation_on_four_replicas_counts_1001_samples_once():
    n, batch, replicas = 1001, 16, 4
    ds = TensorDataset(torch.arange(n))
    seen, padded = [], 0
    shapes = set()
    for rank in range(replicas):
        loader = eval_loader(unpack_loader(ds, batch, "ds"), batch, replicas=replicas, rank=rank)
        for (values,), index in loader:
            mask = index >= 0
            shapes.add(tuple(values.shape))
            seen += values[mask].tolist()
            padded += int((~mask).sum())
    assert sorted(seen) == list(range(n))  # every sample exactly once
    assert padded == padded_length(n, batch, replicas) - n == 23
    assert shapes == {(batch,)}  # every batch full size: one graph
