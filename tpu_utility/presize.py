"""presize_images(): shrink a folder of images once, before training.

Decoding a 3000x2000 JPEG to train at 224 px wastes the host CPU every epoch.
Presizing keeps the folder structure (so ``torchvision.datasets.ImageFolder``
works on the result), runs on every host core, skips files already done (each
is written under a temporary name and renamed), and lists unreadable images
instead of stopping.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Literal, get_args

ResizeMode = Literal["short_side", "crop"]
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff", ".gif")


@dataclass
class PresizeReport:
    """What presize_images did: files written, files already done, files it could not read."""

    written: int = 0
    skipped: int = 0
    failed: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"presized {self.written}, already done {self.skipped}, unreadable {len(self.failed)}"]
        lines += [f"  {path}: {error}" for path, error in self.failed]
        return "\n".join(lines)


def _resize_one(job: tuple[str, str, int, str, int]) -> tuple[str, str | None]:
    """Returns (status, error): "written", "skipped" or "failed"."""
    src, dst, size, mode, quality = job
    if os.path.exists(dst):
        return "skipped", None
    from PIL import Image, ImageOps

    try:
        with Image.open(src) as img:
            img = ImageOps.exif_transpose(img)
            img.load()
            if mode == "crop":
                out = ImageOps.fit(img, (size, size), Image.Resampling.BICUBIC)
            else:
                scale = size / min(img.size)
                out = img.resize((max(1, round(img.width * scale)), max(1, round(img.height * scale))),
                                 Image.Resampling.BICUBIC)  # fmt: skip
            fmt = img.format or "PNG"
        if fmt == "JPEG" and out.mode not in ("RGB", "L"):
            out = out.convert("RGB")
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(dst)[1], dir=os.path.dirname(dst))
        with os.fdopen(fd, "wb") as f:
            out.save(f, format=fmt, **({"quality": quality} if fmt == "JPEG" else {}))
        os.replace(tmp, dst)
        return "written", None
    except Exception as e:  # a corrupt or unreadable image is reported, never fatal
        return "failed", f"{type(e).__name__}: {e}"


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
        workers: Processes (default: all host CPUs).
        quality: JPEG quality.
        progress: A tqdm bar.

    Returns:
        PresizeReport: counts written and skipped, and the unreadable files with why.

    Raises:
        ValueError: a bad ``size`` or ``mode``, or ``dst_dir`` inside ``src_dir``.
        FileNotFoundError: ``src_dir`` does not exist.

    Example:
        >>> # was: ImageFolder("/kaggle/input/big-jpegs", transform=Resize(256) + ...) every epoch
        >>> report = presize_images("/kaggle/input/big-jpegs", "/kaggle/working/small", 256)  # doctest: +SKIP
        >>> train_ds = ImageFolder("/kaggle/working/small", transform=augment)              # doctest: +SKIP
    """
    from tqdm.auto import tqdm

    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size must be a positive int (pixels), but given {size!r}")
    if mode not in get_args(ResizeMode):
        raise ValueError(f"mode must be one of {get_args(ResizeMode)}, but given {mode!r}")
    if not os.path.isdir(src_dir):
        raise FileNotFoundError(f"src_dir {src_dir!r} is not a folder")
    src_abs, dst_abs = os.path.abspath(src_dir), os.path.abspath(dst_dir)
    if dst_abs == src_abs or dst_abs.startswith(src_abs + os.sep):
        raise ValueError(f"dst_dir {dst_dir!r} must be outside src_dir {src_dir!r}")

    jobs = []
    for root, dirs, files in os.walk(src_dir):
        dirs.sort()
        for name in sorted(files):
            if name.lower().endswith(IMAGE_EXTENSIONS) and not name.startswith(".tmp-"):
                src = os.path.join(root, name)
                jobs.append((src, os.path.join(dst_dir, os.path.relpath(src, src_dir)), size, mode, quality))
    report = PresizeReport()
    with ProcessPoolExecutor(max_workers=workers or os.cpu_count() or 1) as pool:
        results = pool.map(_resize_one, jobs, chunksize=16)
        for job, (status, error) in tqdm(zip(jobs, results), total=len(jobs), desc="presizing", disable=not progress):
            if status == "written":
                report.written += 1
            elif status == "skipped":
                report.skipped += 1
            else:
                report.failed.append((job[0], error or ""))
    return report
