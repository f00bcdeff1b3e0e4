"""XLA:CPU's own buffer assignment of a LoRA training step: a bf16 base against an int8 base (quantize_base).

The claim checked: the int8 base's compiled step holds no full dequantized copy of the base, so its peak is below
the bf16 base's by at least 40% of the base's bf16 linear bytes (int8 saves half of them). Each run compiles the
step in its own process with ``--xla_dump_to`` and reads the peak from ``*buffer-assignment.txt``.

    python bench/quantized_memory_bench.py          # both, each in a child; prints the peaks and the ratio
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def step_peak(mode: str) -> None:
    dump = tempfile.mkdtemp(prefix=f"quantized_bench_{mode}_")
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ["XLA_FLAGS"] = f"--xla_dump_to={dump} --xla_dump_hlo_as_text"
    sys.path.insert(0, ROOT)
    import peft
    import torch
    import torch_xla
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpu_utility import get_device, quantize_base

    device = get_device()
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    linear = sum(m.weight.numel() * 2 for n, m in model.named_modules()
                 if isinstance(m, torch.nn.Linear) and "lm_head" not in n)  # fmt: skip
    if mode == "int8":
        quantize_base(model)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).to(torch.bfloat16)
    model.to(device)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, config.vocab_size, (2, 128)).to(device)
    for _ in range(2):  # the second step's graph holds the optimizer's state
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        torch_xla.sync()
    peaks = []
    for path in glob.glob(os.path.join(dump, "*buffer-assignment.txt")):
        found = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", open(path).read())
        if found:
            peaks.append(int(found[1].replace(" ", "")))
    print(f"RESULT {mode} {max(peaks)} {linear}")


def main() -> None:
    results = {}
    for mode in ("bf16", "int8"):
        out = subprocess.run([sys.executable, __file__, mode], capture_output=True, text=True, check=True).stdout
        name, peak, linear = out.split("RESULT ")[1].split()
        results[name] = (int(peak), int(linear))
    (bf16, linear), (int8, _) = results["bf16"], results["int8"]
    print(f"XLA:CPU step peak: bf16 base {bf16 / 1e6:.1f} MB, int8 base {int8 / 1e6:.1f} MB; saved "
          f"{(bf16 - int8) / 1e6:.1f} MB = {(bf16 - int8) / linear:.2f} x the base's bf16 linear bytes "
          f"({linear / 1e6:.1f} MB): int8 halves them, so 0.50 means no dequantized copy is kept; the claim is >= 0.40")


if __name__ == "__main__":
    step_peak(sys.argv[1]) if sys.argv[1:] else main()
