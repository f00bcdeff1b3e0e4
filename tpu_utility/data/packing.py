"""PackedDataset: variable-length token samples packed into rows of one length, no token of padding wasted.

Instruction data spans two orders of magnitude in length. Padded to one length (the
only shape that never recompiles without buckets) most of a step computes padding;
``BucketCollate`` halves that; packing several samples into each row of ``length``
tokens leaves almost none (first-fit decreasing: 0.97 real tokens on Alpaca-like
lengths, against 0.20 padded to 1,024 and 0.68 bucketed)::

    packed = PackedDataset(train_ds, length=1024)        # a tokenized split, any lengths
    history = one_cycle_fit(model, packed, batch_size=8, ...)
    print(packed.summary())                              # rows, real-token share

Each row is a dict ready for ``model(**row)``: ``input_ids``, ``labels`` and
``position_ids``. Positions restart at 0 at each sample (so a row's positions say
where each sample starts: the segments), each sample's first label is -100 (the
previous sample's last token does not learn to predict it, exactly as when they run
apart) and labels already -100 (a prompt) stay so. The row's tail after its last
sample is padding: ``pad_token_id``, labels -100, positions from 0 (a segment of its
own, attending only to itself). Rows carry no ``attention_mask``: the attention must
not cross samples, and ``packed_attention(model)`` (which ``one_cycle_fit``,
``evaluate`` and ``predict`` switch on for a Hugging Face model) builds each row's
block-diagonal causal mask on the device from ``position_ids`` (on a TPU with torch_xla's
flash attention, its segment ids instead).

Rows of several lengths (``length=[128, 256, 512, 1024]``) make each row as short as its
longest sample allows, its tail filled with shorter samples, and train through
``packed.loader(batch_size)``, one graph per row length; ``split=True`` cuts a sample longer
than a row into pieces instead of refusing it.

Parted rows (``chunks="auto"`` or a list) keep one row length and one layout, and still pay
attention over short spans: a row is a first part of ``length`` tokens and chunks after it, no
sample crossing from one part into the next; ``packed_attention`` runs each group of equal parts
as a batch of its own, so a part attends over its own length, in one step shape::

    packed = PackedDataset(train_ds, length=1024, chunks="auto")   # rows of ~4,000-7,000 tokens
    history = one_cycle_fit(model, packed, batch_size=1, ...)       # about 8 x 1,024 tokens a step
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, Iterable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .buckets import BucketBatchSampler, _check_int
from .loaders import IGNORE_INDEX, LABELS

INPUT_IDS = "input_ids"
PACKED_PARTS = "packed_parts"  # a parted row's layout, read by packed_attention (huggingface.py)
# the columns a row is made of: token ids, their labels (else the ids themselves), an all-ones mask
PACKED_COLUMNS = (INPUT_IDS, LABELS, "attention_mask")


# ------------------------------------------------------------ pure math
def first_fit_decreasing(lengths: Sequence[int], capacity: int | Sequence[int], *, seed: int = 0) -> list[list[int]]:
    """Bins of sample indices, each holding at most ``capacity`` in length: first-fit decreasing.

    The samples are taken longest first (equal lengths in an order drawn from ``seed``), each
    put into the first bin it fits in, a new bin when none has room. At most 11/9 of the
    optimal number of bins (+1); on skewed lengths nearly full. A segment tree over the bins'
    free room finds the first bin in log time, so a million samples pack in seconds.

    With several capacities (increasing), a new bin is the smallest that holds the sample
    opening it (its first, and longest), and later, shorter samples still go into the first
    bin of any size with room: the long bins' tails fill with short samples as with one
    capacity, and a sample too long for every open bin's room gets a bin no longer than it needs.

    Args:
        lengths: Every sample's length; indices are positions in it.
        capacity: A bin's room (a row's length), or increasing rooms to choose from.
        seed: Orders samples of equal length; the same seed gives the same bins everywhere.

    Returns:
        The bins, each a list of indices in the order they were placed (a bin's room is the
        smallest capacity that holds its first sample).

    Raises:
        ValueError: a length outside ``[1, capacity]``, named with its index.

    Example:
        >>> first_fit_decreasing([3, 8, 5, 2, 6], capacity=10)   # lengths 8+2, 6+3, 5
        [[1, 3], [4, 0], [2]]
        >>> first_fit_decreasing([3, 8, 5, 2, 6], capacity=[6, 10])   # 8+2 in a 10; 6, 5 and 3 each in a 6
        [[1, 3], [4], [2], [0]]
    """
    capacities = _row_lengths(capacity, "capacity", low=1)
    sizes = _check_sizes(lengths, capacities[-1])
    if not sizes:
        return []
    bins = _FirstFit(len(sizes))
    for i in _longest_first(sizes, seed):
        if bins.place(i, sizes[i]) is None:  # no open bin has room: open the smallest that holds it
            bins.place(i, sizes[i], opened=[next(c for c in capacities if c >= sizes[i])])
    return bins.bins


def _longest_first(sizes: Sequence[int], seed: int) -> list[int]:
    """Sample indices, longest first, equal lengths in an order drawn from ``seed``."""
    tie = torch.randperm(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(range(len(sizes)), key=lambda i: (-sizes[i], tie[i]))


class _FirstFit:
    """Bins in the order opened, and the leftmost one with room for a size in log time: a segment tree over the
    bins' free room (a node holds the largest free room below it; 0: unopened)."""

    def __init__(self, most: int) -> None:
        self.leaves = 1
        while self.leaves < most:
            self.leaves *= 2
        self.room = [0] * (2 * self.leaves)
        self.bins: list[list[int]] = []

    def place(self, index: int, size: int, opened: Sequence[int] = ()) -> int | None:
        """Puts ``index`` (of ``size``) into the leftmost bin with room, after opening bins of the rooms ``opened``
        (right of the others); the bin's number, or None (nothing placed) when none has room."""
        for room in opened:
            self._set(self.leaves + len(self.bins), room)
            self.bins.append([])
        if self.room[1] < size:
            return None
        node = 1
        while node < self.leaves:  # the leftmost bin with room
            node = 2 * node if self.room[2 * node] >= size else 2 * node + 1
        self.bins[node - self.leaves].append(index)
        self._set(node, self.room[node] - size)
        return node - self.leaves

    def _set(self, node: int, room: int) -> None:
        self.room[node] = room
        node //= 2
        while node:
            self.room[node] = max(self.room[2 * node], self.room[2 * node + 1])
            node //= 2


def parted_rows(lengths: Sequence[int], parts: Sequence[int], *, seed: int = 0) -> list[list[list[int]]]:
    """Rows of one layout, parts of ``parts`` tokens one after the other (the first the longest): first-fit
    decreasing over the parts of every open row, in order.

    A sample goes into the first part with room (of any row, a row's parts in order), a new row
    when none has room; a sample longer than a part never goes into it, so the longest go into
    first parts and the short ones fill what is left. No sample crosses from one part into the
    next: a part's attention runs within it, over its own length, not the row's.

    Args:
        lengths: Every sample's length; each at most ``parts[0]``.
        parts: The tokens of each part of a row, the first the longest (``[1024, 512, 256, 256]``).
        seed: Orders samples of equal length.

    Returns:
        The rows, each ``len(parts)`` lists of sample indices: what each part holds.

    Example:
        >>> parted_rows([7, 2, 3, 6, 2], parts=[8, 3, 3])   # rows: 7 | 3 | 2 and 6+2 | - | -
        [[[0], [2], [1]], [[3, 4], [], []]]
    """
    sizes = _check_sizes(lengths, parts[0])
    bins = _FirstFit(len(sizes) * len(parts))
    for i in _longest_first(sizes, seed):
        if bins.place(i, sizes[i]) is None:
            bins.place(i, sizes[i], opened=parts)
    rows, k = bins.bins, len(parts)
    return [rows[r : r + k] for r in range(0, len(rows), k)]


def auto_chunks(lengths: Sequence[int], length: int, *, seed: int = 0) -> tuple[int, ...]:
    """Chunks for rows whose first part is ``length``, in the proportions of the data.

    First-fit decreasing into rows of ``length`` and of 3/4, 1/2, 3/8, 1/4, 3/16, 1/8 and 1/16
    of it (each row as short as its longest sample allows) says how many parts of each length the
    data fills; scaled to rows of about ``4 x length`` tokens (one part of ``length`` at least)
    and rounded, those counts start a search that adds or removes one part at a time while the
    packed rows (``parted_rows``) cost less per real token, a part of ``s`` tokens costing
    ``s^2 + s x length / 8`` (its attention, and its tokens' other work: a small model's balance;
    a wider model's attention weighs less). The chunks are the parts after the first.

    Example:
        >>> auto_chunks([16, 16, 8, 8, 8, 8, 2, 2, 2, 2], 16)   # one row of 64 holds them all, each in a part
        (16, 8, 8, 8, 8, 2, 2, 2, 2)
    """
    sizes = _check_sizes(lengths, length)
    rooms = sorted({length * k // 16 for k in (1, 2, 3, 4, 6, 8, 12) if length * k // 16 >= 1} | {length})
    bins = first_fit_decreasing(sizes, rooms, seed=seed)
    filled = Counter(next(r for r in rooms if r >= sizes[b[0]]) for b in bins)
    scale = 4 * length / sum(filled[r] * r for r in rooms)
    counts = {r: round(filled[r] * scale) for r in rooms}
    counts[length] = max(counts[length], 1)
    real = sum(sizes)

    def parts_of(counts: dict[int, int]) -> tuple[int, ...]:
        return tuple(r for r in reversed(rooms) for _ in range(counts[r]))

    def cost(counts: dict[int, int]) -> float:
        parts = parts_of(counts)
        return len(parted_rows(sizes, parts, seed=seed)) * sum(p * p + p * length / 8 for p in parts) / real

    best, tries, better = cost(counts), 0, True
    while better and tries < 40:
        better = False
        for room in rooms:
            for step in (1, -1):
                trial = {**counts, room: counts[room] + step}
                if trial[room] < (room == length) or sum(r * k for r, k in trial.items()) > 8 * length:
                    continue
                tries += 1
                value = cost(trial)
                if value < best:
                    best, counts, better = value, trial, True
    return parts_of(counts)[1:]


def _chunks(chunks: Any, length: int) -> tuple[int, ...]:
    """``chunks`` checked: a non-empty sequence of ints from 1 to ``length``."""
    if isinstance(chunks, (str, bytes)) or not isinstance(chunks, Sequence) or not chunks:
        raise ValueError(f"chunks must be 'auto' or a non-empty list of chunk lengths (ints up to length={length}), "
                         f"but given chunks={chunks!r}")  # fmt: skip
    for n in chunks:
        _check_int("every chunk", n, 1)
        if n > length:
            raise ValueError(f"every chunk must be at most length={length} (a row's first part, its longest), but "
                             f"given chunks={list(chunks)}")  # fmt: skip
    return tuple(chunks)


def _row_lengths(length: Any, name: str = "length", low: int = 2) -> tuple[int, ...]:
    """``length`` as the tuple of row lengths: one int, or increasing ints (rows of several lengths)."""
    if not isinstance(length, (list, tuple)):
        return (_check_int(name, length, low),)
    for n in length:
        _check_int(f"every {name}", n, low)
    if not length or list(length) != sorted(set(length)):
        raise ValueError(f"{name} must be an int or increasing ints, but given {name}={list(length)}")
    return tuple(length)


def _check_sizes(lengths: Sequence[int], capacity: int) -> list[int]:
    _check_int("capacity", capacity, 1)
    sizes = [int(n) for n in lengths]
    for i, n in enumerate(sizes):
        if n < 1 or n > capacity:
            what = "is empty" if n < 1 else f"has {n} tokens, longer than the row length {capacity}"
            raise ValueError(f"sample {i} {what}; every sample must fit in one row (1 to {capacity} tokens)")
    return sizes


# ------------------------------------------------------------ reading the samples
def real_token_lengths(data: Any) -> list[int] | None:
    """Each sample's real (non-pad) tokens, where token data says them without loading a sample's tensors: a
    ``datasets.Dataset`` with an ``input_ids`` column (read in Arrow, its selection and order as given), or a list
    of dict samples; the ones of an ``attention_mask`` where the samples have one, else the ``input_ids``'
    length. None for other data (a Dataset whose ``__getitem__`` may tokenize or augment is not read).

    Example:
        >>> real_token_lengths([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 0], "attention_mask": [1, 0]}])
        [3, 1]
    """
    names = getattr(data, "column_names", None)
    if isinstance(names, list) and callable(getattr(data, "with_format", None)):  # a datasets.Dataset
        if INPUT_IDS not in names:
            return None
        import numpy as np
        import pyarrow.compute as pc  # datasets' own dependency

        table = data.with_format("arrow")
        column = table[INPUT_IDS]
        lengths = np.asarray(pc.list_value_length(column).to_numpy(zero_copy_only=False), dtype=np.int64)
        if "attention_mask" in names:
            ones = np.concatenate([[0], np.cumsum(pc.list_flatten(table["attention_mask"]).to_numpy(zero_copy_only=False))])
            ends = np.cumsum(pc.list_value_length(table["attention_mask"]).to_numpy(zero_copy_only=False))
            lengths = ones[ends] - ones[np.concatenate([[0], ends[:-1]])]
        return [int(n) for n in lengths]
    if not isinstance(data, (list, tuple)) or not data or not all(isinstance(s, Mapping) and INPUT_IDS in s for s in data):
        return None
    lengths = []
    for sample in data:
        mask = sample.get("attention_mask")
        tokens = torch.as_tensor(mask if mask is not None else sample[INPUT_IDS])
        if tokens.dim() != 1:
            return None
        lengths.append(int(tokens.sum()) if mask is not None else tokens.numel())
    return lengths


def _columns(data: Any) -> tuple[list[Any], list[Any] | None, list[Any] | None]:
    """``(input_ids, labels or None, attention_mask or None)`` of every sample, column by column for a
    ``datasets.Dataset`` (fast), sample by sample otherwise."""
    names = getattr(data, "column_names", None)
    if isinstance(names, list) and callable(getattr(data, "with_format", None)):  # a datasets.Dataset
        _refuse_other_columns(names, "the dataset's columns")
        if INPUT_IDS not in names:
            raise KeyError(f"PackedDataset needs an '{INPUT_IDS}' column; the dataset has {names}")
        plain = data.with_format(None)
        return tuple(list(plain[c]) if c in names else None for c in PACKED_COLUMNS)  # type: ignore[return-value]
    try:
        count = len(data)
    except TypeError:
        raise TypeError(f"PackedDataset needs a sized dataset (len() and [i]), but given {type(data).__name__}") from None
    columns: dict[str, list[Any]] = {c: [] for c in PACKED_COLUMNS}
    keys: list[str] | None = None
    for i in range(count):
        sample = data[i]
        if not isinstance(sample, Mapping):
            raise TypeError(f"PackedDataset expects dict samples of token ids ({{'{INPUT_IDS}': [...], 'labels': "
                            f"[...]}}), but sample {i} is {type(sample).__name__}")  # fmt: skip
        if keys is None:
            keys = sorted(sample)
            _refuse_other_columns(keys, "sample 0's keys")
            if INPUT_IDS not in sample:
                raise KeyError(f"PackedDataset needs '{INPUT_IDS}' in every sample; sample 0 has {keys}")
        elif sorted(sample) != keys:
            raise ValueError(f"sample {i} has the keys {sorted(sample)}, sample 0 {keys}; every sample needs the same")
        for c in PACKED_COLUMNS:
            columns[c].append(sample.get(c))
    return tuple(columns[c] if keys and c in keys else None for c in PACKED_COLUMNS)  # type: ignore[return-value]


def _refuse_other_columns(names: Iterable[str], where: str) -> None:
    other = sorted(set(names) - set(PACKED_COLUMNS))
    if other:
        raise ValueError(
            f"PackedDataset packs {list(PACKED_COLUMNS)}, but {where} also hold {other}, which a packed row cannot "
            f"carry; drop them first (a datasets split: split.remove_columns({other}))"
        )


def _tokens(value: Any, index: int, column: str) -> torch.Tensor:
    tokens = torch.as_tensor(value)
    if tokens.dim() != 1 or (tokens.numel() and (tokens.dtype.is_floating_point or tokens.dtype == torch.bool)):
        raise ValueError(f"sample {index}'s {column} must be a 1-D sequence of integers, but it is {tokens.dtype} "
                         f"of shape {tuple(tokens.shape)}")  # fmt: skip
    return tokens.long()


def _split(tokens: list[torch.Tensor], targets: list[torch.Tensor],
           length: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[int]]:  # fmt: skip
    """Every sample cut into pieces of at most ``length`` tokens: (ids, labels, the sample of each piece)."""
    ids, labels, origin = [], [], []
    for i, (t, y) in enumerate(zip(tokens, targets)):
        for at in range(0, max(len(t), 1), length):
            ids.append(t[at : at + length])
            labels.append(y[at : at + length])
            origin.append(i)
    return ids, labels, origin


# ------------------------------------------------------------ the dataset
class PackedDataset(Dataset):
    """Token samples of any lengths packed into rows of ``length`` tokens (first-fit decreasing).

    The packing is fixed when made (the same ``seed`` gives the same rows in every process and
    on every core); the order in which rows are drawn is the trainer's (seeded as for any
    dataset). A row is ``{"input_ids", "labels", "position_ids"}``, each ``(length,)`` int64
    (module docstring: what each holds). Give packed rows to a Hugging Face causal LM through
    ``one_cycle_fit``, ``evaluate`` or ``predict`` (which build the block-diagonal attention on
    the device), or in a hand loop after ``packed_attention(model)``.

    Args:
        data: Tokenized samples: a ``datasets.Dataset``, a list of dicts, or a torch Dataset of
            dicts, holding ``input_ids`` and optionally ``labels`` (same length; -100 where no loss
            counts, a prompt) and ``attention_mask`` (all ones: unpadded samples). Without
            ``labels`` the labels are the ids, as ``DataCollatorForLanguageModeling(mlm=False)``
            makes them.
        length: Tokens per row; a sample longer than it is refused, named with its index (or cut,
            with ``split``). Several increasing lengths (``[128, 256, 512, 1024]``): rows of each,
            a row as short as its longest sample allows and its tail filled with shorter ones;
            train on them through ``loader(batch_size)`` (batches of one length, one graph each).
        pad_token_id: Fills each row's tail after its last sample.
        seed: Orders samples of equal length before they are placed.
        split: Cut a sample longer than the (longest) row into pieces of the row's length, the last
            shorter, each packed as a sample of its own: its positions restart at 0 and its first
            label is -100 (a piece is a new context: its tokens cannot attend to the piece before,
            which sits in another row or behind a mask, so positions continuing from it would
            claim a context the model does not see; one target is lost per cut). The summary says
            how many were cut. Default: refused.
        chunks: Parted rows: the lengths of the parts after a row's first (``length``), each at most
            ``length`` (``[512, 256, 256]``: rows of 2,048 tokens), or ``"auto"`` (``auto_chunks``: in
            the data's proportions). Every row then has this one layout, no sample crossing a part,
            and carries ``packed_parts``, each group of equal parts' positions ``(parts, part
            length)``, from which ``packed_attention`` runs each group apart (attention over the part,
            not the row). Default: plain rows.

    Attributes:
        rows: The sample indices in each row, in row order (with ``split``, indices of pieces:
            ``origin[i]`` is the sample piece ``i`` comes from).
        real_tokens: Tokens of the data, over all rows.
        fill: ``real_tokens / (rows x length)``: the share of a step's tokens that are data.
        starts: Where each sample of a row starts in it (in ``rows``' order).
        parts: A row's parts: ``(length,)`` for plain rows; the first part and the chunks (longest
            first) for parted rows, whose ``length`` is then their sum.
        chunks: The chunks of parted rows (``parts[1:]``); None for plain rows.

    Raises:
        ValueError, TypeError, KeyError: a sample longer than a row, padded (attention mask
            with zeros), with labels of another length, or keys a row cannot carry; named.

    Example:
        >>> samples = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]}, {"input_ids": [8, 9], "labels": [8, 9]}]
        >>> row = PackedDataset(samples, length=6)[0]
        >>> row["input_ids"].tolist(), row["labels"].tolist(), row["position_ids"].tolist()
        ([5, 6, 7, 8, 9, 0], [-100, 6, 7, -100, 9, -100], [0, 1, 2, 0, 1, 0])
    """

    def __init__(self, data: Any, length: int | Sequence[int], *, pad_token_id: int = 0, seed: int = 0,
                 split: bool = False, chunks: Sequence[int] | str | None = None) -> None:  # fmt: skip
        self.lengths = _row_lengths(length)
        self.length = self.lengths[-1]
        if chunks is not None and len(self.lengths) > 1:
            raise ValueError(f"chunks takes rows of one length (their first part), but given length={list(length)}; "
                             f"give one length, or leave chunks out")  # fmt: skip
        if chunks is not None and chunks != "auto":
            chunks = _chunks(chunks, self.length)
        self.pad_token_id = _check_int("pad_token_id", pad_token_id, 0)
        self.seed = _check_int("seed", seed, 0)
        ids, labels, masks = _columns(data)
        if not ids:
            raise ValueError("PackedDataset got no samples")
        tokens = [_tokens(v, i, INPUT_IDS) for i, v in enumerate(ids)]
        targets = [t.clone() for t in tokens] if labels is None else [_tokens(v, i, LABELS) for i, v in enumerate(labels)]
        for i, (t, y) in enumerate(zip(tokens, targets)):
            if y.shape != t.shape:
                raise ValueError(f"sample {i} has {len(y)} labels for {len(t)} input_ids; a causal LM takes one label "
                                 f"per token")  # fmt: skip
        if masks is not None:
            for i, m in enumerate(masks):
                m = torch.as_tensor(m)
                if m.shape != tokens[i].shape or not bool((m == 1).all()):
                    raise ValueError(f"sample {i}'s attention_mask is not all ones over its {len(tokens[i])} "
                                     f"input_ids: PackedDataset packs unpadded samples (tokenize without "
                                     f"padding=..., or drop the padding first)")  # fmt: skip
        if not isinstance(split, bool):
            raise TypeError(f"split must be True or False, but given {split!r}")
        self.samples, self.split = len(tokens), {}  # samples given; those cut: {sample: pieces}
        self.origin = list(range(len(tokens)))  # the sample each packed piece comes from
        if split:
            tokens, targets, self.origin = _split(tokens, targets, self.length)
            self.split = {i: n for i, n in Counter(self.origin).items() if n > 1}
        sizes = [len(t) for t in tokens]
        _check_sizes(sizes, self.length)  # an empty or too long sample, by index
        if chunks == "auto":
            chunks = auto_chunks(sizes, self.length, seed=self.seed)
        # a row's parts: one (the row) for plain rows; the first part and its chunks for parted rows
        self.parts: tuple[int, ...] = (self.length, *sorted(chunks or (), reverse=True))
        self.chunks = self.parts[1:] if chunks is not None else None
        if self.chunks is not None:
            parted = parted_rows(sizes, self.parts, seed=self.seed)
            self.rows = [[i for part in row for i in part] for row in parted]
            self.length = sum(self.parts)  # a row's tokens: its first part and every chunk
            self.row_lengths = [self.length] * len(self.rows)
        else:
            parted = [[row] for row in first_fit_decreasing(sizes, self.lengths, seed=self.seed)]
            self.rows = [row[0] for row in parted]
            self.row_lengths = [next(n for n in self.lengths if n >= sizes[row[0]]) for row in self.rows]
        count = len(self.rows)
        self._ids = torch.full((count, self.length), self.pad_token_id, dtype=torch.int64)
        self._labels = torch.full((count, self.length), IGNORE_INDEX, dtype=torch.int64)
        self._positions = torch.zeros((count, self.length), dtype=torch.int64)
        self.starts: list[list[int]] = []  # where each sample of a row starts in it (rows' order)
        for r, row in enumerate(parted):
            starts, part_at = [], 0
            for part, room in zip(row, self.parts if self.chunks is not None else (self.length,)):
                at = part_at
                for i in part:
                    n = len(tokens[i])
                    self._ids[r, at : at + n] = tokens[i]
                    self._labels[r, at : at + n] = targets[i]
                    self._labels[r, at] = IGNORE_INDEX  # never the target of the previous sample's last token
                    self._positions[r, at : at + n] = torch.arange(n)
                    starts.append(at)
                    at += n
                part_at += room
                self._positions[r, at:part_at] = torch.arange(part_at - at)  # the tail: a segment of its own
            self.starts.append(starts)
        self.real_tokens = sum(sizes)
        computed = sum(self.row_lengths)
        self.fill = self.real_tokens / computed
        # the part length a computed token's attention runs over, on average: T for one length
        self.attention_length = (sum(n * n for n in self.row_lengths) / computed if self.chunks is None else
                                 sum(p * p for p in self.parts) / self.length)  # fmt: skip

    def loader(self, batch_size: int, **options: Any) -> DataLoader:
        """A DataLoader of batches of rows of one length, for rows of several lengths (``length=[...]``).

        Its batch sampler is a ``BucketBatchSampler`` over the rows' lengths: each batch holds rows
        of one length, so the step compiles once per row length (as ``BucketCollate``'s buckets
        do). On one replica a length's remainder (fewer rows than a batch) joins the next
        length's batch, padded to it (labels -100, a segment of its own), so every row trains
        each pass, as ``BucketBatchSampler`` carries samples.

        Args:
            batch_size: Rows per batch (per core); ``one_cycle_fit`` takes the loader as it is.
            **options: ``BucketBatchSampler``'s (``shuffle``, ``drop_last``, ``seed``).

        Example:
            >>> packed = PackedDataset([{"input_ids": [1] * n} for n in (3, 3, 7, 8)], length=[4, 8])
            >>> print(*(tuple(b["input_ids"].shape) for b in packed.loader(2, shuffle=False)))
            (2, 4) (2, 8)
            >>> # one_cycle_fit(model, packed.loader(8), epochs=2, max_lr=2e-4)   # was: batch_size=8
        """
        if self.chunks is not None:
            raise ValueError("rows with chunks all have one length and one layout: give the PackedDataset itself "
                             "with batch_size (one_cycle_fit(model, packed, batch_size=...)), not packed.loader()")
        sampler = BucketBatchSampler(self.row_lengths, self.lengths, batch_size, **options)
        return DataLoader(self, batch_sampler=sampler, collate_fn=self.collate)

    def collate(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stacks rows, padding shorter ones to the longest (tokens ``pad_token_id``, labels -100, positions a
        tail segment from 0)."""
        n = max(len(r[INPUT_IDS]) for r in rows)
        fill = {INPUT_IDS: self.pad_token_id, LABELS: IGNORE_INDEX}
        out = {}
        for key in (INPUT_IDS, LABELS, "position_ids"):
            tails = [torch.arange(n - len(r[key])) if key == "position_ids" else torch.full((n - len(r[key]),), fill[key])
                     for r in rows]  # fmt: skip
            out[key] = torch.stack([torch.cat([r[key], tail]) for r, tail in zip(rows, tails)])
        return out

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        n = self.row_lengths[index]
        row: dict[str, Any] = {INPUT_IDS: self._ids[index, :n], LABELS: self._labels[index, :n],
                               "position_ids": self._positions[index, :n]}  # fmt: skip
        if self.chunks is not None:  # each group of equal parts' positions, (parts, tokens): the layout, in shapes
            row[PACKED_PARTS], at = [], 0
            for size in sorted(set(self.parts), reverse=True):
                k = self.parts.count(size)
                row[PACKED_PARTS].append(self._positions[index, at : at + k * size].view(k, size))
                at += k * size
        return row

    def summary(self) -> str:
        """The packing in one line: samples, rows, real-token share.

        Example:
            >>> PackedDataset([{"input_ids": [1, 2, 3]}, {"input_ids": [4]}], length=4).summary()
            'packed 2 samples (4 tokens) into 1 rows of 4: 100.0% real tokens'
        """
        cut = (f", {len(self.split)} longer than {self.length} cut into {sum(self.split.values())} pieces" if self.split
               else "")  # fmt: skip
        return (f"packed {self.samples} samples ({self.real_tokens} tokens{cut}) into {self._rows()}: {self.fill:.1%} real "
                f"tokens")  # fmt: skip

    def _rows(self) -> str:
        if self.chunks is not None:
            chunks = " + ".join(f"{self.parts.count(n)} x {n}" for n in sorted(set(self.chunks), reverse=True)) or "none"
            return f"{len(self)} rows of {self.length} ({self.parts[0]}, then chunks {chunks})"
        if len(self.lengths) == 1:
            return f"{len(self)} rows of {self.length}"
        counts = "/".join(str(self.row_lengths.count(n)) for n in self.lengths)
        return f"{len(self)} rows of {'/'.join(map(str, self.lengths))} ({counts})"

    def __repr__(self) -> str:
        return f"PackedDataset({self.samples} samples in {self._rows()}, {self.fill:.1%} real tokens)"
