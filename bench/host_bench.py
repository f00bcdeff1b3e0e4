"""Host cost per step: one_cycle_fit against the fused hand loop with a model so small that
executing it costs nearly nothing, so the figure is the Python each loop runs per step.

On a TPU the host's tracing is the step time for small and medium models (the device
waits for it); XLA:CPU hides it behind execution on the same cores, except here. An MLP
of 2.4k parameters, batch 64, AdamW (torch_xla's fused sync-free one in both), in one
run, interleaved rounds; epoch 1 (compilation) left out. `python bench/host_bench.py
--profile` prints where one_cycle_fit's own per-step time goes (cProfile, cumulative).
"""

from __future__ import annotations

import cProfile
import pstats
import sys
from functools import partial

import torch
from torch import nn
from torch.utils.data import TensorDataset

from peers import Workload, fit, ideal_loop, print_table, print_work, run_interleaved
from tpu_utility import EMA

BATCH, EPOCHS, ROUNDS, STEPS = 64, 3, 15, 200
IDEAL = "fused hand loop (MpDeviceLoader, xm.optimizer_step, constant lr)"


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))  # 2,372 parameters


def workload() -> Workload:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, 32, generator=g)  # 200 steps an epoch: its fixed costs (the one read) spread as in a real epoch
    y = (x[:, :4].argmax(1)).long()
    return Workload(TensorDataset(x, y), tiny_mlp, BATCH, EPOCHS)


def main() -> None:
    w = workload()
    if "--profile" in sys.argv:
        fit(w)  # compile first
        profile = cProfile.Profile()
        profile.runcall(fit, w)
        pstats.Stats(profile).sort_stats(sys.argv[-1] if sys.argv[-1] != "--profile" else "tottime").print_stats(40)
        return
    loops = {
        IDEAL: partial(ideal_loop, fused=True),
        "one_cycle_fit, schedule='constant' (the hand loop's constant lr)": partial(fit, schedule="constant"),
        "fused hand loop + torch OneCycleLR stepped every step": partial(ideal_loop, fused=True, one_cycle=True),
        "one_cycle_fit (fused AdamW, one-cycle schedule)": fit,
        "one_cycle_fit + EMA": partial(fit, callbacks=lambda: [EMA(0.99)]),
        "one_cycle_fit + EMA(every=4)": partial(fit, callbacks=lambda: [EMA(0.99, every=4)]),
    }
    timings = run_interleaved(loops, w, ROUNDS)
    print_table(timings, IDEAL, f"Host cost per step on XLA:CPU, an MLP of 2.4k parameters ({len(w.dataset)} samples, "
                                f"batch {BATCH}, {EPOCHS} epochs x {ROUNDS} rounds)")  # fmt: skip
    print_work(loops, w, IDEAL)


if __name__ == "__main__":
    main()
