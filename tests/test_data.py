"""make_sampler and the padded validation loader: each sample counted once."""

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from tpu_utility import make_sampler, backend
from tpu_utility.data.loaders import eval_loader, padded_length, unpack_loader


def test_one_replica_needs_no_sampler():
    assert make_sampler(list(range(10))) is None


def test_several_replicas_get_their_shard(monkeypatch):
    monkeypatch.setattr(backend.current().processes, "world_size", lambda: 4)
    monkeypatch.setattr(backend.current().processes, "rank", lambda: 1)
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


@pytest.mark.filterwarnings("ignore:dropping the last")
def test_hosts_of_a_pod_slice_each_load_their_share_of_the_global_batch():
    from tpu_utility.training.topology import Topology

    hosts, devices, per_core = 4, 16, 8
    layouts = [Topology(spmd=True, hosts=hosts, host=h, devices=devices) for h in range(hosts)]
    assert {t.loader_batch(per_core) for t in layouts} == {32}  # 4 local devices x 8
    assert {t.global_batch(per_core) for t in layouts} == {128}  # the batch the mesh sees
    assert [t.loaders for t in layouts] == [(4, 0), (4, 1), (4, 2), (4, 3)]
    assert [t.master for t in layouts] == [True, False, False, False]
    spec = unpack_loader(TensorDataset(torch.arange(1001)), per_core, "ds")
    seen, shapes = [], set()
    for t in layouts:
        loaders, index = t.loaders
        for (values,), idx in eval_loader(spec, t.loader_batch(per_core), replicas=loaders, rank=index):
            shapes.add(tuple(values.shape))
            seen += values[idx >= 0].tolist()
    assert sorted(seen) == list(range(1001)) and shapes == {(32,)}  # each sample once, over all hosts
    from tpu_utility.data.loaders import train_loader

    firsts = []
    for t in layouts:
        loaders, index = t.loaders
        loader = train_loader(spec, t.loader_batch(per_core), replicas=loaders, rank=index, seed=0)
        firsts.append(set(next(iter(loader))[0].tolist()))
    assert all(not (a & b) for i, a in enumerate(firsts) for b in firsts[i + 1 :])  # disjoint shares


def test_single_and_multiprocess_layouts_and_an_uneven_mesh():
    import pytest

    from tpu_utility.training.topology import Topology

    single = Topology()
    assert (single.loaders, single.loader_batch(64), single.global_batch(64), single.cores) == ((1, 0), 64, 64, 1)
    spmd = Topology(spmd=True, devices=8)
    assert (spmd.loaders, spmd.loader_batch(16), spmd.cores) == ((1, 0), 128, 8)
    replica = Topology(replicas=8, rank=3)
    assert (replica.loaders, replica.loader_batch(16), replica.global_batch(16), replica.master) == ((8, 3), 16, 128, False)
    with pytest.raises(ValueError, match="6 devices do not split evenly over 4 hosts"):
        Topology(spmd=True, hosts=4, devices=6)


def _ids(loader):
    return sorted(int(i) for batch in loader for i in batch[0])


def test_make_samplers_distributed_sampler_is_sharded_once_not_twice():
    from torch.utils.data import DataLoader

    from tpu_utility.data.loaders import train_loader

    ds = TensorDataset(torch.arange(100))
    seen = []
    for rank in range(2):  # what make_sampler gives each process of a launch
        user = DataLoader(ds, batch_size=10, sampler=DistributedSampler(ds, num_replicas=2, rank=rank))
        spec = unpack_loader(user, None, "train_data")
        assert spec.sampler is None  # stands in for the runner's own sharded sampler
        seen += _ids(train_loader(spec, 10, replicas=2, rank=rank, seed=0))
    assert sorted(seen) == list(range(100))  # together the replicas see every sample once


def test_a_random_sampler_with_settings_of_its_own_is_kept():
    from torch.utils.data import DataLoader, RandomSampler

    ds = TensorDataset(torch.arange(100))
    more = RandomSampler(ds, replacement=True, num_samples=1000)
    assert unpack_loader(DataLoader(ds, batch_size=10, sampler=more), None, "d").sampler is more
    g = torch.Generator().manual_seed(7)
    assert unpack_loader(DataLoader(ds, batch_size=10, shuffle=True, generator=g), None, "d").sampler is not None
    assert unpack_loader(DataLoader(ds, batch_size=10, shuffle=True), None, "d").sampler is None  # plain: replaced
