"""make bench (part 2): one data-loading epoch on the fly against presized-then-cached.

Workload: about 2,000 PNGs of 256x256 (scikit-learn digits, upscaled, noised,
coloured), and a typical torchvision pipeline: decode, RandomResizedCrop(224),
horizontal flip, ToTensor, Normalize. Both loaders use the same DataLoader
settings each works best with; the figure is the median epoch. The cache stores
uint8 crops: on a TPU the float conversion and Normalize belong in the model, on
the device (4x fewer bytes to send); the last row keeps them on the host.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader
from torchvision import transforms
from torchvision.datasets import ImageFolder

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import CachedDataset, cache_dataset, presize_images  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "cache_bench")
IMAGES, PRESIZED, CACHE = (os.path.join(OUT, name) for name in ("images", "presized", "cache"))
COUNT, SIDE, CROP, BATCH, WORKERS, EPOCHS = 2000, 256, 224, 64, 2, 3  # 2 workers: the host has 2 cores
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_images() -> None:
    """Digits upscaled to 256x256 RGB with noise, one folder per class (written once)."""
    if os.path.isdir(IMAGES) and sum(len(f) for _, _, f in os.walk(IMAGES)) >= COUNT:
        return
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    for i in range(COUNT):
        j = i % len(digits.target)
        gray = Image.fromarray((digits.images[j] * 15).astype(np.uint8)).resize((SIDE, SIDE), Image.BICUBIC)
        tint = rng.uniform(0.6, 1.0, 3)
        pixels = np.asarray(gray, dtype=np.float32)[..., None] * tint + rng.normal(0, 12, (SIDE, SIDE, 3))
        folder = os.path.join(IMAGES, str(digits.target[j]))
        os.makedirs(folder, exist_ok=True)
        Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(os.path.join(folder, f"{i:05d}.png"))


class NormalizeUint8:
    """uint8 CHW crop -> normalised float, the cheap step left for read time."""

    def __init__(self) -> None:
        self.mean = torch.tensor(MEAN).view(3, 1, 1)
        self.std = torch.tensor(STD).view(3, 1, 1)

    def __call__(self, sample: tuple) -> tuple:
        image, label = sample
        return (image.float() / 255 - self.mean) / self.std, label


def epoch_seconds(dataset, workers: int) -> float:
    """Median seconds to iterate one epoch of batches (the first epoch included)."""
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=workers)
    times = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for images, _ in loader:
            assert images.shape[1:] == (3, CROP, CROP)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def folder_mb(path: str) -> float:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, files in os.walk(path) for f in files) / 2**20


def main() -> None:
    make_images()
    augment = [transforms.RandomResizedCrop(CROP), transforms.RandomHorizontalFlip()]
    on_the_fly = ImageFolder(IMAGES, transform=transforms.Compose(
        augment + [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]))  # fmt: skip

    for folder in (PRESIZED, CACHE):
        shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    presize_images(IMAGES, PRESIZED, CROP, progress=False)
    presize_s = time.perf_counter() - start
    start = time.perf_counter()
    cache_dataset(ImageFolder(PRESIZED, transform=transforms.Compose(augment + [transforms.PILToTensor()])),
                  CACHE, num_workers=WORKERS, progress=False)  # fmt: skip
    cache_s = time.perf_counter() - start
    rows = [
        ("on the fly: decode + RandomResizedCrop + flip + ToTensor + Normalize", WORKERS,
         epoch_seconds(on_the_fly, WORKERS), f"{folder_mb(IMAGES):.0f} MB PNG"),
        ("cached uint8 crops; ToDtype + Normalize run on the device, in the model", 0,
         epoch_seconds(CachedDataset(CACHE), 0), f"{folder_mb(CACHE):.0f} MB cache"),
        ("cached uint8 crops; ToDtype + Normalize per sample on the host", 0,
         epoch_seconds(CachedDataset(CACHE, transform=NormalizeUint8()), 0), "same cache"),
    ]  # fmt: skip
    fly = rows[0][2]
    print(f"\nData loading, one epoch of {len(on_the_fly)} images, batch {BATCH} (median of {EPOCHS} epochs)")
    print("| pipeline | DataLoader workers | s/epoch | speed-up | on disk |")
    print("|---|---|---|---|---|")
    for name, workers, seconds, disk in rows:
        print(f"| {name} | {workers} | {seconds:.3f} | {fly / seconds:.1f}x | {disk} |")
    print(f"one-time cost: presize {presize_s:.1f} s, cache build {cache_s:.1f} s "
          f"(repaid after {(presize_s + cache_s) / max(fly - rows[1][2], 1e-9):.1f} epochs)")  # fmt: skip


if __name__ == "__main__":
    main()
