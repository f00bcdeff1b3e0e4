"""presize_images(): shrink a folder of images once, before training.

Decoding a 3000x2000 JPEG to train at 224 px wastes the host CPU every epoch.
Presizing keeps the folder structure (so ``torchvision.datasets.ImageFolder``
works on the result) and each image's format (JPEG stays JPEG, at ``quality``),
runs on every usable core, and lists unreadable images instead of stopping.

Re-running it resumes: an output is skipped only if it opens, decodes whole and
has the requested size, and the settings (size, mode, quality) recorded in a
hidden ``.tpu-presize.json`` in ``dst_dir`` are the ones asked for now; with
other settings every output is written again (counted as ``redone``). Each is
written under a hidden ``.tpu-partial`` name (which no image loader picks up)
and renamed when complete, and the temporaries a killed run left are removed. Pool workers exit when their parent is killed.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from ..environment import usable_cpus
from ..files import WriteError, atomic_write, remove_stale_temporaries, write_json
from ..progress import progress_bar

ResizeMode = Literal["short_side", "crop"]
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")
# The modes each format stores; anything else is converted (see _storable_mode).
_MODES = {
    "JPEG": {"1", "L", "RGB", "CMYK"},
    "PNG": {"1", "L", "LA", "P", "RGB", "RGBA", "I;16"},
    "BMP": {"1", "L", "P", "RGB", "RGBA"},
    "TIFF": {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "CMYK", "YCbCr", "LAB", "I", "I;16", "F"},
}
_QUALITY_FORMATS = ("JPEG", "WEBP")
SETTINGS_NAME = ".tpu-presize.json"  # hidden: ImageFolder and glob("*") skip it


@dataclass
class PresizeReport:
    """What presize_images did: files written, files already done, files it could not read.

    ``redone`` counts outputs found truncated, unreadable or of another size
    (an interrupted run), or made by an earlier run with another size, mode or
    quality, and written again.
    """

    written: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)
    redone: int = 0

    def __str__(self) -> str:
        lines = [f"presized {self.written} (of which {self.redone} redone), already done {self.skipped}, "
                 f"unreadable {len(self.failed)}"]  # fmt: skip
        lines += [f"  {path}: {error}" for path, error in self.failed]
        return "\n".join(lines)


def _watch_parent(parent: int) -> None:
    """Pool initializer: a worker whose parent died (kill -9) exits instead of waiting forever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _expected_size(width: int, height: int, size: int, mode: str) -> tuple[int, int]:
    if mode == "crop":
        return size, size
    scale = size / min(width, height)
    return max(1, round(width * scale)), max(1, round(height * scale))


def _done(dst: str, size: int, mode: str) -> bool | None:
    """True: a whole image of the right size. False: one to write again. None: nothing there."""
    if not os.path.exists(dst):
        return None
    from PIL import Image, ImageFile

    loose, ImageFile.LOAD_TRUNCATED_IMAGES = ImageFile.LOAD_TRUNCATED_IMAGES, False
    try:
        with Image.open(dst) as img:
            right = min(img.size) == size and (mode != "crop" or img.size == (size, size))
            img.load()  # a truncated file raises here
        return right
    except Exception:  # a truncated or damaged output: write it again
        return False
    finally:
        ImageFile.LOAD_TRUNCATED_IMAGES = loose


def _storable_mode(mode: str, fmt: str, has_alpha: bool) -> str:
    """``mode`` if ``fmt`` stores it, else the closest mode it does (CMYK -> RGB for PNG, ...)."""
    allowed = _MODES.get(fmt)
    if allowed is None or mode in allowed:
        return mode  # WEBP and GIF convert by themselves
    if mode in ("I", "F") or mode.startswith("I;"):
        return "I;16" if "I;16" in allowed else "L"
    return "RGBA" if has_alpha and "RGBA" in allowed else "RGB"


def _resize(src: str, size: int, mode: str) -> tuple[Any, str, dict[str, Any]]:
    """The resized image, the format to save it in (the input's) and what to keep (ICC profile)."""
    from PIL import Image, ImageOps

    with Image.open(src) as img:
        fmt = {"MPO": "JPEG"}.get(img.format or "", img.format or "")  # phone JPEGs open as MPO
        info = {k: img.info[k] for k in ("icc_profile",) if img.info.get(k)}
        img = ImageOps.exif_transpose(img)  # a copy, with no format: read it before
        img.load()
        if mode == "crop":
            out = ImageOps.fit(img, (size, size), Image.Resampling.BICUBIC)
        else:
            out = img.resize(_expected_size(img.width, img.height, size, mode), Image.Resampling.BICUBIC)
    if fmt not in Image.SAVE:
        fmt = Image.registered_extensions().get(os.path.splitext(src)[1].lower(), "PNG")
    storable = _storable_mode(out.mode, fmt, "A" in out.mode or "transparency" in out.info)
    if storable != out.mode:
        out = out.convert(storable)
        info.pop("icc_profile", None)  # a profile for the old mode would misdescribe the new one
    return out, fmt, info


def _resize_one(job: tuple[str, str, int, str, int, bool]) -> tuple[str, str | None]:
    """Returns (status, error): "written", "redone", "skipped" or "failed"."""
    src, dst, size, mode, quality, redo = job
    state = _done(dst, size, mode)
    if state and not redo:
        return "skipped", None
    try:
        out, fmt, info = _resize(src, size, mode)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with atomic_write(dst, durable=False) as f:  # a hidden .tpu-partial name until whole: no loader picks it up
            out.save(f, format=fmt, **info, **({"quality": quality} if fmt in _QUALITY_FORMATS else {}))
        return ("written" if state is None else "redone"), None
    except WriteError:
        raise  # the destination's disk is full (or failing): every further image would fail too
    except Exception as e:  # a corrupt or unreadable image is reported, never fatal
        return "failed", f"{type(e).__name__}: {e}"


def _remove_leftovers(dst_dir: str) -> None:
    """Temporaries a killed run left (their writers are dead), in every folder under ``dst_dir``."""
    for root, _, _ in os.walk(dst_dir):
        remove_stale_temporaries(root, old_suffixes=IMAGE_EXTENSIONS)  # and earlier releases' .tmp-XXXXXXXX.jpg


def _recorded_settings(dst_dir: str) -> dict[str, Any] | None:
    """The settings the outputs in ``dst_dir`` were made with; None if unknown (no or damaged record)."""
    try:
        with open(os.path.join(dst_dir, SETTINGS_NAME)) as f:
            settings = json.load(f)
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def _record_settings(dst_dir: str, settings: dict[str, Any]) -> None:
    os.makedirs(dst_dir, exist_ok=True)
    write_json(os.path.join(dst_dir, SETTINGS_NAME), settings)


def _holds_images(dst_dir: str) -> bool:
    return any(name.lower().endswith(IMAGE_EXTENSIONS) for _, _, files in os.walk(dst_dir) for name in files)


def _must_redo(dst_dir: str, settings: dict[str, Any]) -> bool:
    """True when ``dst_dir`` holds outputs made with other (or unknown) settings.

    The record is written before the run when nothing is to be redone, else only
    after every output was redone: a run killed half-way through a change of
    settings redoes everything again, never skips an output made the old way.
    """
    recorded = _recorded_settings(dst_dir)
    if recorded == settings:
        return False
    if recorded is None and not _holds_images(dst_dir):
        _record_settings(dst_dir, settings)  # a new folder: every output will be made with these
        return False
    return True


def presize_images(
    src_dir: str,
    dst_dir: str,
    size: int,
    *,
    mode: ResizeMode = "short_side",
    workers: int | None = None,
    quality: int = 95,
    progress: bool = True,
) -> PresizeReport:
    """Resizes every image under ``src_dir`` into the same place under ``dst_dir``.

    Args:
        src_dir: Folder of images, any depth (class subfolders for ImageFolder).
        dst_dir: Where the resized images go, same relative paths and formats.
        size: The short side (``mode="short_side"``, aspect kept) or the square
            side (``mode="crop"``, resized then center-cropped).
        mode: "short_side" or "crop".
        workers: Processes (default: the CPUs this process may use, container
            CPU quota included).
        quality: JPEG and WebP quality, 1-100. Every other format keeps its
            own lossless encoding; each image keeps its input format. Re-running
            with another ``quality``, ``size`` or ``mode`` writes every output again.
        progress: A progress bar (a widget in notebooks; none in logs).

    Returns:
        PresizeReport: counts written and skipped, and the unreadable files with why.

    Raises:
        ValueError: a bad ``size`` or ``mode``, or ``dst_dir`` inside ``src_dir``.
        FileExistsError: ``dst_dir`` is a file.
        FileNotFoundError: ``src_dir`` does not exist.

    Example:
        >>> # was: ImageFolder("/kaggle/input/big-jpegs", transform=Resize(256) + ...) every epoch
        >>> report = presize_images("/kaggle/input/big-jpegs", "/kaggle/working/small", 256)  # doctest: +SKIP
        >>> train_ds = ImageFolder("/kaggle/working/small", transform=augment)              # doctest: +SKIP
    """
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int (pixels), but given {size!r}")
    if mode not in get_args(ResizeMode):
        raise ValueError(f"mode must be one of {get_args(ResizeMode)}, but given {mode!r}")
    if isinstance(quality, bool) or not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"quality must be an int from 1 to 100, but given {quality!r}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be a positive int or None (the usable CPUs), but given {workers!r}")
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"src_dir {src_dir!r} is not a folder")
    src_abs, dst_abs = os.path.abspath(src_dir), os.path.abspath(dst_dir)
    if dst_abs == src_abs or dst_abs.startswith(src_abs + os.sep):
        raise ValueError(f"dst_dir {dst_dir!r} must be outside src_dir {src_dir!r}")
    if os.path.exists(dst_dir) and not os.path.isdir(dst_dir):
        raise FileExistsError(
            f"dst_dir {dst_dir!r} is an existing file, not a folder; the resized images go into a folder there. "
            f"Give a folder's path (it is made if missing), or move the file away"
        )

    _remove_leftovers(dst_dir)
    settings = {"size": size, "mode": mode, "quality": quality}
    redo = _must_redo(dst_dir, settings)
    jobs = []
    for root, dirs, files in os.walk(src_dir):
        dirs.sort()
        for name in sorted(files):
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".tmp-"):
                src = os.path.join(root, name)
                jobs.append((src, os.path.join(dst_dir, os.path.relpath(src, src_dir)), size, mode, quality, redo))
    report = PresizeReport()
    pool = ProcessPoolExecutor(max_workers=workers or usable_cpus(), initializer=_watch_parent, initargs=(os.getpid(),))
    bar = progress_bar(len(jobs), "presizing", enabled=progress, unit="image")
    try:
        results = pool.map(_resize_one, jobs, chunksize=16)
        for job, (status, error) in zip(jobs, results):
            bar.update(1)
            if status in ("written", "redone"):
                report.written += 1
                report.redone += status == "redone"
            elif status == "skipped":
                report.skipped += 1
            else:
                report.failed.append((job[0], error or ""))
        if redo:
            _record_settings(dst_dir, settings)  # every output is now made with these settings
    finally:
        bar.close()
        pool.shutdown(wait=True, cancel_futures=True)  # an interrupt does not wait for every queued image
    return report
