"""XLA:CPU's own buffer assignment of a LoRA training step: a bf16 base against an int8 base (quantize_base).

The claim checked: the int8 base's compiled step holds no full dequantized copy of the base, so its peak is below
the bf16 base's by at least 40% of the base's bf16 linear bytes (int8 saves half of them). The step of each is
compiled in one process run with ``--xla_dump_to``; the peak is read from the ``*buffer-assignment.txt`` files that
each model's steps added. ``tests/test_quantization.py`` runs ``compiled_peaks`` on 2 blocks.

    python bench/quantized_memory_bench.py          # 8 blocks, in a child; prints the peaks and the ratio
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _peaks(dump: str, seen: set[str]) -> list[int]:
    peaks = []
    for path in sorted(set(glob.glob(os.path.join(dump, "*buffer-assignment.txt"))) - seen):
        seen.add(path)
        text = open(path).read()
        found = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", text)
        if found:
            peaks.append(int(found[1].replace(" ", "")))
            continue
        # torch_xla 2.8's XLA writes no breakdown line: the buffers live at the peak, with their running sum
        block = re.search(r"Live ranges at \d+ \(peak\):\n((?:    .*\n?)+)", text)
        if block:
            peaks.append(max(int(n) for n in re.findall(r"cumulative: (\d+) bytes", block[1])))
    return peaks


def compiled_peaks(dump: str, layers: int = 8, steps: int = 2) -> dict[str, int]:
    """``{"bf16": peak, "int8": peak, "linear": the base's bf16 linear bytes}``: two LoRA steps of a Llama of
    ``layers`` 512 x 2048 blocks (``steps`` steps each: the second's graph holds the optimizer's state), a bf16 base
    and then an int8 one, compiled on XLA:CPU in this process, whose
    XLA_FLAGS give ``--xla_dump_to=dump --xla_dump_hlo_as_text`` (set before torch_xla is imported)."""
    sys.path.insert(0, ROOT)
    import peft
    import torch
    import torch_xla
    from transformers import LlamaConfig, LlamaForCausalLM

    from tpu_utility import get_device, quantize_base

    device = get_device()
    config = LlamaConfig(hidden_size=512, intermediate_size=2048, num_hidden_layers=layers, num_attention_heads=8,
                         num_key_value_heads=8, vocab_size=512, max_position_embeddings=256)  # fmt: skip
    seen: set[str] = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt")))
    out = {}
    for mode in ("bf16", "int8"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        out["linear"] = sum(m.weight.numel() * 2 for n, m in model.named_modules()
                            if isinstance(m, torch.nn.Linear) and "lm_head" not in n)  # fmt: skip
        if mode == "int8":
            quantize_base(model)
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"])).to(torch.bfloat16)
        model.to(device)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.randint(0, config.vocab_size, (2, 128)).to(device)
        for _ in range(steps):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
            torch_xla.sync()
        out[mode] = max(_peaks(dump, seen))
    return out


def main() -> None:
    dump = tempfile.mkdtemp(prefix="quantized_bench_")
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU"),
           "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"}  # fmt: skip
    code = f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import quantized_memory_bench as b; " \
           f"print('RESULT', b.compiled_peaks({dump!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    peaks = eval(out.split("RESULT ")[1])
    bf16, int8, linear = peaks["bf16"], peaks["int8"], peaks["linear"]
    print(f"XLA:CPU step peak: bf16 base {bf16 / 1e6:.1f} MB, int8 base {int8 / 1e6:.1f} MB; saved "
          f"{(bf16 - int8) / 1e6:.1f} MB = {(bf16 - int8) / linear:.2f} x the base's bf16 linear bytes "
          f"({linear / 1e6:.1f} MB): int8 halves them, so 0.50 means no dequantized copy is kept; the claim is >= 0.40")


if __name__ == "__main__":
    main()
