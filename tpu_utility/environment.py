"""setup_tpu(): the first cell of a notebook.

Finds where it runs (Kaggle, Colab, a TPU VM or a local machine), checks the
torch/torch_xla pair, picks the PJRT device, turns on the persistent compile
cache where torch_xla can reload it (nowhere at 2.8/2.9: it is off, and the summary says why),
starts the XLA runtime where no multi-process launch can follow, and prints
what it found, including which backend runs and why.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass
from typing import Literal, get_args

import torch

from . import backend as backends
from .huggingface import check_transformers

Platform = Literal["kaggle", "colab", "tpu-vm", "local"]
DeviceChoice = Literal["auto", "TPU", "CPU"]


@dataclass(frozen=True)
class TpuInfo:
    """What setup_tpu found; printed as a short summary."""

    platform: str
    device_type: str  # "TPU", "CPU" (XLA on the host CPU), "CUDA" or "cpu" (no XLA)
    device_kind: str | None
    num_devices: int
    xla: bool
    host_cpus: int
    host_ram_gb: float
    torch_version: str
    torch_xla_version: str | None
    cache_dir: str | None
    num_workers: int
    cache_note: str = "off"
    spmd: bool = False
    backend: str = ""
    backend_reason: str = ""

    def summary(self) -> str:
        if self.xla:
            stack = "XLA"
        elif self.torch_xla_version is None:
            stack = "no XLA: torch_xla is not installed"
        else:
            stack = "no XLA"
        kind = f" {self.device_kind}" if self.device_kind else ""
        lines = [
            f"tpu_utility on {self.platform}: {self.device_type}{kind} x {self.num_devices} via {stack}",
            f"  backend: {self.backend}, because {self.backend_reason}",
            f"  host: {self.host_cpus} CPUs, {self.host_ram_gb:.1f} GiB RAM;"
            f" suggested DataLoader num_workers={self.num_workers}"
            + (" (the model trains on these CPUs: a worker would take cores from its compute threads)"
               if self.device_type == "cpu" else ""),
            f"  torch {self.torch_version}, torch_xla {self.torch_xla_version or 'not installed'}",
            f"  compile cache: {self.cache_dir or self.cache_note}",
        ]
        if self.spmd:
            lines.append(f"  SPMD on: one process drives all {self.num_devices} devices (setup_tpu(spmd=False) keeps it off)")
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return asdict(self)


def detect_platform(environ: dict[str, str] | None = None, tpu_chips: int | None = None) -> Platform:
    """Names the platform from environment variables and the TPU on the PCI bus."""
    env = os.environ if environ is None else environ
    if "KAGGLE_KERNEL_RUN_TYPE" in env or "KAGGLE_URL_BASE" in env:
        return "kaggle"
    if "COLAB_RELEASE_TAG" in env or "COLAB_GPU" in env or "COLAB_TPU_ADDR" in env:
        return "colab"
    chips = backends.detect_tpu().chips if tpu_chips is None else tpu_chips
    if chips or "TPU_ACCELERATOR_TYPE" in env or "TPU_NAME" in env:
        return "tpu-vm"
    return "local"


def default_cache_dir(
    platform: str, process_rank: int | None, environ: dict[str, str] | None = None, base: str | None = None
) -> str:
    """Where compiled graphs survive a kernel restart; one folder per launched process.

    ``base`` is a folder the user chose; the per-process subfolder applies to it too.
    """
    env = os.environ if environ is None else environ
    if base is None and platform == "kaggle":
        base = "/kaggle/working/xla_cache"
    elif base is None:
        cache_home = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        base = os.path.join(cache_home, "tpu_utility", "xla_cache")
    return base if process_rank is None else os.path.join(base, f"process_{process_rank}")


def suggest_num_workers(host_cpus: int, processes: int = 1) -> int:
    """DataLoader workers per process: leave one CPU per process to feed the device."""
    return max(0, min(8, host_cpus // max(processes, 1) - 1))


def default_num_workers(processes: int = 1) -> int:
    """DataLoader workers per process for a Dataset, as one_cycle_fit and setup_tpu choose them.

    0 where the model trains on the host CPU itself (the native CPU backend):
    torch's compute threads already use every core, and a worker takes cores from
    them (a tiny BERT from dict samples on a 2-core host: 0.89x the steps per second
    of no worker). Elsewhere ``suggest_num_workers`` over the CPUs this process may use.
    """
    if backends.current().device_type == "cpu":
        return 0
    return suggest_num_workers(usable_cpus(), processes)


def usable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """CPUs this process may really use: its CPU affinity, capped by a container's CPU quota.

    ``os.cpu_count()`` counts the host's CPUs, which a notebook container (Kaggle, Colab,
    Docker) may be limited well below; more DataLoader workers than this only contend.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(cgroup_root)
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def _cgroup_cpu_quota(root: str) -> float | None:
    """The container's CPU quota in CPUs (cgroup v2, else v1), or None when unlimited."""
    def read(name: str) -> list[str]:
        with open(os.path.join(root, name)) as f:
            return f.read().split()

    for quota_file, period_file in (("cpu.max", None), ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")):
        try:
            values = read(quota_file)  # v2: "max 100000" or "<quota> <period>"; v1: "-1" or "<quota>"
            quota, period = values[0], (values[1] if period_file is None else read(period_file)[0])
            return None if quota in ("max", "-1") else int(quota) / int(period)
        except (OSError, ValueError, IndexError):
            continue
    return None


def _host_ram_gb() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


_last_info: TpuInfo | None = None


def _choose_spmd(spmd: bool | None, several_devices: bool) -> bool:
    """Switches SPMD on now, before the runtime starts, when asked or when several devices are visible."""
    if spmd is None:
        spmd = several_devices and not backends.in_launched_process() and (backends.is_spmd() or not backends.runtime_started())
    if spmd:
        backends.use_spmd()
    return bool(spmd)


def setup_tpu(
    device: DeviceChoice = "auto",
    cache_dir: str | None = None,
    compile_cache: bool | None = None,
    verbose: bool = True,
    spmd: bool | None = None,
    backend: backends.choice.BackendName = "auto",
) -> TpuInfo:
    """Prepares this process for XLA and prints what it found.

    Call it first, before anything touches a device. On XLA it starts the
    runtime (with SPMD, or on one device), so that a CPU backward pass later (a
    CPU check of the model) cannot break XLA's backward passes (pytorch/xla#4174);
    with ``spmd=False`` and several devices it leaves the runtime off, so a
    multi-process launch can still follow.

    Args:
        device: ``"auto"`` picks TPU when one is attached and otherwise leaves
            XLA off (``get_device`` then falls back to CUDA or CPU). ``"TPU"`` or
            ``"CPU"`` (XLA on the host CPU) force a PJRT device. A ``PJRT_DEVICE``
            environment variable the user set always wins over ``"auto"``.
        cache_dir: Folder for torch_xla's persistent compile cache. Default:
            ``/kaggle/working/xla_cache`` on Kaggle, ``~/.cache/tpu_utility/xla_cache``
            elsewhere, with a ``process_<rank>`` subfolder per launched process.
        compile_cache: None (default) turns the cache on where torch_xla can reload
            compiled programs, which today is nowhere: XLA:CPU writes them but cannot
            read them back, and neither can a TPU at torch_xla 2.8/2.9 (its PJRT plugin
            does not implement the deserialization torch_xla calls, pytorch/xla#9094;
            every run compiles anew). True forces it on (for a torch_xla with the fix,
            pytorch/xla#9759); False leaves it off.
        verbose: Print the summary.
        spmd: None (default) switches SPMD on when several XLA devices are visible
            outside a launched process, so ``cores="all"`` works after other XLA
            work (find_lr, earlier cells). False keeps it off (needed for
            ``strategy="multiprocess"``); True forces it on.
        backend: ``"auto"`` (default): torch_xla when a TPU is attached or
            ``PJRT_DEVICE`` is set, else TorchTPU when installed on a TPU, else
            CUDA, else the CPU. ``"native"``: PyTorch's own devices (CUDA, else
            the CPU) even where torch_xla set ``PJRT_DEVICE=CPU`` when it was
            imported (``from transformers import ...`` does that). ``"xla"``:
            torch_xla (the TPU, else XLA on the host CPU). ``"tpu"``: TorchTPU.
            The ``TPU_UTILITY_BACKEND`` environment variable chooses the same
            way when this is ``"auto"``; the summary says which and why.

    Returns:
        TpuInfo: platform, device type and kind, device count, host CPUs and RAM,
        versions, cache folder and a suggested DataLoader ``num_workers``.

    Raises:
        ValueError: ``device`` is not one of "auto", "TPU", "CPU", or ``backend``
            not one of "auto", "native", "xla", "tpu"; ``PJRT_DEVICE`` set to
            something other than TPU or CPU (CUDA: unset it for PyTorch's own GPU
            device); a ``cache_dir`` that is a file.
        RuntimeError: torch, torch_xla and torchvision are not of one release (the
            message has the pip command that fixes it), ``PJRT_DEVICE=TPU`` with no TPU attached, the XLA runtime
            already runs on a different device type than the one asked for, another backend already runs,
            ``backend="native"`` with ``device="TPU"``/``"CPU"``, or a CPU backward pass ran before the XLA
            runtime started (restart the runtime and call ``setup_tpu()`` first).

    Example:
        >>> # was: (nothing; on CUDA there is no set-up cell)
        >>> from tpu_utility import setup_tpu
        >>> info = setup_tpu()          # doctest: +SKIP
        tpu_utility on kaggle: TPU v5 lite x 8 via XLA
          backend: xla, because a TPU is attached (8 chips on the PCI bus) ...
        >>> info = setup_tpu(backend="native")   # CUDA/CPU although torch_xla is installed  # doctest: +SKIP
    """
    global _last_info
    if device not in get_args(DeviceChoice):
        raise ValueError(f"device must be one of {get_args(DeviceChoice)}, but given {device!r}")

    tpu = backends.detect_tpu()
    platform = detect_platform(tpu_chips=tpu.chips)
    torch_xla_version = backends.installed_version("torch_xla") if backends.XLA_INSTALLED else None
    backends.check_versions(torch.__version__, torch_xla_version, backends.installed_version("torchvision"))
    check_transformers()  # a warning, once: transformers below the tested range

    name = backends.choice.check(backend, "setup_tpu(backend=...)")
    if name == "auto":  # this call's "auto" replaces an earlier call's choice; TPU_UTILITY_BACKEND still counts
        name = backends.choice.from_environment()[0]
    wanted = backends.requested_device(device, name, tpu)  # torch_xla's checks: its PJRT device, or None
    backends.ask(backend)
    asked_device = device != "auto" and backends.choice.runs_xla(name) is None
    reason = f"setup_tpu(device={device!r})" if asked_device else backends.why()
    use_xla = wanted is not None
    if use_xla:
        backends.use_device(wanted)

    chosen = backends.current()  # XLA now, where setup_tpu(device=...) set PJRT_DEVICE
    folder = default_cache_dir(platform, backends.local_process_rank(), base=cache_dir)
    chosen_cache, cache_note = chosen.compute.compile_cache(folder, cache_dir, compile_cache)
    found = chosen.diagnosis.found(tpu)
    info = TpuInfo(
        platform=platform,
        device_type=found.device_type,
        device_kind=found.kind,
        num_devices=found.count,
        xla=use_xla,
        host_cpus=usable_cpus(),
        host_ram_gb=_host_ram_gb(),
        torch_version=torch.__version__,
        torch_xla_version=torch_xla_version,
        cache_dir=chosen_cache,
        cache_note=cache_note,
        num_workers=default_num_workers(found.processes),
        spmd=_choose_spmd(spmd, use_xla and found.count > 1),
        backend=found.backend,
        backend_reason=reason,
    )
    if use_xla and (info.spmd or found.count == 1 or backends.in_launched_process()):
        backends.device()  # starts the runtime (no launch can follow here) and checks the autograd engine
    if verbose and info != _last_info:
        print(info.summary())
    _last_info = info
    return info


def choose_start_method(interactive: bool) -> str:
    """fork in a notebook (spawn cannot find functions defined there), spawn otherwise."""
    return "fork" if interactive else "spawn"


def is_interactive() -> bool:
    main = sys.modules.get("__main__")
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(main, "__file__")
