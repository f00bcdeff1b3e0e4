"""make bench: a small ResNet on 32x32 images. one_cycle_fit against the best hand-written
torch_xla loop on the same optimizer (torch_xla's fused sync-free AdamW, MpDeviceLoader,
no .item()), Lightning's Trainer and Accelerate's loop.

The images are scikit-learn's digits upscaled to 32x32 (nothing is downloaded). Same
model, data, batch size and AdamW for every loop, on XLA:CPU, in one run; epoch 1
(compilation) left out; rounds interleaved, ratios taken within each round.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.utils.data import TensorDataset

from peers import Workload, accelerate_loop, fit, ideal_loop, lightning_trainer, print_table, run_interleaved
from tpu_utility.demo import digits_datasets

BATCH, EPOCHS, ROUNDS = 32, 3, 5
HAND = "hand-written loop, fused AdamW, MpDeviceLoader (constant lr)"


class Block(nn.Module):
    """ResNet's basic block: two 3x3 convolutions with batch norm, and the shortcut."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )  # fmt: skip
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


def small_resnet() -> nn.Module:
    """A ResNet for 32x32 inputs (CIFAR-style stem), 3 stages of 8, 16 and 32 channels."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
        Block(8, 8, 1), Block(8, 16, 2), Block(16, 32, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
    )  # fmt: skip


def digits_32() -> TensorDataset:
    train, _ = digits_datasets()
    x, y = train.tensors
    return TensorDataset(nn.functional.interpolate(x, size=32, mode="bilinear", align_corners=False), y)


def main() -> None:
    w = Workload(digits_32(), small_resnet, BATCH, EPOCHS)
    loops = {
        HAND: partial(ideal_loop, fused=True),
        "one_cycle_fit (fused AdamW, one-cycle schedule)": fit,
        "Lightning Trainer + OneCycleLR (workaround: XLA:CPU refused)": lightning_trainer,
        "Accelerate loop + OneCycleLR": accelerate_loop,
    }
    timings = run_interleaved(loops, w, ROUNDS)
    print_table(timings, HAND, f"Small ResNet on 32x32 digits, XLA:CPU ({len(w.dataset)} images, batch {BATCH}, "
                               f"{EPOCHS} epochs x {ROUNDS} rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
