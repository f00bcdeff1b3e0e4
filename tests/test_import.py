"""import tpu_utility never imports torch_xla, and everything falls back to CPU without it."""

import json

import pytest

from conftest import BLOCK_TORCH_XLA, run_python


def test_import_does_not_import_torch_xla():
    r = run_python("""
        import sys, tpu_utility
        print("loaded:", "torch_xla" in sys.modules)
        print("runtime:", tpu_utility.backend.runtime_started())
    """)
    assert r.returncode == 0, r.stderr
    assert "loaded: False" in r.stdout
    assert "runtime: False" in r.stdout


# The three checks without torch_xla share one fresh interpreter (torch_xla blocked, torch imported once):
# each runs in a child forked from it, with its own PJRT_DEVICE, and tpu_utility imported there for the first time.
WITHOUT_XLA = {
    "falls back": (None, """
import torch
import tpu_utility
from tpu_utility import get_device, setup_tpu, step_optimizer, make_sampler
assert not tpu_utility.backend.XLA_INSTALLED
print("device:", get_device())
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
before = model.weight.detach().clone()
model(torch.ones(2, 3)).sum().backward()
step_optimizer(opt, max_grad_norm=1.0)
print("stepped:", not torch.equal(before, model.weight))
print("sampler:", make_sampler(list(range(10))))
info = setup_tpu()
print("xla:", info.xla, info.device_type)
"""),
    "pjrt_device": ("CPU", """
from tpu_utility import setup_tpu
try:
    setup_tpu()
except ModuleNotFoundError as e:
    print("error:", e)
"""),
    "one_cycle_fit": (None, """
import warnings; warnings.simplefilter("ignore")
import torch
from tpu_utility import one_cycle_fit
from tpu_utility.demo import digits_datasets
train, valid = digits_datasets()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
history = one_cycle_fit(model, train, valid_data=valid, epochs=3, max_lr=1e-2, batch_size=32, progress=False)
print(history.summary)
print("losses", [round(r.train_loss, 3) for r in history.records])
print("accuracy", history.records[-1].metrics["accuracy"])
"""),
}
FORKS = """
import json, os, sys, traceback
import torch  # the import the children share
assert "tpu_utility" not in sys.modules
results = {}
for name, (pjrt, code) in json.loads(sys.argv[1]).items():
    out, err = (os.path.join(sys.argv[2], f"{name}.{kind}") for kind in ("out", "err"))
    pid = os.fork()
    if pid == 0:
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        os.environ.pop("PJRT_DEVICE", None)
        os.environ.update({} if pjrt is None else {"PJRT_DEVICE": pjrt})
        status = 1
        try:
            exec(compile(code, f"<{name}>", "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush(); sys.stderr.flush()
            os._exit(status)
    results[name] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), open(out).read(), open(err).read()]
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def without_xla(tmp_path_factory):
    """{check: (returncode, stdout, stderr)} for the checks of WITHOUT_XLA, run once."""
    folder = tmp_path_factory.mktemp("without_xla")
    r = run_python(f"import sys; sys.argv[1:] = [{json.dumps(WITHOUT_XLA)!r}, {str(folder)!r}]\n" + BLOCK_TORCH_XLA + FORKS,
                   env={"PJRT_DEVICE": None})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_everything_falls_back_without_torch_xla(without_xla):
    returncode, stdout, stderr = without_xla["falls back"]
    assert returncode == 0, stderr
    assert "device: cpu" in stdout
    assert "stepped: True" in stdout
    assert "sampler: None" in stdout
    assert "no XLA: torch_xla is not installed" in stdout
    assert "xla: False cpu" in stdout


def test_pjrt_device_without_torch_xla_names_the_install_command(without_xla):
    returncode, stdout, stderr = without_xla["pjrt_device"]
    assert returncode == 0, stderr
    assert "error: PJRT_DEVICE='CPU' needs torch_xla" in stdout
    assert "pip install" in stdout


def test_one_cycle_fit_runs_without_torch_xla(without_xla):
    returncode, stdout, stderr = without_xla["one_cycle_fit"]
    assert returncode == 0, stderr
    assert "one_cycle_fit: single on 1 cpu core(s)" in stdout
    losses = eval(stdout.split("losses ")[1].splitlines()[0])
    assert losses[-1] < 0.5 * losses[0]
    assert float(stdout.split("accuracy ")[1]) > 0.9
