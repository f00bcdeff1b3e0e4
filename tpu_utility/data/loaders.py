"""make_sampler() and the loaders the runner builds: fixed shapes, every
validation sample counted once on any number of cores, the user's own sampler
and DataLoader settings kept."""

from __future__ import annotations

import collections.abc

import os
import sys
import threading
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Sampler, SequentialSampler
from torch.utils.data.dataloader import default_collate

from .. import backend
from .buckets import BucketBatchSampler, BucketCollate


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
    processes = backend.current().processes
    replicas = processes.world_size()
    if replicas == 1:
        return None
    return DistributedSampler(
        dataset, num_replicas=replicas, rank=processes.rank(), shuffle=shuffle, seed=seed, drop_last=drop_last
    )


# the key of a dict batch that holds the targets (a tokenized Hugging Face dataset's)
LABELS = "labels"


def padded_length(num_samples: int, batch_size: int, replicas: int) -> int:
    """Smallest length >= num_samples that fills every replica's batches exactly."""
    chunk = batch_size * replicas
    return -(-num_samples // chunk) * chunk


class MaskedPadding(Dataset):
    """Pads a dataset to ``length`` by repeating samples, with each item's index.

    Item ``i`` is ``(dataset[i % n], i)`` for ``i < n`` and ``(dataset[i % n], -1)``
    for padding: padded items keep batch shapes fixed, a negative index keeps them
    out of every sum, and real indices put predictions back in dataset order.
    """

    def __init__(self, dataset: Dataset, length: int) -> None:
        self.dataset, self.length, self.n = dataset, length, len(dataset)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[Any, int]:
        return self.dataset[i % self.n], (i if i < self.n else -1)


def _layout(sample: Any) -> str:
    """A sample's structure with its tensors' shapes: ``(Tensor(3, 8), int)``, for comparing and naming."""
    def leaf(x: Any) -> str:
        if isinstance(x, (torch.Tensor, np.ndarray)):
            return f"{type(x).__name__}{tuple(x.shape)}"
        return f"list[{len(x)}]" if isinstance(x, list) else type(x).__name__
    leaves, spec = pytree.tree_flatten(sample, is_leaf=lambda x: isinstance(x, list) and not (
        x and isinstance(x[0], (dict, tuple, list))))  # fmt: skip
    return repr(pytree.tree_unflatten([_Text(leaf(x)) for x in leaves], spec))


class _Text(str):
    def __repr__(self) -> str:
        return str(self)


def collate_naming_sample(collate_fn: Callable[[list], Any], samples: list, indices: Sequence[int], name: str) -> Any:
    """``collate_fn(samples)``; if it fails on a sample laid out otherwise than the batch's first (another
    structure, or another shape), a ValueError that names that sample's dataset index and both layouts."""
    if isinstance(collate_fn, BucketCollate):  # lengths differ by design; it names what it cannot pad itself
        return collate_fn(samples)
    try:
        return collate_fn(samples)
    except Exception as error:
        first = _layout(samples[0])
        odd = next((k for k, sample in enumerate(samples) if _layout(sample) != first), None)
        if odd is None:
            raise
        raise ValueError(
            f"{name}: sample {indices[odd]} is {_layout(samples[odd])}, but sample {indices[0]} of the same batch "
            f"is {first}, so the batch cannot be collated ({type(error).__name__}: {error}). Every sample needs "
            f"the same parts and shapes (pad variable-length sequences with BucketCollate)"
        ) from error


class MaskCollate:
    """Collates ``(sample, index)`` items into ``(batch, indices)``; picklable for workers.

    A sample laid out otherwise than the batch's first is named by its index (``collate_naming_sample``).
    """

    def __init__(self, collate_fn: Callable[[list], Any] | None, name: str = "data") -> None:
        self.collate_fn, self.name = collate_fn or default_collate, name

    def __call__(self, items: list[tuple[Any, int]]) -> tuple[Any, torch.Tensor]:
        indices = [i for _, i in items]
        return collate_naming_sample(self.collate_fn, [s for s, _ in items], indices, self.name), torch.tensor(indices)


class _Fetched(list):
    """One batch's samples as a loader fetched them, with their dataset ``indices``."""

    indices: Sequence[int] = ()


class IndexedFetch(Dataset):
    """A training set as its loader fetches it: each batch's samples carry their indices, so that a
    collate failure names the sample (``NamingCollate``). Everything else is the dataset's own."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[i]

    def __getitems__(self, indices: list[int]) -> _Fetched:
        own = getattr(self.dataset, "__getitems__", None)  # a Hugging Face dataset fetches a batch at once
        fetched = _Fetched(own(indices) if own is not None else [self.dataset[i] for i in indices])
        fetched.indices = list(indices)
        return fetched

    def __getattr__(self, name: str) -> Any:  # set_epoch, a CachedDataset's own attributes
        if name.startswith("__") or name == "dataset":  # unpickling in a worker looks these up first
            raise AttributeError(name)
        return getattr(self.dataset, name)


class NamingCollate:
    """A training loader's collate, naming the dataset index of a sample laid out otherwise than its batch's first."""

    def __init__(self, collate_fn: Callable[[list], Any] | None, name: str) -> None:
        self.collate_fn, self.name = collate_fn or default_collate, name

    def __call__(self, samples: list) -> Any:
        indices = getattr(samples, "indices", None) or range(len(samples))
        return collate_naming_sample(self.collate_fn, samples, indices, self.name)


# DataLoader settings we pass on unchanged (the sampler, batch size, collate_fn and
# num_workers are handled explicitly).
_KEPT_SETTINGS = ("pin_memory", "worker_init_fn", "generator", "prefetch_factor", "timeout",
                  "multiprocessing_context", "persistent_workers", "in_order")  # fmt: skip


@dataclass
class LoaderSpec:
    """What a Dataset or DataLoader given by the user asks for, kept whole.

    ``sampler`` is the user's own sampler (None for a plain shuffled or
    sequential one, which the runner replaces by a sharded one); ``settings``
    are the other DataLoader arguments the user set.
    """

    dataset: Dataset
    batch_size: int
    collate_fn: Callable | None = None
    num_workers: int | None = None
    sampler: Sampler | None = None
    shuffle: bool = True
    settings: dict[str, Any] = field(default_factory=dict)
    batch_sampler: BucketBatchSampler | None = None
    name: str = "data"  # the argument it came from, for errors: "train_data", "valid_data"

    def __len__(self) -> int:
        return len(self.sampler) if self.sampler is not None else len(self.dataset)


def _loader_settings(loader: DataLoader) -> dict[str, Any]:
    defaults = {"pin_memory": False, "worker_init_fn": None, "generator": None, "timeout": 0,
                "multiprocessing_context": None, "persistent_workers": False, "in_order": True,
                "prefetch_factor": None if loader.num_workers == 0 else 2}  # fmt: skip
    return {
        name: getattr(loader, name)
        for name in _KEPT_SETTINGS
        if hasattr(loader, name) and getattr(loader, name) != defaults.get(name)
    }


def _only_orders(sampler: Sampler, dataset: Dataset) -> bool:
    """True for a sampler that only orders the whole dataset (or shards it, as make_sampler's
    DistributedSampler does): the runner's own sharded sampler stands in for it. Anything
    else (a subset, weights, replacement, its own generator) is the user's and is kept."""
    if isinstance(sampler, SequentialSampler):
        return sampler.data_source is dataset
    if isinstance(sampler, RandomSampler):
        plain = not sampler.replacement and sampler._num_samples is None and sampler.generator is None
        return plain and sampler.data_source is dataset
    if isinstance(sampler, DistributedSampler):  # sharding it again would split each shard anew
        return sampler.dataset is dataset
    return False


_READ_AGAIN = "a Dataset (a list of samples, torch.utils.data.TensorDataset) or the DataLoader itself, not iter(loader)"


def refuse_one_pass(data: Any, name: str, instead: str = _READ_AGAIN) -> None:
    """A generator or iterator (``iter(loader)``) can be read once: epoch 2 would get no batches.

    Raises:
        TypeError: naming what ``data`` is and ``instead``, what to give.
    """
    if isinstance(data, (Dataset, DataLoader)) or not isinstance(data, collections.abc.Iterator):
        return
    what = "a generator" if isinstance(data, types.GeneratorType) else f"an iterator ({type(data).__name__})"
    raise TypeError(
        f"{name} is {what}, which can be read only once: the second epoch (and every evaluation after the "
        f"first) would get no batches. Give something that can be read again: {instead}"
    )


def unpack_loader(data: Any, batch_size: int | None, name: str) -> LoaderSpec:
    """A LoaderSpec from a Dataset or DataLoader.

    A DataLoader's own batch size is used; a different explicit ``batch_size`` is
    an error rather than a silent choice between the two. Its sampler (unless
    the default sequential or random one) and its settings are kept.
    """
    if isinstance(data, tuple) and len(data) == 2 and all(isinstance(t, torch.Tensor) for t in data):
        raise TypeError(
            f"{name} is a tuple of tensors (x, y); give a Dataset, for example "
            f"torch.utils.data.TensorDataset(x, y)"
        )
    refuse_one_pass(data, name)
    spec = _spec_of(data, batch_size, name)
    spec.name = name
    return spec


def _number_list(value: Any) -> bool:
    """A (nested) list of Python numbers: what a tokenized ``datasets`` split gives without ``set_format``."""
    while isinstance(value, list) and value:
        value = value[0]
    return isinstance(value, (bool, int, float)) and not isinstance(value, list)


class TensorFields(Dataset):
    """A dataset whose dict samples hold lists of numbers, each list given as a tensor.

    A tokenized Hugging Face ``datasets`` split yields ``{"input_ids": [101, 2023, ...]}``
    until ``set_format("torch")``; collated by default, each list becomes a list of
    per-position tensors, and the model fails deep inside. These fields become tensors
    as ``set_format("torch")`` makes them (int64 for ints, float32 for floats); other
    fields are left as they are. Everything else is the dataset's own.
    """

    def __init__(self, dataset: Any, fields: Sequence[str]) -> None:
        self.dataset, self.fields = dataset, tuple(fields)

    def __len__(self) -> int:
        return len(self.dataset)

    def _tensors(self, sample: Any) -> Any:
        if not isinstance(sample, Mapping):
            return sample
        return {k: torch.tensor(v) if k in self.fields and isinstance(v, list) else v for k, v in sample.items()}

    def __getitem__(self, i: int) -> Any:
        return self._tensors(self.dataset[i])

    def __getitems__(self, indices: list[int]) -> list:
        own = getattr(self.dataset, "__getitems__", None)  # a Hugging Face dataset fetches a batch at once
        return [self._tensors(s) for s in (own(indices) if own is not None else [self.dataset[i] for i in indices])]

    def __getattr__(self, name: str) -> Any:  # set_epoch, column_names: the dataset's own
        if name.startswith("__") or name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def with_tensor_fields(dataset: Any) -> Any:
    """``dataset`` as ``TensorFields`` when its first sample is a dict holding lists of numbers, else itself."""
    first = dataset[0]
    fields = [k for k, v in first.items() if _number_list(v)] if isinstance(first, Mapping) else []
    return TensorFields(dataset, fields) if fields else dataset


def check_padding_collate(dataset: Any, collate_fn: Callable, batch_size: int, name: str, batches: int = 4) -> None:
    """Warns when ``collate_fn`` pads each batch to its own longest sample: on XLA each new length compiles again.

    Hugging Face's ``DataCollatorWithPadding`` and ``DataCollatorForLanguageModeling`` do
    this without ``pad_to_multiple_of``; the recompiles come in every epoch until each
    length was seen once, silently. Seen here from the first ``batches`` batches in
    dataset order (only when the samples' sequence lengths differ at all), before training.
    """
    if collate_fn is default_collate or isinstance(collate_fn, BucketCollate) or not backend.current().lazy:
        return
    n = min(len(dataset), batch_size * batches)
    first = _field_shapes(dataset[0])
    if n < 2 * batch_size or not any(len(shape) == 1 for shape in first.values()):  # no sequences: nothing to pad
        return
    if all(_field_shapes(dataset[i]) == first for i in range(1, min(n, 2 * batch_size))):
        return  # one length for all: any collate gives one shape
    with torch.random.fork_rng(devices=[]):  # a masking collator draws from torch's generator: left as it was
        made = [collate_fn([dataset[i] for i in range(k, k + batch_size)]) for k in range(0, n - batch_size + 1, batch_size)]
    shapes = [_field_shapes(dict(b) if isinstance(b, Mapping) else b) for b in made]  # a BatchEncoding is no dict
    varying = next((key for key in shapes[0] if len({s.get(key) for s in shapes}) > 1), None)
    if varying is None:
        return
    seen = ", ".join(str(s[varying][-1] if len(s[varying]) == 2 else list(s[varying][1:])) for s in shapes)
    warnings.warn(
        f"{name}'s collate_fn {type(collate_fn).__name__} pads each batch to its own longest sample: its first "
        f"{len(shapes)} batches hold {varying} of lengths {seen}, and on XLA every new length compiles the step "
        f"again (minutes each on a TPU, in epoch after epoch). Pad to a few fixed lengths: "
        f"{type(collate_fn).__name__}(..., pad_to_multiple_of=64) for a Hugging Face collator, or "
        f"collate_fn=BucketCollate([...]) (from tpu_utility; choose_buckets(lengths) picks the lengths)",
        stacklevel=user_stacklevel(),
    )


def _spec_of(data: Any, batch_size: int | None, name: str) -> LoaderSpec:
    if isinstance(data, DataLoader) and isinstance(data.batch_sampler, BucketBatchSampler):
        return _bucketed_spec(data, batch_size, name)
    if isinstance(data, DataLoader):
        if data.batch_size is None:
            raise ValueError(
                f"{name} is a DataLoader with batch_size=None ({type(data.batch_sampler).__name__} as its "
                f"batch_sampler); give it a fixed batch_size, or a BucketBatchSampler"
            )
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from {name}.batch_size={data.batch_size}; "
                f"give one of them"
            )
        _check_sized(data.dataset, f"{name}.dataset")
        dataset = data.dataset
        if data.collate_fn is default_collate:
            dataset = with_tensor_fields(dataset)
            check_fixed_shapes(dataset, data.batch_size, name)
        else:
            check_padding_collate(dataset, data.collate_fn, data.batch_size, name)
        own = data.sampler
        shuffle = own.shuffle if isinstance(own, DistributedSampler) else not isinstance(own, SequentialSampler)
        return LoaderSpec(
            dataset, data.batch_size, data.collate_fn, data.num_workers,
            sampler=None if _only_orders(own, data.dataset) else own, shuffle=shuffle,
            settings=_loader_settings(data),
        )  # fmt: skip
    _check_sized(data, name)
    row_lengths = set(getattr(data, "row_lengths", ()))  # a PackedDataset's (packing reads this module's names)
    if len(row_lengths) > 1:
        raise ValueError(f"{name} is a {type(data).__name__} of rows of {len(row_lengths)} lengths "
                         f"{sorted(row_lengths)}, which no batch of one shape holds; give "
                         f"{name}.loader(batch_size) (batches of one row length)")  # fmt: skip
    size = 64 if batch_size is None else batch_size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"batch_size must be a positive int, but given {size!r}")
    data = with_tensor_fields(data)
    check_fixed_shapes(data, size, name)
    return LoaderSpec(data, size)


def _field_shapes(sample: Any) -> dict[str, tuple[int, ...]]:
    """Each field's shape (a list's length), keyed by its path: ``input_ids``, ``[0]``, ``[1].mask``."""
    leaves, spec = pytree.tree_flatten_with_path(sample, is_leaf=lambda x: isinstance(x, list) and not (
        x and isinstance(x[0], (dict, tuple))))  # fmt: skip
    shapes = {}
    for path, leaf in leaves:
        key = "".join(f"[{k.idx}]" if hasattr(k, "idx") else str(getattr(k, "key", k)) for k in path) or "sample"
        if isinstance(leaf, (torch.Tensor, np.ndarray)):
            shapes[key] = tuple(leaf.shape)
        elif isinstance(leaf, list):
            shapes[key] = (len(leaf),)
    return shapes


def check_fixed_shapes(dataset: Dataset, count: int, name: str) -> None:
    """Refuses samples the default collate cannot stack: the first ``count`` (one batch) must agree per field.

    A tokenized split before padding has one length per sample; stacked, it fails inside a loader
    worker with "Trying to resize storage that is not resizable". Said here, before any epoch, with
    the fix.
    """
    first: dict[str, tuple[int, ...]] | None = None
    for i in range(min(count, len(dataset))):
        shapes = _field_shapes(dataset[i])
        if first is None:
            first = shapes
            continue
        for key, shape in shapes.items():
            if key in first and shape != first[key]:
                raise ValueError(
                    f"{name}: samples 0 and {i} differ in shape, {key} {list(first[key])} and {list(shape)}, so "
                    f"batches of {count} cannot be stacked (variable-length sequences?). Pad each batch to one of "
                    f"a few fixed lengths (one graph per length on XLA):\n"
                    f"    collate = BucketCollate([32, 64, 128])  # from tpu_utility\n"
                    f"    one_cycle_fit(model, DataLoader({name}, batch_size={count}, collate_fn=collate), ...)"
                )


def _bucketed_spec(loader: DataLoader, batch_size: int | None, name: str) -> LoaderSpec:
    """A LoaderSpec of a DataLoader built on a BucketBatchSampler: its batch size is per core."""
    sampler: BucketBatchSampler = loader.batch_sampler
    if batch_size is not None and batch_size != sampler.batch_size:
        raise ValueError(
            f"batch_size={batch_size} differs from {name}.batch_sampler.batch_size={sampler.batch_size}; "
            f"give one of them"
        )
    _check_sized(loader.dataset, f"{name}.dataset")
    sampler.check_dataset(loader.dataset, name, loader.collate_fn, stacklevel=user_stacklevel())
    if sampler.num_replicas not in (None, 1):
        raise ValueError(
            f"{name}.batch_sampler has num_replicas={sampler.num_replicas}, but the data is shared out over "
            f"the cores here; leave num_replicas and rank out"
        )
    collate = loader.collate_fn
    if isinstance(collate, BucketCollate) and collate.overflow == "error" and max(sampler.lengths) > collate.buckets[-1]:
        raise ValueError(
            f"{name} holds a sequence of length {max(sampler.lengths)} (sample "
            f"{sampler.lengths.index(max(sampler.lengths))}), longer than its collate's largest bucket "
            f"{collate.buckets[-1]}; add a larger bucket or pass overflow='truncate' to BucketCollate"
        )
    return LoaderSpec(loader.dataset, sampler.batch_size, loader.collate_fn, loader.num_workers,
                      shuffle=sampler.shuffle, settings=_loader_settings(loader), batch_sampler=sampler)  # fmt: skip


def set_epoch(loader: DataLoader, epoch: int) -> None:
    """Tells the loader's sampler, batch sampler and dataset (those with ``set_epoch``) the
    epoch: a new order, and for a CachedDataset another augmented copy."""
    for part in (loader.sampler, loader.batch_sampler, loader.dataset):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)


class ShardedSampler(Sampler[int]):
    """This replica's share of a user's sampler, the same draw on every replica.

    The user's sampler is drawn once per epoch with a generator seeded by
    ``seed + epoch`` (when it draws at random and has none of its own), padded by
    repetition to a multiple of ``replicas``, and split round-robin.
    """

    def __init__(self, sampler: Sampler, replicas: int, rank: int, seed: int) -> None:
        self.sampler, self.replicas, self.rank, self.seed, self.epoch = sampler, replicas, rank, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.replicas)

    def __iter__(self) -> Iterator[int]:
        own = getattr(self.sampler, "generator", False)
        if own is None:  # it would draw from the global RNG: a different order on each replica
            self.sampler.generator = torch.Generator().manual_seed(self.seed + self.epoch)
        try:
            indices = list(self.sampler)
        finally:
            if own is None:
                self.sampler.generator = None
        total = len(self) * self.replicas
        indices = (indices * (-(-total // len(indices))))[:total]
        return iter(indices[self.rank :: self.replicas])


def user_stacklevel() -> int:
    """The stacklevel of the first caller outside tpu_utility, torch and torch_xla.

    So a warning points at the user's line, not at our code or a launcher.
    """
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tpu_utility/, above data/
    ours = (package + os.sep, os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = os.path.abspath(frame.f_code.co_filename)
        if not name.startswith(ours) and "torch_xla" not in name and "multiprocessing" not in name:
            return level
        frame, level = frame.f_back, level + 1
    return 1


_PIN_MEMORY_WARNED = False


def _dataloader(dataset: Dataset, spec: LoaderSpec, **kwargs: Any) -> DataLoader:
    global _PIN_MEMORY_WARNED
    settings = dict(spec.settings)
    workers = spec.num_workers or 0
    if settings.get("pin_memory") and backend.xla_requested():
        settings.pop("pin_memory")
        if not _PIN_MEMORY_WARNED:
            _PIN_MEMORY_WARNED = True
            warnings.warn(
                "pin_memory=True has no effect on XLA (torch_xla's loader copies batches to the "
                "device itself); it is left off",
                stacklevel=user_stacklevel(),
            )
    if workers == 0:
        settings.pop("prefetch_factor", None)
        settings.pop("persistent_workers", None)
    else:
        # workers keep their own copy of the dataset: one with set_epoch needs fresh ones each epoch
        settings.setdefault("persistent_workers", not hasattr(dataset, "set_epoch"))
    return DataLoader(dataset, collate_fn=kwargs.pop("collate_fn", spec.collate_fn), num_workers=workers,
                      **kwargs, **settings)  # fmt: skip


def stop_workers(loader: DataLoader) -> None:
    """Stops a loader's persistent worker processes now, as Lightning does at the end of a run.

    A loader with ``persistent_workers`` keeps its iterator, and the iterator its workers, until the loader is
    garbage. When that happens in the cyclic collector (a run that ended with an exception holds its loaders in
    the traceback's frames), the worker queues are finalized before the iterator, so the iterator's "stop"
    never reaches a worker and each is waited out for torch's 5 s status interval before it is terminated.
    Stopping them when the run ends costs nothing and never waits.

    Example:
        >>> loader = DataLoader(range(8), num_workers=1, persistent_workers=True)
        >>> first = next(iter(loader))
        >>> stop_workers(loader)   # was: nothing, and 5 s waited per worker at a later garbage collection
    """
    iterator = getattr(loader, "_iterator", None)  # torch keeps a persistent loader's iterator there
    if iterator is not None:
        shutdown = getattr(iterator, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        loader._iterator = None


def train_loader(spec: LoaderSpec, batch_size: int, *, replicas: int, rank: int, seed: int) -> DataLoader:
    """Shuffled (seed + epoch, via set_epoch), drop_last so every batch has one shape.

    ``batch_size`` is what this loader yields per step (per core, or per host
    under SPMD); the data is split over ``replicas`` loaders. A BucketBatchSampler
    is kept, resharded for this batch size and replica.
    """
    named = {"collate_fn": NamingCollate(spec.collate_fn, spec.name)}  # an odd sample's failure names its index
    if spec.batch_sampler is not None:
        return _dataloader(IndexedFetch(spec.dataset), spec, **named,
                           batch_sampler=_bucketed_batches(spec.batch_sampler, batch_size, replicas, rank, seed))
    if spec.sampler is None:
        sampler: Sampler = DistributedSampler(spec.dataset, num_replicas=replicas, rank=rank, shuffle=spec.shuffle, seed=seed)
    elif replicas > 1:
        sampler = ShardedSampler(spec.sampler, replicas, rank, seed)
    else:
        sampler = spec.sampler
    n = len(sampler)
    if n < batch_size:
        raise ValueError(
            f"the training set has {len(spec)} samples, fewer than one batch of {batch_size} "
            f"on each of {replicas} loader(s); lower batch_size"
        )
    tail = n % batch_size
    if tail and rank == 0 and spec.sampler is None and not spec.shuffle:
        # reshuffled, the tail is other samples each epoch (the summary line says so); in a fixed
        # order it is the same samples every epoch, never trained on
        warnings.warn(
            f"dropping the last {tail} sample(s) of the training set every epoch (a short batch would change "
            f"the graph's shapes and recompile), and the loader does not shuffle, so they are never trained "
            f"on; shuffle=True, or a batch_size that divides {n}, uses them",
            stacklevel=user_stacklevel(),
        )
    return _dataloader(IndexedFetch(spec.dataset), spec, **named, sampler=sampler, batch_size=batch_size, drop_last=True)


def _bucketed_batches(sampler: BucketBatchSampler, batch_size: int, replicas: int, rank: int,
                      seed: int) -> BucketBatchSampler:  # fmt: skip
    """The user's BucketBatchSampler for this loader's batch size and share, its seed checked."""
    if sampler.seed != seed:
        raise ValueError(
            f"seed={seed} differs from train_data.batch_sampler.seed={sampler.seed}, and both would order the "
            f"data; give the same seed to both"
        )
    try:
        batches = sampler.reshard(batch_size, replicas, rank)
    except ValueError as e:
        raise ValueError(f"the training set's BucketBatchSampler, {batch_size} per loader: {e}") from None
    if batches.left_out and rank == 0 and not sampler.shuffle:  # shuffled, one_cycle_fit's summary line says it
        warnings.warn(
            f"the BucketBatchSampler leaves the same {batches.left_out} sample(s) out of every epoch (it does not "
            f"shuffle), so they are never trained on; give it shuffle=True",
            stacklevel=user_stacklevel(),
        )
    return batches


def dropped_per_epoch(loader: DataLoader) -> int:
    """Samples a fixed-shape training loader leaves out of each epoch (on this process).

    ``train_loader`` drops a short last batch (its shape would compile a graph of its
    own); a BucketBatchSampler leaves out each bucket's remainder.

    Example:
        >>> from torch.utils.data import DataLoader, TensorDataset
        >>> dropped_per_epoch(DataLoader(TensorDataset(torch.zeros(111)), batch_size=32, drop_last=True))
        15
    """
    if isinstance(loader.batch_sampler, BucketBatchSampler):
        return loader.batch_sampler.left_out
    if loader.batch_size is None or not loader.drop_last:
        return 0
    return len(loader.sampler) % loader.batch_size


def eval_loader(spec: LoaderSpec, batch_size: int, *, replicas: int, rank: int) -> DataLoader:
    """Every batch full size; padded items carry index -1 so each sample counts once.

    A user's own sampler chooses the samples (for example a validation split of
    one dataset) and their order.
    """
    # a user's sampler chooses the samples; they are evaluated in ascending dataset index, so
    # predict's rows can be matched to the samples whatever order the sampler draws them in
    dataset = spec.dataset if spec.sampler is None else torch.utils.data.Subset(spec.dataset, sorted(spec.sampler))
    padded = MaskedPadding(dataset, padded_length(len(dataset), batch_size, replicas))
    sampler = DistributedSampler(padded, num_replicas=replicas, rank=rank, shuffle=False)
    return _dataloader(padded, spec, sampler=sampler, batch_size=batch_size, collate_fn=MaskCollate(spec.collate_fn, spec.name))


def real_counts(loader: DataLoader) -> list[int]:
    """Real (unpadded) samples in each batch of an eval_loader, known on the host."""
    indices, size, n = list(loader.sampler), loader.batch_size, loader.dataset.n
    return [sum(i < n for i in indices[k : k + size]) for k in range(0, len(indices), size)]


IGNORE_INDEX = -100  # torch's cross_entropy default: a target that counts in no loss and no metric


def class_dim(output: torch.Size | tuple[int, ...], target: torch.Size | tuple[int, ...]) -> int:
    """The dimension of ``output`` that holds the classes for a ``target`` of class ids.

    torch's ``cross_entropy`` reads ``(N, C, ...)`` against ``(N, ...)``: dimension 1.
    Sequence models give ``(N, T, C)`` against ``(N, T)`` (a language model's tokens, a
    tagger's labels): the last dimension. A 3-d output whose shape fits both readings
    (T == C) is read as a sequence's, the far more common case.

    Example:
        >>> class_dim((8, 10), (8,)), class_dim((8, 64, 50), (8, 64)), class_dim((8, 5, 32, 32), (8, 32, 32))
        (1, 2, 1)
    """
    output, target = tuple(output), tuple(target)
    if len(output) >= 3 and output[:-1] == target:
        if len(output) == 3 or (output[0], *output[2:]) != target:
            return len(output) - 1
    return 1


class LabelCheck:
    """Class labels checked on the host against the class count of the model's first real output.

    On XLA an out-of-range label does not raise (on the CPU, cross_entropy's
    IndexError would): the run trains on garbage. Each batch's target is checked
    as the loader yields it, still on the host (no device sync). The class count
    is the size of the output's class dimension (``class_dim``: dim 1, or the last
    of a sequence model's ``(N, T, C)``; a model's own loss: its vocabulary) in the
    first batch the model runs on anyway (``see``), so the check costs no forward
    and no compile of its own; labels of
    batches loaded before that are kept (their distinct values) and checked
    then, before the loss is computed. ``ignore_index`` (-100 for
    ``nn.CrossEntropyLoss``) is allowed, but a training batch in which every
    target is ``ignore_index`` is refused (its loss is 0/0), as is evaluation
    data in which no target counts (``refuse_uncounted``); ``causal``: a causal
    LM's labels must have its ``input_ids``' shape, one label per token.

    Example:
        >>> labels = LabelCheck()
        >>> loader = labels.loader(train_loader)           # doctest: +SKIP
        >>> for x, y in loader:                            # doctest: +SKIP
        ...     output = model(x)
        ...     labels.see(output, y)   # raises ValueError if a label is not in [0, classes)
    """

    def __init__(self, ignore_index: int = -100, causal: bool = False) -> None:
        self.ignore_index, self.causal = ignore_index, causal
        self.classes: int | None = None  # unknown until see(); 0 for an output with no class dimension
        self._pending: set[int] = set()  # distinct labels loaded before the class count was known
        self._float_targets: set[tuple[int, torch.dtype]] = set()  # (dim, dtype) of float targets loaded before
        self.output_dim: int | None = None
        self._held: list[torch.Tensor] = []  # whole datasets' labels, checked at once when the class count is known
        self._lock = threading.Lock()

    def loader(self, loader: DataLoader, masked: bool = False, what: str = "the data") -> DataLoader | LabelCheckedLoader:
        """``loader`` with each batch's target checked; ``masked`` for an eval_loader's ``(batch, index)``;
        ``what``: the data's name in an error ("train_data").

        A loader whose batches' targets are all in one tensor it is handed as it is (a TensorDataset's
        integer labels, default collation, every sample drawn): those labels are checked together, once,
        as the class count is learnt, and its batches are not looked at (no host work per step).
        """
        held = _held_labels(loader)
        if held is None:
            return LabelCheckedLoader(loader, self, masked, what)
        if not _counts(held, self.ignore_index):
            raise ValueError(_uncounted(what, held, self.ignore_index, masked))
        with self._lock:
            if self.classes is None:
                self._held.append(held)
                return loader
        self._check(held, "the dataset")
        return loader

    def target(self, batch: Any, where: str = "a batch") -> bool | None:
        """Checks (or keeps, before the class count is known) the target of a host batch ``(*inputs, target)``
        or a dict batch's ``labels``; whether a target counts (is not ``ignore_index``), None where there is
        no integer target to tell."""
        target = _target_of(batch)
        if self.causal and isinstance(target, torch.Tensor) and isinstance(batch, Mapping):
            _check_causal_shape(batch, target, where)
        if not isinstance(target, torch.Tensor) or not target.numel():
            return None
        if target.is_floating_point():  # class probabilities (the output's shape), or class ids gone float
            with self._lock:
                if self.classes is None:
                    self._float_targets.add((target.dim(), target.dtype))
                    return None
            self._check_float(target.dim(), target.dtype)
            return None
        bounds = (0, 1) if target.dtype == torch.bool else tuple(int(v) for v in torch.aminmax(target))
        counts = bounds != (self.ignore_index, self.ignore_index)
        if self.classes is None:  # set once, never unset: the lock only while it may still be None
            with self._lock:
                if self.classes is None:
                    self._pending.update(torch.unique(target).tolist())
                    return counts
        self._check(target, bounds=bounds)
        return counts

    def see(self, output: Any, target: Any = None, own_loss: bool = False) -> None:
        """Learns the class count from the model's first output and checks the labels loaded so far.

        The class dimension is the one the loss reads (``class_dim``): dim 1 of ``(N, C, ...)``,
        the last of ``(N, T, C)`` against ``(N, T)`` targets. A model that computed its own loss
        from the labels (``own_loss``: a Hugging Face model) is trusted with their layout (a
        causal LM's logits may be longer than its labels, prompt tuning's virtual tokens); its
        labels are still checked against its scores' last dimension (the vocabulary).
        """
        if self.classes is not None:
            return
        with self._lock:
            self.classes = _class_count(output, target, own_loss)
            self.output_dim = output.dim() if isinstance(output, torch.Tensor) and not own_loss else None
            pending, self._pending = self._pending, set()
            floats, self._float_targets = self._float_targets, set()
            held, self._held = self._held, []
        for dim, dtype in sorted(floats, key=str):
            self._check_float(dim, dtype)
        for labels in held:
            self._check(labels, "the dataset")
        if pending:
            self._check(torch.tensor(sorted(pending)))

    def _check_float(self, dim: int, dtype: torch.dtype) -> None:
        """Float targets one dimension short of the output are class ids stored as floats: the default loss
        would read them wrongly (or, on XLA, not fail at all)."""
        if not self.classes or self.output_dim is None or dim != self.output_dim - 1:
            return
        raise ValueError(
            f"labels are {str(dtype).replace('torch.', '')} with one value per sample, but the default loss "
            f"(nn.CrossEntropyLoss) and accuracy take class indices as integers (int64), or class probabilities "
            f"shaped like the output; convert the labels with .long() in the dataset (TensorDataset(x, y.long())), "
            f"or pass loss_fn= for regression (nn.MSELoss(), with metrics= of your own)"
        )

    def _check(self, target: torch.Tensor, where: str = "a batch", bounds: tuple[int, int] | None = None) -> None:
        if not self.classes:
            return
        if target.dtype != torch.bool:  # every batch: three ops, not the mask's seven
            low, high = bounds or torch.aminmax(target)
            if int(low) >= 0 and int(high) < self.classes:
                return
        bad = ((target < 0) & (target != self.ignore_index)) | (target >= self.classes)
        if bool(bad.any()):
            raise ValueError(
                f"labels must be class indices in [0, {self.classes}) for a model with {self.classes} "
                f"outputs, but {where} holds {sorted(set(target[bad].tolist()))[:5]}; check the "
                f"dataset's targets or the model's last layer"
            )


def _class_count(output: Any, target: Any, own_loss: bool) -> int:
    """The classes a target's ids index in ``output`` (0: no class dimension to check against)."""
    if not isinstance(output, torch.Tensor) or output.dim() < 2:
        return 0
    if own_loss:
        return output.shape[-1]
    if isinstance(target, torch.Tensor):
        return output.shape[class_dim(output.shape, target.shape)]
    return output.shape[1]


def _held_labels(loader: Any) -> torch.Tensor | None:
    """Every target a loader yields, as one tensor, when its dataset holds them so: a TensorDataset's last
    tensor of integer class ids, under the package's own wrappers only (a Subset's parent holds samples it
    never draws), collated by default_collate (a collate_fn of one's own may change them), every sample
    drawn (a sampler of one's own may leave some out)."""
    dataset = getattr(loader, "dataset", None)
    while isinstance(dataset, (IndexedFetch, MaskedPadding)):
        dataset = dataset.dataset
    if not isinstance(dataset, torch.utils.data.TensorDataset) or len(dataset.tensors) < 2:
        return None
    collate = getattr(loader, "collate_fn", None)
    if isinstance(collate, (NamingCollate, MaskCollate)):
        collate = collate.collate_fn
    if collate is not default_collate:
        return None
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler, DistributedSampler)):
        return None
    if type(getattr(loader, "batch_sampler", None)) not in (torch.utils.data.BatchSampler, type(None)):
        return None  # a batch sampler of one's own draws what it likes
    if isinstance(loader.sampler, RandomSampler) and (loader.sampler.replacement or loader.sampler.num_samples != len(dataset)):
        return None
    labels = dataset.tensors[-1]
    return labels if not labels.is_floating_point() and labels.dtype != torch.bool and labels.numel() else None


def _target_of(batch: Any) -> Any:
    """A host batch's target: the last of ``(*inputs, target)``, a dict batch's ``labels``, else None."""
    if isinstance(batch, (list, tuple)):  # the common case first: no Mapping check
        return batch[-1] if len(batch) >= 2 else None
    return batch.get(LABELS) if isinstance(batch, Mapping) else None


def _counts(target: torch.Tensor, ignore_index: int) -> bool:
    """Whether any target of ``target`` counts (is not ``ignore_index``)."""
    return target.dtype == torch.bool or bool((target != ignore_index).any())


def _uncounted(what: str, target: torch.Tensor | None, ignore_index: int, evaluated: bool) -> str:
    """Why data in which no target counts is refused, and the way on."""
    held = f"all its {target.numel()} labels are" if target is not None else "every label is"
    why = ("so its loss and metrics would be NaN (0/0) and nothing could be compared" if evaluated else
           "so its loss is 0/0, NaN, and training would stop there")  # fmt: skip
    return (f"{what} has no target that counts: {held} {ignore_index} (ignore_index), {why}. Check how the labels "
            f"are masked (prompt-only samples, a masking helper that masked every token): a causal LM's labels are "
            f"its input_ids, -100 only where a token is no target")  # fmt: skip


def _check_causal_shape(batch: Mapping, labels: torch.Tensor, where: str) -> None:
    """A causal LM's labels have its input_ids' shape: one per token (the model shifts them itself)."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.shape != labels.shape:
        raise ValueError(
            f"{where}: a causal LM takes one label per token, shaped as input_ids (the model shifts them itself), "
            f"but labels have shape {tuple(labels.shape)} and input_ids {tuple(ids.shape)} (a sample's: "
            f"{tuple(labels.shape[1:])} against {tuple(ids.shape[1:])}); give labels of input_ids' shape, -100 "
            f"where a token is no target"
        )


def refuse_uncounted(loader: Any) -> None:
    """Evaluation data (a LabelCheckedLoader's) in which no target counts, refused before its pass."""
    if isinstance(loader, LabelCheckedLoader):
        loader.refuse_uncounted()


class LabelCheckedLoader:
    """A loader whose batches' targets a LabelCheck sees as they are loaded; otherwise the loader itself.

    A training batch in which no target counts is refused as it is loaded, before its step. Evaluation data
    keeps whether any target counted so far (``counted``), so ``refuse_uncounted`` reads its batches on the
    host only where the first (already loaded before any run, by ``Runner.check_eval``) had none.
    """

    def __init__(self, loader: DataLoader, check: LabelCheck, masked: bool, what: str = "the data") -> None:
        self.loader, self.check, self.masked, self.what = loader, check, masked, what
        self.counted = False

    def __iter__(self) -> Iterator[Any]:
        for i, batch in enumerate(self.loader):
            counts = self._see(batch, i)
            if counts is False and not self.masked:
                where = f"batch {i + 1} of an epoch of {self.what}"
                raise ValueError(_uncounted(where, _target_of(batch), self.check.ignore_index, False))
            yield batch

    def _see(self, batch: Any, i: int) -> bool | None:
        counts = self.check.target(batch[0] if self.masked else batch, f"batch {i + 1} of {self.what}")
        self.counted = self.counted or counts is not False
        return counts

    def refuse_uncounted(self) -> None:
        """Refuses evaluation data in which no target counts (every label ``ignore_index``): nothing more
        is read where one has counted already."""
        if self.counted:
            return
        for i, batch in enumerate(self.loader):
            if self._see(batch, i) is not False:
                return
        raise ValueError(_uncounted(self.what, None, self.check.ignore_index, True))

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:  # sampler, batch_size, dataset: the loader's own
        return getattr(self.__dict__["loader"], name)
