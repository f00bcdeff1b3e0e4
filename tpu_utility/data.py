"""make_sampler() and the loaders one_cycle_fit builds: fixed shapes, every
validation sample counted once on any number of cores."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torch.utils.data.dataloader import default_collate

from . import xla


def _check_sized(dataset: Any, name: str = "dataset") -> int:
    if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"{name} must be a map-style Dataset with __len__ and __getitem__, but given "
            f"{type(dataset).__name__}, which has no length (an IterableDataset must shard itself)"
        )
    n = len(dataset)
    if n == 0:
        raise ValueError(f"{name} is empty (len({name}) == 0); it needs at least one sample")
    return n


def make_sampler(
    dataset: Dataset,
    shuffle: bool = True,
    *,
    seed: int = 0,
    drop_last: bool = False,
) -> DistributedSampler | None:
    """A DistributedSampler for this replica when several run, else None.

    The world size and rank come from torch_xla (or torch.distributed): inside
    ``launch`` (one process per core) each process gets its own part of the data.
    With a single replica it returns None, so ``DataLoader(..., sampler=None,
    shuffle=True)`` works as before; that includes SPMD (``use_all_cores()``),
    where one process drives every core and ``device_loader`` splits each batch
    over them instead: there the loader's ``batch_size`` is the global batch.

    Call ``sampler.set_epoch(epoch)`` at the start of each epoch, or every epoch
    sees the same order.

    A DistributedSampler pads with repeated samples so every replica gets the
    same count; on a validation set those duplicates would be counted twice. To
    count each sample once, evaluate only indices below ``len(dataset)`` (a mask)
    and sum over replicas, which ``one_cycle_fit`` does for you.

    Args:
        dataset: A map-style dataset (with ``__len__``).
        shuffle: Shuffle each epoch (False for validation).
        seed: Seed of the shuffle; the same on every replica.
        drop_last: Drop the tail instead of padding it.

    Returns:
        DistributedSampler or None.

    Raises:
        TypeError: ``dataset`` has no ``__len__``.
        ValueError: ``dataset`` is empty.

    Example:
        >>> sampler = make_sampler(train_ds)
        >>> # was: DataLoader(train_ds, batch_size=64, shuffle=True)
        >>> loader = DataLoader(train_ds, batch_size=64, sampler=sampler,
        ...                     shuffle=sampler is None, drop_last=True)
        >>> for epoch in range(epochs):
        ...     if sampler is not None:
        ...         sampler.set_epoch(epoch)
    """
    _check_sized(dataset)
    replicas = xla.world_size()
    if replicas == 1:
        return None
    return DistributedSampler(
        dataset, num_replicas=replicas, rank=xla.ordinal(), shuffle=shuffle, seed=seed, drop_last=drop_last
    )


def padded_length(num_samples: int, batch_size: int, replicas: int) -> int:
    """Smallest length >= num_samples that fills every replica's batches exactly."""
    chunk = batch_size * replicas
    return -(-num_samples // chunk) * chunk


class MaskedPadding(Dataset):
    """Pads a dataset to ``length`` by repeating samples, with a flag per item.

    Item ``i`` is ``(dataset[i % n], i < n)``: padded items keep batch shapes fixed
    and their flag (False) keeps them out of every sum.
    """

    def __init__(self, dataset: Dataset, length: int) -> None:
        self.dataset, self.length, self.n = dataset, length, len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, torch.Tensor]:
        return self.dataset[i % self.n], torch.tensor(i < self.n)


class MaskCollate:
    """Collates ``(sample, flag)`` items into ``(batch, mask)``; picklable for workers."""

    def __init__(self, collate_fn: Callable[[list], Any] | None) -> None:
        self.collate_fn = collate_fn or default_collate

    def __call__(self, items: list[tuple[Any, torch.Tensor]]) -> tuple[Any, torch.Tensor]:
        return self.collate_fn([s for s, _ in items]), torch.stack([f for _, f in items])


def unpack_loader(data: Any, batch_size: int | None, name: str) -> tuple[Dataset, int, Callable | None, int | None]:
    """Dataset, batch size, collate_fn and num_workers from a Dataset or DataLoader.

    A DataLoader's own batch size is used; a different explicit ``batch_size`` is
    an error rather than a silent choice between the two.
    """
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise ValueError(f"{name} is a DataLoader with batch_size=None; give it a fixed batch_size")
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from {name}.batch_size={data.batch_size}; "
                f"give one of them"
            )
        dataset = data.dataset
        _check_sized(dataset, f"{name}.dataset")
        return dataset, data.batch_size, data.collate_fn, data.num_workers
    _check_sized(data, name)
    size = 64 if batch_size is None else batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive int, but given {size!r}")
    return data, size, None, None


def train_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    replicas: int,
    rank: int,
    seed: int,
    collate_fn: Callable | None,
    num_workers: int,
) -> DataLoader:
    """Shuffled (seed + epoch, via set_epoch), drop_last so every batch has one shape."""
    n = len(dataset)
    if -(-n // replicas) < batch_size:
        raise ValueError(
            f"the training set has {n} samples, fewer than one batch of {batch_size} per core "
            f"on {replicas} core(s); lower batch_size"
        )
    tail = -(-n // replicas) % batch_size
    if tail:
        warnings.warn(
            f"dropping the last {tail} sample(s) per core each epoch (a short batch would change "
            f"the graph's shapes and recompile); they are in other epochs' batches, since the "
            f"order is reshuffled every epoch",
            stacklevel=4,
        )
    sampler = DistributedSampler(dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        drop_last=True,
        collate_fn=collate_fn,
        num_workers=num_workers,
        # workers keep their own copy of the dataset: one with set_epoch needs fresh ones each epoch
        persistent_workers=num_workers > 0 and not hasattr(dataset, "set_epoch"),
    )


def eval_loader(
    dataset: Dataset,
    batch_size: int,
    *,
    replicas: int,
    rank: int,
    collate_fn: Callable | None,
    num_workers: int,
) -> DataLoader:
    """Every batch full size; padded items carry a False mask so each sample counts once."""
    padded = MaskedPadding(dataset, padded_length(len(dataset), batch_size, replicas))
    sampler = DistributedSampler(padded, num_replicas=replicas, rank=rank, shuffle=False)
    return DataLoader(
        padded,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=MaskCollate(collate_fn),
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
    )
