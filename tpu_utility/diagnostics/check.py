"""python -m tpu_utility.check: the guarantees that matter, run on this machine, as a report.

Run it on a new TPU VM, Kaggle or Colab image, and paste what it prints into a
bug report::

    python -m tpu_utility.check          # in a shell; exit code 1 if a check failed
    tpu_utility.check()                  # in a notebook cell (a fresh kernel)

It runs, on a small synthetic task (about a minute on a v5e-8 or on XLA:CPU):
``one_cycle_fit`` on one core and on all cores (the loss falls, compiles stay
flat from epoch 2, no host sync in any step), ``predict`` in dataset order on
all cores, a checkpoint written and read back on the CPU, bf16 autocast where
the hardware has it, and, on a TPU, whether the persistent compile cache is
hit by a second run. Checks that cannot run here say ``skipped`` and why.

Run it in a fresh process (before other XLA work): it calls ``setup_tpu()``,
which switches SPMD on when there are several devices.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils.data import TensorDataset

from .. import backend
from .rules import gone_in

EPOCHS = 3


class _Skip(Exception):
    """A check that cannot run here; the message says why."""


class CheckFailed(Exception):
    """A guarantee that did not hold; the message says what was seen."""


@dataclass
class CheckResult:
    name: str
    status: str  # "ok", "FAILED" or "skipped"
    detail: str
    error: str = ""  # the traceback of a failure


@dataclass
class CheckReport:
    """What ``check()`` found: the platform lines and one result per check."""

    platform: list[str]
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(r.status != "FAILED" for r in self.results)

    def text(self) -> str:
        counts = {s: sum(r.status == s for r in self.results) for s in ("ok", "FAILED", "skipped")}
        lines = ["tpu_utility check (paste this into a bug report)", *self.platform]
        lines += [f"{r.status:8} {r.name}: {r.detail}" for r in self.results]
        lines.append(f"result: {counts['ok']} ok, {counts['FAILED']} failed, {counts['skipped']} skipped "
                     f"in {self.seconds:.0f} s")  # fmt: skip
        for r in self.results:
            if r.error:
                lines += ["", f"--- {r.name} failed:", r.error.rstrip()]
        return "\n".join(lines)


# ------------------------------------------------------------------ task
def blobs(n: int, seed: int = 0) -> TensorDataset:
    """Four Gaussian blobs in 16 dimensions: a task any working loop learns in a few epochs."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(4, 16, generator=torch.Generator().manual_seed(1234)) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    return TensorDataset(centers[y] + torch.randn(n, 16, generator=g), y)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _fit(cores: int | str, precision: str = "fp32", epochs: int = EPOCHS) -> tuple[nn.Module, str]:
    """one_cycle_fit on the blobs; (model, a line of figures) or CheckFailed."""
    from ..training.fit import one_cycle_fit

    h = one_cycle_fit(_mlp(), blobs(1024), valid_data=blobs(256, seed=1), epochs=epochs, max_lr=1e-2,
                      batch_size=32, cores=cores, precision=precision, progress=False)  # fmt: skip
    first, last = h.records[0], h.records[-1]
    figures = (f"train loss {first.train_loss:.3f} -> {last.train_loss:.3f}, valid accuracy "
               f"{last.metrics['accuracy']:.3f}, {h.steps_per_epoch} steps/epoch")  # fmt: skip
    if not last.train_loss < first.train_loss:
        raise CheckFailed(f"the loss did not fall: {figures}")
    if backend.current().diagnosis.counters().measured:  # XLA counts compiles and host syncs; eager backends do not
        compiles, syncs = [r.compiles for r in h.records], [r.host_syncs for r in h.records]
        figures += f"; compiles so far after each epoch {compiles}, host syncs in each epoch {syncs}"
        if len(set(compiles[1:])) > 1:
            raise CheckFailed(f"compiles grew after epoch 1 (each new graph recompiles every epoch): {figures}")
        if any(syncs[1:]):
            raise CheckFailed(f"a step read a value on the host (a host sync stalls the device): {figures}")
    return h.model, figures


# ----------------------------------------------------------------- checks
def _one_core() -> str:
    return _fit(1)[1]


def _all_cores() -> str:
    from ..training.topology import available_cores

    cores = available_cores()
    how = "SPMD" if cores > 1 else "1 device here, so the same as one core"
    return f"{cores} core(s), {how}: {_fit('all')[1]}"


def _predict_in_order() -> str:
    from ..training.inference import predict

    n = 1001  # not a multiple of any batch: the last one is padded
    x = torch.zeros(n, 4)
    x[:, 0] = torch.arange(n, dtype=torch.float32)
    echo = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        echo.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    rows = predict(echo, TensorDataset(x), batch_size=16, cores="all", progress=False).squeeze(1)
    wrong = (rows != torch.arange(n, dtype=torch.float32)).nonzero().flatten().tolist()
    if wrong:
        raise CheckFailed(f"{len(wrong)} of {n} rows are not model(sample i), the first at {wrong[:5]}")
    return f"{n} rows, row i = model(sample i), on all cores"


def _checkpoint() -> str:
    from ..checkpoint import load_checkpoint, save_checkpoint
    from ..device import get_device
    from ..optim import step_optimizer

    device = get_device()
    model = _mlp().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = blobs(32).tensors
    nn.functional.cross_entropy(model(x.to(device)), y.to(device)).backward()
    step_optimizer(opt)  # weights and Adam's moments now live on the device
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "check.pt")
        save_checkpoint(path, model=model, optimizer=opt, epoch=1)
        size = os.path.getsize(path)
        loaded = load_checkpoint(path)
    back, moments = loaded["model"], loaded["optimizer"]["state"]
    where = {t.device.type for t in [*back.values(), *(m for s in moments.values() for m in s.values()
                                                        if isinstance(m, torch.Tensor))]}  # fmt: skip
    if where != {"cpu"} or back.keys() != want.keys() or not all(torch.equal(back[k], want[k]) for k in want):
        raise CheckFailed(f"the checkpoint read back differs from the model on {device} (tensors on {where})")
    return f"model and Adam state from {device}: {len(back)} tensors ({size} bytes) read back equal, on the CPU"


def _bf16() -> str:
    from ..device import get_device
    from ..training.precision import Precision

    mode = Precision.of("bf16").on(get_device())
    if mode.mode != "autocast":
        raise _Skip(f"{mode.device} has no bf16 autocast (precision='bf16' runs as {mode.label} there)")
    return f"{mode.label} on {mode.device}: {_fit(1, precision='bf16', epochs=2)[1]}"


CACHE_RUN = """
import time
t0 = time.perf_counter()
from tpu_utility import setup_tpu, backend
setup_tpu(cache_dir={folder!r}, compile_cache=True, verbose=False)
from tpu_utility.diagnostics.check import _fit
_fit(1, epochs=1)
print("compiles", backend.current().diagnosis.compile_count(), "seconds", time.perf_counter() - t0)
"""


def _compile_cache() -> str:
    if backend.runtime_device_type() != "TPU":
        raise _Skip("TPU only (XLA:CPU writes compiled programs but cannot read them back)")
    with tempfile.TemporaryDirectory() as folder:
        code = textwrap.dedent(CACHE_RUN.format(folder=folder))
        runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300) for _ in range(2)]
        for r in runs:
            if r.returncode:
                raise CheckFailed(f"a run with the cache failed: {r.stderr[-1500:]}")
        files = sum(len(names) for _, _, names in os.walk(folder))
    first, second = (float(r.stdout.split("seconds")[-1]) for r in runs)
    figures = f"a fresh process took {first:.1f} s, a second one {second:.1f} s; {files} file(s) in the cache"
    if files == 0 or second > 0.8 * first:
        raise CheckFailed(f"the second run was not faster: {figures}")
    return figures


CHECKS: list[tuple[str, Callable[[], str]]] = [
    ("one-core one_cycle_fit", _one_core),
    ("all-core one_cycle_fit", _all_cores),
    ("predict in order", _predict_in_order),
    ("checkpoint", _checkpoint),
    ("bf16 autocast", _bf16),
    ("compile cache", _compile_cache),
]


def _platform_lines() -> list[str]:
    from ..environment import setup_tpu

    version = backend.installed_version("tpu_utility") or "0+unknown"  # the package's __version__, read below it

    info = setup_tpu(verbose=False)
    versions = ", ".join(f"{name} {backend.installed_version(name) or 'not installed'}" for name in ("libtpu", "torchvision"))
    lines = [*info.summary().splitlines(),
             f"  python {platform.python_version()} on {platform.platform()}; tpu_utility {version}; {versions}"]  # fmt: skip
    xla_version = backend.installed_version("torch_xla")
    if xla_version:
        gone = ", ".join(rule.replaces for rule in gone_in(xla_version))
        lines.append(f"  torch_xla {xla_version} refuses these 1.x calls: {gone} (python -m tpu_utility.port rewrites them)")
    return lines


def check(verbose: bool = True) -> CheckReport:
    """Runs tpu_utility's guarantees on this machine and prints a report to paste into a bug report.

    Call it in a fresh process or kernel: it calls ``setup_tpu()`` first. Takes
    about a minute (under two on a v5e-8).

    Args:
        verbose: Print each result as it comes and the report at the end.

    Returns:
        CheckReport: ``passed`` is False when a check failed; ``text()`` is the report.

    Example:
        >>> # was: (nothing; "does it work on my TPU?" was a bug report)
        >>> report = tpu_utility.check()      # doctest: +SKIP
        >>> report.passed                     # doctest: +SKIP
        True
    """
    t0 = time.perf_counter()
    report = CheckReport(_platform_lines())
    if verbose:
        print(f"tpu_utility check: {len(CHECKS)} checks, about a minute", flush=True)
    for name, run in CHECKS:
        try:
            result = CheckResult(name, "ok", run())
        except _Skip as why:
            result = CheckResult(name, "skipped", str(why))
        except Exception as error:  # noqa: BLE001 - every failure goes into the report
            result = CheckResult(name, "FAILED", f"{type(error).__name__}: {error}".splitlines()[0],
                                 traceback.format_exc())  # fmt: skip
        report.results.append(result)
        if verbose:
            print(f"  {result.status:8} {name}", flush=True)
    report.seconds = time.perf_counter() - t0
    if verbose:
        print("\n" + report.text())
    return report


def main() -> int:
    """The command: 0 when every check passed or was skipped, 1 when one failed."""
    return 0 if check().passed else 1


if __name__ == "__main__":
    sys.exit(main())
