"""predict() against a hand-written torch_xla inference loop on the same model.

Same model (the demo's CNN), same data (scikit-learn digits, x16 = 28,752
samples), same batch size, on XLA:CPU, in one run. The hand-written loop is
what a careful user writes: MpDeviceLoader, ``model(x)`` under no_grad, the
outputs kept on the device and copied to the host once at the end (one
``torch.cat(...).cpu()``). ``predict`` also pads the last batch, carries each
sample's index back to restore dataset order, and moves outputs to the host
every 16 batches (so a test set larger than device memory still fits).

The first call of each (compilation) is left out; the figure is the best
(and the median) time over interleaved rounds, as a throughput ratio to the
hand-written loop, and the device-to-host transfers per batch. On XLA:CPU the
"device" shares the host's cores, so a busy machine makes the median noisy;
the best round is the steadier figure. Target: ratio >= 0.95.

    PJRT_DEVICE=CPU python bench/predict_bench.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.distributed.parallel_loader as pl  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import predict, backend  # noqa: E402
from tpu_utility.demo import digits_datasets, small_cnn  # noqa: E402

BATCH, ROUNDS, COPIES = 256, 15, 16


def hand_written(model: torch.nn.Module, ds: TensorDataset) -> torch.Tensor:
    device = torch_xla.device()
    loader = DataLoader(ds, batch_size=BATCH)  # in order; the last batch is short (one more compile)
    outputs = []
    model.eval()
    with torch.no_grad():
        for (x,) in pl.MpDeviceLoader(loader, device):
            outputs.append(model(x))
    return torch.cat(outputs).cpu()


def with_predict(model: torch.nn.Module, ds: TensorDataset) -> torch.Tensor:
    return predict(model, ds, batch_size=BATCH, progress=False)


def timed(fn, model, ds) -> tuple[float, int, torch.Tensor]:
    before = backend.transfer_from_device_count()
    start = time.perf_counter()
    out = fn(model, ds)
    return time.perf_counter() - start, backend.transfer_from_device_count() - before, out


def main() -> None:
    train, _ = digits_datasets()
    ds = TensorDataset(torch.cat([train.tensors[0]] * COPIES))
    torch.manual_seed(0)
    model = small_cnn().to(torch_xla.device())
    batches = -(-len(ds) // BATCH)
    for fn in (hand_written, with_predict):  # compile both
        fn(model, ds)
    seconds: dict[str, list[float]] = {"hand-written": [], "predict": []}
    moved: dict[str, int] = {}
    for _ in range(ROUNDS):
        for name, fn in (("hand-written", hand_written), ("predict", with_predict)):
            s, n, _ = timed(fn, model, ds)
            seconds[name].append(s)
            moved[name] = n
    reference = hand_written(model, ds)
    same = torch.allclose(with_predict(model, ds), reference, atol=1e-5)
    best_base, median_base = min(seconds["hand-written"]), statistics.median(seconds["hand-written"])
    print(f"predict bench: {len(ds)} samples, batch {BATCH}, {batches} batches, XLA:CPU, {ROUNDS} interleaved rounds")
    print(f"{'loop':<14}{'samples/s (best)':>18}{'ratio':>8}{'ratio (median)':>16}{'transfers/batch':>18}")
    for name in ("hand-written", "predict"):
        best, median = min(seconds[name]), statistics.median(seconds[name])
        print(f"{name:<14}{len(ds) / best:>18,.0f}{best_base / best:>8.3f}{median_base / median:>16.3f}"
              f"{moved[name] / batches:>18.3f}")
    print(f"same outputs: {same}")


if __name__ == "__main__":
    main()
