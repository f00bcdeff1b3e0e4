"""make bench: one_cycle_fit against the hand-written ideal torch_xla loop, the naive
port, PyTorch Lightning's Trainer and HuggingFace Accelerate.

Same model (the demo's CNN), same data (scikit-learn digits, x4), same batch size,
AdamW, on XLA:CPU, in one run. The peers run the one-cycle schedule too
(torch's OneCycleLR, stepped every batch), as one_cycle_fit does. Epoch 1 (compilation) is left out; the figure is the
median steady-state time per step over the later epochs of several interleaved
rounds, reported as a ratio to the ideal loop. Timing is only reported here,
never asserted in tests.
"""

from __future__ import annotations

import os
import statistics
from functools import partial
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


def hand_written_setup(ds: TensorDataset, device: torch.device, adamw: type = torch.optim.AdamW) -> tuple:
    """What the hand-written loops share: model, AdamW at a constant lr, loss, loader."""
    torch.manual_seed(0)
    model = small_cnn().to(device)
    opt = adamw(model.parameters(), lr=1e-3)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True)
    return model, opt, nn.CrossEntropyLoss(), loader


def ideal_loop(ds: TensorDataset, fused: bool = False) -> list[float]:
    """MpDeviceLoader, xm.optimizer_step, no .item(): torch_xla's recommended loop.

    ``fused`` swaps in torch_xla's sync-free AdamW (one XLA op per parameter), the
    optimizer one_cycle_fit uses on XLA.
    """
    from torch_xla.amp import syncfree

    device = torch_xla.device()
    model, opt, loss_fn, loader = hand_written_setup(ds, device, syncfree.AdamW if fused else torch.optim.AdamW)
    step_args = {"found_inf": torch.zeros((), device=device)} if fused else {}
    seconds = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for x, y in pl.MpDeviceLoader(loader, device):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            xm.optimizer_step(opt, optimizer_args=step_args)
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


def _one_cycle(opt: torch.optim.Optimizer, steps_per_epoch: int) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=EPOCHS * steps_per_epoch, pct_start=0.25)


def lightning_trainer(ds: TensorDataset) -> list[float]:
    """Lightning refuses XLA:CPU: XLAAccelerator.is_available() counts TPU chips only.

    The minimal workaround, patching is_available and auto_device_count, is
    enough for Trainer(accelerator="tpu", devices=1) to train.
    """
    import lightning as L
    from lightning.fabric.accelerators import xla as fabric_xla
    from lightning.pytorch.accelerators import XLAAccelerator

    for cls in (XLAAccelerator, fabric_xla.XLAAccelerator):
        cls.is_available = staticmethod(lambda: True)
        cls.auto_device_count = staticmethod(lambda: 1)
    steps = len(ds) // BATCH

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = small_cnn()

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _one_cycle(opt, steps), "interval": "step"}}

    class EpochTimer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_epoch_start(self, trainer, module) -> None:
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module) -> None:
            xm.wait_device_ops()
            self.seconds.append((time.perf_counter() - self.start) / steps)

    timer = EpochTimer()
    trainer = L.Trainer(accelerator="tpu", devices=1, max_epochs=EPOCHS, callbacks=[timer], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Module(), DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True))
    return timer.seconds


def accelerate_loop(ds: TensorDataset) -> list[float]:
    """Accelerate's documented loop; it accepts XLA:CPU as it is (DistributedType.XLA)."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, drop_last=True)
    sched = _one_cycle(opt, len(loader))
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    seconds = []
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            sched.step()
        xm.wait_device_ops()
        seconds.append((time.perf_counter() - start) / len(loader))
    return seconds


def fit(ds: TensorDataset) -> list[float]:
    torch.manual_seed(0)
    history = one_cycle_fit(small_cnn(), ds, epochs=EPOCHS, max_lr=3e-3, batch_size=BATCH, progress=False)
    steps = len(ds) // BATCH
    return [r.seconds / steps for r in history.records]


def main() -> None:
    ds = data()
    loops = {
        "ideal torch_xla loop (constant lr)": ideal_loop,
        "ideal loop, torch_xla fused AdamW (constant lr)": partial(ideal_loop, fused=True),
        "one_cycle_fit (fused AdamW, one-cycle schedule)": fit,
        "naive port (.item() per step, constant lr)": naive_port,
        "Lightning Trainer + OneCycleLR (workaround: XLA:CPU refused)": lightning_trainer,
        "Accelerate loop + OneCycleLR": accelerate_loop,
    }
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
    ideal = statistics.median(per_step["ideal torch_xla loop (constant lr)"])
    print(f"\nSteady-state time per step on XLA:CPU ({len(ds)} samples, batch {BATCH}, {EPOCHS} epochs x {ROUNDS} rounds)")
    print(f"| loop | ms/step | vs ideal | graphs compiled per run | host syncs per step |")
    print(f"|---|---|---|---|---|")
    for name in loops:
        ms = statistics.median(per_step[name]) * 1000
        print(f"| {name} | {ms:.2f} | {ms / (ideal * 1000):.2f}x | {max(compiles[name])} | {syncs[name]:.2f} |")


if __name__ == "__main__":
    main()
