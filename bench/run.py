"""make bench: one_cycle_fit against the hand-written ideal torch_xla loop, the naive
port, PyTorch Lightning's Trainer and HuggingFace Accelerate.

Same model (the demo's CNN), same data (scikit-learn digits, x4), same batch size,
AdamW, on XLA:CPU, in one run (the loops are in bench/peers.py). Epoch 1
(compilation) is left out; the figure is the median steady-state time per step of
several interleaved rounds, and its ratio to the ideal loop within each round.
"""

from __future__ import annotations

import tempfile
from functools import partial

import torch
from torch.utils.data import TensorDataset

from peers import (Workload, accelerate_loop, fit, ideal_loop, lightning_trainer, naive_port, print_table,
                   run_interleaved)
from tpu_utility import EMA, TensorBoardLogger
from tpu_utility.demo import digits_datasets, small_cnn

BATCH, EPOCHS, ROUNDS = 64, 4, 3
IDEAL = "ideal torch_xla loop (constant lr)"


def main() -> None:
    train, _ = digits_datasets()
    x, y = train.tensors
    w = Workload(TensorDataset(torch.cat([x] * 4), torch.cat([y] * 4)), small_cnn, BATCH, EPOCHS)
    logs = tempfile.mkdtemp(prefix="bench_tb_")
    loops = {
        IDEAL: ideal_loop,
        "ideal loop, torch_xla fused AdamW (constant lr)": partial(ideal_loop, fused=True),
        "one_cycle_fit (fused AdamW, one-cycle schedule)": fit,
        "one_cycle_fit + EMA + TensorBoardLogger callbacks": partial(
            fit, callbacks=lambda: [EMA(0.99), TensorBoardLogger(logs)]),
        "naive port (.item() per step, constant lr)": naive_port,
        "Lightning Trainer + OneCycleLR (workaround: XLA:CPU refused)": lightning_trainer,
        "Accelerate loop + OneCycleLR": accelerate_loop,
    }
    timings = run_interleaved(loops, w, ROUNDS)
    print_table(timings, IDEAL, f"Steady-state time per step on XLA:CPU, small CNN on digits ({len(w.dataset)} "
                                f"samples, batch {BATCH}, {EPOCHS} epochs x {ROUNDS} rounds)")  # fmt: skip


if __name__ == "__main__":
    main()
