"""make bench (memory plans): issue 54's table, planned by one traced step, against the peaks measured on an H200.

Each row's model is built on the ``meta`` device at its full size (Llama 300M, the same with 4 KV heads, a
Gemma-shaped model with a 256k vocabulary, TinyLlama's 1.1B shape; sdpa attention) and planned by
``memory_plan(model, cores=1, batch_size=, seq_len=, precision="bf16", checkpointing=)``: one training step traced
on fake tensors by torch's MemTracker (nothing allocated; it runs on this 2-core host), and the formulas
(``method="estimate"``) beside it. The measured figures are the issue's: ``torch.cuda.max_memory_allocated()``
over 3 steps of ``one_cycle_fit(precision="bf16")`` on one H200 (torch 2.11, transformers 5.24). A ratio above
1.00 plans more than the chip used; below 1.00 would let a run out of memory.

XLA schedules a step's memory itself, so ``xla`` compares a traced plan with XLA's own buffer assignment of the
same step graph, compiled on XLA:CPU (``--xla_dump_to``; its ``*buffer-assignment.txt`` gives the peak and the
allocations): a Llama of hidden 256, 4 layers, 8k vocabulary, 4 x 512 tokens, fp32 (XLA:CPU has no bf16
autocast), AdamW, the second step's graph (the optimizer's state made).

    python bench/memory_bench.py          # the table, and bench/out/memory_bench.json
    python bench/memory_bench.py xla      # a traced plan against XLA:CPU's buffer assignment
"""

from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile
import time

import torch

# the issue's runs were on the native backend; and transformers imports torch_xla where it is installed, which sets
# PJRT_DEVICE and would make this process an XLA one (where a traced step must wait for the XLA runtime)
XLA = sys.argv[1:] == ["xla"]
os.environ.setdefault("TPU_UTILITY_BACKEND", "xla" if XLA else "native")
DUMP = tempfile.mkdtemp(prefix="memory_bench_xla_")
if XLA:  # before anything imports torch_xla
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP} --xla_dump_hlo_as_text".strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import memory_plan  # noqa: E402
from tpu_utility.training.memory import MARGIN  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "memory_bench.json")

# the issue's models; their intermediate sizes and heads are the ones its plans (9.41, 36.29, 32.35, 57.32 GB) used
LLAMA_300M = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=32000)  # fmt: skip
MODELS = {
    "Llama 300M": ("llama", LLAMA_300M),
    "Llama 300M, 4 KV heads": ("llama", {**LLAMA_300M, "num_key_value_heads": 4}),
    "Gemma-shaped, 256k vocab": ("gemma", dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                                               num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                                               vocab_size=256000)),  # fmt: skip
    "Llama 1.1B (TinyLlama)": ("llama", dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                             num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)),  # fmt: skip
}
# (model, batch, seq, checkpointing, the issue's measured peak in GB, the issue's plan in GB before this change)
ROWS = [
    ("Llama 300M", 16, 256, False, 9.41, 9.41),
    ("Llama 300M", 16, 1024, False, 25.44, 37.50),
    ("Llama 300M", 4, 2048, False, 14.74, 29.51),
    ("Llama 300M", 16, 1024, True, 10.96, 11.86),
    ("Llama 300M, 4 KV heads", 16, 1024, False, 24.19, 36.29),
    ("Gemma-shaped, 256k vocab", 8, 1024, False, 34.86, 32.35),
    ("Gemma-shaped, 256k vocab", 8, 1024, True, 30.69, 27.87),
    ("Llama 1.1B (TinyLlama)", 8, 1024, False, 38.05, 57.32),
]


def meta_model(name: str, device: str = "meta") -> torch.nn.Module:
    """The row's model on ``device`` (``meta``: no storage; "cpu": initialised weights, for a real run)."""
    from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig

    family, sizes = MODELS[name]
    config = (GemmaConfig if family == "gemma" else LlamaConfig)(**sizes)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config)


def main() -> None:
    results = []
    header = (f"{'model':<26} {'batch x seq':>11} {'ckpt':>4} {'traced':>7} {'measured':>8} {'ratio':>6} {'s':>5} "
              f"{'formulas':>8} {'ratio':>6} {'before':>6} {'ratio':>6}")  # fmt: skip
    print(header)
    for name, batch, seq, ckpt, measured, before in ROWS:
        model = meta_model(name)
        run = dict(cores=1, batch_size=batch, seq_len=seq, precision="bf16", checkpointing=ckpt)
        start = time.perf_counter()
        traced = memory_plan(model, **run)
        seconds = time.perf_counter() - start
        estimate = memory_plan(model, **run, method="estimate")
        row = {"model": name, "batch": batch, "seq_len": seq, "checkpointing": ckpt, "measured_gb": measured,
               "traced_gb": traced.replicated / 1e9, "estimate_gb": estimate.replicated / 1e9, "before_gb": before,
               "seconds": seconds, "method": traced.method}  # fmt: skip
        results.append(row)
        print(f"{name:<26} {f'{batch} x {seq}':>11} {'on' if ckpt else 'off':>4} {row['traced_gb']:7.2f} {measured:8.2f} "
              f"{row['traced_gb'] / measured:6.2f} {seconds:5.1f} {row['estimate_gb']:8.2f} "
              f"{row['estimate_gb'] / measured:6.2f} {before:6.2f} {before / measured:6.2f}", flush=True)  # fmt: skip
        if not traced.method.startswith("traced"):
            print(f"  not traced: {traced.method}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as out:
        json.dump(results, out, indent=1)
    print(f"traced GB: memory_plan's replicated total (the traced peak + {MARGIN:.0%} for the allocator); "
          f"measured: the issue's H200 peaks; before: the plan before issue 54. Written to {OUT}")


def xla_buffer_assignment() -> None:
    """One traced plan against XLA:CPU's buffer assignment of the same training step's graph."""
    import torch_xla
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tpu_utility import get_device

    device = get_device()  # the runtime first: a traced step runs a CPU backward
    config = LlamaConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, vocab_size=8000)  # fmt: skip
    config._attn_implementation = "sdpa"
    batch, seq = 4, 512
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    plan = memory_plan(meta, cores=1, batch_size=batch, seq_len=seq, precision="fp32", device_memory="16GB")
    print(plan)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (batch, seq)).to(device)
    for _ in range(2):  # the second step's graph holds the optimizer's state
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    path = sorted(glob.glob(os.path.join(DUMP, "*buffer-assignment.txt")))[-1]
    text = open(path).read()
    peak = int(re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", text)[1].replace(" ", ""))
    total = int(re.search(r"Total bytes used: (\d+)", text)[1])
    params = sum(int(m[1]) for m in re.finditer(r"allocation \d+: size (\d+), parameter", text))
    traced = plan.replicated - plan.term("allocator rounding and workspaces (4%)").replicated
    print(f"XLA:CPU buffer assignment ({os.path.basename(path)}): peak {peak / 1e6:.1f} MB, total allocations "
          f"{total / 1e6:.1f} MB ({params / 1e6:.1f} MB of them parameters and optimizer state)\n"
          f"traced step (no margin): {traced / 1e6:.1f} MB; XLA peak / traced: {peak / traced:.2f}; "
          f"plan (with margin) / XLA peak: {plan.replicated / peak:.2f}")  # fmt: skip


if __name__ == "__main__":
    xla_buffer_assignment() if XLA else main()
