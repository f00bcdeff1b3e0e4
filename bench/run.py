"""make bench: one_cycle_fit against the hand-written ideal torch_xla loop and the naive port.

Same model (the demo's CNN), same data (scikit-learn digits, x4), same batch size,
on XLA:CPU, in one run. Epoch 1 (compilation) is left out; the figure is the
median steady-state time per step over the later epochs of several interleaved
rounds, reported as a ratio to the ideal loop. Timing is only reported here,
never asserted in tests.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")
warnings.filterwarnings("ignore", message="dropping the last")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.debug.metrics as met  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import get_device, one_cycle_fit, step_optimizer  # noqa: E402
from tpu_utility.demo import digits_datasets, small_cnn  # noqa: E402

BATCH, EPOCHS, ROUNDS = 64, 4, 3


def data() -> TensorDataset:
    train, _ = digits_datasets()
    x, y = train.tensors
    return TensorDataset(torch.cat([x] * 4), torch.cat([y] * 4))


def counters() -> tuple[int, int]:
    compiles = met.metric_data("CompileTime")
    return (int(compiles[0]) if compiles else 0), int(met.counter_value("aten::_local_scalar_dense") or 0)


def hand_written_setup(ds: TensorDataset, device: torch.device) -> tuple:
    """What both hand-written loops share: model, AdamW at a constant lr, loss, loader."""
    torch.manual_seed(0)
    model = small_cnn().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True)
    return model, opt, nn.CrossEntropyLoss(), loader


def ideal_loop(ds: TensorDataset) -> list[float]:
    """MpDeviceLoader, xm.optimizer_step, no .item(): torch_xla's recommended loop."""
    device = torch_xla.device()
    model, opt, loss_fn, loader = hand_written_setup(ds, device)
    seconds = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for x, y in pl.MpDeviceLoader(loader, device):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            xm.optimizer_step(opt)
        xm.wait_device_ops()
        seconds.append((time.perf_counter() - start) / len(loader))
    return seconds


def naive_port(ds: TensorDataset) -> list[float]:
    """The two-line port of a CUDA loop that logs loss.item() every step."""
    device = get_device()
    model, opt, loss_fn, loader = hand_written_setup(ds, device)
    seconds = []
    for _ in range(EPOCHS):
        start, running = time.perf_counter(), 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            step_optimizer(opt)
            running += loss.item()
        seconds.append((time.perf_counter() - start) / len(loader))
    return seconds


def fit(ds: TensorDataset) -> list[float]:
    torch.manual_seed(0)
    history = one_cycle_fit(small_cnn(), ds, epochs=EPOCHS, max_lr=3e-3, batch_size=BATCH, progress=False)
    steps = len(ds) // BATCH
    return [r.seconds / steps for r in history.records]


def main() -> None:
    ds = data()
    loops = {"ideal torch_xla loop": ideal_loop, "one_cycle_fit": fit, "naive port (.item() per step)": naive_port}
    per_step: dict[str, list[float]] = {name: [] for name in loops}
    compiles: dict[str, list[int]] = {name: [] for name in loops}
    syncs: dict[str, float] = {}
    steps = EPOCHS * (len(ds) // BATCH)
    for _ in range(ROUNDS):
        for name, loop in loops.items():
            met.clear_all()
            c0, s0 = counters()
            seconds = loop(ds)
            c1, s1 = counters()
            per_step[name] += seconds[1:]  # epoch 1 is compilation
            compiles[name].append(c1 - c0)
            syncs[name] = (s1 - s0) / steps
    ideal = statistics.median(per_step["ideal torch_xla loop"])
    print(f"\nSteady-state time per step on XLA:CPU ({len(ds)} samples, batch {BATCH}, {EPOCHS} epochs x {ROUNDS} rounds)")
    print(f"| loop | ms/step | vs ideal | graphs compiled per run | host syncs per step |")
    print(f"|---|---|---|---|---|")
    for name in loops:
        ms = statistics.median(per_step[name]) * 1000
        print(f"| {name} | {ms:.2f} | {ms / (ideal * 1000):.2f}x | {max(compiles[name])} | {syncs[name]:.2f} |")


if __name__ == "__main__":
    main()
