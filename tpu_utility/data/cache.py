"""Preprocess once: cache_dataset() and CachedDataset.

Decoding and augmenting images on a notebook's 2-4 vCPUs starves a TPU. Run
the expensive part of the pipeline once, store the results in a few large
``.npy`` shards (numpy's own format: no pickle), and train from memory-mapped
shards. ``copies=K`` stores K differently augmented passes; ``set_epoch``
serves a different one each epoch.

A build is crash-safe: each shard is written under a temporary name and
renamed when complete, the manifest is written last, and every sample is
produced from its own seed ``(seed, copy, index)``, so re-running an
interrupted build resumes it and gives byte-identical files. The manifest holds
a fingerprint of the source (its length and a hash of samples spread over it):
a folder holding a cache of other data, or an interrupted build of other data,
is refused rather than reused or mixed. A lock file lets one build at a time
write a folder; a second build waits for it, then reuses its result.

Nothing here touches torch_xla: a cache can be built on a machine without a TPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import operator
import random
import re
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from .. import backend
from ..files import LOCK_NAME, TEMP_SUFFIX, atomic_write, folder_lock, write_json
from ..progress import progress_bar

FORMAT = "tpu_utility.cache/1"
MANIFEST = "manifest.json"
PLAN = "build.json"
_SHARD = re.compile(r"^copy\d+-shard\d+-f\d+\.npy$")
_FINGERPRINT_SAMPLES = 32


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


@contextmanager
def _callers_rng_kept() -> Iterator[None]:
    """Restores the caller's torch (CPU), random and numpy streams, which _Seeded reseeds."""
    python_state, numpy_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        random.setstate(python_state)
        np.random.set_state(numpy_state)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _is_temporary(name: str) -> bool:
    return name.startswith(".tmp-") or name.endswith(TEMP_SUFFIX)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode())
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise _damaged(path, f"it holds a {type(obj).__name__}, not a JSON object")
    return obj


def _damaged(path: str, why: str) -> ValueError:
    folder = os.path.dirname(path) or "."
    return ValueError(f"{path} is damaged ({why}); delete {folder!r} and build the cache again with cache_dataset")


def _identity_of(plan: dict[str, Any]) -> dict[str, Any]:
    """What must match for a folder to hold the same cache (not package versions)."""
    identity = {k: v for k, v in plan.items() if k not in ("shards", "versions")}
    identity.setdefault("source", None)  # a cache built before fingerprints: not comparable
    return identity


def _differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between two plans, in words."""
    old, new = _identity_of(old), _identity_of(new)
    if old["source"] is None:
        new = {**new, "source": None}
    out = []
    for key in sorted(set(old) | set(new)):
        if key == "source" or old.get(key) == new.get(key):
            continue
        out.append(f"{key} is {old.get(key)!r} there, {new.get(key)!r} now")
    if old["source"] != new["source"]:
        was, now = old["source"] or {}, new["source"] or {}
        changed = [i for i in now.get("samples", {}) if was.get("samples", {}).get(i) != now["samples"][i]]
        if was.get("count") != now.get("count"):
            out.append(f"the dataset has {was.get('count')} samples there, {now.get('count')} now")
        if changed:
            out.append(
                f"samples {', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''} hold other values (if the "
                f"data is the same, its augmentation draws from a random source cache_dataset cannot seed)"
            )
        if not changed and was.get("count") == now.get("count"):
            out.append("the source fingerprint differs")
    return out


def _sample_hash(sample: Any, index: int) -> str:
    digest = hashlib.sha256()
    for position, value in enumerate(_fields_of(sample)[0]):
        array, kind = _to_array(value, index, position)
        digest.update(f"{kind}/{array.dtype}/{array.shape}/".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


def _fingerprint(dataset: Dataset, n: int, seed: int) -> dict[str, Any]:
    """The source's length and the hashes of samples spread over it (as stored in copy 0)."""
    seeded = _Seeded(dataset, seed, 0)
    k = min(n, _FINGERPRINT_SAMPLES)
    indices = sorted({i * n // k for i in range(k)})
    samples = {str(i): _sample_hash(seeded[i], i) for i in indices}
    if _sample_hash(seeded[indices[0]], indices[0]) != samples[str(indices[0])]:
        warnings.warn(
            "the dataset gives different values for one sample under one seed (a random source that "
            "cache_dataset cannot seed), so the cache is not reproducible and a resumed or reused build "
            "cannot be checked against the data beyond its length and shapes",
            stacklevel=3,
        )
        return {"count": n, "samples": {}}
    return {"count": n, "samples": samples}


def _keep(sample: Any) -> Any:
    return sample


def _shard_name(copy: int, shard: int, field: int) -> str:
    return f"copy{copy:03d}-shard{shard:05d}-f{field}.npy"


def _check_target(path: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"cache path {path!r} exists and is a file; give a new or empty folder")
    if not os.path.isdir(path):
        return
    foreign = [n for n in os.listdir(path) if n not in (MANIFEST, PLAN, LOCK_NAME) and not _SHARD.match(n) and not _is_temporary(n)]
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
        path: A new or empty folder, or one an earlier build of the same data
            left: a complete cache is reused, an interrupted one resumed, missing
            or short shards rebuilt. Another build of the folder running at the
            same time is waited for.
        copies: Differently augmented passes to store; ``CachedDataset.set_epoch``
            serves copy ``epoch % copies``.
        shard_mb: Target size of one shard file.
        seed: Seeds each sample's augmentation as ``(seed, copy, index)``. The
            caller's torch, random and numpy random states are the same after
            the call as before it.
        num_workers: DataLoader workers running the dataset in parallel.
        progress: A progress bar (a widget in notebooks; none in logs).

    Returns:
        The path of the manifest.

    Raises:
        ValueError: an empty dataset, samples whose shapes or dtypes differ, a path
            that holds something else, or a cache (or interrupted build) of other
            data: the error lists what differs (length, samples, seed, copies...).
        TypeError: a sample part that is not a tensor, array or number (a string,
            a PIL image not converted to a tensor).

    Example:
        >>> # was: ImageFolder(root, transform=augment) decoded on every epoch
        >>> cache_dataset(ImageFolder(root, transform=augment), "cache/train", copies=4)  # doctest: +SKIP
        >>> train_ds = CachedDataset("cache/train", transform=to_float)                  # doctest: +SKIP
    """
    _check_arguments(dataset, copies, shard_mb, seed, num_workers)
    _check_target(path)
    os.makedirs(path, exist_ok=True)
    manifest_path = os.path.join(path, MANIFEST)
    with _callers_rng_kept():  # the per-sample seeding must not change the user's later random numbers
        plan = _plan(dataset, copies, shard_mb, seed)
        if _complete(path, plan):
            return manifest_path  # nothing to write: no lock needed (the folder may be read-only)
        with folder_lock(path, "building a cache with cache_dataset", timeout=None):
            if _complete(path, plan):  # another build finished while this one waited
                return manifest_path
            _build(dataset, path, plan, num_workers, progress)
    return manifest_path


def _check_arguments(dataset: Dataset, copies: int, shard_mb: float, seed: int, num_workers: int) -> None:
    if not hasattr(dataset, "__len__"):
        raise TypeError(f"dataset must be a map-style Dataset with __len__, but given {type(dataset).__name__}")
    if len(dataset) == 0:
        raise ValueError("dataset is empty (len(dataset) == 0); there is nothing to cache")
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ValueError(f"copies must be a positive int, but given {copies!r}")
    if isinstance(shard_mb, bool) or not isinstance(shard_mb, (int, float)) or not 0 < shard_mb < float("inf"):
        raise ValueError(f"shard_mb must be a finite number > 0 (megabytes per shard), but given {shard_mb!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, but given {seed!r} of type {type(seed).__name__}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers must be an int >= 0, but given {num_workers!r}")


def _plan(dataset: Dataset, copies: int, shard_mb: float, seed: int) -> dict[str, Any]:
    """What the folder will hold: counts, sample layout, the source's fingerprint."""
    n = len(dataset)
    fields, is_tuple = _describe(_Seeded(dataset, seed, 0)[0], 0)
    sample_bytes = sum(np.dtype(f.dtype).itemsize * int(np.prod(f.shape)) for f in fields)
    return {
        "format": FORMAT,
        "count": n,
        "copies": copies,
        "seed": seed,
        "samples_per_shard": max(1, int(shard_mb * 2**20) // max(sample_bytes, 1)),
        "tuple": is_tuple,
        "fields": [f.as_dict() for f in fields],
        "source": _fingerprint(dataset, n, seed),
        "versions": {"numpy": np.__version__, "torch": str(torch.__version__), "tpu_utility": backend.installed_version("tpu_utility") or ""},
    }


def _complete(path: str, plan: dict[str, Any]) -> bool:
    """True when the folder holds this cache, whole; raises when it holds another one."""
    manifest_path, plan_path = os.path.join(path, MANIFEST), os.path.join(path, PLAN)
    for existing in (manifest_path, plan_path):
        if os.path.exists(existing):
            old = _read_manifest(existing) if existing == manifest_path else _read_json(existing)
            differences = _differences(old, plan)
            if differences:
                what = "a cache" if existing == manifest_path else "an interrupted build"
                raise ValueError(
                    f"{path!r} holds {what} of other data ({existing}): {'; '.join(differences)}. "
                    f"Give a new folder, or delete this one to rebuild it"
                )
    return os.path.exists(manifest_path) and not _problems(path, _read_manifest(manifest_path))


def _build(dataset: Dataset, path: str, plan: dict[str, Any], num_workers: int, progress: bool) -> None:
    manifest_path, plan_path = os.path.join(path, MANIFEST), os.path.join(path, PLAN)
    if os.path.exists(manifest_path):  # shards missing or short since: rebuild those
        for file in _problems(path, _read_manifest(manifest_path)):
            if os.path.exists(file):
                os.unlink(file)
    write_json(plan_path, plan, indent=1)
    if os.path.exists(manifest_path):
        os.unlink(manifest_path)
    for name in os.listdir(path):
        if _is_temporary(name):
            os.unlink(os.path.join(path, name))  # an interrupted write (we hold the lock: none is running)

    n, per_shard, copies = plan["count"], plan["samples_per_shard"], plan["copies"]
    fields = [_Field(f["kind"], f["dtype"], tuple(f["shape"])) for f in plan["fields"]]
    shards = []
    bar = progress_bar(n * copies, "caching", enabled=progress, unit="sample")
    for copy in range(copies):
        for shard in range(-(-n // per_shard)):
            start, stop = shard * per_shard, min((shard + 1) * per_shard, n)
            names = [_shard_name(copy, shard, j) for j in range(len(fields))]
            if not all(os.path.exists(os.path.join(path, name)) for name in names):
                _build_shard(_Seeded(dataset, plan["seed"], copy), path, names, fields, range(start, stop), num_workers)
            shards.append({
                "copy": copy, "start": start, "count": stop - start,
                "files": [{"name": name, "sha256": _sha256(os.path.join(path, name))} for name in names],
            })  # fmt: skip
            bar.update(stop - start)
    bar.close()
    write_json(manifest_path, {**plan, "shards": shards}, indent=1)
    os.unlink(plan_path)


def _build_shard(seeded: Dataset, path: str, names: list[str], fields: list[_Field], rows: range,
                 num_workers: int) -> None:  # fmt: skip
    """Samples ``rows`` of ``seeded``, one .npy file per part, each checked against sample 0's shape and dtype."""
    start = rows.start
    columns = [np.empty((len(rows), *f.shape), dtype=f.dtype) for f in fields]
    subset = torch.utils.data.Subset(seeded, rows)
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
            if str(array.dtype) != field.dtype:
                raise ValueError(
                    f"sample {index}, part {j} is {array.dtype} but sample 0 is {field.dtype}; a cache stores one "
                    f"dtype per part and does not cast (1.5 would become 1). Give every sample the same type "
                    f"(for example float(y) or x.to(torch.float32) in the transform)"
                )
            columns[j][offset] = array
    for name, column in zip(names, columns):
        with atomic_write(os.path.join(path, name), size=column.nbytes) as f:
            np.save(f, column, allow_pickle=False)


def _read_manifest(manifest_path: str) -> dict[str, Any]:
    """The manifest, its structure checked: a damaged one is an error naming it."""
    manifest = _read_json(manifest_path)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{manifest_path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    try:
        count, copies, per_shard = (int(manifest[k]) for k in ("count", "copies", "samples_per_shard"))
        fields = [(str(f["kind"]), np.dtype(f["dtype"]), tuple(int(d) for d in f["shape"])) for f in manifest["fields"]]
        shards, n_shards = manifest["shards"], -(-count // per_shard)
        if min(count, copies, per_shard) < 1 or not fields or len(shards) != copies * n_shards:
            raise ValueError(f"{len(shards)} shards for {count} samples x {copies} copies")
        for k, shard in enumerate(shards):
            start = (k % n_shards) * per_shard
            if (shard["start"], shard["count"]) != (start, min(per_shard, count - start)) or len(shard["files"]) != len(fields):
                raise ValueError(f"shard {k} does not fit the counts")
            for entry in shard["files"]:
                if not (isinstance(entry["name"], str) and _SHARD.match(entry["name"]) and isinstance(entry["sha256"], str)):
                    raise ValueError(f"shard {k} names no shard file")
    except (KeyError, TypeError, ValueError, IndexError) as e:
        raise _damaged(manifest_path, f"{type(e).__name__}: {e}") from None
    return manifest


def _shard_problem(file: str, count: int, field: dict[str, Any]) -> str | None:
    """Why a shard does not hold ``count`` samples of ``field`` (cheap: header and size), or None."""
    if not os.path.exists(file):
        return f"{file} is missing"
    try:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
            header = f.tell()
            size = os.fstat(f.fileno()).st_size
    except (ValueError, OSError, SyntaxError) as e:
        return f"{file} is damaged: its header cannot be read ({e})"
    want = (count, *field["shape"])
    if tuple(shape) != want or str(dtype) != field["dtype"]:
        return f"{file} holds {dtype}{tuple(shape)}, not {field['dtype']}{want} as the manifest says"
    expected = header + int(np.prod(shape)) * dtype.itemsize
    if size != expected:
        return f"{file} is {size} bytes but its header says {expected}: the shard is damaged (truncated?)"
    return None


def _problems(path: str, manifest: dict[str, Any]) -> dict[str, str]:
    """Every shard file that is missing, short or of another shape, with why."""
    out = {}
    for shard in manifest["shards"]:
        for entry, field in zip(shard["files"], manifest["fields"]):
            file = os.path.join(path, entry["name"])
            problem = _shard_problem(file, shard["count"], field)
            if problem:
                out[file] = problem
    return out


class CachedDataset(Dataset):
    """A Dataset over a cache_dataset folder: memory-mapped shards, fast random access.

    Args:
        path: The folder cache_dataset wrote.
        verify: Check every shard's SHA-256 against the manifest first (shard
            headers and sizes are always checked: that is cheap).
        transform: Applied to each sample after reading (keep it cheap, for
            example uint8 -> float and Normalize).

    Raises:
        FileNotFoundError: the manifest or a shard is missing (an incomplete build).
        ValueError: a damaged manifest, or a shard whose size, header or checksum
            does not match the manifest.

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
        self.manifest = _read_manifest(manifest_path)
        self.count, self.copies = self.manifest["count"], self.manifest["copies"]
        self.per_shard = self.manifest["samples_per_shard"]
        self.fields = self.manifest["fields"]
        self.epoch = 0
        self._shards = self.manifest["shards"]
        for file, problem in _problems(path, self.manifest).items():  # cheap: headers and sizes
            error = FileNotFoundError if not os.path.exists(file) else ValueError
            raise error(f"{problem}; {path!r} is not a whole cache. Re-run cache_dataset with the same arguments to rebuild it")
        if verify:
            for shard in self._shards:
                for entry in shard["files"]:
                    file = os.path.join(path, entry["name"])
                    if _sha256(file) != entry["sha256"]:
                        raise ValueError(f"{file} does not match its checksum in {manifest_path}: the cache is corrupt")
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
        try:
            index = operator.index(index)  # an int, a numpy integer or a 0-d integer tensor
        except TypeError:
            raise TypeError(
                f"CachedDataset indices must be integers, but given {index!r} of type {type(index).__name__}; "
                f"use int(...) for one sample, or a DataLoader / torch.utils.data.Subset for several"
            ) from None
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
