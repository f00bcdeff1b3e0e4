"""Folders given as URLs (``gs://``, ``s3://``, ``memory://``): run files written through fsspec.

A TPU VM's disk goes with the VM, so users write checkpoints to a bucket:
``one_cycle_fit(..., checkpoint_dir="gs://bucket/run")``. Every file tpu_utility writes
there is one whole-object put (``fs.pipe_file``): object stores make an object appear
whole or not at all, so a reader sees the old ``last.pt`` or the new one, as with the
rename used for local files. fsspec is an optional extra (``pip install fsspec gcsfs``); a
URL whose filesystem package is missing is refused at once with the ``pip install`` line,
never written as a local folder named ``gs:``.

A bucket has no lock a crashed writer releases, so two runs writing one URL at once are
not stopped as they are in a local folder: give each run its own URL.
"""

from __future__ import annotations

import re
from typing import Any

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: Any) -> bool:
    """True for ``scheme://...`` strings (not ``file://``: a local path is written as one)."""
    return isinstance(path, str) and bool(_URL.match(path)) and not path.startswith("file://")


def filesystem(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    Raises:
        ModuleNotFoundError: fsspec, or the package of the URL's filesystem (gcsfs for
            ``gs://``, s3fs for ``s3://``), is not installed; the message has the pip line.
        ValueError: fsspec knows no filesystem for the URL's scheme.

    Example:
        >>> # was: open("gs://bucket/run/last.pt", "wb")   (a local folder named gs:)
        >>> fs, path = filesystem("memory://run")
        >>> path
        '/run'
    """
    protocol = url.split("://", 1)[0]
    try:
        import fsspec
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            f"{url!r} is a URL, which tpu_utility writes through fsspec; it is not installed: pip install fsspec "
            f"(and the filesystem's own package: gcsfs for gs://, s3fs for s3://)"
        ) from None
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as error:  # fsspec knows the filesystem; its package is missing
        from fsspec.registry import known_implementations

        known = known_implementations.get(protocol, {})
        package = known.get("class", protocol).split(".")[0]
        raise ModuleNotFoundError(
            f"{url!r} needs the {package} package for {protocol}:// URLs: pip install {package}"
        ) from error
    except ValueError as error:
        known = ", ".join(f"{p}://" for p in ("gs", "s3", "az", "hf", "memory") if p in fsspec.available_protocols())
        raise ValueError(f"{url!r}: fsspec has no filesystem for {protocol}:// (known ones include {known})") from error


def join(folder: str, name: str) -> str:
    """``folder/name`` for a URL (``os.path.join`` would keep a local separator)."""
    return folder.rstrip("/") + "/" + name


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def is_folder(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.isdir(path)


def read_bytes(url: str) -> bytes:
    """The whole object; ``FileNotFoundError`` naming the URL when there is none."""
    fs, path = filesystem(url)
    try:
        return fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{url} does not exist") from None


def write_bytes(url: str, data: bytes) -> None:
    """One whole-object put: the object is replaced whole or not at all."""
    fs, path = filesystem(url)
    parent = path.rsplit("/", 1)[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)  # a no-op on object stores; memory:// and local need it
    fs.pipe_file(path, data)


def remove(url: str) -> None:
    """Deletes the object; ``FileNotFoundError`` when there is none."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        raise FileNotFoundError(url)
    fs.rm_file(path)


def check_folder(url: str) -> None:
    """A URL usable as a folder, checked before any epoch is spent (the filesystem installed, not a file)."""
    fs, path = filesystem(url)
    if fs.isfile(path):
        raise ValueError(f"checkpoint_dir={url!r} is a file, not a folder")
    fs.makedirs(path, exist_ok=True)
