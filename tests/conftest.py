"""Tests run on torch_xla's CPU backend; PJRT_DEVICE is set before anything imports torch_xla."""

import os
import subprocess
import sys
import textwrap

os.environ["PJRT_DEVICE"] = "CPU"
os.environ.pop("CPU_NUM_DEVICES", None)
os.environ.setdefault("MPLBACKEND", "Agg")
os.environ["XDG_CACHE_HOME"] = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "xdg")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def blocking(*modules: str) -> str:
    """Code that makes these modules (and their submodules) unimportable, as on a machine without them."""
    return f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in {modules!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Blocked())
"""


BLOCK_TORCH_XLA = blocking("torch_xla")


def run_python(code: str, env: dict | None = None, timeout: int = 300, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Runs code in a fresh interpreter (fresh XLA runtime); the caller checks the returncode."""
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    for key, value in list(full_env.items()):
        if value is None:
            del full_env[key]
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
    )  # fmt: skip
    return result


def run_script(tmp_path, name: str, code: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Writes code to tmp_path/name and runs it as __main__ in a fresh interpreter; fails the test on a non-zero exit.

    As a file, not ``-c``: a multiprocess launch's spawned workers re-import the main script.
    """
    script = tmp_path / name
    script.write_text(code)
    r = run_python(f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')", env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


@pytest.fixture(scope="session")
def digits():
    """scikit-learn's real handwritten digits: (train, valid) TensorDatasets of (1, 8, 8) images."""
    from tpu_utility.demo import digits_datasets

    return digits_datasets()


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return small_mlp()


def flat_digits(n: int | None = None) -> TensorDataset:
    from tpu_utility.demo import digits_datasets

    train, _ = digits_datasets()
    x, y = train.tensors
    return TensorDataset(x[:n], y[:n])
