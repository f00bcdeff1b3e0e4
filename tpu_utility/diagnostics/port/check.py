"""``--check``: the ported program's first steps run on XLA:CPU, so the verdict is checked, not guessed.

The output runs in a child interpreter (``PJRT_DEVICE=CPU`` unless the environment names a device)
with a hook after every ``optimizer.step()`` (torch's global post hook, which ``step_optimizer``
calls too): the hook records the devices of the optimizer's parameters and stops the program after
``steps`` steps. The check passes when the program reached its step limit (or ended by itself)
with every parameter on XLA and XLA ran at least one graph; a program without an optimizer passes
on XLA graphs alone. A notebook runs its code cells in order (``notebook_script``: IPython lines left
out). A program that launches processes (``xmp.spawn``, ``torch_xla.launch``) runs its function in the
checking process, as torch_xla's own one-process path does (the runtime is already started there). A
program that stops before its first step on data it cannot find or a library this host lacks is "not
run", never passed; a module with no entry point has nothing to run.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

_MARK = "TPU_UTILITY_CHECK "
_BOOT = r"""
import json, os, runpy, sys, traceback
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from tpu_utility import backend, get_device
from tpu_utility.backend.xla import spawn_in_this_process

limit, path = int(sys.argv[1]), sys.argv[2]
sys.argv = [path, *sys.argv[3:]]
sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # as `python path` would: the program's own modules import
get_device()  # the runtime first: a CPU backward before it would break every XLA backward (pytorch/xla#4174)
spawn_in_this_process()  # a launch runs its function here (torch_xla's one-process path), on the runtime started above
seen = {"steps": 0, "devices": set(), "on_xla": True}


class StepLimit(BaseException):
    pass


def hook(optimizer, args, kwargs):
    seen["steps"] += 1
    params = [p for group in optimizer.param_groups for p in group["params"]]
    seen["devices"].update(p.device.type for p in params)
    seen["on_xla"] = seen["on_xla"] and all(backend.current().devices.is_lazy(p.device) for p in params)
    if seen["steps"] >= limit:
        raise StepLimit


register_optimizer_step_post_hook(hook)
ended, error = "finished", ""
try:
    runpy.run_path(path, run_name="__main__")
except StepLimit:
    ended = "step limit"
except SystemExit as stop:
    ended, error = ("finished", "") if stop.code in (None, 0) else ("exit", str(stop.code))
except (FileNotFoundError, ImportError) as missing:  # data it cannot find here, a library this host lacks
    ended, error = ("missing" if not seen["steps"] else "raised"), (f"{type(missing).__name__}: {missing}"
                                                                     if not seen["steps"] else traceback.format_exc()[-2000:])
except BaseException:
    ended, error = "raised", traceback.format_exc()[-2000:]
if backend.current().devices.is_lazy(get_device()):
    backend.current().devices.sync(wait=True)  # the last step's graph
print(%r + json.dumps({"ended": ended, "error": error, "steps": seen["steps"], "devices": sorted(seen["devices"]),
                        "on_xla": seen["on_xla"], "executed": backend.execute_count(), "device": get_device().type,
                        "lazy": backend.current().devices.is_lazy(get_device())}), flush=True)
""" % _MARK


@dataclass
class CheckResult:
    """What the dry run saw: how it ended, the optimizer steps, their parameters' devices, XLA executions.

    ``ok`` is True when it ran on XLA, False when it stopped or ran on the CPU, None when it could not run here
    (``why`` says why: data it cannot find, a library this host lacks, nothing to run).
    """

    ok: bool | None
    text: str
    why: str = ""


def _verdict(said: dict, steps: int) -> tuple[bool | None, str]:
    if said["ended"] == "missing":
        return None, f"it needs what this host lacks before its first step: {said['error'][:300]}"
    if said["ended"] in ("raised", "exit"):
        return False, f"the program stopped on XLA:\n{said['error']}"
    if not said["lazy"]:
        return False, f"no XLA device here (get_device() is {said['device']!r}): nothing to check"
    if said["steps"] and not said["on_xla"]:
        return False, f"the optimizer's parameters are on {', '.join(said['devices'])}: it trains on the host CPU"
    if not said["executed"]:
        return False, "XLA ran no graph: the program computes on the host CPU"
    how = f"stopped after {said['steps']} optimizer step(s)" if said["ended"] == "step limit" else (
        f"ran to its end ({said['steps']} optimizer step(s))")
    return True, f"{how} with the parameters on XLA; XLA ran {said['executed']} graph(s)"


def run_bounded(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """``command``'s run, its output captured, or None if it ran past ``timeout`` seconds.

    It runs in a session of its own, and at the end (its own exit, or the timeout) the whole process group is
    killed: DataLoader workers or servers it started stop with it, and none holds the output pipes open.
    """
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as process:  # fmt: skip
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process.pid)
            process.communicate()
            return None
        _kill_group(process.pid)  # what it left running
        return subprocess.CompletedProcess(command, process.returncode, out, err)


def _kill_group(group: int) -> None:
    try:
        os.killpg(group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # none left
        pass


def dry_run(path: str, steps: int = 3, argv: list[str] | None = None, timeout: float = 600) -> CheckResult:
    """Runs ``path`` (a ported .py script) until ``steps`` optimizer steps on XLA:CPU and says whether it ran on XLA.

    Args:
        path: The ported script.
        steps: Optimizer steps after which the program is stopped.
        argv: The program's own arguments.
        timeout: Seconds before the run is stopped and the check fails.

    Example:
        >>> dry_run("train_tpu.py", steps=2, argv=["--epochs", "1"]).ok   # doctest: +SKIP
        True
    """
    env = {**os.environ, "PJRT_DEVICE": os.environ.get("PJRT_DEVICE", "CPU")}
    r = run_bounded([sys.executable, "-c", _BOOT, str(steps), path, *(argv or [])], env, timeout)
    if r is None:
        return CheckResult(False, f"check: failed: the program ran past {timeout:.0f} s before {steps} optimizer steps "
                                  f"(stopped, with the processes it started)")  # fmt: skip
    lines = [line for line in r.stdout.splitlines() if line.startswith(_MARK)]
    if not lines:
        return CheckResult(False, f"check: failed: the run ended without a verdict (exit {r.returncode}):\n{r.stderr[-2000:]}")
    ok, why = _verdict(json.loads(lines[-1][len(_MARK):]), steps)
    word = {True: "passed", False: "failed", None: "not run"}[ok]
    return CheckResult(ok, f"check ({steps} step(s) on XLA:{env['PJRT_DEVICE']}): {word}: {why}", why)


def entry_point(source: str) -> bool:
    """Whether a module runs anything when run as a script: a statement beyond imports, definitions and assignments
    of names (a library module has none: nothing to run)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return True  # the run names it
    quiet = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign, ast.AnnAssign,
             ast.Pass)  # fmt: skip
    return any(not isinstance(stmt, quiet) and not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant))
               for stmt in tree.body)  # fmt: skip


def notebook_script(path: str) -> str:
    """A notebook's code cells in order, as one script: IPython lines (``!pip``, ``%matplotlib``) and cell magics
    left out (they set up the host, which the check does not change)."""
    import nbformat

    cells = [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    kept = []
    for n, source in enumerate(cells, 1):
        if source.lstrip().startswith("%%"):
            continue
        lines = [("pass  # " + line.strip()[:60]) if line.lstrip().startswith(("!", "%")) else line
                 for line in source.split("\n")]  # fmt: skip
        kept.append(f"# cell {n}\n" + "\n".join(lines))
    return "\n\n".join(kept) + "\n"
