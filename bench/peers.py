"""The loops `make bench` compares, for any (model, dataset) workload, and the timing harness.

Every loop trains the same model on the same data and batch size with AdamW on XLA:CPU.
The peers run the one-cycle schedule too (torch's OneCycleLR, stepped every batch), as
one_cycle_fit does. Epoch 1 (compilation) is left out of every figure. Timing is only
reported here, never asserted in tests.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

os.environ.setdefault("PJRT_DEVICE", "CPU")
warnings.filterwarnings("ignore", message="dropping the last")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import Callback, backend, get_device, one_cycle_fit, step_optimizer  # noqa: E402


@dataclass
class Workload:
    dataset: Dataset
    make_model: Callable[[], nn.Module]
    batch: int
    epochs: int
    max_lr: float = 3e-3

    @property
    def steps(self) -> int:
        return len(self.dataset) // self.batch


class Clock:
    """Per epoch, per step: wall seconds, and the CPU seconds of the thread that runs the loop.

    On a TPU the host's tracing is the step time for small models; here the compute threads share
    the two cores and move every wall figure by tens of percent. The loop thread's CPU time is the
    host work itself (tracing, the loop's Python, dispatch), which waiting for the device or being
    descheduled does not add to: the figure to compare per-step host cost by.
    """

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def start(self) -> None:
        self._wall, self._cpu = time.perf_counter(), time.thread_time()

    def stop(self, steps: int) -> None:
        self.wall.append((time.perf_counter() - self._wall) / steps)
        self.cpu.append((time.thread_time() - self._cpu) / steps)


def hand_written_setup(w: Workload, device: torch.device, adamw: type = torch.optim.AdamW) -> tuple:
    """What the hand-written loops share: model, AdamW at a constant lr, loss, loader."""
    torch.manual_seed(0)
    model = w.make_model().to(device)
    opt = adamw(model.parameters(), lr=1e-3)
    loader = DataLoader(w.dataset, batch_size=w.batch, shuffle=True, drop_last=True)
    return model, opt, nn.CrossEntropyLoss(), loader


def hand_written_extras(model: nn.Module, opt: torch.optim.Optimizer, w: Workload, one_cycle: bool,
                        ema: float | None) -> Callable[[], None]:  # fmt: skip
    """What a hand-written loop does after each optimizer step: step torch's OneCycleLR (``one_cycle``),
    update torch's EMA as its docs write it (``ema``: ``AveragedModel(model,
    multi_avg_fn=get_ema_multi_avg_fn(ema)).update_parameters(model)``); either, both or nothing."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    scheduler = _one_cycle(opt, w) if one_cycle else None
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(ema)) if ema is not None else None

    def after_step() -> None:
        if scheduler is not None:
            scheduler.step()
        if averaged is not None:
            averaged.update_parameters(model)

    return after_step


def ideal_loop(w: Workload, fused: bool = False, one_cycle: bool = False, ema: float | None = None) -> Clock:
    """MpDeviceLoader, xm.optimizer_step, no .item(): torch_xla's recommended loop.

    ``fused`` swaps in torch_xla's sync-free AdamW (one XLA op per parameter), the
    optimizer one_cycle_fit uses on XLA; ``one_cycle`` steps torch's OneCycleLR after
    every step (its lr and beta1 reach the step as new Python floats each time); ``ema``
    keeps torch's EMA (``hand_written_extras``).
    """
    from torch_xla.amp import syncfree

    device = torch_xla.device()
    model, opt, loss_fn, loader = hand_written_setup(w, device, syncfree.AdamW if fused else torch.optim.AdamW)
    step_args = {"found_inf": torch.zeros((), device=device)} if fused else {}
    after_step = hand_written_extras(model, opt, w, one_cycle, ema)
    clock = Clock()
    for _ in range(w.epochs):
        clock.start()
        for x, y in pl.MpDeviceLoader(loader, device):
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            xm.optimizer_step(opt, optimizer_args=step_args)
            after_step()
        xm.wait_device_ops()
        clock.stop(len(loader))
    return clock


def naive_port(w: Workload) -> Clock:
    """The two-line port of a CUDA loop that logs loss.item() every step."""
    device = get_device()
    model, opt, loss_fn, loader = hand_written_setup(w, device)
    clock = Clock()
    for _ in range(w.epochs):
        clock.start()
        running = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model(x), y)
            loss.backward()
            step_optimizer(opt)
            running += loss.item()
        clock.stop(len(loader))
    return clock


def _one_cycle(opt: torch.optim.Optimizer, w: Workload) -> torch.optim.lr_scheduler.OneCycleLR:
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=w.max_lr, total_steps=w.epochs * w.steps, pct_start=0.25)


def lightning_trainer(w: Workload) -> Clock:
    """Lightning refuses XLA:CPU: XLAAccelerator.is_available() counts TPU chips only.

    The minimal workaround, patching is_available and auto_device_count, is
    enough for Trainer(accelerator="tpu", devices=1) to train.
    """
    import logging

    import lightning as L

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # its banner, every run
    from lightning.fabric.accelerators import xla as fabric_xla
    from lightning.pytorch.accelerators import XLAAccelerator

    for cls in (XLAAccelerator, fabric_xla.XLAAccelerator):
        cls.is_available = staticmethod(lambda: True)
        cls.auto_device_count = staticmethod(lambda: 1)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = w.make_model()

        def training_step(self, batch, index):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": _one_cycle(opt, w), "interval": "step"}}

    clock = Clock()

    class EpochTimer(L.Callback):
        def on_train_epoch_start(self, trainer, module) -> None:
            clock.start()

        def on_train_epoch_end(self, trainer, module) -> None:
            xm.wait_device_ops()
            clock.stop(w.steps)

    timer = EpochTimer()
    trainer = L.Trainer(accelerator="tpu", devices=1, max_epochs=w.epochs, callbacks=[timer], logger=False,
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(Module(), DataLoader(w.dataset, batch_size=w.batch, shuffle=True, drop_last=True))
    return clock


def accelerate_loop(w: Workload) -> Clock:
    """Accelerate's documented loop; it accepts XLA:CPU as it is (DistributedType.XLA)."""
    from accelerate import Accelerator

    accelerator = Accelerator()
    torch.manual_seed(0)
    model = w.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(w.dataset, batch_size=w.batch, shuffle=True, drop_last=True)
    sched = _one_cycle(opt, w)
    model, opt, loader, sched = accelerator.prepare(model, opt, loader, sched)
    clock = Clock()
    for _ in range(w.epochs):
        clock.start()
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(nn.functional.cross_entropy(model(x), y))
            opt.step()
            sched.step()
        xm.wait_device_ops()
        clock.stop(len(loader))
    return clock


class _EpochClock(Callback):
    """Starts the clock as an epoch's first step is about to run and stops it as its last step has run.

    Two of them (``_EpochClock.pair``): the start is the last hook of ``on_train_epoch_start`` and the
    stop the first of ``on_train_epoch_end``, so the callbacks' own epoch work (EMA puts the averaged
    weights in at the epoch's end and the training weights back at its start) is an epoch's cost,
    not a step's, as in a hand loop whose clock runs around its steps.
    """

    def __init__(self, clock: Clock, steps: int, start: bool) -> None:
        self.clock, self.steps, self.start = clock, steps, start
        self.order = math.inf if start else -math.inf

    @classmethod
    def pair(cls, clock: Clock, steps: int) -> list[Callback]:
        return [cls(clock, steps, start=True), cls(clock, steps, start=False)]

    def on_train_epoch_start(self, loop: Any, epoch: int) -> None:
        if self.start:
            self.clock.start()

    def on_train_epoch_end(self, loop: Any) -> None:
        if not self.start:
            self.clock.stop(self.steps)


def fit(w: Workload, callbacks: Callable[[], list] | None = None, schedule: Any = "one_cycle") -> Clock:
    """one_cycle_fit; ``callbacks`` makes a fresh list of callbacks for each run.

    The wall figure is the epoch record's (the epoch's read of the loss included, as the hand loops'
    wait for the device); the CPU one is the training's, between the epoch's first and last step.
    """
    torch.manual_seed(0)
    clock = Clock()
    history = one_cycle_fit(w.make_model(), w.dataset, epochs=w.epochs, max_lr=w.max_lr, batch_size=w.batch,
                            progress=False, callbacks=[*(callbacks() if callbacks else []), *_EpochClock.pair(clock, w.steps)],
                            schedule=schedule)  # fmt: skip
    clock.wall = [r.seconds / w.steps for r in history.records]
    return clock


def per_step_work(run: Callable[["Workload"], Clock], w: "Workload") -> tuple[float, float]:
    """(Python function calls, torch ops dispatched) per training step of ``run``: exact counts, which no
    load on the host moves. Counted over a run of 3 epochs and one of 6 on the same data, so what a run
    does once (setup, compiles, the epoch's reads) cancels out: (long - short) / the extra steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.count += 1
            return func(*args, **(kwargs or {}))

    def counted(epochs: int) -> tuple[int, int]:
        calls = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal calls
            calls += event in ("call", "c_call")

        short = Workload(w.dataset, w.make_model, w.batch, epochs, w.max_lr)
        Ops.count = 0
        with Ops():
            sys.setprofile(profile)
            try:
                run(short)
            finally:
                sys.setprofile(None)
        return calls, Ops.count

    (calls_3, ops_3), (calls_6, ops_6) = counted(3), counted(6)
    steps = 3 * w.steps
    return (calls_6 - calls_3) / steps, (ops_6 - ops_3) / steps


def print_work(loops: dict[str, Callable[[Workload], object]], w: Workload, baseline: str, nodes: bool = True) -> None:
    """The exact figures: what the host does per step, whatever the load (IR nodes traced, on XLA)."""
    print("\nWork per step (exact: counted, not timed; the same on any host)\n")
    print("| loop |" + (" IR nodes traced per step |" if nodes else "") + " Python calls per step | torch ops per step |")
    print("|---|" + ("---|" if nodes else "") + "---|---|")
    work = {name: per_step_work(run, w) for name, run in loops.items()}
    graph = {name: step_nodes(run, w) for name, run in loops.items()} if nodes else {}
    for name, (calls, ops) in work.items():
        base_calls, base_ops = work[baseline]
        cells = [f"{graph[name]} ({graph[name] - graph[baseline]:+d})"] if nodes else []
        cells += [f"{calls:.0f} ({calls - base_calls:+.0f})", f"{ops:.1f} ({ops - base_ops:+.1f})"]
        print(f"| {name} | " + " | ".join(cells) + " |")


def step_nodes(run: Callable[[Workload], Clock], w: Workload) -> int:
    """The IR nodes of the graph each step of ``run`` syncs: the commonest size among the graphs of a short
    run (torch_xla's TensorsGraphSize samples), the others being the epoch's reads and additions."""
    import torch_xla.debug.metrics as met

    short = Workload(TensorDataset(*(t[: w.batch * 8] for t in w.dataset.tensors)), w.make_model, w.batch, 2)
    met.clear_metrics()  # this run's graphs alone
    run(short)
    return int(statistics.mode(size for _, size in met.metric_data("TensorsGraphSize")[2]))


@dataclass
class Timings:
    """Steady-state seconds per step of every loop, by round, with compiles and host syncs."""

    per_round: dict[str, list[float]]  # median s/step of each round
    best: dict[str, float]  # the fastest steady epoch's s/step, over all rounds (the least disturbed)
    compiles: dict[str, list[int]]  # graphs compiled by each run
    syncs: dict[str, float]  # host syncs per step (last run)
    cpu_per_round: dict[str, list[float]]  # median CPU s/step of the loop's thread, each round

    def ratios(self, name: str, baseline: str, cpu: bool = False) -> list[float]:
        """Per-round ratios to the baseline, each taken within one round (same load)."""
        figures = self.cpu_per_round if cpu else self.per_round
        return [a / b for a, b in zip(figures[name], figures[baseline])]


def run_interleaved(loops: dict[str, Callable[[Workload], Clock]], w: Workload, rounds: int) -> Timings:
    """Runs every loop once per round, in turn, so load on the host hits them alike."""
    names = list(loops)
    t = Timings({n: [] for n in names}, {n: float("inf") for n in names}, {n: [] for n in names}, {}, {n: [] for n in names})
    for _ in range(rounds):
        for name, loop in loops.items():
            backend.clear_counters()  # the counts below are this run's alone
            clock = loop(w)
            seconds = clock.wall
            t.per_round[name].append(statistics.median(seconds[1:]))  # epoch 1 is compilation
            t.cpu_per_round[name].append(statistics.median(clock.cpu[1:]))
            t.best[name] = min(t.best[name], *seconds[1:])
            t.compiles[name].append(backend.compile_count())
            t.syncs[name] = backend.host_sync_count() / (w.epochs * w.steps)
    return t


def print_table(t: Timings, baseline: str, title: str) -> None:
    short = baseline.split(" (")[0]
    print(f"\n{title}")
    print(f"| loop | ms/step, median (best) | vs {short}: median (range over rounds) | best vs best "
          f"| loop thread's CPU ms/step | its CPU vs {short}: median (range) "
          f"| graphs compiled per run | host syncs per step |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name in t.per_round:
        ms = statistics.median(t.per_round[name]) * 1000
        cpu_ms = statistics.median(t.cpu_per_round[name]) * 1000
        r, c = t.ratios(name, baseline), t.ratios(name, baseline, cpu=True)
        print(f"| {name} | {ms:.2f} ({t.best[name] * 1000:.2f}) | {statistics.median(r):.2f}x "
              f"({min(r):.2f}-{max(r):.2f}) | {t.best[name] / t.best[baseline]:.2f}x "
              f"| {cpu_ms:.2f} | {statistics.median(c):.3f}x ({min(c):.3f}-{max(c):.3f}) "
              f"| {max(t.compiles[name])} | {t.syncs[name]:.2f} |")  # fmt: skip
