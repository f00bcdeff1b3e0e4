"""Files that survive a kill -9: atomic writes, stale temporaries, folder locks.

Every file tpu_utility writes (checkpoints, cache shards, presized images) is
written under a temporary name in the same folder and renamed over its target
when complete, so a reader sees the old file or the new one, never half of one.
Temporary names start with a dot and end with ``.tpu-partial``: no image loader
(``ImageFolder``'s extensions), glob or shard pattern picks them up, and the
next writer removes those whose process died. Files get the usual permissions
(0644 under a default umask), not ``mkstemp``'s 0600.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import secrets
import shutil
import socket
import time
import warnings
from typing import IO, Any, Iterator

from . import remote

TEMP_SUFFIX = ".tpu-partial"
LOCK_NAME = ".tpu_utility.lock"
# The names releases before this module gave temporaries (mkstemp's 8 random characters).
_OLD_TEMP = re.compile(r"^\.tmp-[a-z0-9_]{8}(\.[A-Za-z]+)?$")


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def temp_path(path: str) -> str:
    """A fresh temporary name next to ``path``: ``.<name>.<host>.<pid>.<token>.tpu-partial``."""
    folder, name = os.path.split(os.path.abspath(path))
    return os.path.join(folder, f".{name}.{_host()}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}")


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # os.kill(pid, 0) would send CTRL_C there: leave such temporaries alone
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return True


def _is_stale(name: str, old_suffixes: tuple[str, ...]) -> bool:
    old = _OLD_TEMP.match(name)
    if old:
        return (old.group(1) or "").lower() in old_suffixes
    if not (name.startswith(".") and name.endswith(TEMP_SUFFIX)):
        return False
    parts = name[: -len(TEMP_SUFFIX)].rsplit(".", 3)
    if len(parts) != 4 or not parts[2].isdigit():
        return False
    _, host, pid, _ = parts
    return host == _host() and not _pid_alive(int(pid))  # another host's live write is left alone


def check_file_path(path: str | os.PathLike, what: str = "path") -> None:
    """Refuses a path where a file is to be written that is an existing folder (a URL is not checked).

    Raises:
        ValueError: ``path`` is a folder, named with a file path inside it as the way on.
    """
    path = os.fspath(path)
    if not remote.is_url(path) and os.path.isdir(path):
        raise ValueError(
            f"{what} {path!r} is a folder, not a file; give the path of a file to write, such as "
            f"{os.path.join(path, 'name')!r}"
        )


def write_json(path: str, obj: Any, indent: int | None = None) -> None:
    """``obj`` as JSON (sorted keys), written atomically."""
    with atomic_write(path) as f:
        f.write(json.dumps(obj, indent=indent, sort_keys=True).encode())


def join(folder: str | os.PathLike, name: str) -> str:
    """``folder/name``, for a local folder or a URL (``gs://bucket/run``)."""
    return remote.join(folder, name) if remote.is_url(folder) else os.path.join(folder, name)


def exists(path: str) -> bool:
    """Whether the file (or folder) exists, locally or at a URL."""
    return remote.exists(path) if remote.is_url(path) else os.path.exists(path)


def remove(path: str) -> None:
    """Deletes a file, locally or at a URL; ``FileNotFoundError`` when there is none."""
    if remote.is_url(path):
        remote.remove(path)
    else:
        os.unlink(path)


def remove_stale_temporaries(folder: str, old_suffixes: tuple[str, ...] = ()) -> list[str]:
    """Deletes temporaries in ``folder`` (not below) left by killed tpu_utility writers.

    Nothing is written under a temporary name at a URL (one whole-object put), so a URL
    has none. ``old_suffixes`` also removes ``.tmp-XXXXXXXX<suffix>`` files, the names earlier
    releases used; pass only the suffixes that release wrote in this kind of folder.
    """
    removed: list[str] = []
    if remote.is_url(folder):
        return removed
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(folder):
            if _is_stale(name, old_suffixes):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(folder, name))
                    removed.append(name)
    return removed


def _fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):  # not every filesystem (or OS) allows it
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Upload(io.BytesIO):
    """The bytes for one put; they outlive a wrapper (``io.TextIOWrapper``) that closes the buffer."""

    _closed_value: bytes | None = None

    def close(self) -> None:
        if not self.closed:
            self._closed_value = self.getvalue()
        super().close()

    def value(self) -> bytes:
        return self._closed_value if self.closed and self._closed_value is not None else self.getvalue()


@contextlib.contextmanager
def atomic_write(path: str, durable: bool = True, size: int | None = None) -> Iterator[IO[bytes]]:
    """Opens a temporary file for writing; on success it is renamed over ``path``.

    On an exception the temporary is removed and ``path`` is untouched; after a
    kill -9, the temporary is left for ``remove_stale_temporaries``. ``durable``
    also flushes the file and its folder to disk (against power loss, not needed
    against a kill; costly for many small files). A write that fails for lack of
    space (or another ``OSError``) raises one ``OSError`` naming the file, the free
    space and the size needed (``size``, the bytes about to be written, when the
    caller knows it), and saying that the previous file is intact. A ``path`` that is a
    folder is a ``ValueError`` at once, before anything is written.

    Example:
        >>> # was: with open(path, "wb") as f: f.write(data)   (a kill leaves half a file)
        >>> with atomic_write(path) as f:          # doctest: +SKIP
        ...     f.write(data)

    At a URL (``gs://``, ``memory://``) the bytes are buffered and written as one
    whole-object put on success; nothing is written on an exception.
    """
    if remote.is_url(path):
        upload = _Upload()
        yield upload
        remote.write_bytes(path, upload.value())
        return
    check_file_path(path)  # os.replace onto a folder fails after the write, with advice about disk space
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as for open()
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise write_failed(path, e, size or 0, known=size is not None) from e
        raise OSError(e.errno, f"cannot write {path}: {e.strerror}") from e  # PermissionError etc. kept
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        written = 0
        with contextlib.suppress(OSError):
            written = os.path.getsize(tmp)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        cause = _os_error(error)
        if cause is None or isinstance(error, WriteError):
            raise
        raise write_failed(path, cause, max(size or 0, written), known=size is not None) from error
    if durable:
        _fsync_folder(os.path.dirname(os.path.abspath(path)))


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: the error itself or one it was raised from.

    torch.save reports a failed write as a RuntimeError ("enforce fail at
    inline_container.cc") raised while handling the OSError.
    """
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError):
            return error
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"  # unreachable


class WriteError(OSError):
    """A file could not be written (disk full, quota, I/O error); the message says what is intact."""


def write_failed(path: str, cause: OSError, needed: int, known: bool = True) -> WriteError:
    """The error for a file that could not be written: which file, free space, size needed, what is intact."""
    folder = os.path.dirname(os.path.abspath(path))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        free = None
    full = cause.errno in (errno.ENOSPC, errno.EDQUOT) or (free is not None and free < needed)
    what = "the disk is full" if full else f"{cause.strerror or cause}"
    space = f"{_size(free)} free on its filesystem" if free is not None else "free space unknown"
    need = f"{'about' if known else 'at least'} {_size(needed)} needed" if known or needed else "size needed unknown"
    name = os.path.basename(path)
    kept = f"the previous {name} is intact" if os.path.exists(path) else f"no {name} existed before and none was left"
    return WriteError(
        cause.errno or (errno.ENOSPC if full else errno.EIO),
        f"cannot write {path}: {what} ({space}, {need}). Nothing was replaced: {kept}. "
        f"Free some space or write to a larger disk, then run again",
    )


def _try_lock(fd: int) -> bool:
    try:
        import fcntl
    except ImportError:  # Windows
        import msvcrt

        try:
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
            return True
        except OSError:
            return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _holder(lock_path: str) -> str:
    try:
        with open(lock_path) as f:
            return f.read().strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def folder_lock(folder: str, purpose: str, timeout: float | None = 0.0) -> Iterator[str]:
    """Holds ``folder/.tpu_utility.lock`` so one process at a time writes the folder.

    The lock is an OS file lock: it is released when the holder exits, even by
    kill -9, so a crash never leaves the folder locked.

    Args:
        folder: The folder to lock (created if missing).
        purpose: What the holder does, for the error message ("building a cache").
        timeout: Seconds to wait for another holder; 0 refuses at once, None waits
            as long as it takes (with a warning naming the holder).

    Raises:
        RuntimeError: another process holds the folder and did not let go in time.

    Example:
        >>> # was: two notebooks writing one checkpoint folder, each overwriting the other
        >>> with folder_lock("checkpoints", "training"):   # doctest: +SKIP
        ...     train()

    A URL has no lock that a crashed holder releases: there it holds nothing (see
    ``tpu_utility.remote``), and two runs must not share one URL.
    """
    if remote.is_url(folder):
        yield folder
        return
    os.makedirs(folder, exist_ok=True)
    lock_path = os.path.join(folder, LOCK_NAME)
    start, warned = time.monotonic(), False
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o666)
        if _try_lock(fd):
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                same = False
            if same:
                break  # not a file the last holder just unlinked
        os.close(fd)
        waited = time.monotonic() - start
        if timeout is not None and waited >= timeout:
            raise RuntimeError(
                f"{folder!r} is in use by another process ({_holder(lock_path)}); one process at a time may "
                f"write it. Wait for that one to finish, stop it, or use another folder"
            )
        if not warned and timeout is None:
            warnings.warn(f"waiting for another process ({_holder(lock_path)}) to finish with {folder!r}", stacklevel=3)
            warned = True
        time.sleep(0.2)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}, {purpose}".encode())
        yield lock_path
    finally:
        with contextlib.suppress(OSError):  # gone already, or (Windows) still open
            os.unlink(lock_path)
        os.close(fd)
