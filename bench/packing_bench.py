"""make bench: real tokens per second of a LoRA fine-tune, packed rows vs BucketCollate vs padding to 1,024.

A tiny Llama with LoRA adapters trains through one_cycle_fit on XLA:CPU over instruction-like
lengths (the issue's seeded log-normal: median 150, sigma 0.8, clipped to 16..1,024 tokens),
batch 8, shaped three ways:

- padded: every sample padded to 1,024 tokens (the one shape that never recompiles without buckets);
- bucketed: ``BucketCollate([128, 256, 512, 1024])`` with ``BucketBatchSampler`` (batches of one bucket each: the
  best bucketing does, 0.68 real tokens; shuffled batches pad to the bucket of their longest, 0.29);
- packed: ``PackedDataset(samples, 1024)`` (first-fit decreasing), block-diagonal attention on the device.

The same with the model 256 wide instead of 64, bucketed and packed: attention over a packed row of 1,024
costs the whole row's (a dense mask; no segment-aware kernel on XLA:CPU), so at tiny widths, where
attention outweighs the projections, short bucketed rows win; the wider the model, the more the
projections (which scale with tokens computed) decide.

Real tokens/s counts the data's tokens only (padding computed is not work done), over the epochs
after the first, compile time left out as ``samples_per_s`` leaves it out. Each run is a fresh
process (XLA keeps compiled graphs in memory); the rounds interleave the three, and the ratios
are taken within each round. Compiles and host syncs per epoch come from the run's History.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLES, ROW, BATCH, EPOCHS, ROUNDS, VOCAB, WIDTH, WIDE = 160, 1024, 8, 2, 2, 128, 64, 256
KINDS = {"padded": "padded to 1,024", "bucketed": "BucketCollate 128/256/512/1024 + BucketBatchSampler",
         "packed": "PackedDataset rows of 1,024"}  # fmt: skip


def samples(n: int, seed: int = 0) -> list[dict]:
    """Token samples of the issue's lengths; the first quarter of each is a prompt (labels -100)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = np.clip(np.round(rng.lognormal(np.log(150), 0.8, n)), 16, 1024).astype(int)
    out = []
    for n_tokens in lengths:
        ids = rng.integers(0, VOCAB, int(n_tokens)).tolist()
        prompt = int(n_tokens) // 4
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def one_run(kind: str, width: int = WIDTH) -> dict:
    import peft
    import torch
    import transformers as t
    from torch.utils.data import DataLoader

    from tpu_utility import BucketBatchSampler, BucketCollate, PackedDataset, one_cycle_fit

    data = samples(SAMPLES)
    real = sum(len(s["input_ids"]) for s in data)
    if kind == "packed":
        train = PackedDataset(data, ROW)
        tokens_per_item = real / len(train)
        share = train.fill
    elif kind == "padded":
        train = [{"input_ids": s["input_ids"] + [0] * (ROW - len(s["input_ids"])),
                  "attention_mask": [1] * len(s["input_ids"]) + [0] * (ROW - len(s["input_ids"])),
                  "labels": s["labels"] + [-100] * (ROW - len(s["labels"]))} for s in data]  # fmt: skip
        tokens_per_item, share = real / len(data), real / (len(data) * ROW)
    else:
        collate = BucketCollate([128, 256, 512, 1024], keys=None)
        sampler = BucketBatchSampler([len(s["input_ids"]) for s in data], collate.buckets, batch_size=BATCH)
        train = DataLoader(data, batch_sampler=sampler, collate_fn=collate)
        tokens_per_item, share = real / len(data), None
    torch.manual_seed(0)
    config = t.LlamaConfig(num_hidden_layers=2, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=ROW)  # fmt: skip
    model = peft.get_peft_model(t.LlamaForCausalLM(config), peft.LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                                             target_modules=["q_proj", "v_proj"]))  # fmt: skip
    history = one_cycle_fit(model, train, epochs=EPOCHS, max_lr=1e-3, batch_size=BATCH, progress=False)
    if kind == "bucketed":
        share = collate.real_tokens / (collate.real_tokens + collate.padded_tokens)
    compiles = [r.compiles for r in history.records]
    return {"tokens_per_s": [r.samples_per_s * tokens_per_item for r in history.records], "share": share,
            "compiles": [b - a for a, b in zip([0] + compiles, compiles)], "host_syncs": [r.host_syncs for r in history.records],
            "seconds": [r.seconds for r in history.records]}  # fmt: skip


def _fresh_process(kind: str, width: int = WIDTH) -> dict:
    command = [sys.executable, __file__, "--one", kind, str(width)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(wide_only: bool = False) -> None:
    if not wide_only:
        _table({kind: KINDS[kind] for kind in KINDS}, WIDTH)
    _table({kind: KINDS[kind] for kind in ("bucketed", "packed")}, WIDE)


def _table(kinds: dict[str, str], width: int) -> None:
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(ROUNDS):
        for kind in kinds:
            runs[kind].append(_fresh_process(kind, width))
    steady = {k: [statistics.median(r["tokens_per_s"][1:]) for r in rs] for k, rs in runs.items()}
    print(f"\nLoRA on a Llama {width} wide (2 layers), XLA:CPU: {SAMPLES} samples of 16-1,024 tokens (log-normal, median 150), batch "
          f"{BATCH}, {EPOCHS} epochs; {ROUNDS} rounds interleaved, each run a fresh process")  # fmt: skip
    print("| batches | real tokens / computed | graphs compiled per epoch | host syncs per epoch | real tokens/s, "
          "later epochs (median) | packed is this many times faster (median, range over rounds) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for kind, name in kinds.items():
        first = runs[kind][0]
        ratio = [p / s for p, s in zip(steady["packed"], steady[kind])]
        print(f"| {name} | {first['share']:.2f} | {', '.join(map(str, first['compiles']))} | "
              f"{', '.join(map(str, first['host_syncs']))} | {statistics.median(steady[kind]):,.0f} | "
              f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f}) |")  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2], int(sys.argv[3]))))
    else:
        main(wide_only="--wide" in sys.argv)
