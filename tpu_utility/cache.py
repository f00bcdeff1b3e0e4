"""Preprocess once: cache_dataset() and CachedDataset.

Decoding and augmenting images on a notebook's 2-4 vCPUs starves a TPU. Run
the expensive part of the pipeline once, store the results in a few large
``.npy`` shards (numpy's own format: no pickle), and train from memory-mapped
shards. ``copies=K`` stores K differently augmented passes; ``set_epoch``
serves a different one each epoch.

A build is crash-safe: each shard is written under a temporary name and
renamed when complete, the manifest is written last, and every sample is
produced from its own seed ``(seed, copy, index)``, so re-running an
interrupted build resumes it and gives byte-identical files.

Nothing here touches torch_xla: a cache can be built on a machine without a TPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from . import xla

FORMAT = "tpu_utility.cache/1"
MANIFEST = "manifest.json"
PLAN = "build.json"
_SHARD = re.compile(r"^copy\d+-shard\d+-f\d+\.npy$")


@dataclass(frozen=True)
class _Field:
    kind: str  # "tensor", "int" or "float"
    dtype: str
    shape: tuple[int, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "dtype": self.dtype, "shape": list(self.shape)}


def _fields_of(sample: Any) -> tuple[list[Any], bool]:
    """The sample's parts, and whether it was a tuple/list (or a single value)."""
    if isinstance(sample, (tuple, list)):
        return list(sample), True
    return [sample], False


def _to_array(value: Any, index: int, position: int) -> tuple[np.ndarray, str]:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy(), "tensor"
    if isinstance(value, np.ndarray):
        return value, "tensor"
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return np.asarray(value, dtype=np.int64), "int"
    if isinstance(value, (float, np.floating)):
        return np.asarray(value, dtype=np.float64), "float"
    hint = ""
    if type(value).__module__.startswith("PIL"):
        hint = " Convert images to tensors in the transform (transforms.PILToTensor() or ToTensor())."
    raise TypeError(
        f"sample {index}, part {position} is a {type(value).__name__}; a cache stores tensors, numpy "
        f"arrays, ints and floats.{hint}"
    )


def _describe(sample: Any, index: int) -> tuple[list[_Field], bool]:
    parts, is_tuple = _fields_of(sample)
    fields = []
    for position, value in enumerate(parts):
        array, kind = _to_array(value, index, position)
        fields.append(_Field(kind, str(array.dtype), tuple(array.shape)))
    return fields, is_tuple


def _seed_for(seed: int, copy: int, index: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{copy}/{index}".encode()).digest()[:8], "little") >> 1


class _Seeded(Dataset):
    """Seeds torch, random and numpy per sample, so each is reproducible on its own."""

    def __init__(self, dataset: Dataset, seed: int, copy: int) -> None:
        self.dataset, self.seed, self.copy = dataset, seed, copy

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        s = _seed_for(self.seed, self.copy, index)
        torch.manual_seed(s)
        random.seed(s)
        np.random.seed(s % 2**32)
        return self.dataset[index]


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json_atomic(obj: Any, path: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _identity_of(plan: dict[str, Any]) -> dict[str, Any]:
    """What must match for a folder to hold the same cache (not package versions)."""
    return {k: v for k, v in plan.items() if k not in ("shards", "versions")}


def _keep(sample: Any) -> Any:
    return sample


def _shard_name(copy: int, shard: int, field: int) -> str:
    return f"copy{copy:03d}-shard{shard:05d}-f{field}.npy"


def _check_target(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cache path {path!r} exists and is a file; give a new or empty folder")
    if not os.path.isdir(path):
        return
    foreign = [n for n in os.listdir(path) if n not in (MANIFEST, PLAN) and not _SHARD.match(n) and not n.startswith(".tmp-")]
    if foreign:
        raise ValueError(
            f"cache path {path!r} exists and holds something else ({', '.join(sorted(foreign)[:3])}); "
            f"give a new or empty folder, or a folder an earlier cache_dataset build wrote"
        )


def cache_dataset(
    dataset: Dataset,
    path: str,
    *,
    copies: int = 1,
    shard_mb: float = 256.0,
    seed: int = 0,
    num_workers: int = 0,
    progress: bool = True,
) -> str:
    """Runs ``dataset`` (transforms and augmentations included) once and stores the results.

    Args:
        dataset: A map-style dataset whose samples are tensors, numpy arrays,
            ints or floats, or tuples of them, with the same shapes in every sample.
        path: A new or empty folder (or one an interrupted build left: it resumes).
        copies: Differently augmented passes to store; ``CachedDataset.set_epoch``
            serves copy ``epoch % copies``.
        shard_mb: Target size of one shard file.
        seed: Seeds each sample's augmentation as ``(seed, copy, index)``.
        num_workers: DataLoader workers running the dataset in parallel.
        progress: A tqdm bar.

    Returns:
        The path of the manifest.

    Raises:
        ValueError: an empty dataset, samples whose shapes differ, or a path that
            holds something else.
        TypeError: a sample part that is not a tensor, array or number (a string,
            a PIL image not converted to a tensor).

    Example:
        >>> # was: ImageFolder(root, transform=augment) decoded on every epoch
        >>> cache_dataset(ImageFolder(root, transform=augment), "cache/train", copies=4)  # doctest: +SKIP
        >>> train_ds = CachedDataset("cache/train", transform=to_float)                  # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    if not hasattr(dataset, "__len__"):
        raise TypeError(f"dataset must be a map-style Dataset with __len__, but given {type(dataset).__name__}")
    n = len(dataset)
    if n == 0:
        raise ValueError("dataset is empty (len(dataset) == 0); there is nothing to cache")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive int, but given {copies!r}")
    _check_target(path)
    os.makedirs(path, exist_ok=True)

    fields, is_tuple = _describe(_Seeded(dataset, seed, 0)[0], 0)
    sample_bytes = sum(np.dtype(f.dtype).itemsize * int(np.prod(f.shape)) for f in fields)
    per_shard = max(1, int(shard_mb * 2**20) // max(sample_bytes, 1))
    plan = {
        "format": FORMAT,
        "count": n,
        "copies": copies,
        "seed": seed,
        "samples_per_shard": per_shard,
        "tuple": is_tuple,
        "fields": [f.as_dict() for f in fields],
        "versions": {"numpy": np.__version__, "torch": str(torch.__version__), "tpu_utility": xla.installed_version("tpu_utility") or ""},
    }
    manifest_path = os.path.join(path, MANIFEST)
    plan_path = os.path.join(path, PLAN)
    for existing in (manifest_path, plan_path):
        if os.path.exists(existing):
            with open(existing) as f:
                old = json.load(f)
            if _identity_of(old) != _identity_of(plan):
                raise ValueError(
                    f"{existing} describes a different cache (count, copies, seed or sample shapes differ); "
                    f"give a new folder or delete this one"
                )
    if os.path.exists(manifest_path):
        return manifest_path  # already complete
    _write_json_atomic(plan, plan_path)
    for name in os.listdir(path):
        if name.startswith(".tmp-"):
            os.unlink(os.path.join(path, name))  # an interrupted write

    n_shards = -(-n // per_shard)
    shards = []
    bar = tqdm(total=n * copies, desc="caching", unit="sample", disable=not progress)
    for copy in range(copies):
        for shard in range(n_shards):
            start, stop = shard * per_shard, min((shard + 1) * per_shard, n)
            names = [_shard_name(copy, shard, j) for j in range(len(fields))]
            if not all(os.path.exists(os.path.join(path, name)) for name in names):
                _build_shard(dataset, path, names, fields, is_tuple, seed, copy, start, stop, num_workers)
            shards.append({
                "copy": copy, "start": start, "count": stop - start,
                "files": [{"name": name, "sha256": _sha256(os.path.join(path, name))} for name in names],
            })  # fmt: skip
            bar.update(stop - start)
    bar.close()
    _write_json_atomic({**plan, "shards": shards}, manifest_path)
    os.unlink(plan_path)
    return manifest_path


def _build_shard(dataset: Dataset, path: str, names: list[str], fields: list[_Field], is_tuple: bool,
                 seed: int, copy: int, start: int, stop: int, num_workers: int) -> None:  # fmt: skip
    columns = [np.empty((stop - start, *f.shape), dtype=f.dtype) for f in fields]
    subset = torch.utils.data.Subset(_Seeded(dataset, seed, copy), range(start, stop))
    loader = DataLoader(subset, batch_size=None, num_workers=num_workers, collate_fn=_keep)
    for offset, sample in enumerate(loader):
        index = start + offset
        parts, _ = _fields_of(sample)
        if len(parts) != len(fields):
            raise ValueError(f"sample {index} has {len(parts)} parts, sample 0 has {len(fields)}")
        for j, (value, field) in enumerate(zip(parts, fields)):
            array, _ = _to_array(value, index, j)
            if array.shape != field.shape:
                raise ValueError(
                    f"sample {index}, part {j} has shape {tuple(array.shape)} but sample 0 has {field.shape}; "
                    f"a cache needs one shape. Resize first: presize_images(..., mode='crop') or a transform "
                    f"such as CenterCrop / RandomResizedCrop to a fixed size."
                )
            columns[j][offset] = array
    for name, column in zip(names, columns):
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=path)
        with os.fdopen(fd, "wb") as f:
            np.save(f, column, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(path, name))


class CachedDataset(Dataset):
    """A Dataset over a cache_dataset folder: memory-mapped shards, fast random access.

    Args:
        path: The folder cache_dataset wrote.
        verify: Check every shard's SHA-256 against the manifest first.
        transform: Applied to each sample after reading (keep it cheap, for
            example uint8 -> float and Normalize).

    Raises:
        FileNotFoundError: the manifest or a shard is missing (an incomplete build).
        ValueError: a shard's checksum or header does not match the manifest.

    Example:
        >>> train_ds = CachedDataset("cache/train")                          # doctest: +SKIP
        >>> for epoch in range(epochs):
        ...     train_ds.set_epoch(epoch)    # copy epoch % copies           # doctest: +SKIP
    """

    def __init__(self, path: str, verify: bool = False, transform: Callable | None = None) -> None:
        self.path, self.transform = path, transform
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.exists(manifest_path):
            state = "an interrupted build (re-run cache_dataset to resume it)" if os.path.exists(os.path.join(path, PLAN)) else "not a cache"
            raise FileNotFoundError(f"{manifest_path} is missing: {path!r} is {state}")
        with open(manifest_path) as f:
            self.manifest = json.load(f)
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{manifest_path} has format {self.manifest.get('format')!r}, expected {FORMAT!r}")
        self.count, self.copies = self.manifest["count"], self.manifest["copies"]
        self.per_shard = self.manifest["samples_per_shard"]
        self.fields = self.manifest["fields"]
        self.epoch = 0
        self._shards = self.manifest["shards"]
        for shard in self._shards:
            for entry, field in zip(shard["files"], self.fields):
                file = os.path.join(path, entry["name"])
                if not os.path.exists(file):
                    raise FileNotFoundError(f"{file} is missing from the cache at {path!r}")
                if verify and _sha256(file) != entry["sha256"]:
                    raise ValueError(f"{file} does not match its checksum in {manifest_path}: the cache is corrupt")
                header = np.load(file, mmap_mode="r")
                if header.shape != (shard["count"], *field["shape"]) or str(header.dtype) != field["dtype"]:
                    raise ValueError(f"{file} holds {header.dtype}{header.shape}, not what {manifest_path} says")
        self._open: dict[str, np.ndarray] = {}

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_open": {}}  # memory maps are reopened in each worker

    def __len__(self) -> int:
        return self.count

    def set_epoch(self, epoch: int) -> None:
        """Serve copy ``epoch % copies`` from now on (one_cycle_fit calls this)."""
        self.epoch = epoch

    def _column(self, name: str) -> np.ndarray:
        if name not in self._open:
            self._open[name] = np.load(os.path.join(self.path, name), mmap_mode="r")
        return self._open[name]

    def __getitem__(self, index: int) -> Any:
        if not -self.count <= index < self.count:
            raise IndexError(f"index {index} is out of range for a cache of {self.count} samples")
        index %= self.count
        copy = self.epoch % self.copies
        shard = self._shards[copy * -(-self.count // self.per_shard) + index // self.per_shard]
        offset = index - shard["start"]
        parts = []
        for entry, field in zip(shard["files"], self.fields):
            value = self._column(entry["name"])[offset]
            if field["kind"] == "int":
                parts.append(int(value))
            elif field["kind"] == "float":
                parts.append(float(value))
            else:
                parts.append(torch.from_numpy(np.array(value)))
        sample = tuple(parts) if self.manifest["tuple"] else parts[0]
        return self.transform(sample) if self.transform is not None else sample
