"""The main job: a small CNN learns scikit-learn's 1,797 real handwritten digits.

    python -m tpu_utility.demo                                      # one core
    CPU_NUM_DEVICES=4 python -m tpu_utility.demo --cores all         # SPMD over 4 devices

Nothing is downloaded: the digits ship inside scikit-learn. Without a TPU it
runs on XLA's CPU backend (PJRT_DEVICE=CPU), which compiles real XLA graphs.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

from . import backend
from .environment import setup_tpu
from .training.fit import one_cycle_fit


def digits_datasets(valid_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's 8x8 digits as (1, 8, 8) float images in [0, 1] and int labels."""
    try:
        from sklearn.datasets import load_digits
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError("the demo's data ships with scikit-learn: pip install scikit-learn") from e
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_valid = int(len(y) * valid_fraction)
    valid, train = order[:n_valid], order[n_valid:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[valid], y[valid])


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Dropout(0.2), nn.Linear(128, 10),
    )  # fmt: skip



# ------------------------------------------------- variable-length text
MARKER, PAD = 1, 0


def marker_sequences(n: int, seed: int = 0, vocab: int = 50, max_len: int = 120) -> list[tuple[torch.Tensor, int]]:
    """A synthetic text task: token sequences of skewed length 5..max_len, label 1 if
    the marker token (1) occurs anywhere. Most are short, a few long, like real text."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        length = 5 + int((max_len - 5) * torch.rand((), generator=g).item() ** 3)
        tokens = torch.randint(2, vocab, (length,), generator=g)
        label = int(torch.rand((), generator=g).item() < 0.5)
        if label:
            tokens[torch.randint(0, length, (), generator=g)] = MARKER
        samples.append((tokens, label))
    return samples


def pad_to_longest(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The collate of a typical CUDA text loop: each batch padded to its longest sequence."""
    seqs = [s for s, _ in samples]
    tokens = nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=PAD)
    mask = torch.arange(tokens.shape[1]) < torch.tensor([len(s) for s in seqs])[:, None]
    return tokens, mask, torch.tensor([y for _, y in samples])


def masked_train_step(model: nn.Module, batch: tuple) -> torch.Tensor:
    """one_cycle_fit's ``train_step`` for ``(tokens, mask, target)`` batches."""
    tokens, mask, target = batch
    return nn.functional.cross_entropy(model(tokens, mask), target)


def masked_eval_step(model: nn.Module, batch: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """one_cycle_fit's ``eval_step`` for ``(tokens, mask, target)`` batches."""
    tokens, mask, target = batch
    return model(tokens, mask), target


class MarkerClassifier(nn.Module):
    """Embedding, a per-token layer and a max over the real tokens (``mask``)."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.token = nn.Sequential(nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, 2)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.token(self.embed(tokens)).masked_fill(~mask.unsqueeze(-1), float("-inf"))
        return self.head(h.amax(dim=1))

def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="1", help="1 or 'all' (default 1)")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per core")
    parser.add_argument("--max-lr", type=float, default=3e-3)
    parser.add_argument("--out", default="demo_out", help="folder for the history plot and checkpoint")
    args = parser.parse_args(argv)

    # XLA on the host CPU when there is no TPU, so the demo exercises real XLA graphs.
    setup_tpu(device="auto" if backend.detect_tpu().chips or backend.pjrt_device() else "CPU")
    train_ds, valid_ds = digits_datasets()
    print(f"digits: {len(train_ds)} training and {len(valid_ds)} validation images (8x8, from scikit-learn)")
    history = one_cycle_fit(
        small_cnn(),
        train_ds,
        valid_data=valid_ds,
        epochs=args.epochs,
        max_lr=args.max_lr,
        batch_size=args.batch_size,
        cores="all" if args.cores == "all" else int(args.cores),
        checkpoint_dir=os.path.join(args.out, "checkpoints"),
        overwrite=True,  # each demo run starts afresh
    )
    os.makedirs(args.out, exist_ok=True)
    plot_path = os.path.abspath(os.path.join(args.out, "history.png"))
    history.plot(plot_path)
    final = history.records[-1]
    losses = " -> ".join(f"{r.train_loss:.3f}" for r in history.records)
    print(f"train loss per epoch: {losses}")
    print(f"validation accuracy: {final.metrics['accuracy']:.2%} on {len(valid_ds)} images")
    print(f"history plot: {plot_path}")
    return final.metrics["accuracy"]


if __name__ == "__main__":
    main()
