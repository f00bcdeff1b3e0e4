"""make bench: real tokens per second of a LoRA fine-tune, packed rows vs BucketCollate vs padding to 1,024.

A tiny Llama (2 layers, Llama's shapes: MLP 3.5x the width, heads of 64 from 256 wide) with LoRA
adapters trains through one_cycle_fit on XLA:CPU over instruction-like lengths (the issue's seeded
log-normal: median 150, sigma 0.8, clipped to 16..1,024 tokens), batch 8, shaped four ways:

- padded: every sample padded to 1,024 tokens (the one shape that never recompiles without buckets);
- bucketed: ``BucketCollate([128, 256, 512, 1024])`` with ``BucketBatchSampler`` (batches of one bucket each: the
  best bucketing does, 0.68 real tokens; shuffled batches pad to the bucket of their longest, 0.29);
- packed: ``PackedDataset(samples, 1024)`` (first-fit decreasing, the default), block-diagonal attention on the device;
- packed rows of 128/256/512/1024: ``PackedDataset(samples, [128, 256, 512, 1024])``
  (``.loader(8)``:
  a row as short as its longest sample allows, the tails filled; one graph per row length, as buckets);
- parted rows: ``PackedDataset(samples, 1024, chunks="auto")``: every row one layout, a first part of 1,024
  then chunks of 512/256/128 in the data's proportions, no sample crossing a part; each part attends within
  itself (its own length, not the row's): one shape, one train-step graph. Batches of about as many tokens
  as 8 rows of 1,024 (the rows are longer: ``round(8 x 1,024 / row length)`` rows).

A packed row of 1,024 pays attention over all of it (a dense mask: no segment-aware kernel on XLA:CPU),
a bucketed row its bucket's length: where attention outweighs the projections (a tiny width) short
bucketed rows win; the wider the model, the more the projections (which scale with tokens computed)
decide. Each table says attention's share of a packed step's FLOPs at its width (Llama 3 8B at 1,024
tokens: 3%). Rows of several lengths pay attention over about 570 tokens, not 1,024.

Real tokens/s counts the data's tokens only (padding computed is not work done), over the epochs
after the first, compile time left out as ``samples_per_s`` leaves it out. Each run is a fresh
process (XLA keeps compiled graphs in memory); the rounds interleave the kinds, and the ratios
are taken within each round. Compiles and host syncs per epoch come from the run's History.
``python bench/packing_bench.py [WIDTH ...]`` measures the widths given (default 64, 512, 1024).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SAMPLES, ROW, BATCH, EPOCHS, ROUNDS, VOCAB, WIDTHS = 160, 1024, 8, 3, 2, 128, (64, 512, 1024)
LENGTHS = [128, 256, 512, 1024]
KINDS = {"padded": "padded to 1,024", "bucketed": "BucketCollate 128/256/512/1024 + BucketBatchSampler",
         "packed": "PackedDataset rows of 1,024 (the default)",
         "rows": "PackedDataset rows of 128/256/512/1024, .loader(8)",
         "parted": "PackedDataset rows of 1,024 + chunks='auto' (one layout)"}  # fmt: skip
FASTER = ("packed", "rows", "parted")  # the kinds whose speed-up over each kind the table gives


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


def model(width: int):
    """A 2-layer LoRA Llama of Llama's proportions at ``width``."""
    import peft
    import torch
    import transformers as t

    torch.manual_seed(0)
    heads = max(4, width // 64)
    config = t.LlamaConfig(num_hidden_layers=2, hidden_size=width, intermediate_size=width * 7 // 2,
                           num_attention_heads=heads, num_key_value_heads=max(2, heads // 4), vocab_size=VOCAB,
                           max_position_embeddings=ROW)  # fmt: skip
    return peft.get_peft_model(t.LlamaForCausalLM(config), peft.LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM",
                                                                           target_modules=["q_proj", "v_proj"]))  # fmt: skip


def attention_share(width: int) -> float:
    """Attention's share of a packed LoRA step's FLOPs per token at ``width`` (training_flops_per_token)."""
    from tpu_utility.training.throughput import training_flops_per_token

    lora = model(width)
    total, none = training_flops_per_token(lora, ROW), training_flops_per_token(lora, 0)
    return (total - none) / total


def one_run(kind: str, width: int) -> dict:
    from torch.utils.data import DataLoader

    from tpu_utility import BucketBatchSampler, BucketCollate, PackedDataset, one_cycle_fit

    data = samples(SAMPLES)
    real = sum(len(s["input_ids"]) for s in data)
    batch = BATCH
    if kind in ("packed", "rows", "parted"):
        train = PackedDataset(data, LENGTHS if kind == "rows" else ROW, chunks="auto" if kind == "parted" else None)
        share = train.fill
        per_row = [sum(len(data[i]["input_ids"]) for i in row) for row in train.rows]
        if kind == "rows":  # a pass leaves out its short last batch, of the longest (fullest) rows: count what trains
            train = train.loader(BATCH)
            tokens_per_item = []
            for epoch in range(EPOCHS):
                drawn = train.batch_sampler.reshard(BATCH, 1, 0)  # the same draw as the run's, epoch by epoch
                drawn.set_epoch(epoch)
                rows = [r for b in drawn for r in b]
                tokens_per_item.append(sum(per_row[r] for r in rows) / len(rows))
        else:  # rows of one shape, drawn as one_cycle_fit draws a dataset: count the rows each epoch trains
            from torch.utils.data import DistributedSampler

            batch = max(1, round(BATCH * ROW / train.length))
            drawn = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
            tokens_per_item = []
            for epoch in range(EPOCHS):
                drawn.set_epoch(epoch)
                rows = list(drawn)[: len(train) // batch * batch]
                tokens_per_item.append(sum(per_row[r] for r in rows) / len(rows))
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
    history = one_cycle_fit(model(width), train, epochs=EPOCHS, max_lr=1e-3, batch_size=None if kind == "rows" else batch,
                            progress=False)  # fmt: skip
    if kind == "bucketed":
        share = collate.real_tokens / (collate.real_tokens + collate.padded_tokens)
    compiles = [r.compiles for r in history.records]
    per_epoch = tokens_per_item if isinstance(tokens_per_item, list) else [tokens_per_item] * EPOCHS
    return {"tokens_per_s": [r.samples_per_s * t for r, t in zip(history.records, per_epoch)], "share": share,
            "compiles": [b - a for a, b in zip([0] + compiles, compiles)], "host_syncs": [r.host_syncs for r in history.records],
            "seconds": [r.seconds for r in history.records], "batch": batch, "row": ROW if kind != "parted" else train.length,
            "train_shapes": len({str(g.shapes) for g in history.graphs if g.graph == "train step"})}  # fmt: skip


def _fresh_process(kind: str, width: int) -> dict:
    command = [sys.executable, __file__, "--one", kind, str(width)]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"the {kind} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(widths: tuple[int, ...] = WIDTHS) -> None:
    for width in widths:  # padding to 1,024 loses by far at any width: measured at the narrowest only
        _table({k: v for k, v in KINDS.items() if k != "padded" or width == min(widths)}, width)


def _table(kinds: dict[str, str], width: int) -> None:
    runs: dict[str, list[dict]] = {kind: [] for kind in kinds}
    for _ in range(ROUNDS):
        for kind in kinds:
            runs[kind].append(_fresh_process(kind, width))
    steady = {k: [statistics.median(r["tokens_per_s"][1:]) for r in rs] for k, rs in runs.items()}
    print(f"\nLoRA on a Llama {width} wide (2 layers; attention {attention_share(width):.0%} of a packed step's FLOPs), "
          f"XLA:CPU: {SAMPLES} samples of 16-1,024 tokens (log-normal, median 150), batch {BATCH}, {EPOCHS} epochs; "
          f"{ROUNDS} rounds interleaved, each run a fresh process")  # fmt: skip
    print("| batches | real tokens / computed | graphs compiled per epoch | train-step shapes | host syncs per epoch | "
          "real tokens/s, later epochs (median) | packed (1,024) is this many times faster | packed rows of 4 lengths "
          "is this many times faster | parted rows is this many times faster (median, range over rounds) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for kind, name in kinds.items():
        first = runs[kind][0]
        ratios = []
        for faster in FASTER:
            ratio = [p / s for p, s in zip(steady[faster], steady[kind])]
            ratios.append(f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})")
        name = f"{name}: {first['batch']} x {first['row']}" if kind == "parted" else name
        print(f"| {name} | {first['share']:.2f} | {', '.join(map(str, first['compiles']))} | {first['train_shapes']} | "
              f"{', '.join(map(str, first['host_syncs']))} | {statistics.median(steady[kind]):,.0f} | "
              f"{' | '.join(ratios)} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(one_run(sys.argv[2], int(sys.argv[3]))))
    else:
        main(tuple(int(w) for w in sys.argv[1:]) or WIDTHS)
