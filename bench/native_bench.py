"""Per-step cost on the native backend (plain PyTorch, as on a CUDA GPU) at a ~1 ms step.

one_cycle_fit with ``TPU_UTILITY_BACKEND=native`` on the CPU against the loop a user
writes for it: the same MLP, data, batch and torch AdamW, a DataLoader without workers
(what one_cycle_fit chooses when the model trains on the host's own cores, see its setup
summary), interleaved rounds, epoch 1 left out. On the native backend there is no
tracing: the figure is the loop's own Python and ops against the model's compute.
"""

from __future__ import annotations

import os
import sys
from functools import partial

os.environ["TPU_UTILITY_BACKEND"] = "native"  # before tpu_utility picks one: plain PyTorch on the CPU

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from peers import (Clock, Workload, fit, hand_written_extras, hand_written_setup, print_table,  # noqa: E402
                   print_work, run_interleaved)
from tpu_utility import EMA  # noqa: E402

BATCH, EPOCHS, ROUNDS, STEPS = 32, 3, 9, 200
HAND = "hand loop (torch AdamW, constant lr)"


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))


def workload() -> Workload:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, 256, generator=g)
    y = (x[:, :10].argmax(1)).long()
    return Workload(TensorDataset(x, y), mlp, BATCH, EPOCHS)


def hand_loop(w: Workload, one_cycle: bool = False, ema: float | None = None) -> Clock:
    """The loop a user writes; ``one_cycle``, ``ema``: peers.hand_written_extras."""
    model, opt, loss_fn, loader = hand_written_setup(w, torch.device("cpu"))
    after_step = hand_written_extras(model, opt, w, one_cycle, ema)
    clock = Clock()
    for _ in range(w.epochs):
        clock.start()
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
            after_step()
        clock.stop(len(loader))
    return clock


def main() -> None:
    w = workload()
    loops = {
        HAND: hand_loop,
        "one_cycle_fit, schedule='constant'": partial(fit, schedule="constant"),
        "hand loop + torch OneCycleLR stepped every step": partial(hand_loop, one_cycle=True),
        "one_cycle_fit (one-cycle schedule)": fit,
        "one_cycle_fit + EMA": partial(fit, callbacks=lambda: [EMA(0.99)]),
        "one_cycle_fit + EMA(every=4)": partial(fit, callbacks=lambda: [EMA(0.99, every=4)]),
    }
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else ROUNDS
    timings = run_interleaved(loops, w, rounds)
    print_table(timings, HAND, f"Per-step cost on the native backend (CPU), an MLP of 0.1M parameters "
                               f"({len(w.dataset)} samples, batch {BATCH}, {EPOCHS} epochs x {rounds} rounds)")  # fmt: skip
    print_work(loops, w, HAND, nodes=False)


if __name__ == "__main__":
    main()
