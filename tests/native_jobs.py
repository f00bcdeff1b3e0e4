"""How the native backend's multi-process tests start their jobs cheaply (tests/test_native.py, test_replicas.py).

Every process of a gloo job imports torch afresh (about 3 CPU-seconds each), so what costs is the number
of processes started, not the work they do. Two things keep it down:

- The launcher (a script's parent process that calls ``launch``, or ``torchrun``'s agent) starts from the
  suite's warm interpreter (``conftest.run_python``) and takes torch_xla out of the way itself (``WARM``),
  instead of asking for a fresh interpreter with another environment. torchrun's workers are fresh
  interpreters with the native environment (no ``PJRT_DEVICE``); a launch that only needs real processes
  (the shared replica job, the failure scenarios) forks them from that warm parent, torch already imported:
  a spawned replica's import of torch alone is about 2.5 CPU-seconds. The spawned launch of a script, the
  default, is tested by test_native.py's ``test_one_cycle_fit_launches_its_own_replicas_and_learns``.
- Scenarios of one kind run one after the other in one job whose result several tests read (``shared``):
  once per test session, whichever pytest worker asks first; the others wait for it and read its files.
"""

import fcntl
import json
import os

from conftest import run_python

# What the native tests' scripts run in: torch_xla out of the way, so the native CPU backend is chosen.
NATIVE = {"PJRT_DEVICE": None, "CPU_NUM_DEVICES": None, "TORCH_CPP_LOG_LEVEL": "ERROR"}

# The same, set by the script itself as its first lines: it may then start from the warm interpreter
# (torch and torch_xla imported there, no runtime started; tpu_utility not yet imported, so it sees no
# PJRT_DEVICE), and the processes it starts (spawned replicas, torchrun's workers) inherit it. gc.freeze:
# the objects inherited from the warm interpreter are left out of this process's collections, the last one
# at exit included, which otherwise walks them all and copies their pages (2.1 CPU-s of a child that runs
# `pass`, 0.6 with the freeze).
WARM = """
import gc
gc.freeze()
import os
os.environ.pop("PJRT_DEVICE", None)
os.environ.pop("CPU_NUM_DEVICES", None)
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
"""


def torchrun(script, nprocs: int, expect_ok: bool = True, env: dict | None = None, timeout: int = 600):
    """Runs ``script`` as a ``torchrun --standalone`` job of ``nprocs`` processes, torch_xla out of the way.

    The agent starts from the warm interpreter; its workers are fresh interpreters (with ``env`` added, which
    must leave the imports' variables alone). Asserts exit status 0 unless ``expect_ok`` is False; returns
    the CompletedProcess (the agent's and the workers' output)."""
    r = run_python(WARM + f"""
import runpy, sys
sys.argv = ["torchrun", "--standalone", "--nproc-per-node", "{nprocs}", {str(script)!r}]
runpy.run_module("torch.distributed.run", run_name="__main__")
""", env=env, timeout=timeout)  # fmt: skip
    if expect_ok:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "terminate called" not in r.stderr, r.stderr[-3000:]  # a rank aborted at exit (issue 40)
    return r


def ranks(folder, n: int) -> list[dict]:
    """What each of ``n`` replicas wrote to ``folder`` (rank0.json ...), after checking that each wrote once."""
    found = sorted(f for f in os.listdir(folder) if f.endswith(".json"))
    assert found == [f"rank{r}.json" for r in range(n)], found
    return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(n)]


_DONE: dict[str, dict] = {}


def shared(tmp_path_factory, name: str, run) -> dict:
    """``run(folder)`` (a JSON-able result) once per test session, for every test that asks by ``name``.

    Without xdist, kept in this process. With it, the first worker to ask runs it under a lock in the
    session's shared temporary folder and leaves the result there; the others wait on the lock and read it
    (``--dist load`` hands a file's tests to different workers)."""
    if name in _DONE:
        return _DONE[name]
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        _DONE[name] = run(tmp_path_factory.mktemp(name))
        return _DONE[name]
    root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        saved = root / f"{name}.json"
        if not saved.exists():
            saved.write_text(json.dumps(run(tmp_path_factory.mktemp(name))))
        _DONE[name] = json.loads(saved.read_text())
    return _DONE[name]
