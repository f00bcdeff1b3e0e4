"""Tests run on torch_xla's CPU backend; PJRT_DEVICE is set before anything imports torch_xla."""

import contextlib
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

os.environ["PJRT_DEVICE"] = "CPU"
os.environ.pop("CPU_NUM_DEVICES", None)
os.environ.setdefault("MPLBACKEND", "Agg")
# one OpenMP thread for torch's eager CPU ops (the plain-CPU reference runs): three pytest workers share two cores,
# where a second thread spins more than it computes (a BERT's plain CPU loop: 9.5 CPU-s against 21.1). Set before
# torch is imported here and before the warm interpreter starts, so its children keep forking warm.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["XDG_CACHE_HOME"] = os.path.join(os.path.dirname(__file__), "..", ".pytest_cache", "xdg")
# XLA:CPU's LLVM backend at optimization level 0, its expensive passes off: the suite's graphs compile in about
# 40% of the CPU time (a tiny BERT's first train steps: 8.4 CPU-s against 20.1); the graphs, and the compiles,
# host syncs and transfers the tests count, are the same, and so is the arithmetic up to rounding (the BERT's
# losses bitwise; a ResNet's first loss to 1e-6, its last after an epoch 2% apart, as between any two float
# paths: the tests that compare with the CPU have tolerances). The compiled code runs slower, which for the
# suite's tiny models is nothing; a test whose time is compute (a ResNet's epoch: 73 CPU-s at XLA's defaults,
# 301 at level 0) runs its script with ``xla_flags(1)`` or XLA's default level (``xla_flags()``). make demo and
# make bench keep XLA's defaults. Every script of the suite also emits XLA:CPU's fused loops with its older LLVM IR
# emitters, not the MLIR fusion emitters of torch_xla 2.8 and 2.9 (``xla_flags``): the same graphs and counts,
# a third less CPU time in the compiles (38 tests of fit, BERT, FSDP, generate: 133 CPU-s against 89; the timm
# loop's ResNet epoch at level 1: 74 against 63).
# The user's flags are kept in the environment: pytest-xdist's workers inherit it from the controller, which
# imported this file first, and a worker reading XLA_FLAGS would take the controller's level 0 for the user's
# (the ResNet's test then ran at level 0 under `make test`: 331 CPU-s against 116).
USER_XLA_FLAGS = os.environ.setdefault("TPU_UTILITY_TEST_USER_XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
FUSION_EMITTERS_OFF = "--xla_cpu_use_fusion_emitters=false"


def xla_flags(level: int | None = None) -> str:
    """XLA_FLAGS for a script of the suite: the user's flags, the fusion emitters off, and this LLVM optimization
    level (None: XLA's default, for a script whose time is compute rather than compiles)."""
    chosen = [] if level is None else [f"--xla_backend_optimization_level={level}"]
    return " ".join([USER_XLA_FLAGS, FUSION_EMITTERS_OFF, *chosen]).strip()


os.environ["XLA_FLAGS"] = xla_flags(0) + " --xla_llvm_disable_expensive_passes=true"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, TensorDataset  # noqa: E402

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


# A guard against a hung child, not a speed bar. In a full run on a 2-core host at load ~7 the
# slowest subprocess test took 109 s (the README's one-call block on 4 devices) and the 4-device
# bucket script 51-95 s alone; 300 s was within reach of a more loaded host, and once failed there.
SUBPROCESS_TIMEOUT = 900


def run_python(code: str, env: dict | None = None, timeout: int = SUBPROCESS_TIMEOUT,
               cwd: str | None = None) -> subprocess.CompletedProcess:  # fmt: skip
    """Runs code in a new interpreter (a fresh XLA runtime); the caller checks the returncode.

    The interpreter is forked from one of this worker's warm ones (``zygote.py``: torch, torch_xla and
    transformers already imported, or torch alone; no runtime started) where ``warm_start`` allows, else
    started fresh. A child still running after ``timeout`` seconds is killed and the test fails with its
    output so far.
    """
    full_env = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    for key, value in list(full_env.items()):
        if value is None:
            del full_env[key]
    kind = warm_start(code, full_env)
    if kind:
        return _zygote(kind).run(code, full_env, timeout, cwd or ROOT)
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env=full_env, capture_output=True, text=True, timeout=timeout, cwd=cwd or ROOT,
        )  # fmt: skip
    except subprocess.TimeoutExpired as expired:
        said = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (expired.stdout, expired.stderr)]
    _timed_out(timeout, *said)


def child_result(code: str, env: dict | None = None, timeout: int = 600) -> object:
    """What a child script printed as ``RESULT <json>``, after checking that it exited cleanly."""
    r = run_python(code, env=env, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.split("RESULT ")[1].splitlines()[0])


def record_figure(check: str, figure: str, target: str, ok: bool) -> None:
    """Hands a figure a GPU test measured to make gpu-check's table (bench/gpu_check.py names the file in
    TPU_UTILITY_GPU_FIGURES); outside that run, nothing. The test still asserts on it itself."""
    path = os.environ.get("TPU_UTILITY_GPU_FIGURES")
    if path:
        with open(path, "a") as out:
            out.write(json.dumps({"check": check, "figure": figure, "target": target, "ok": bool(ok)}) + "\n")


def _timed_out(timeout: int, stdout: str, stderr: str) -> None:
    pytest.fail(
        f"the test's subprocess was still running after {timeout} s and was killed (a hang, or a "
        f"host loaded far beyond CI's usual). Its stdout so far:\n{stdout[-2000:]}\nstderr:\n{stderr[-2000:]}",
        pytrace=False,
    )


# What a script may change and still start from the warm interpreter: anything but the variables that the
# imports read (torch's, torch_xla's, XLA's and libtpu's, Python's own, transformers', scikit-learn's and its BLAS'),
# and the platform.
COLD_PREFIXES = ("XLA", "PJRT", "PT_XLA", "TF_", "LIBTPU", "TORCH", "PYTHON", "HF_", "TRANSFORMERS", "CUDA",
                 "NEURON", "OMP_", "MKL_", "LD_", "GRPC", "SKLEARN", "SCIPY", "OPENBLAS", "KMP_")  # fmt: skip
COLD_CODE = ("in sys.modules", "_Blocked", "importlib.reload")  # a script that looks at what was imported


# What `import torch` alone reads, and code that looks at torch's own import: a script cold for the warm
# interpreter (it blocks torch_xla, looks at sys.modules, or sets PJRT_DEVICE or XLA_FLAGS) still forks from the
# torch-only one unless it changes these; it then imports torch_xla itself, if at all, under its own environment.
TORCH_COLD_PREFIXES = ("TORCH", "PYTHON", "CUDA", "OMP_", "MKL_", "KMP_", "LD_", "NCCL", "GLOO")
TORCH_COLD_CODE = ("importlib.reload", "'torch' in sys.modules", '"torch" in sys.modules')


def warm_start(code: str, env: dict) -> str | None:
    """Which warm interpreter a script runs the same from as from a fresh start: "warm" where it does not look at
    what is imported and its environment differs from this process's only where no import reads, "torch" (torch
    alone imported) where only torch's import must not see a change, else None (a fresh interpreter)."""
    if os.environ.get("TPU_UTILITY_TEST_FRESH") or env.get("PYTHONPATH") != ROOT:
        return None
    changed = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)} - {"PYTHONPATH"}
    cold = [k for k in changed if k.startswith(COLD_PREFIXES) or k.startswith("TPU_") and not k.startswith("TPU_UTILITY_")]
    if not cold and not any(marker in code for marker in COLD_CODE):
        return "warm"
    if not any(k.startswith(TORCH_COLD_PREFIXES) for k in changed) and not any(m in code for m in TORCH_COLD_CODE):
        return "torch"
    return None


class Zygote:
    """This worker's warm interpreter (tests/zygote.py), started at its first use and kept for the session."""

    def __init__(self, kind: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "zygote.py"), *(["--torch-only"] if kind == "torch" else [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": ROOT}, cwd=ROOT,
        )  # fmt: skip
        assert self._line(None) == "ready", "the warm interpreter (tests/zygote.py) did not start"

    def _line(self, deadline: float | None) -> str | None:
        """The zygote's next line, or None at the deadline."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not select.select([self.process.stdout], [], [], wait)[0]:
            return None
        return self.process.stdout.readline().decode().strip()

    def run(self, code: str, env: dict, timeout: int, cwd: str) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as folder:
            out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
            request = {"code": textwrap.dedent(code), "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self.process.stdin.write(json.dumps(request).encode() + b"\n")
            self.process.stdin.flush()
            pid = int(self._line(None).split()[1])
            said = self._line(time.monotonic() + timeout)
            if said is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                self._line(None)
            read = [open(path, errors="replace").read() for path in (out, err)]
        if said is None:
            _timed_out(timeout, *read)
        _, returncode, cpu = said.split()
        CHILD_CPU_SECONDS[0] += float(cpu)
        return subprocess.CompletedProcess(["python", "-c", code], int(returncode), *read)


_ZYGOTE: dict[str, Zygote] = {}  # "warm" and "torch": this worker's warm interpreters, each started at its first use
CHILD_CPU_SECONDS = [0.0]  # what this worker's warm-started children spent, for a profile of the suite


def _zygote(kind: str) -> Zygote:
    if kind not in _ZYGOTE or _ZYGOTE[kind].process.poll() is not None:
        _ZYGOTE[kind] = Zygote(kind)
    return _ZYGOTE[kind]


def pytest_sessionfinish(session, exitstatus):
    """The warm interpreter ends with its worker: told to leave its loop, and waited for. (Closing its stdin is
    not enough: a DataLoader worker forked from this process, kept alive by a test's traceback, holds the pipe.)"""
    for zygote in _ZYGOTE.values():
        with contextlib.suppress(BrokenPipeError):
            zygote.process.stdin.write(json.dumps({"quit": True}).encode() + b"\n")
            zygote.process.stdin.close()
        zygote.process.wait(timeout=60)
        zygote.process.stdout.close()


# What the other stacks run (make test-kaggle, make test-colab): the tests whose result can differ there.
# The pinned stack (make test) runs every test. Kaggle's lane (torch/torch_xla 2.8) runs the first kind,
# Colab's (the pinned trio on Python 3.13) the second: Kaggle's Python 3.12 lies between the pinned 3.11
# and Colab's 3.13. Left out of the first on purpose: gloo (test_native: torch 2.9 here, 2.13 in the
# TorchTPU lane), the hand-loop ports and the platform check (their backend calls are test_loop's,
# test_amp's and test_fit's), and trainer logic over the backend (monitor, buckets, epoch metrics: the
# SPMD gathers are test_predict's). A file here is marked torch_release and/or python_release; both lanes also
# run the hf_release files, on the transformers each lane pins.
TORCH_RELEASE = {  # code whose behaviour moved between torch/torch_xla 2.8 and 2.9, or that a library branches on
    "test_setup.py": "the version check, 2.8's jax warning probe, platform detection",
    "test_errors.py": "the version-mismatch and PJRT_DEVICE errors",
    "test_graphs.py": "torch_xla's CompileTime and TensorsGraphSize samples, read for each graph's seconds and size",
    "test_scan.py": "torch_xla's scan (AOTAutograd's trace of a layer, its SPMD backward's sharding hint)",
    "test_device.py": "torch.accelerator's device choice",
    "test_loop.py": "the device loader, launch, use_all_cores and step_optimizer's graph cut",
    "test_amp.py": "autocast and GradScaler",
    "test_fp16.py": "float16 autocast and torch's GradScaler in one_cycle_fit, their checkpoint state",
    "test_fit.py": "compile counts flat from epoch 2, no host syncs, the fused sync-free optimizer",
    "test_compile.py": "torch.compile's dynamo (its counters and recompile reasons), AOTAutograd, and inductor's C++ "
                       "build (this lane alone: TPU_UTILITY_TEST_INDUCTOR=1, set by make test-kaggle)",
    "test_predict.py": "SPMD gathers and transfers in dataset order",
    "test_multicore.py": "the SPMD mesh and the multi-process launch",
    "test_doctor.py": "torch_xla's counter and metric names",
    "test_callbacks.py": "swa_utils' AveragedModel and torch.utils.tensorboard",
    "test_checkpoint.py": "torch.save/torch.load(weights_only=True) formats",
    "test_huggingface.py": "transformers' mask code branches on the torch version",
    "test_generate.py": "compile and transfer counts of generate's graphs, SPMD sharding of its KV cache",
    "test_readme.py": "every README and docs block, as a user runs it",
    "test_notebook.py": "the quickstart notebook end to end",
    "test_porter.py": "ported 1.x kernels and CUDA loops run on this torch_xla (the API table's premise)",
    "test_port_device.py": "ported programs run on this torch_xla: where parameters and batches land, --check's XLA graphs",
    "test_mesh2d.py": "a 2-D SPMD mesh's shardings, and DTensor's parallelize_module under FSDP2, on this torch",
}
PYTHON_RELEASE = {  # code whose behaviour can change with the Python version
    "test_import.py": "imports with and without torch_xla",
    "test_packaging.py": "the sdist and wheel build and install",
    "test_notebook.py": "a Jupyter kernel on this Python",
    "test_progress.py": "tqdm bars and ipywidgets in a kernel",
    "test_setup.py": "the platform summary",
    "test_loop.py": "launch's spawned processes (pickling, start methods)",
    "test_multicore.py": "the multi-process launch",
    "test_checkpoint.py": "atomic writes and a kill -9 during a save",
    "test_cache.py": "worker processes, file locks and .npy shards",
    "test_presize.py": "a process pool and its clean-up",
    "test_readme.py": "every README and docs block, as a user runs it",
    "test_check.py": "the whole platform check on 1 and 4 devices",
    "test_porter.py": "LibCST's parser on this Python's grammar; a ported notebook in a kernel",
}

HF_RELEASE = {  # code whose behaviour moved between transformers releases, or peft's over them: the Kaggle lane
    # runs the floor (5.0.0), the Colab lane Colab's 5.15.0, the pinned stack the newest
    "test_huggingface.py": "the mask code static_masks replaces, set_attn_implementation, the version floor",
    "test_llm.py": "causal-LM losses, peft's wrappers and their masks, checkpointing's entry points",
    "test_packing.py": "the 4-D mask argument, Gemma 2/Qwen2's per-layer-type mask dict, the decoder's forward kwargs",
    "test_generate.py": "the KV cache's argument (cache or past_key_values) and layout, layer kinds, model.generate",
    "test_export.py": "save_pretrained/from_pretrained and peft's merge_and_unload",
    "test_memory.py": "models built on the meta device from configs, their block classes",
    "test_fsdp.py": "a Llama's blocks sharded and saved with save_pretrained",
    "test_porter.py": "ported Hugging Face and peft loops (the course loop, LoRA, the legacy LM script)",
    "test_quantization.py": "peft's LoRA over an nn.Linear subclass, from_config under init_empty_weights, shards",
    "test_scan.py": "each family's decoder-layer call (cache or past_key_values, GPT-2's tuple and mask buffer in 5.0)",
}


# Why each slow test is where it is (issue 63): the tests over 10 CPU-s in a quiet run of the whole pinned suite
# (393 s on a 2-core host; the table at the end of every run gives today's figures), what they cost and why that
# cost is paid here rather than in a lane or by a formula. A new entry in the run's slowest 15 belongs here.
SLOW = {
    "test_porter.py::test_a_cuda_loop_ports_and_trains_on_the_xla_device_as_on_the_cpu[timm_amp_loop.py-1-0.2]":
        "42 CPU-s: a timm ResNet's CUDA loop, ported, trains an epoch on XLA beside its plain-CPU original; the port's "
        "promise is a run that learns as the original does, and only a real loop shows it. Pinned stack only: the "
        "backend calls the port writes are test_loop's and test_amp's in the lanes",
    "test_notebook.py::test_notebook_runs_end_to_end":
        "26 CPU-s: the quickstart notebook in a real Jupyter kernel, the product's front door; the Kaggle and Colab "
        "lanes run it too, as the two images' users open it",
    "test_compile.py::test_a_compiled_llama_trains_as_eager_also_with_checkpointing_ema_fp16_and_lora":
        "21 CPU-s: dynamo and AOTAutograd over a Llama's step with each callback and on packed rows (aot_eager here; inductor's C++ "
        "build, about 50 CPU-s more from a cold cache, in the Kaggle lane alone: TPU_UTILITY_TEST_INDUCTOR)",
    "test_fsdp.py::test_fsdp_on_four_devices_shards_every_parameter_and_trains_as_the_replicated_run":
        "17 CPU-s: FSDPv2 on 4 XLA:CPU devices in one child that every fsdp check shares",
    "test_packaging.py::test_the_wheel_installs_offline_into_the_kaggle_stack_and_trains":
        "17 CPU-s where .venv-kaggle exists (skipped in a fresh clone's make test, which builds no lane venv)",
    "test_ports.py::test_timm_model_optimizer_factory_and_scheduler_port":
        "16 CPU-s: timm's own optimizer factory and scheduler driven by one_cycle_fit on a real timm model",
    "test_readme.py::test_readme_block_runs_as_written[torch.accelerator-1dev]":
        "15 CPU-s: the README's blocks run as a user runs them, one interpreter for each device count",
    "test_compile.py::test_compiled_ddp_and_fsdp2_replicas_train_as_eager_ones":
        "13 CPU-s: two gloo processes, DDP and FSDP2, eager and compiled",
    "test_gpu_check.py::test_the_gpu_check_dry_run_collects_every_cuda_test_and_fills_the_table":
        "11 CPU-s: make gpu-check's dry run, so the one command a 15-minute GPU loan runs cannot rot",
    "test_replicas.py::test_a_replica_that_stops_answering_is_named_by_the_one_that_waited":
        "21 s of wall, 1 CPU-s: it waits out a collective's timeout on purpose (the other workers use the cores)",
}

# Files whose tests train real models or start interpreters and processes (20-80 s each with two
# workers), slowest first: scheduled before the rest, so that a run ends on short tests, not with one
# worker still on a long one while the others idle. Order within a file is kept.
LONG_FIRST = ["test_notebook.py", "test_compile.py", "test_huggingface.py", "test_porter.py", "test_ports.py", "test_readme.py", "test_user_input.py",
              "test_native.py", "test_replicas.py", "test_resume_safety.py", "test_multicore.py", "test_check.py", "test_predict.py"]  # fmt: skip


def pytest_collection_modifyitems(config, items):
    rank = {name: k for k, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: file order kept otherwise
    for item in items:
        name = item.path.name
        only = item.get_closest_marker("lanes")  # a test that narrows its file's lanes, with the reason beside it
        if name in TORCH_RELEASE and (only is None or "torch_release" in only.args):
            item.add_marker(pytest.mark.torch_release)
        if name in PYTHON_RELEASE and (only is None or "python_release" in only.args):
            item.add_marker(pytest.mark.python_release)
        if name in HF_RELEASE and (only is None or "hf_release" in only.args):
            item.add_marker(pytest.mark.hf_release)


def _cpu_seconds() -> float:
    """CPU seconds this process, its waited-for children and its warm-started children have spent so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + CHILD_CPU_SECONDS[0]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    yield


_CPU_AT_START = pytest.StashKey[float]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Says plainly why a test stopped when pytest-timeout stopped it, and gives the teardown's report the CPU
    seconds the whole test spent (for the time report at the end of a run)."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_AT_START]))
    if report.failed and "Timeout (>" in str(report.longrepr):
        marker = item.get_closest_marker("timeout")
        limit = marker.args[0] if marker and marker.args else item.config.getini("timeout")
        report.sections.append(("pytest-timeout", (
            f"{item.nodeid} ran past its limit of {limit} s and was stopped (the per-test limit is "
            f"[tool.pytest.ini_options] timeout in pyproject.toml, or the test's @pytest.mark.timeout). "
            f"A hang shows in the thread dump above; on a loaded host, rerun the test alone.")))


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


# small_cnn's shape with a quarter of its channels: the tests that need a convnet that learns the digits, not the
# demo's size. At the suite's XLA level 0 its steps cost a third of small_cnn's; 0.978 after 3 epochs at max_lr
# 1e-2. Source too, so a child script can prepend it (children do not import conftest).
TINY_CNN = """
import torch as _torch
def tiny_cnn():
    nn = _torch.nn
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(16 * 4 * 4, 64), nn.ReLU(), nn.Dropout(0.2),
                         nn.Linear(64, 10))
"""
exec(TINY_CNN)


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.fixture
def mlp():
    torch.manual_seed(0)
    return small_mlp()


class MaskedBag(nn.Module):
    """Token ids (vocabulary 50) and a padding mask -> 2 classes: the mean of the unpadded embeddings."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Embedding(50, 8), nn.Linear(8, 2)

    def forward(self, tokens, mask):
        return self.out((self.embed(tokens) * mask[..., None]).sum(1) / mask.sum(1, keepdim=True))


class Counted(Dataset):
    """A dataset of ``samples`` that counts the samples read: a refusal before training reads none (or the few a check reads)."""

    def __init__(self, samples):
        self.samples, self.reads = samples, 0

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        self.reads += 1
        return self.samples[i]


def flat_digits(n: int | None = None) -> TensorDataset:
    from tpu_utility.demo import digits_datasets

    train, _ = digits_datasets()
    x, y = train.tensors
    return TensorDataset(x[:n], y[:n])


# Where the suite's time goes, printed at the end of every run (make test, the lanes): the 15 slowest tests and each
# file's total, wall seconds as pytest measures a test (setup, call, teardown) and CPU seconds (the test's process and
# every interpreter it started). With three workers on two cores a test's wall time grows with what runs beside it;
# its CPU seconds do not, so they are the figure to compare between runs.
SLOWEST_SHOWN = 15


def pytest_terminal_summary(terminalreporter):
    wall: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) not in ("setup", "call", "teardown"):
                continue
            wall[report.nodeid] = wall.get(report.nodeid, 0.0) + report.duration
            cpu[report.nodeid] = cpu.get(report.nodeid, 0.0) + dict(report.user_properties).get("cpu_s", 0.0)
    if not wall:
        return
    write = terminalreporter.write_line
    terminalreporter.section(f"time: the {SLOWEST_SHOWN} slowest tests (wall s, CPU s)")
    for nodeid in sorted(wall, key=wall.get, reverse=True)[:SLOWEST_SHOWN]:
        write(f"{wall[nodeid]:7.1f} {cpu[nodeid]:7.1f}  {nodeid}")
    files: dict[str, list[float]] = {}
    for nodeid in wall:
        total = files.setdefault(nodeid.split("::")[0], [0.0, 0.0, 0])
        total[0], total[1], total[2] = total[0] + wall[nodeid], total[1] + cpu[nodeid], total[2] + 1
    terminalreporter.section("time: each file (wall s, CPU s, tests), slowest first")
    for name in sorted(files, key=lambda f: files[f][0], reverse=True):
        write(f"{files[name][0]:7.1f} {files[name][1]:7.1f} {files[name][2]:4d}  {name}")
    write(f"{sum(wall.values()):7.1f} {sum(cpu.values()):7.1f} {len(wall):4d}  in all (wall summed over the workers)")
