"""Host cost per step as instructions: what the loop thread executes per training step, counted.

Timings of a host-bound step move by tens of percent on a shared 2-core host, so a 3% gap
cannot be read off them (see docs/benchmarks.md). The instructions a thread executes do not
depend on the load: this runs host_bench's loops (XLA:CPU, an MLP of 2.4k parameters) or
native_bench's (plain PyTorch, an MLP of 0.1M parameters) under valgrind's callgrind, which
counts the instructions each thread executes, and reads the counts of each loop's steady epochs
(epoch 1, the compiles, left out) from the loop's own clock: the same start and stop as
the timed benches.

On XLA the figure is the loop thread's (tracing, dispatch, the loop's Python: the host's
share of a step on a TPU; XLA's execution runs on other threads). On the native backend
torch computes on that thread alone here (one intra-op thread), so the figure is the whole
step: the model's compute, and the loop's work beside it. Instructions are not time
(cache misses, branch misses), but two loops that execute the same code per step at the
same counts run alike; the difference is the loop's own work.

    python bench/instructions.py [xla|native]     # about 10 minutes each under valgrind

Needs valgrind (with its callgrind.h) and a C compiler; says so and stops without them.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from functools import partial

HERE = os.path.dirname(os.path.abspath(__file__))
_MARK = "TPU_UTILITY_UNDER_CALLGRIND"  # set in the child that valgrind runs
EPOCHS, STEPS = 3, 50  # epochs 2 and 3 counted: 100 steps, enough when the counts are exact

_METER_C = r"""
#include <valgrind/callgrind.h>
void meter_zero(void) { CALLGRIND_ZERO_STATS; }
void meter_dump(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""


def _meter(folder: str):
    """The two client requests, from Python: zero the counts, dump them under a name."""
    import ctypes

    source, library = os.path.join(folder, "meter.c"), os.path.join(folder, "meter.so")
    with open(source, "w") as f:
        f.write(_METER_C)
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", library, source], check=True)
    meter = ctypes.CDLL(library)
    meter.meter_dump.argtypes = [ctypes.c_char_p]
    return meter


def _loops(kind: str) -> tuple[dict, object, str]:
    sys.path.insert(0, HERE)
    if kind == "native":
        os.environ["TPU_UTILITY_BACKEND"] = "native"
        import native_bench as bench

        hand = bench.HAND
    else:
        import host_bench as bench

        hand = bench.IDEAL
    import peers
    from torch.utils.data import TensorDataset

    from tpu_utility import EMA

    w = bench.workload()
    w = peers.Workload(TensorDataset(*(t[: w.batch * STEPS] for t in w.dataset.tensors)), w.make_model, w.batch, EPOCHS)
    fit = peers.fit
    hand_loop = bench.hand_loop if kind == "native" else partial(peers.ideal_loop, fused=True)
    loops = {
        hand: hand_loop,
        "one_cycle_fit, schedule='constant'": partial(fit, schedule="constant"),
        "the same hand loop + torch OneCycleLR stepped every step": partial(hand_loop, one_cycle=True),
        "one_cycle_fit (one-cycle schedule)": fit,
        "one_cycle_fit + EMA": partial(fit, callbacks=lambda: [EMA(0.99)]),
        "the same hand loop + torch's EMA (AveragedModel, update_parameters every step)": partial(hand_loop, ema=0.99),
        "one_cycle_fit + EMA(every=4)": partial(fit, callbacks=lambda: [EMA(0.99, every=4)]),
        "one_cycle_fit + EMA(every=8)": partial(fit, callbacks=lambda: [EMA(0.99, every=8)]),
        "one_cycle_fit, schedule='constant' + EMA": partial(fit, schedule="constant", callbacks=lambda: [EMA(0.99)]),
        "one_cycle_fit, schedule='constant' + EMA(every=4)": partial(fit, schedule="constant",
                                                                    callbacks=lambda: [EMA(0.99, every=4)]),
    }
    return loops, w, hand


def _child(kind: str, folder: str) -> None:
    """Under callgrind: every loop once; each steady epoch's counts dumped as '<loop>|<steps>'."""
    meter = _meter(folder)
    loops, w, _ = _loops(kind)
    if kind == "native":
        import torch

        torch.set_num_threads(1)  # the model's compute on the loop thread too: the step's whole cost in one count
    import peers

    name = ""

    class MeteredClock(peers.Clock):
        def start(self) -> None:
            if self.cpu:  # epoch 2 on
                meter.meter_zero()
            super().start()

        def stop(self, steps: int) -> None:
            super().stop(steps)
            if len(self.cpu) > 1:
                meter.meter_dump(f"{name}|{steps}".encode())

    for module in (peers, sys.modules.get("native_bench")):  # the loops make their clocks from these names
        if module is not None:
            module.Clock = MeteredClock
    for name, loop in loops.items():
        loop(w)


def _read(folder: str) -> dict[str, float]:
    """Per loop: the loop thread's instructions per step, from the dumps (callgrind dumps the thread that asks)."""
    counts, steps = defaultdict(int), defaultdict(int)
    for path in sorted(glob.glob(os.path.join(folder, "out.*-01"))):
        trigger, total = None, None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    trigger = line.split(": ", 3)[-1].strip()
                elif line.startswith("summary:"):  # this dump's count ("totals:" may hold more)
                    total = int(line.split()[1])
                    break
        if trigger and total is not None:  # not the counts at exit
            loop, n = trigger.rsplit("|", 1)
            counts[loop] += total
            steps[loop] += int(n)
    return {loop: counts[loop] / steps[loop] for loop in counts}


def main() -> None:
    kind = sys.argv[1] if len(sys.argv) > 1 else "xla"
    if kind not in ("xla", "native"):
        raise SystemExit(f"bench/instructions.py: the backend must be 'xla' or 'native', but given {kind!r}")
    if os.environ.get(_MARK):
        _child(kind, os.environ[_MARK])
        return
    if not (shutil.which("valgrind") and shutil.which("cc") and os.path.exists("/usr/include/valgrind/callgrind.h")):
        print("bench/instructions.py needs valgrind (with /usr/include/valgrind/callgrind.h) and cc; skipped")
        return
    folder = tempfile.mkdtemp(prefix="callgrind-")
    env = dict(os.environ, **{_MARK: folder, "PYTHONHASHSEED": "0", "PJRT_DEVICE": "CPU"})
    command = ["valgrind", "--tool=callgrind", "--separate-threads=yes", "--collect-systime=no",
               f"--callgrind-out-file={folder}/out.%p", sys.executable, os.path.abspath(__file__), kind]  # fmt: skip
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    counts = _read(folder)
    shutil.rmtree(folder, ignore_errors=True)
    loops, w, hand = _loops(kind)
    base = counts[hand]
    where = "XLA:CPU, an MLP of 2.4k parameters" if kind == "xla" else "the native backend, an MLP of 0.1M parameters"
    print(f"\nInstructions per training step ({where}, batch {w.batch}, epochs 2-{EPOCHS} of {STEPS} steps; "
          f"callgrind, exact)\n")  # fmt: skip
    print(f"| loop | instructions per step (loop thread) | vs {hand.split(' (')[0]} | beyond it |")
    print("|---|---|---|---|")
    for loop in (name for name in loops if name in counts):  # the loops' order (the dumps' names sort 1, 10, 2)
        count = counts[loop]
        print(f"| {loop} | {count / 1e6:.3f} M | {count / base:.3f}x | {(count - base) / 1e3:+,.0f} k |")


if __name__ == "__main__":
    main()
