"""BucketCollate: fixed shapes for variable-length data, so XLA compiles once per bucket.

A CUDA text loop usually pads each batch to its longest sequence. On XLA every new
length is a new graph and a new compile (seconds each), nearly every batch. Padding
to one of a few bucket lengths instead bounds the distinct shapes, and so the
compiles, by the number of buckets:

    collate = BucketCollate.from_lengths([len(s) for s, _ in train_ds], batch_size=32)
    loader = DataLoader(train_ds, batch_size=32, shuffle=True, collate_fn=collate, drop_last=True)
    for tokens, mask, target in loader:      # mask: True on real tokens
        ...
    print(collate.summary())                 # buckets used, padding waste

A shuffled batch pads to the bucket of its longest sequence, so most of its tokens
can be padding. ``BucketBatchSampler`` makes batches of similar lengths instead
(shuffled within each bucket, and the batches shuffled), so each pads little:

    sampler = BucketBatchSampler(lengths, collate.buckets, batch_size=32)
    loader = DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate)

``choose_buckets``, ``padding_waste`` and ``group_batches`` are the pure math behind them.
"""

from __future__ import annotations

import bisect
import math
import numbers
import sys
import warnings
import zlib
from collections.abc import Mapping
from typing import Any, Iterable, Iterator, Literal, Sequence, get_args

import torch
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.dataloader import default_collate

from .. import backend
from ..arguments import check_keywords, parameter_names

Overflow = Literal["error", "truncate"]


# ------------------------------------------------------------ pure math
def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, but given {value!r} of type {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be an int >= {low}, but given {value}")
    return value


def _check_lengths(lengths: Iterable[int]) -> list[int]:
    values = [int(n) for n in lengths]
    if not values:
        raise ValueError("lengths is empty; give the length of every sequence (at least one)")
    if min(values) < 0:
        raise ValueError(f"lengths must be >= 0, but given {min(values)}")
    return values


def _check_buckets(buckets: Sequence[int]) -> list[int]:
    if isinstance(buckets, (str, bytes)) or not isinstance(buckets, Iterable):
        raise TypeError(f"buckets must be a sequence of positive ints, but given {buckets!r}")
    values = list(buckets)
    if not values:
        raise ValueError("buckets is empty; give at least one bucket length")
    for b in values:
        _check_int("every bucket length", b, 1)
    if values != sorted(set(values)):
        raise ValueError(f"buckets must be strictly increasing, but given {values}")
    return values


def choose_buckets(lengths: Iterable[int], num_buckets: int = 4, multiple_of: int = 8, *,
                   batch_size: int = 1) -> list[int]:  # fmt: skip
    """Bucket lengths from the data's length distribution: quantiles, rounded up.

    Bucket ``k`` (of ``num_buckets``) is the length below which a fraction
    ``k / num_buckets`` of the batches fall, rounded up to a multiple of
    ``multiple_of``; the last bucket holds the longest sequence. A shuffled batch is
    padded to its longest sequence, whose distribution is that of the maximum of
    ``batch_size`` lengths (CDF ``F**batch_size``); with ``batch_size`` given,
    each bucket serves about the same number of batches. Equal buckets merge, so
    fewer may come back.

    Args:
        lengths: Length of every sequence (or, with ``batch_size=1``, the padded
            lengths of batches seen, as ``doctor`` reports them).
        num_buckets: At most this many buckets (distinct shapes, compiles).
        multiple_of: Round every bucket up to a multiple of this (8 suits TPU tiles).
        batch_size: Sequences per shuffled batch (1: quantiles of ``lengths`` themselves).

    Returns:
        Strictly increasing bucket lengths.

    Example:
        >>> choose_buckets([5, 7, 9, 12, 30, 31, 60, 120], num_buckets=4, multiple_of=8)
        [8, 16, 32, 120]
    """
    values = sorted(_check_lengths(lengths))
    _check_int("num_buckets", num_buckets, 1)
    _check_int("multiple_of", multiple_of, 1)
    _check_int("batch_size", batch_size, 1)
    buckets: list[int] = []
    for k in range(1, num_buckets + 1):
        level = (k / num_buckets) ** (1 / batch_size)
        length = values[min(len(values) - 1, max(0, math.ceil(level * len(values)) - 1))]
        rounded = max(multiple_of, -(-length // multiple_of) * multiple_of)
        if not buckets or rounded > buckets[-1]:
            buckets.append(rounded)
    return buckets


def bucket_for(length: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``length``, or None when it is longer than all."""
    i = bisect.bisect_left(buckets, length)
    return buckets[i] if i < len(buckets) else None


def padding_waste(lengths: Iterable[int], buckets: Sequence[int]) -> float:
    """Tokens padded / tokens total when each sequence is padded to its own bucket.

    This is the waste of batches that hold sequences of similar length. A shuffled
    batch is padded to the bucket of its longest sequence and wastes more:
    ``BucketCollate.waste`` measures the batches it really made.

    Raises:
        ValueError: a length exceeds the largest bucket (named with both).

    Example:
        >>> padding_waste([3, 8, 10], [8, 16])      # (5 + 0 + 6) padded of 8 + 8 + 16
        0.34375
    """
    values, buckets = _check_lengths(lengths), _check_buckets(buckets)
    if max(values) > buckets[-1]:
        raise ValueError(f"a length of {max(values)} exceeds the largest bucket {buckets[-1]} (buckets {buckets})")
    total = sum(bucket_for(n, buckets) or 0 for n in values)
    return (total - sum(values)) / total if total else 0.0


def bucket_groups(lengths: Sequence[int], buckets: Sequence[int]) -> list[list[int]]:
    """Sample indices by bucket: each in the smallest that holds it (one longer than all, the largest)."""
    groups: list[list[int]] = [[] for _ in buckets]
    for i, n in enumerate(lengths):
        groups[min(bisect.bisect_left(buckets, n), len(buckets) - 1)].append(i)
    return groups


def group_batches(lengths: Sequence[int], buckets: Sequence[int], batch_size: int, *, drop_last: bool = True,
                  carry: bool = True, generator: torch.Generator | None = None) -> list[list[int]]:  # fmt: skip
    """Batches of sample indices, each made of samples of one bucket where it can be.

    Bucket by bucket (``bucket_groups``), from the shortest, its samples (shuffled
    by ``generator``, else in index order) are cut into batches of ``batch_size``.
    With ``carry`` a bucket's remainder moves up to the next bucket, whose length
    holds it too: every sample is used once, and only the last bucket can leave a
    short batch (dropped with ``drop_last``, else last). Without ``carry`` each
    bucket's remainder sits out (``drop_last`` must be True), so every batch holds
    one bucket only. With ``generator`` the batches are shuffled too.

    Args:
        lengths: The length of every sample; indices are positions in it.
        buckets: Increasing bucket lengths.
        batch_size: Samples per batch.
        drop_last: Drop the short batch (fewer than ``batch_size`` samples).
        carry: Move each bucket's remainder up to the next bucket.
        generator: Shuffles samples within buckets and the batch order; None keeps
            index order within buckets and batches in bucket order.

    Returns:
        The batches; with ``carry``, ``len(lengths) // batch_size`` full ones (plus
        the short one without ``drop_last``).

    Raises:
        ValueError, TypeError: a bad argument, named with its value.

    Example:
        >>> group_batches([3, 9, 4, 10, 2, 11], [4, 16], batch_size=2)
        [[0, 2], [4, 1], [3, 5]]
        >>> group_batches([3, 9, 4, 10, 2, 11], [4, 16], batch_size=2, carry=False)
        [[0, 2], [1, 3]]
    """
    values, buckets = _check_lengths(lengths), _check_buckets(buckets)
    _check_int("batch_size", batch_size, 1)
    if not (carry or drop_last):
        raise ValueError("drop_last=False needs carry=True: without carry every bucket leaves a remainder")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator or None, but given {generator!r}")
    return _batches_of(bucket_groups(values, buckets), batch_size, drop_last, carry, generator)


def _batches_of(groups: list[list[int]], batch_size: int, drop_last: bool, carry: bool,
                generator: torch.Generator | None) -> list[list[int]]:  # fmt: skip
    """``group_batches`` from groups already made and checked (a sampler's, every pass)."""
    batches: list[list[int]] = []
    left: list[int] = []
    for group in groups:
        if generator is not None:
            group = [group[i] for i in torch.randperm(len(group), generator=generator).tolist()]
        pool = left + group if carry else group
        full = len(pool) - len(pool) % batch_size
        batches += [pool[k : k + batch_size] for k in range(0, full, batch_size)]
        left = pool[full:]
    if carry and left and not drop_last:
        batches.append(left)
    if generator is not None:
        batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
    return batches


# ------------------------------------------------------------ the sampler
class BucketBatchSampler(Sampler[list[int]]):
    """Batches of similar lengths, so a bucketed batch pads little.

    A shuffled batch pads to the bucket of its longest sequence: with skewed lengths
    most of its tokens are padding. This batch sampler draws each batch from one
    bucket (``group_batches``): samples are shuffled within their bucket, and the
    batches shuffled, every pass anew. On one replica each pass uses every sample
    once, except those of one short batch, dropped with ``drop_last`` (the default)
    so every batch has the same size. Give it to the DataLoader as ``batch_sampler``
    (the loader then takes no ``batch_size``, ``shuffle`` or ``drop_last``).

    Pass ``k`` draws its order from ``seed + k``; ``set_epoch(epoch)`` chooses the
    pass (as with DistributedSampler, for a resumed run). With several replicas
    (``launch``) every replica draws the same global batches of ``batch_size x
    num_replicas`` samples, all of one bucket, and takes its slice of each: so all
    pad to the same length at every step (one program), in equal numbers of steps.
    Each bucket's remainder then sits out the pass (a different one each pass),
    and the replicas keep in step only through ``set_epoch``: call it every epoch.
    Under SPMD one process feeds every core: give the global batch size.
    ``one_cycle_fit`` takes a loader built on it as it is, for any number of cores
    (``batch_size`` is then per core, and its ``seed`` must be the sampler's); its
    validation, ``evaluate`` and ``predict`` go through every sample in dataset order.

    Args:
        lengths: The length of every sample of the dataset, in dataset order.
        buckets: Increasing bucket lengths: the collate's (``collate.buckets``).
        batch_size: Samples per batch (per replica).
        shuffle: A new order every pass (False: index order within buckets, batches in
            bucket order).
        drop_last: Drop the short batch of each pass, so every batch is full (True
            with several replicas).
        seed: Seed of the shuffle; the same on every replica.
        num_replicas: Replicas sharing the data (default: those running when the
            batches are drawn, as ``make_sampler`` finds them, so a sampler made
            before ``launch`` shards inside it).
        rank: This replica's rank (default: this process's, when drawn).

    Raises:
        ValueError, TypeError: a bad argument, named with its value.

    Example:
        >>> # was: DataLoader(train_ds, batch_size=32, shuffle=True, collate_fn=pad_to_longest)
        >>> lengths = [len(tokens) for tokens, _ in train_ds]                 # doctest: +SKIP
        >>> collate = BucketCollate.from_lengths(lengths, num_buckets=4)      # doctest: +SKIP
        >>> sampler = BucketBatchSampler(lengths, collate.buckets, batch_size=32)  # doctest: +SKIP
        >>> loader = DataLoader(train_ds, batch_sampler=sampler, collate_fn=collate)  # doctest: +SKIP
    """

    def __init__(self, lengths: Iterable[int], buckets: Sequence[int], batch_size: int, *, shuffle: bool = True,
                 drop_last: bool = True, seed: int = 0, num_replicas: int | None = None,
                 rank: int | None = None) -> None:  # fmt: skip
        self.lengths, self.buckets = _check_lengths(lengths), _check_buckets(buckets)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        for name, flag in (("shuffle", shuffle), ("drop_last", drop_last)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be True or False, but given {flag!r}")
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, _check_int("seed", seed, 0)
        self.num_replicas = None if num_replicas is None else _check_int("num_replicas", num_replicas, 1)
        self.rank = None if rank is None else _check_int("rank", rank, 0)
        self._groups = bucket_groups(self.lengths, self.buckets)  # the same every pass
        self._bucket_sizes = [len(g) for g in self._groups]
        self._share()
        self.epoch = 0

    def _share(self) -> tuple[int, int]:
        """(replicas, rank): as given, else those running now; checked against the data."""
        replicas = backend.current().processes.world_size() if self.num_replicas is None else self.num_replicas
        rank = backend.current().processes.rank() if self.rank is None else self.rank
        if rank >= replicas:
            raise ValueError(f"rank must be in [0, {replicas}) for num_replicas={replicas}, but given {rank}")
        if replicas > 1 and not self.drop_last:
            raise ValueError(
                f"drop_last=False needs one replica, but {replicas} share the data: a short batch on "
                f"one of them would be a program of its own; leave drop_last=True"
            )
        if self._batches(replicas) == 0:
            within = "" if replicas == 1 else f" x {replicas} replicas within one bucket (samples per bucket {self._bucket_sizes})"
            raise ValueError(
                f"{len(self.lengths)} samples make no full batch of {self.batch_size}{within}; lower batch_size"
            )
        return replicas, rank

    def _batches(self, replicas: int) -> int:
        if replicas == 1:
            full, short = divmod(len(self.lengths), self.batch_size)
            return full + (short > 0 and not self.drop_last)
        return sum(n // (self.batch_size * replicas) for n in self._bucket_sizes)

    @property
    def left_out(self) -> int:
        """Samples each pass leaves out (a short batch, or the buckets' remainders with several replicas)."""
        replicas = self._share()[0]
        return max(0, len(self.lengths) - self._batches(replicas) * self.batch_size * replicas)

    def set_epoch(self, epoch: int) -> None:
        """Draws the next pass's order from ``seed + epoch``."""
        self.epoch = _check_int("epoch", epoch, 0)

    def __len__(self) -> int:
        return self._batches(self._share()[0])

    def __iter__(self) -> Iterator[list[int]]:
        loader = sys._getframe(1).f_locals.get("loader")  # torch's DataLoader iterator starting a pass holds its loader
        if isinstance(loader, DataLoader) and loader.batch_sampler is self:  # a hand loop's: checked as one_cycle_fit's
            self.check_dataset(loader.dataset, "loader", loader.collate_fn, stacklevel=4)
        replicas, rank = self._share()
        generator = torch.Generator().manual_seed(self.seed + self.epoch) if self.shuffle else None
        if replicas == 1:
            self.epoch += 1  # the next pass draws anew; with several, set_epoch keeps them in step
            return iter(_batches_of(self._groups, self.batch_size, self.drop_last, True, generator))
        size = self.batch_size
        batches = _batches_of(self._groups, size * replicas, True, False, generator)
        return iter([b[rank * size : (rank + 1) * size] for b in batches])

    def reshard(self, batch_size: int, num_replicas: int, rank: int) -> BucketBatchSampler:
        """The same sampler (lengths, buckets, order, pass) for another batch size and share."""
        copy = BucketBatchSampler(self.lengths, self.buckets, batch_size, shuffle=self.shuffle,
                                  drop_last=self.drop_last, seed=self.seed, num_replicas=num_replicas, rank=rank)  # fmt: skip
        copy.epoch = self.epoch
        return copy

    def check_dataset(self, dataset: Any, name: str, collate: Any = None, stacklevel: int = 2) -> None:
        """Refuses a dataset whose size is not the number of lengths; warns when the lengths are not its samples'.

        Shorter lengths leave samples that are never drawn; longer ones draw indices the
        dataset lacks. Lengths in another order than the dataset's (sorted, or another
        split's) make batches of mixed lengths, most padded to the largest bucket: a few
        evenly spaced samples are read and compared (once per dataset), and a warning
        names them when half or more differ.

        Raises:
            ValueError: naming both counts.
        """
        n = len(dataset)
        if len(self.lengths) != n:
            what = (f"samples {len(self.lengths)} to {n - 1} would never be drawn" if len(self.lengths) < n
                    else f"indices {n} to {len(self.lengths) - 1} are not in the dataset")  # fmt: skip
            raise ValueError(
                f"{name}.batch_sampler has {len(self.lengths)} lengths but {name}.dataset has {n} samples ({what}); "
                f"give the length of every sample, in dataset order"
            )
        if getattr(self, "_checked", None) == id(dataset):
            return
        self._checked = id(dataset)
        picks = sorted({round(j * (n - 1) / 7) for j in range(8)}) if n > 1 else [0]
        differ = []
        for i in picks:
            real = _sample_length(dataset[i], i, collate)
            if real is None:
                return  # samples whose length cannot be told: nothing to compare
            if real != self.lengths[i]:
                differ.append((i, real))
        if differ and 2 * len(differ) >= len(picks):
            shown = ", ".join(f"sample {i} has length {real}, lengths[{i}] is {self.lengths[i]}" for i, real in differ[:3])
            warnings.warn(
                f"{name}.batch_sampler's lengths do not match {name}.dataset's samples ({shown}; {len(differ)} of "
                f"{len(picks)} checked differ): in another order than the dataset's, its batches mix lengths and most "
                f"pad to the largest bucket. Give lengths = [len(sequence) for sequence, _ in dataset], in dataset order",
                stacklevel=stacklevel,
            )

    def fingerprint(self) -> str:
        """What decides the batches (for a resumed run's check): buckets, order, and a CRC of the lengths."""
        crc = zlib.crc32(",".join(map(str, self.lengths)).encode())
        return (f"{len(self.lengths)} lengths (crc {crc:08x}), buckets {self.buckets}, shuffle={self.shuffle}, "
                f"drop_last={self.drop_last}, seed={self.seed}")  # fmt: skip

    def __repr__(self) -> str:
        share = "replicas found when drawn" if self.num_replicas is None else f"{self.num_replicas} replicas"
        return (f"BucketBatchSampler({len(self.lengths)} samples, buckets={self.buckets}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last}, seed={self.seed}, {share})")  # fmt: skip


def _sample_length(sample: Any, index: int, collate: Any) -> int | None:
    """A sample's sequence length as its BucketCollate reads it (else a pair's first part, a dict's
    ``input_ids``), or None when it cannot be told."""
    try:
        if isinstance(collate, BucketCollate):
            return collate._length(sample, index)
        if isinstance(sample, Mapping):
            sample = sample.get("input_ids")
        elif isinstance(sample, (tuple, list)) and sample:
            sample = sample[0]
        return int(torch.as_tensor(sample).shape[0])
    except Exception:  # a heuristic only: no check rather than a wrong one
        return None


# ------------------------------------------------------------ the collate
# What a dict batch's sequences are padded with, by key (others: pad_value): no attention on padding,
# and -100, which cross_entropy and Hugging Face's losses ignore, for token labels.
DICT_PAD_VALUES = {"attention_mask": 0, "labels": -100, "token_type_ids": 0}


def _numeric(value: Any) -> bool:
    """A value a batch can hold as a tensor: a tensor, an array, a number or a (nested) list of numbers; not text."""
    while isinstance(value, (list, tuple)) and value:
        value = value[0]
    return isinstance(value, (torch.Tensor, numbers.Number, list, tuple)) or hasattr(value, "__array__")


class BucketCollate:
    """Pads each batch of variable-length sequences to the smallest bucket that fits it.

    A batch comes out as ``(tokens, mask, target)``:

    * ``tokens``: ``(batch, bucket, *feature_dims)``, the sequences left-aligned,
      filled with ``pad_value`` after their end;
    * ``mask``: ``(batch, bucket)`` bool, True on real tokens (``~mask`` is PyTorch's
      ``key_padding_mask``; ``mask.sum(1)`` gives the lengths);
    * ``target``: the targets collated by ``default_collate``.

    Samples are ``(sequence, target)`` pairs (a sequence is a tensor, array or list
    whose first dimension is the length) or dicts holding both under ``keys``
    (``{"input_ids": [...], "label": 3}``).

    By default (``keys="auto"``) a dict sample with ``input_ids`` and ``label`` is such a
    pair, and any other dict sample (a causal LM's ``input_ids``, ``attention_mask`` and
    ``labels``) is collated as with ``keys=None``. With ``keys=None`` a dict sample keeps all its keys and the batch is a dict
    (a tokenized Hugging Face dataset, for ``model(**batch)``): every sequence
    (a value with a first dimension; all of a sample's share one length) is
    padded to the bucket with its own value: ``attention_mask`` with 0 (added,
    all ones on real tokens, when the samples have none), ``labels`` with -100
    (ignored by the loss) where they are sequences, the rest with ``pad_value``
    (the tokenizer's ``pad_token_id`` for ``input_ids``); scalars are collated; columns
    that are not numbers (a split's text) are left out, as ``one_cycle_fit`` leaves them unread.

    Each bucket is one shape, so at most ``len(buckets)`` graphs are compiled
    when the batch size is fixed too: ``drop_last=True`` for training; for
    evaluation ``one_cycle_fit`` pads the last batch itself. A sequence longer than
    the largest bucket is an error, or cut to it with ``overflow="truncate"``
    (counted, and warned about once). The counts of the batches made in this
    process (not in DataLoader workers, which keep their own copy) are in
    ``real_tokens``, ``padded_tokens``, ``truncated_tokens``, ``bucket_batches``,
    ``waste`` and ``summary()``. Picklable, for DataLoader workers and spawn.

    Args:
        buckets: Increasing bucket lengths, e.g. ``[32, 64, 128, 256]``.
        pad_value: Fills the tokens after each sequence's end.
        overflow: "error" (default) or "truncate" for sequences longer than the
            largest bucket.
        keys: The sequence's and the target's keys in dict samples, None for
            dict batches with every key padded, or "auto" (see above).

    Example:
        >>> # was: DataLoader(train_ds, batch_size=32, shuffle=True, collate_fn=pad_to_longest)
        >>> collate = BucketCollate([32, 64, 128])
        >>> loader = DataLoader(train_ds, batch_size=32, shuffle=True,    # doctest: +SKIP
        ...                     collate_fn=collate, drop_last=True)
        >>> tokens, mask, target = collate([(torch.tensor([5, 6, 7]), 1), (torch.tensor([8]), 0)])
        >>> tokens.shape, mask.sum(1).tolist(), target.tolist()
        (torch.Size([2, 32]), [3, 1], [1, 0])
        >>> # was: DataCollatorWithPadding(tokenizer), which pads to the longest: a new shape per batch
        >>> batch = BucketCollate([8, 16], pad_value=0, keys=None)([{"input_ids": [101, 7, 102], "labels": 1}])
        >>> batch["input_ids"].tolist(), batch["attention_mask"].tolist(), batch["labels"].tolist()
        ([[101, 7, 102, 0, 0, 0, 0, 0]], [[1, 1, 1, 0, 0, 0, 0, 0]], [1])
    """

    def __init__(self, buckets: Sequence[int], pad_value: float = 0, *, overflow: Overflow = "error",
                 keys: tuple[str, str] | None | Literal["auto"] = "auto") -> None:  # fmt: skip
        self.buckets = _check_buckets(buckets)
        if isinstance(pad_value, bool) or not isinstance(pad_value, (int, float)):
            raise TypeError(f"pad_value must be a number, but given {pad_value!r}")
        if overflow not in get_args(Overflow):
            raise ValueError(f"overflow must be one of {get_args(Overflow)}, but given {overflow!r}")
        if not (keys is None or (isinstance(keys, str) and keys == "auto") or (isinstance(keys, tuple) and len(keys) == 2)):
            raise TypeError(f"keys must be a (sequence_key, target_key) tuple, None or 'auto', but given {keys!r}")
        self.pad_value, self.overflow, self.keys = pad_value, overflow, keys
        self.data_waste: float | None = None
        self.real_tokens = self.padded_tokens = self.truncated_tokens = 0
        self.bucket_batches = {b: 0 for b in self.buckets}

    @classmethod
    def from_lengths(cls, lengths: Iterable[int], num_buckets: int = 4, multiple_of: int = 8, *,
                     batch_size: int = 1, **kwargs: Any) -> BucketCollate:  # fmt: skip
        """A collate whose buckets come from ``choose_buckets(lengths, ...)``.

        ``data_waste`` holds ``padding_waste(lengths, buckets)``. Other keyword
        arguments (``pad_value``, ``overflow``, ``keys``) go to ``BucketCollate``.

        Example:
            >>> lengths = [len(tokens) for tokens, _ in train_ds]             # doctest: +SKIP
            >>> collate = BucketCollate.from_lengths(lengths, batch_size=32)  # doctest: +SKIP
        """
        check_keywords(kwargs, parameter_names(cls.__init__, ("self", "buckets")), "BucketCollate.from_lengths")
        values = _check_lengths(lengths)
        collate = cls(choose_buckets(values, num_buckets, multiple_of, batch_size=batch_size), **kwargs)
        collate.data_waste = padding_waste(values, collate.buckets)
        return collate

    def check_fits(self, dataset: Any, what: str, lengths: Sequence[int] | None = None,
                   indices: Iterable[int] | None = None) -> None:  # fmt: skip
        """Refuses, before training, a dataset holding a sequence longer than the largest bucket.

        ``lengths`` (a ``BucketBatchSampler``'s) saves reading every sample; ``indices``
        (a sampler's) limits the check to the samples used. Nothing to check with
        ``overflow="truncate"``.

        Example:
            >>> BucketCollate([8, 16]).check_fits([(torch.ones(20), 0)], "valid_data")  # doctest: +SKIP
            ValueError: valid_data sample 0 has a sequence of length 20, longer than the largest bucket 16 ...

        Raises:
            ValueError: naming the sample, its length and the largest bucket.
        """
        if self.overflow != "error":
            return
        if lengths is None:
            chosen = range(len(dataset)) if indices is None else indices
            lengths = {i: self._length(dataset[i], i) for i in chosen}
        else:
            lengths = dict(enumerate(lengths))
        if not lengths:
            return
        longest = max(lengths, key=lengths.__getitem__)
        if lengths[longest] > self.buckets[-1]:
            raise ValueError(
                f"{what} sample {longest} has a sequence of length {lengths[longest]}, longer than the largest "
                f"bucket {self.buckets[-1]} of its BucketCollate (buckets {self.buckets}); build the buckets from "
                f"the lengths of every dataset it collates (BucketCollate.from_lengths(train + valid lengths)), or "
                f"pass overflow='truncate'"
            )

    # -------------------------------------------------------------- collate
    def _keys_for(self, sample: Any) -> tuple[str, str] | None:
        """The keys a batch starting with ``sample`` is collated by: ``keys="auto"`` decided from it."""
        if not (isinstance(self.keys, str) and self.keys == "auto"):
            return self.keys
        return None if isinstance(sample, Mapping) and not {"input_ids", "label"} <= set(sample) else ("input_ids", "label")

    def _length(self, sample: Any, index: int) -> int:
        keys = self._keys_for(sample)
        if keys is None:
            return next(iter(self._sequences(sample, index).values())).shape[0]
        return self._split(sample, index, keys)[0].shape[0]

    @staticmethod
    def _sequences(sample: Any, index: int) -> dict[str, torch.Tensor]:
        """A dict sample's sequences (values with a first dimension), checked to share one length."""
        if not isinstance(sample, Mapping):
            raise TypeError(f"BucketCollate(keys=None) expects dict samples, but sample {index} of the batch is "
                            f"{type(sample).__name__}; give keys=(sequence_key, target_key) for pairs")  # fmt: skip
        seqs = {k: torch.as_tensor(v) for k, v in sample.items() if _numeric(v)}
        seqs = {k: v for k, v in seqs.items() if v.dim() > 0}
        if not seqs:
            raise ValueError(f"sample {index} of the batch has no sequence among {sorted(sample)}")
        lengths = {k: v.shape[0] for k, v in seqs.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"sample {index}'s sequences differ in length {lengths}; every sequence of a sample "
                             f"is padded to one bucket, so they must have one length")  # fmt: skip
        return seqs

    def _split(self, sample: Any, index: int, keys: tuple[str, str]) -> tuple[torch.Tensor, Any]:
        if isinstance(sample, Mapping):
            missing = [k for k in keys if k not in sample]
            if missing:
                raise KeyError(f"sample {index} of the batch lacks {missing}; it has {sorted(sample)}; set keys=...")
            seq, target = sample[keys[0]], sample[keys[1]]
        elif isinstance(sample, (tuple, list)) and len(sample) == 2:
            seq, target = sample
        else:
            raise TypeError(
                f"BucketCollate expects (sequence, target) pairs or dicts with keys {keys}, but sample "
                f"{index} of the batch is {type(sample).__name__}"
                f"{f' of length {len(sample)}' if isinstance(sample, (tuple, list)) else ''}"
            )
        seq = torch.as_tensor(seq)
        if seq.dim() == 0:
            raise ValueError(f"sample {index}'s sequence is a scalar; it needs a length (first dimension)")
        return seq, target

    def __call__(self, samples: Sequence[Any]) -> Any:
        if not samples:
            raise ValueError("BucketCollate got an empty batch")
        keys = self._keys_for(samples[0])
        if keys is None:
            return self._dict_batch(samples)
        pairs = [self._split(s, i, keys) for i, s in enumerate(samples)]
        tokens, mask = self._pad([seq for seq, _ in pairs], self.pad_value)
        return tokens, mask, default_collate([t for _, t in pairs])

    def _dict_batch(self, samples: Sequence[Any]) -> dict[str, Any]:
        sequences = [self._sequences(s, i) for i, s in enumerate(samples)]
        names = sorted(k for k, v in samples[0].items() if _numeric(v))
        for i, sample in enumerate(samples):
            if sorted(k for k, v in sample.items() if _numeric(v)) != names or sorted(sequences[i]) != sorted(sequences[0]):
                raise ValueError(f"sample {i} of the batch has the keys {sorted(sample)}, sample 0 {names} (sequences "
                                 f"{sorted(sequences[i])} and {sorted(sequences[0])}); every sample needs the same")  # fmt: skip
        batch: dict[str, Any] = {}
        for key in sequences[0]:
            value = DICT_PAD_VALUES.get(key, self.pad_value)
            batch[key], mask = self._pad([s[key] for s in sequences], value, count=not batch)
        batch.setdefault("attention_mask", mask.long())  # padding that the model does not see needs a mask
        for key in names:
            if key not in batch:
                batch[key] = default_collate([s[key] for s in samples])
        return {key: batch[key] for key in [*names, *(k for k in batch if k not in names)]}

    def _pad(self, seqs: list[torch.Tensor], pad_value: float, count: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequences left-aligned in one ``(batch, bucket, ...)`` tensor filled with ``pad_value``, and
        the mask of real tokens; ``count``: add them to the padding figures (once per batch)."""
        sizes = [seq.shape[0] for seq in seqs]
        longest = max(sizes)
        bucket = bucket_for(longest, self.buckets)
        if bucket is None:
            if self.overflow == "error":
                raise ValueError(
                    f"a sequence of length {longest} is longer than the largest bucket {self.buckets[-1]} "
                    f"(buckets {self.buckets}); add a larger bucket (BucketCollate.from_lengths over all the "
                    f"data) or pass overflow='truncate'"
                )
            if self.truncated_tokens == 0:
                warnings.warn(
                    f"truncating sequences longer than {self.buckets[-1]} tokens (one had {longest}); "
                    f"BucketCollate.truncated_tokens counts what is cut",
                    stacklevel=3,  # the DataLoader's call of the collate
                )
            bucket = self.buckets[-1]
        first = seqs[0]
        dtype = first.dtype
        for seq in seqs[1:]:  # one int and one float sequence: float for both, never 1.5 -> 1
            dtype = torch.promote_types(dtype, seq.dtype)
        if not (dtype.is_floating_point or dtype.is_complex or float(pad_value).is_integer()):
            raise ValueError(
                f"pad_value={pad_value!r} cannot fill {dtype} sequences without rounding; give an int"
            )
        for i, seq in enumerate(seqs):
            if seq.shape[1:] != first.shape[1:]:
                raise ValueError(
                    f"sample {i}'s sequence has feature shape {tuple(seq.shape[1:])}, sample 0's "
                    f"{tuple(first.shape[1:])}; only the first dimension (the length) may vary"
                )
        kept = seqs if longest <= bucket else [seq[:bucket] for seq in seqs]
        lengths = torch.tensor([min(n, bucket) for n in sizes])
        tokens = torch.full((len(seqs), bucket, *first.shape[1:]), pad_value, dtype=dtype)
        mask = torch.arange(bucket) < lengths[:, None]
        tokens[mask] = torch.cat(kept).to(dtype)  # row by row, in one copy rather than one per sequence
        if count:
            real = int(lengths.sum())
            self.truncated_tokens += sum(sizes) - real
            self.real_tokens += real
            self.padded_tokens += mask.numel() - real
            self.bucket_batches[bucket] += 1
        return tokens, mask

    # -------------------------------------------------------------- report
    @property
    def waste(self) -> float | None:
        """Tokens padded / tokens total over the batches collated here (None before any)."""
        total = self.real_tokens + self.padded_tokens
        return self.padded_tokens / total if total else None

    def summary(self) -> str:
        """Buckets, batches per bucket and padding waste, in one line."""
        parts = [f"BucketCollate: buckets {self.buckets}"]
        if self.data_waste is not None:
            parts.append(f"padding waste {self.data_waste:.1%} if batches held similar lengths")
        if self.waste is None:
            parts.append("no batches collated in this process (DataLoader workers keep their own counts)")
        else:
            used = ", ".join(f"{b}: {n}" for b, n in self.bucket_batches.items())
            parts.append(f"batches per bucket {{{used}}}")
            parts.append(f"padding waste {self.waste:.1%} of {self.real_tokens + self.padded_tokens} tokens")
        if self.truncated_tokens:
            parts.append(f"{self.truncated_tokens} tokens truncated")
        return " | ".join(parts)

    def __repr__(self) -> str:
        return f"BucketCollate(buckets={self.buckets}, pad_value={self.pad_value!r}, overflow={self.overflow!r})"
