"""``--check``: the ported program's first steps run on XLA:CPU, so the verdict is checked, not guessed.

The output runs in a child interpreter (``PJRT_DEVICE=CPU`` unless the environment names a device)
with a hook after every ``optimizer.step()`` (torch's global post hook, which ``step_optimizer``
calls too): the hook records the devices of the optimizer's parameters and stops the program after
``steps`` steps. The check passes when the program reached its step limit (or ended by itself)
with every parameter on XLA and XLA ran at least one graph; a program without an optimizer passes
on XLA graphs alone. A notebook is not checked (run its cells); a program that spawns processes is
checked in the launching process only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

_MARK = "TPU_UTILITY_CHECK "
_BOOT = r"""
import json, runpy, sys, traceback
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from tpu_utility import backend, get_device

limit, path = int(sys.argv[1]), sys.argv[2]
sys.argv = [path, *sys.argv[3:]]
get_device()  # the runtime first: a CPU backward before it would break every XLA backward (pytorch/xla#4174)
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
    """What the dry run saw: how it ended, the optimizer steps, their parameters' devices, XLA executions."""

    ok: bool
    text: str


def _verdict(said: dict, steps: int) -> tuple[bool, str]:
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
    return CheckResult(ok, f"check ({steps} step(s) on XLA:{env['PJRT_DEVICE']}): {'passed' if ok else 'failed'}: {why}")
