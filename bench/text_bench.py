"""make bench: a variable-length text classifier. The naive port (each batch padded to its
longest sequence, as the CUDA loop did), the bucketed port (BucketCollate, same loop),
and one_cycle_fit with BucketCollate; compiles and seconds per epoch.

Data: tpu_utility.demo.marker_sequences, lengths 5..120 skewed short, label = whether a
marker token occurs. The two hand loops differ only in their collate (and neither calls
.item()), so the difference is the shapes. Each run is a fresh process, as a new notebook
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

SAMPLES, BATCH, EPOCHS, ROUNDS, BUCKETS = 1536, 32, 4, 3, 4
LOOPS = {
    "naive": "naive port: pad to longest per batch",
    "bucketed": "bucketed port: BucketCollate, hand loop",
    "fit": "one_cycle_fit + BucketCollate (train_step)",
}


def one_run(kind: str) -> dict:
    """Trains once in this process; per-epoch seconds and compiles, and the padding waste."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from tpu_utility import BucketCollate, get_device, one_cycle_fit, step_optimizer, xla
    from tpu_utility.demo import MarkerClassifier, marker_sequences, masked_train_step, pad_to_longest

    train = marker_sequences(SAMPLES, seed=0)
    lengths = [len(s) for s, _ in train]
    collate = pad_to_longest if kind == "naive" else BucketCollate.from_lengths(lengths, BUCKETS, batch_size=BATCH)
    torch.manual_seed(0)
    if kind == "fit":
        history = one_cycle_fit(MarkerClassifier(), DataLoader(train, batch_size=BATCH, collate_fn=collate),
                                epochs=EPOCHS, max_lr=1e-2, train_step=masked_train_step, progress=False)  # fmt: skip
        compiles = [r.compiles for r in history.records]
        return {"seconds": [r.seconds for r in history.records], "compiles": compiles, "waste": collate.waste,
                "shapes": sum(n > 0 for n in collate.bucket_batches.values())}  # fmt: skip
    device = get_device()
    model = MarkerClassifier().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(train, batch_size=BATCH, shuffle=True, collate_fn=collate, drop_last=True)
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
        xla.wait_device_ops()
        seconds.append(time.perf_counter() - start)
        compiles.append(xla.compile_count())
    return {"seconds": seconds, "compiles": compiles, "waste": padded / total, "shapes": len(shapes)}


def _fresh_process(kind: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", kind], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _per_epoch(compiles: list[int]) -> list[int]:
    return [b - a for a, b in zip([0] + compiles, compiles)]


def main() -> None:
    runs: dict[str, list[dict]] = {kind: [] for kind in LOOPS}
    for _ in range(ROUNDS):
        for kind in LOOPS:
            runs[kind].append(_fresh_process(kind))
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


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2])))
    else:
        main()
