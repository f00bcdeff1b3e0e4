"""make gpu-check: every check that needs a GPU, in one command and one table (run it whenever a GPU is lent).

A lent GPU comes with about 15 minutes, start and transfers included, so what runs on it is this one prepared
command, under 8 minutes on an H200:

1. every CUDA-marked test (``pytest -m cuda`` over the files that hold them), each test's outcome and seconds;
   the tests that measure something (the memory plan against the peak, the compiled run's losses) hand their
   figures to the table through the file named by ``TPU_UTILITY_GPU_FIGURES`` (``conftest.record_figure``);
2. ``bench/compile_bench.py --gpu``: ``one_cycle_fit(compile=True)`` against a compiled hand loop and both eager,
   on issue 52's 300M Llama (16 x 512 tokens, bf16): ms per step, peak memory, the ratios and their targets;
3. ``generate()`` against transformers' ``model.generate()`` on the GPU: the same greedy tokens.

Without CUDA it says so and runs the same code on the CPU at small shapes (the tests collected, not run; the
bench's 2-layer Llama through torch.compile's ``aot_eager``; ``generate`` on the CPU), prints the same table and
exits 0: tests/test_gpu_check.py runs that dry run, so the script cannot rot between loans. It needs no
torch_xla: on the lent machine it runs on the image's own Python (``make gpu-check`` picks it).

    python bench/gpu_check.py              # CUDA where there is one, else the dry run
    python bench/gpu_check.py --dry-run    # the dry run even on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
TEST_SECONDS = 420  # the CUDA-marked tests' share of the 8 minutes; a hang is stopped and reported as such

Row = tuple[str, str, str, str]  # (check, figure, target, verdict: "ok", "FAILED", "skipped" or "dry run")


def cuda_test_files() -> list[str]:
    """The test files that hold a CUDA-marked test."""
    tests = os.path.join(ROOT, "tests")
    return sorted(os.path.join("tests", name) for name in os.listdir(tests)
                  if name.startswith("test_") and name.endswith(".py")
                  and "@pytest.mark.cuda" in open(os.path.join(tests, name)).read())  # fmt: skip


def cuda_tests(dry: bool) -> tuple[list[Row], list[dict]]:
    """Runs (on a GPU) or collects (dry run) the CUDA-marked tests: a row each, and the figures they recorded."""
    files = cuda_test_files()
    with tempfile.TemporaryDirectory() as folder:
        junit, figures = os.path.join(folder, "junit.xml"), os.path.join(folder, "figures.jsonl")
        command = [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-q", "-n", "0",
                   f"--junitxml={junit}", *(["--collect-only"] if dry else []), *files]  # fmt: skip
        env = {**os.environ, "TPU_UTILITY_GPU_FIGURES": figures}
        env.pop("TPU_UTILITY_BACKEND")  # each test chooses its own backend, as under make test
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TEST_SECONDS)
        except subprocess.TimeoutExpired:
            return [("CUDA-marked tests", f"still running after {TEST_SECONDS} s: stopped", "all pass", "FAILED")], []
        if dry:
            names = re.findall(r"^(tests/\S+::\S+)$", done.stdout, re.M)
            if done.returncode != 0 or not names:
                return [("CUDA-marked tests", f"collection failed: {done.stdout[-300:]}", "collected", "FAILED")], []
            return [(name.split("/")[-1], "not run: no CUDA", "passes", "dry run") for name in names], []
        rows = []
        for case in ET.parse(junit).getroot().iter("testcase") if os.path.exists(junit) else []:
            outcome = "FAILED" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "ok"  # fmt: skip
            why = case.find("skipped").get("message", "") if outcome == "skipped" else ""
            rows.append((f"{case.get('classname').split('.')[-1]}.py::{case.get('name')}",
                         f"{float(case.get('time', 0)):.0f} s {why}".strip(), "passes", outcome))  # fmt: skip
        if not rows:
            rows = [("CUDA-marked tests", f"pytest exited {done.returncode}: {done.stdout[-300:]}", "passes", "FAILED")]
        recorded = [json.loads(line) for line in open(figures)] if os.path.exists(figures) else []
        return rows, recorded


def compile_rows(dry: bool) -> list[Row]:
    """compile_bench's four loops, interleaved: ms per step, peak memory, and the ratios with their targets."""
    import compile_bench

    if dry:
        compile_bench.BACKEND, kind, rounds, epochs = "aot_eager", "tiny", 1, 2
        compile_bench.SHAPES["tiny"] = (32, 64, 2, 4, 64, 4, 16, 3, "fp32")  # OneCycleLR needs 6 steps
    else:
        kind, rounds, epochs = "gpu", 2, 3
    figures = compile_bench.measure(kind, rounds=rounds, epochs=epochs)
    ms = figures["ms"]
    verdict = "dry run" if dry else None
    ours = ms["one_cycle_fit(compile=True)"] / ms["hand loop, torch.compile(model)"]
    speedup = ms["one_cycle_fit(compile=False)"] / ms["one_cycle_fit(compile=True)"]
    peak = {name: "" if gb != gb else f", peak {gb:.2f} GB" for name, gb in figures["peak"].items()}  # nan: the CPU
    rows = [(f"compile bench: {name}", f"{ms[name]:.1f} ms/step{peak[name]}", "", "") for name in ms]
    rows += [("compile bench: one_cycle_fit compiled / compiled hand loop", f"{ours:.3f}x", "<= 1.03",
              verdict or ("ok" if ours <= 1.03 else "FAILED")),
             ("compile bench: one_cycle_fit eager / compiled", f"{speedup:.2f}x", ">= 1.5 (300M Llama)",
              verdict or ("ok" if speedup >= 1.5 else "FAILED"))]  # fmt: skip
    return rows


def generate_rows(dry: bool) -> list[Row]:
    """generate() against model.generate() on the device, greedy: the same new tokens for every prompt."""
    from llm_models import causal_lm, counting

    from tpu_utility import generate

    device = torch.device("cpu" if dry else "cuda")
    rows = []
    for kind in ("llama", "gemma"):
        model = causal_lm(kind).to(device).eval()
        prompts = [s["input_ids"][: 5 + i % 7].tolist() for i, s in enumerate(counting(12, 3))]
        ours = generate(model, prompts, max_new_tokens=10, batch_size=4, progress=False)
        theirs = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
            theirs.append(out[0, len(prompt):].tolist())
        same = sum(a == b for a, b in zip(ours, theirs))
        rows.append((f"generate() vs model.generate(): {kind}, on {device.type}", f"{same} of {len(prompts)} prompts'"
                     " tokens equal", "all equal", "ok" if same == len(prompts) else "FAILED"))  # fmt: skip
    return rows


def figure_rows(recorded: list[dict]) -> list[Row]:
    return [(f["check"], f["figure"], f["target"], "ok" if f["ok"] else "FAILED") for f in recorded]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the CPU at small shapes, even where CUDA is")
    args = parser.parse_args()
    # here, not at import (a test imports this module): transformers imports torch_xla where it is installed
    os.environ.setdefault("TPU_UTILITY_BACKEND", "native")
    sys.path[:0] = [ROOT, BENCH, os.path.join(ROOT, "tests")]
    dry = args.dry_run or not torch.cuda.is_available()
    start = time.perf_counter()
    if dry:
        print("gpu-check: " + ("--dry-run" if args.dry_run else "no CUDA here") + ": a dry run on the CPU at small "
              "shapes (nothing below measures a GPU; run make gpu-check on a lent GPU)")  # fmt: skip
    else:
        print(f"gpu-check: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, recorded = cuda_tests(dry)
    rows += figure_rows(recorded) + compile_rows(dry) + generate_rows(dry)
    width = max(len(r[0]) for r in rows)
    print(f"\n{'check':{width}}  {'figure':42}  {'target':20}  result")
    for check, figure, target, verdict in rows:
        print(f"{check:{width}}  {figure:42}  {target:20}  {verdict}")
    failed = [r for r in rows if r[3] == "FAILED"]
    print(f"\ngpu-check: {len(rows)} rows, {len(failed)} failed, {time.perf_counter() - start:.0f} s"
          + (" (dry run)" if dry else ""))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
