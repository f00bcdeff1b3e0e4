"""compile=True against a compiled hand loop, and both against eager, on the native backend (the CPU here, CUDA
where a GPU is).

The same Llama (built from a config), the same token batches, AdamW and the one-cycle schedule: ``one_cycle_fit``
with ``compile=True`` / ``False`` against the loop a user writes with ``torch.compile(model)`` (torch's
``OneCycleLR``, its betas cycled as one_cycle_fit cycles them) and the same loop eager. Rounds interleaved in one
process; a round's first epoch (the compile) is left out of the step time and reported as compile seconds.
Prints ms per step, tokens/s, peak memory (CUDA) and the ratios the issue asks for: one_cycle_fit compiled over
the compiled hand loop (target <= 1.03), and compiled over eager.

    python bench/compile_bench.py            # the CPU: a 2-layer Llama, 8 x 128 tokens
    python bench/compile_bench.py --gpu      # CUDA: the 300M Llama of the issue, 16 x 512 tokens, bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TPU_UTILITY_BACKEND", "native")

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from tpu_utility import Compile, one_cycle_fit  # noqa: E402
from tpu_utility.training.schedule import OneCycle  # noqa: E402

BACKEND = None  # torch.compile's backend: None is inductor; bench/gpu_check.py's dry run sets "aot_eager"

SHAPES = {  # (hidden, intermediate, layers, heads, vocab, batch, seq, steps an epoch, precision)
    "cpu": (128, 256, 2, 4, 512, 8, 128, 24, "fp32"),
    "gpu": (1024, 4096, 16, 16, 32000, 16, 512, 30, "bf16"),
}


def build(shape: tuple, device: torch.device) -> torch.nn.Module:
    hidden, inner, layers, heads, vocab = shape[:5]
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inner, num_hidden_layers=layers,
                         num_attention_heads=heads, vocab_size=vocab, max_position_embeddings=shape[6])  # fmt: skip
    return LlamaForCausalLM(config).to(device)


def batches(shape: tuple) -> list[dict[str, torch.Tensor]]:
    vocab, batch, seq, steps = shape[4], shape[5], shape[6], shape[7]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * steps, seq), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def fit_round(shape: tuple, data: list, epochs: int, compile: bool) -> tuple[list[float], float]:
    """one_cycle_fit: each epoch's seconds per step (from its records), and the peak memory."""
    model = build(shape, DEVICE)
    _reset_peak()
    if compile and BACKEND:
        compile = Compile(backend=BACKEND)
    h = one_cycle_fit(model, data, epochs=epochs, max_lr=1e-3, batch_size=shape[5], compile=compile,
                      precision=shape[8], progress=False)  # fmt: skip
    return [r.seconds / shape[7] for r in h.records], _peak()


def hand_round(shape: tuple, data: list, epochs: int, compile: bool) -> tuple[list[float], float]:
    """The loop a user writes: torch.compile(model), AdamW, OneCycleLR, autocast for bf16."""
    model = build(shape, DEVICE)
    _reset_peak()
    called = torch.compile(model, **({"backend": BACKEND} if BACKEND else {})) if compile else model
    cycle = OneCycle()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=1e-3, total_steps=epochs * shape[7], pct_start=cycle.pct_start, div_factor=cycle.div_factor,
        final_div_factor=cycle.final_div_factor, base_momentum=cycle.base_momentum, max_momentum=cycle.max_momentum)  # fmt: skip
    loader = torch.utils.data.DataLoader(data, batch_size=shape[5], shuffle=True, drop_last=True)
    bf16 = shape[8] == "bf16"
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for batch in loader:
            batch = {k: v.to(DEVICE, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=bf16):
                loss = called(**batch).loss
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        loss.item()  # the epoch's work done (one_cycle_fit reads its losses once an epoch)
        _wait()
        times.append((time.perf_counter() - t0) / shape[7])
    return times, _peak()


def _wait() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _reset_peak() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 1e9 if DEVICE.type == "cuda" else float("nan")


def measure(kind: str, rounds: int, epochs: int) -> dict[str, dict[str, float]]:
    """The four loops on SHAPES[kind], interleaved over rounds: each one's median ms per step after epoch 1 ("ms"),
    its peak memory in GB ("peak", CUDA; nan on the CPU) and its compile seconds (epoch 1 less a steady one)."""
    global DEVICE
    DEVICE = torch.device("cuda" if kind == "gpu" else "cpu")
    shape, data = SHAPES[kind], batches(SHAPES[kind])
    loops = {
        "one_cycle_fit(compile=True)": lambda: fit_round(shape, data, epochs, True),
        "hand loop, torch.compile(model)": lambda: hand_round(shape, data, epochs, True),
        "one_cycle_fit(compile=False)": lambda: fit_round(shape, data, epochs, False),
        "hand loop, eager": lambda: hand_round(shape, data, epochs, False),
    }
    steady: dict[str, list[float]] = {name: [] for name in loops}
    first: dict[str, list[float]] = {name: [] for name in loops}
    peaks: dict[str, float] = {}
    for _ in range(rounds):  # interleaved: a drift of the host's speed touches every loop alike
        for name, run in loops.items():
            times, peaks[name] = run()
            steady[name] += times[1:]
            first[name].append(times[0])
    ms = {name: 1e3 * statistics.median(times) for name, times in steady.items()}
    compile_s = {name: (statistics.median(first[name]) - ms[name] / 1e3) * shape[7] for name in loops}
    return {"ms": ms, "peak": peaks, "compile_s": compile_s}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", action="store_true", help="CUDA and the issue's 300M Llama")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    kind = "gpu" if args.gpu else "cpu"
    shape = SHAPES[kind]
    figures = measure(kind, args.rounds, args.epochs)
    ms = figures["ms"]
    tokens = shape[5] * shape[6]
    print(f"{kind}: Llama hidden {shape[0]}, {shape[2]} layers, vocab {shape[4]}; {shape[5]} x {shape[6]} tokens a "
          f"step, {shape[7]} steps an epoch, {shape[8]}; {args.rounds} rounds of {args.epochs} epochs, epoch 1 "
          f"left out; torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if args.gpu else ""))  # fmt: skip
    print(f"{'loop':34} {'ms/step':>9} {'tokens/s':>10} {'peak GB':>8} {'compile s':>10}")
    for name in ms:
        print(f"{name:34} {ms[name]:9.2f} {tokens / ms[name] * 1e3:10,.0f} {figures['peak'][name]:8.2f} "
              f"{figures['compile_s'][name]:10.1f}")
    print(f"one_cycle_fit compiled / compiled hand loop: {ms['one_cycle_fit(compile=True)'] / ms['hand loop, torch.compile(model)']:.3f}x (target <= 1.03)")
    print(f"one_cycle_fit eager / compiled: {ms['one_cycle_fit(compile=False)'] / ms['one_cycle_fit(compile=True)']:.2f}x; "
          f"hand loop eager / compiled: {ms['hand loop, eager'] / ms['hand loop, torch.compile(model)']:.2f}x")


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    main()
