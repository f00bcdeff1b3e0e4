"""What `python -m tpu_utility.port` saves and what the ported programs do on XLA (make bench runs it).

For each program in tests/kernels/ (two torch_xla 1.x Kaggle kernels, the Hugging Face course
loop, a timm AMP loop) it prints:

* the lines a hand port edits to make it run (the lines the tool adds or changes, imports included),
  and the lines the report then names for speed (per-step host syncs and the like);
* the ported program run on XLA:CPU in a fresh interpreter: optimizer steps, graphs compiled, host
  syncs per step (torch_xla's counters), accuracy and wall time. The counters are per process, so
  the kernels' one replica (XLA:CPU has one device) runs in that interpreter instead of a spawned
  child; tests/test_porter.py runs the real spawn.

    PJRT_DEVICE=CPU python bench/port_bench.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tpu_utility.diagnostics.port import port_file  # noqa: E402

KERNELS = os.path.join(ROOT, "tests", "kernels")
PROGRAMS = ["xla1x_kernel.py", "xla1x_notebook.ipynb", "hf_course_loop.py", "timm_amp_loop.py"]

# Runs a ported program and counts its optimizer steps through the two step calls the ports use.
RUN = """
import runpy, sys, json
import torch_xla.core.xla_model as xm
import tpu_utility
from tpu_utility import backend
steps = [0]
def counted(step):
    def wrapper(*args, **kwargs):
        steps[0] += 1
        return step(*args, **kwargs)
    return wrapper
tpu_utility.step_optimizer = counted(tpu_utility.step_optimizer)
xm.optimizer_step = counted(xm.optimizer_step)
# the counters are per process: the one replica XLA:CPU has runs here (the tests run the real spawn)
import torch_xla.distributed.xla_multiprocessing as xmp
xmp.spawn = lambda fn, args=(), **kwargs: fn(0, *args)
sys.argv = [{path!r}]
runpy.run_path({path!r}, run_name="__main__")
print("COUNTS " + json.dumps({{"steps": steps[0], "compiles": backend.compile_count(),
                              "host_syncs": backend.host_sync_count()}}))
"""


def _as_script(notebook: str, script: str) -> None:
    """The notebook's code cells as one script, IPython lines dropped (as the report tells a user to)."""
    import nbformat

    cells = [c.source for c in nbformat.read(notebook, as_version=4).cells if c.cell_type == "code"]
    lines = [line for cell in cells for line in cell.splitlines() if not line.lstrip().startswith(("!", "%"))]
    with open(script, "w") as f:
        f.write("\n".join(lines) + "\n")


def measure(name: str, folder: str) -> dict:
    output = os.path.join(folder, name)
    report, _ = port_file(os.path.join(KERNELS, name), output)
    edited = len({c.where for c in report.changes})
    if name.endswith(".ipynb"):
        _as_script(output, output.replace(".ipynb", ".py"))
        output = output.replace(".ipynb", ".py")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "PYTHONPATH": ROOT, "OUT_DIR": folder}
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", RUN.format(path=output)], env=env, cwd=folder,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise RuntimeError(f"{name} failed after porting:\n{run.stderr[-3000:]}")
    counts = json.loads(run.stdout.split("COUNTS ")[1].splitlines()[0])
    result = json.loads(next(line for line in run.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return {"program": name, "edited": edited, "reported": len(report.left), "host_sync_lines": len(report.host_syncs()),
            **counts, "accuracy": result["valid_accuracy"], "seconds": seconds}  # fmt: skip


def main() -> None:
    print(f"{'program':24} {'lines the tool edits':>20} {'left, named':>11} {'steps':>6} {'graphs':>6} "
          f"{'host syncs/step':>15} {'accuracy':>8} {'time':>6}")  # fmt: skip
    with tempfile.TemporaryDirectory() as folder:
        for name in PROGRAMS:
            row = measure(name, folder)
            print(f"{row['program']:24} {row['edited']:>20} {row['reported']:>11} {row['steps']:>6} {row['compiles']:>6} "
                  f"{row['host_syncs'] / max(row['steps'], 1):>15.2f} {row['accuracy']:>8.3f} {row['seconds']:>5.0f}s",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
