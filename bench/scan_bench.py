"""Would torch_xla's ``scan`` pay for a Hugging Face decoder's layers? Compile time, graph size and step time of a
tiny-width Llama's training step (forward, loss, backward), its layers unrolled (as transformers traces them
today, and as one_cycle_fit runs them) against one layer run by ``torch_xla.experimental.scan.scan`` over the
stacked weights, on XLA:CPU.

This measures the decision of issue 59 before the package scans anything: one_cycle_fit does not scan layers yet.
The scanned run swaps ``model.model.layers`` for a ModuleList whose slice (transformers' ``self.layers[:n]``)
gives one callable that scans the layers, passing the rotary embeddings and the mask along in the carry; the same
model and batch give both runs, whose losses and gradients are compared (they were equal to the bit on
torch_xla 2.9). Each (layers, mode) runs in a fresh interpreter (no compile shared), interleaved by depth.

    python bench/scan_bench.py               # 8, 16 and 32 layers
    python bench/scan_bench.py --layers 4 8  # fewer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, time
import torch, torch_xla
import torch_xla.debug.metrics as met
from transformers import LlamaConfig, LlamaForCausalLM

layers, scanned = int(sys.argv[1]), sys.argv[2] == "scan"
torch.manual_seed(0)
config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
config._attn_implementation = "eager"
dev = torch_xla.device()
model = LlamaForCausalLM(config).to(dev)
ids = torch.randint(0, 128, (4, 32)).to(dev)


if scanned:  # the package's scan: the weights stored stacked for the run, one layer traced and looped
    from tpu_utility.scan import scan_layers

    handle = scan_layers(model)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)


def step():
    opt.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    return loss


torch_xla.sync()  # the model's tensors (and the scanned run's stacking) placed: set-up, not the step's compile
setup_s = (met.metric_data("CompileTime") or (0, 0))[1] / 1e9
t0 = time.perf_counter()
loss = step()
hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss] + [p for p in model.parameters()])
instructions = sum(1 for line in hlo.splitlines() if " = " in line)
torch_xla.sync()
first = loss.item()
first_s = time.perf_counter() - t0
compile_s = met.metric_data("CompileTime")[1] / 1e9 - setup_s
sizes = met.metric_data("TensorsGraphSize")[2]
times = []
for _ in range(6):
    t = time.perf_counter()
    step()
    torch_xla.sync()
    torch_xla._XLAC._xla_wait_device_ops(devices=[])
    times.append(time.perf_counter() - t)
if scanned:
    handle.undo()  # the layers' own parameters again, in the model's order: comparable with the unrolled run
torch.save(torch.cat([p.detach().flatten().cpu() for p in model.parameters()]), sys.argv[3])  # after 7 steps
print(json.dumps(dict(loss=first, first_s=first_s, compile_s=compile_s, nodes=max(v for _, v in sizes),
                      instructions=instructions, step_s=sorted(times)[len(times) // 2])))
"""


def run(layers: int, mode: str, grads: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    env.setdefault("XLA_FLAGS", "--xla_cpu_use_fusion_emitters=false")
    done = subprocess.run([sys.executable, "-c", CHILD, str(layers), mode, grads], env=env, capture_output=True,
                          text=True, check=False)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"{layers} layers, {mode}: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    args = parser.parse_args()
    import tempfile

    import torch

    found = {}
    with tempfile.TemporaryDirectory() as folder:
        for layers in args.layers:
            for mode in ("unrolled", "scan"):
                found[layers, mode] = run(layers, mode, os.path.join(folder, f"{layers}{mode}.pt"))
            a, b = (torch.load(os.path.join(folder, f"{layers}{m}.pt")) for m in ("unrolled", "scan"))
            found[layers, "weight_diff"] = float((a - b).abs().max())
    print(f"{'layers':>6} {'mode':>9} {'compile s':>9} {'IR nodes':>8} {'HLO instr':>9} {'step ms':>8}  loss")
    for layers in args.layers:
        for mode in ("unrolled", "scan"):
            r = found[layers, mode]
            print(f"{layers:>6} {mode:>9} {r['compile_s']:>9.1f} {r['nodes']:>8} {r['instructions']:>9} "
                  f"{1000 * r['step_s']:>8.1f}  {r['loss']:.6f}")
        u, s = found[layers, "unrolled"], found[layers, "scan"]
        print(f"{layers:>6} compile unrolled/scan {u['compile_s'] / s['compile_s']:.2f}x, step scan/unrolled "
              f"{s['step_s'] / u['step_s']:.2f}x, max |weight diff| after 7 steps {found[layers, 'weight_diff']:.2e}")
    low, high = min(args.layers), max(args.layers)
    for mode in ("unrolled", "scan"):
        print(f"compile growth {low}->{high} layers, {mode}: "
              f"{found[high, mode]['compile_s'] / found[low, mode]['compile_s']:.2f}x")


if __name__ == "__main__":
    main()
