"""make bench: a variable-length text classifier. The naive port (each batch padded to its
longest sequence, as the CUDA loop did), the bucketed port (BucketCollate, same loop),
the same with batches of similar lengths (BucketBatchSampler), and one_cycle_fit with
each; compiles and seconds per epoch.

Data: tpu_utility.demo.marker_sequences, lengths 5..120 skewed short, label = whether a
marker token occurs. The hand loops differ only in their loader (and none calls .item()),
so the difference is the shapes and the padding. Each run is a fresh process, as a new notebook
kernel would be: XLA keeps compiled graphs in memory, and a second run in one process
would find the naive port's shapes already compiled. Rounds are interleaved; the ratios
are taken within each round.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import warnings

os.environ.setdefault("PJRT_DEVICE", "CPU")
warnings.filterwarnings("ignore", message="dropping the last")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLES, BATCH, EPOCHS, ROUNDS, BUCKETS, WIDE = 1536, 32, 4, 5, 4, 256
LOOPS = {
    "naive": "naive port: pad to longest per batch",
    "bucketed": "bucketed port: BucketCollate, hand loop",
    "grouped": "bucketed port + BucketBatchSampler, hand loop",
    "fit": "one_cycle_fit + BucketCollate (train_step)",
    "fit-grouped": "one_cycle_fit + BucketCollate + BucketBatchSampler",
}


def _loader(kind: str, train: list) -> tuple:
    """The training DataLoader of this kind, and its collate."""
    from torch.utils.data import DataLoader

    from tpu_utility import BucketBatchSampler, BucketCollate
    from tpu_utility.demo import pad_to_longest

    lengths = [len(s) for s, _ in train]
    if kind == "naive":
        return DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=pad_to_longest, drop_last=True), None
    if kind.endswith("grouped"):  # batches of similar lengths: buckets are quantiles of the lengths themselves
        collate = BucketCollate.from_lengths(lengths, BUCKETS)
        sampler = BucketBatchSampler(lengths, collate.buckets, batch_size=BATCH)
        return DataLoader(train, batch_sampler=sampler, collate_fn=collate), collate
    collate = BucketCollate.from_lengths(lengths, BUCKETS, batch_size=BATCH)
    return DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=collate, drop_last=True), collate


def one_run(kind: str, width: int = 32) -> dict:
    """Trains once in this process (a model ``width`` wide); per-epoch seconds and compiles, and the padding waste."""
    import torch
    from torch import nn

    from tpu_utility import get_device, one_cycle_fit, step_optimizer, backend
    from tpu_utility.demo import MarkerClassifier, marker_sequences, masked_train_step

    loader, collate = _loader(kind, marker_sequences(SAMPLES, seed=0))
    torch.manual_seed(0)
    if kind.startswith("fit"):
        history = one_cycle_fit(MarkerClassifier(), loader, epochs=EPOCHS, max_lr=1e-2, train_step=masked_train_step,
                                progress=False)  # fmt: skip
        compiles = [r.compiles for r in history.records]
        return {"seconds": [r.seconds for r in history.records], "compiles": compiles, "waste": collate.waste,
                "shapes": sum(n > 0 for n in collate.bucket_batches.values())}  # fmt: skip
    device = get_device()
    model = MarkerClassifier(width=width).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    seconds, compiles, shapes, padded, total = [], [], set(), 0, 0
    for _ in range(EPOCHS):
        start = time.perf_counter()
        for tokens, mask, y in loader:
            shapes.add(tokens.shape[1])
            padded, total = padded + int((~mask).sum()), total + mask.numel()
            tokens, mask, y = tokens.to(device), mask.to(device), y.to(device)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(tokens, mask), y).backward()
            step_optimizer(optimizer)
        backend.wait()
        seconds.append(time.perf_counter() - start)
        compiles.append(backend.compile_count())
    return {"seconds": seconds, "compiles": compiles, "waste": padded / total, "shapes": len(shapes)}


def _fresh_process(kind: str, width: int = 32) -> dict:
    command = [sys.executable, __file__, "--one", kind, str(width)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _per_epoch(compiles: list[int]) -> list[int]:
    return [b - a for a, b in zip([0] + compiles, compiles)]


def main() -> None:
    runs: dict[str, list[dict]] = {kind: [] for kind in LOOPS}
    wide: dict[str, list[dict]] = {"bucketed": [], "grouped": []}
    for _ in range(ROUNDS):
        for kind in LOOPS:
            runs[kind].append(_fresh_process(kind))
        for kind in wide:
            wide[kind].append(_fresh_process(kind, WIDE))
    steady = {k: [statistics.median(r["seconds"][1:]) for r in rs] for k, rs in runs.items()}
    print(f"\nVariable-length text classifier on XLA:CPU ({SAMPLES} sequences of 5-120 tokens, batch {BATCH}, "
          f"{EPOCHS} epochs, {BUCKETS} buckets asked; {ROUNDS} rounds, each run a fresh process)")  # fmt: skip
    print("| loop | input shapes | graphs compiled in epoch 1, 2, 3, ... | s/epoch, epoch 1 | s/epoch, later "
          "epochs (median) | later epochs vs naive (median, range over rounds) | padding waste |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for kind, name in LOOPS.items():
        first = runs[kind][0]
        per_epoch = ", ".join(str(c) for c in _per_epoch(first["compiles"]))
        speedup = [n / s for n, s in zip(steady["naive"], steady[kind])]
        print(f"| {name} | {first['shapes']} | {per_epoch} | "
              f"{statistics.median(r['seconds'][0] for r in runs[kind]):.2f} | {statistics.median(steady[kind]):.2f} | "
              f"{statistics.median(speedup):.1f}x faster ({min(speedup):.1f}-{max(speedup):.1f}) | "
              f"{first['waste']:.0%} |")  # fmt: skip
    _print_wide(wide)


def _print_wide(wide: dict[str, list[dict]]) -> None:
    """Where the step costs compute, grouped batches pay for fewer padded tokens."""
    steady = {k: [statistics.median(r["seconds"][1:]) for r in rs] for k, rs in wide.items()}
    speedup = [s / g for s, g in zip(steady["bucketed"], steady["grouped"])]
    print(f"\nThe same hand loops, the model {WIDE} wide instead of 32 (more compute per token)")
    print("| loop | padding waste | s/epoch, later epochs (median) | vs shuffled batches (median, range) |")
    print("|---|---|---|---|")
    print(f"| bucketed, shuffled batches | {wide['bucketed'][0]['waste']:.0%} | {statistics.median(steady['bucketed']):.2f} | 1.0x |")
    print(f"| bucketed + BucketBatchSampler | {wide['grouped'][0]['waste']:.0%} | {statistics.median(steady['grouped']):.2f} | "
          f"{statistics.median(speedup):.1f}x faster ({min(speedup):.1f}-{max(speedup):.1f}) |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
