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
import warnings
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


# torch_xla 2.8/2.9 on a TPU write compiled programs to the persistent cache but never load them: its
# DeserializeComputation calls PjRtClient::DeserializeExecutable, which libtpu's PJRT C API client leaves
# unimplemented ("Failed to deserialize executable: UNIMPLEMENTED: Deserializing serialized executable not
# supported", pytorch/xla#9094, open; the fix, pytorch/xla#9759, calls LoadSerializedExecutable and is not
# released). So the cache is off by default and the summary says why; `python -m tpu_utility.check` measures
# on a TPU whether a second run is faster.
CACHE_ON_TPU = "off (torch_xla 2.8/2.9 on TPU write compiled programs but cannot load them back: pytorch/xla#9094)"


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


def _check_folder(folder: str, given: str | None) -> None:
    """The compile cache's folder (or one above it) that is a file is named, not a bare FileExistsError."""
    probe = folder
    while probe and not os.path.exists(probe):
        parent = os.path.dirname(probe)
        probe = parent if parent != probe else ""
    if probe and not os.path.isdir(probe):
        raise ValueError(f"cache_dir={given if given is not None else folder!r} cannot be made: {probe!r} is a file, "
                         f"not a folder; give a folder path for the compile cache")  # fmt: skip


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
    torchtpu = backends.torch_tpu_installed()

    name = backends.choice.check(backend, "setup_tpu(backend=...)")
    if name == "auto":  # this call's "auto" replaces an earlier call's choice; TPU_UTILITY_BACKEND still counts
        name = backends.choice.from_environment()[0]
    forced_xla = backends.choice.runs_xla(name)
    if forced_xla is False and device != "auto":
        raise ValueError(
            f"setup_tpu(device={device!r}) picks an XLA device, but backend={name!r} does not run XLA: "
            f"give device='auto' with it, or backend='xla'"
        )
    user_choice = None if forced_xla is False else backends.pjrt_device()
    backends.refuse_missing_tpu(user_choice)  # a PJRT_DEVICE we do not run (CUDA, garbage), before any other check
    if device != "auto" and user_choice is not None and user_choice != device:
        raise RuntimeError(
            f"setup_tpu(device={device!r}) conflicts with PJRT_DEVICE={user_choice!r} set in "
            f"the environment. Unset one of them."
        )
    xla_default = "TPU" if tpu.chips else ("CPU" if forced_xla else None)
    wanted = user_choice or (device if device != "auto" else xla_default)

    running = backends.runtime_device_type()
    if running is not None and wanted is not None and running != wanted:
        raise RuntimeError(
            f"The XLA runtime already started on {running!r} in this process, so it cannot "
            f"switch to {wanted!r}. Restart the kernel and call setup_tpu() first."
        )
    backends.refuse_missing_tpu(wanted)
    if wanted is not None and not backends.XLA_INSTALLED:
        also = " (torch_tpu is installed: unset PJRT_DEVICE to run on TorchTPU instead)" if torchtpu else ""
        raise ModuleNotFoundError(
            f"PJRT_DEVICE={wanted!r} needs torch_xla{also}. Install it with: {backends.INSTALL_HINT}"
        )
    backends.ask(backend)
    reason = f"setup_tpu(device={device!r})" if device != "auto" and forced_xla is None else backends.why()
    if wanted is not None:
        os.environ["PJRT_DEVICE"] = wanted
        if torchtpu:
            warnings.warn(
                f"torch_tpu (TorchTPU, device 'tpu') is installed, but tpu_utility runs on torch_xla (device 'xla') "
                f"in this process, because PJRT_DEVICE={wanted!r} asks for it. Start without PJRT_DEVICE (and "
                f"without setup_tpu(device=...)), or call setup_tpu(backend='tpu'), to use TorchTPU.",
                stacklevel=2,
            )

    use_xla = wanted is not None
    rank = backends.local_process_rank()
    chosen_cache = None
    cache_note = "off"
    if compile_cache is None:  # on where it reloads: nowhere at torch_xla 2.8/2.9 (see CACHE_ON_TPU)
        compile_cache = False
        if wanted == "CPU":
            cache_note = "off (XLA:CPU cannot reload compiled programs)"
        elif wanted == "TPU":
            cache_note = CACHE_ON_TPU
    if use_xla and compile_cache:
        chosen_cache = default_cache_dir(platform, rank, base=cache_dir)
        _check_folder(chosen_cache, cache_dir)
        os.makedirs(chosen_cache, exist_ok=True)
        if not backends.initialize_cache(chosen_cache):
            warnings.warn(
                "The compile cache could not be switched on: XLA already compiled a graph in "
                "this process. Call setup_tpu() before any XLA work to keep compiled graphs "
                "across kernel restarts.",
                stacklevel=2,
            )
            chosen_cache = None

    chosen = backends.current()  # XLA now, where setup_tpu(device=...) set PJRT_DEVICE
    torchtpu_runs = not use_xla and isinstance(chosen, backends.TorchTpuBackend)
    if torchtpu_runs:  # TorchTPU: its caches are read when torch starts
        chosen_cache, cache_note = _torchtpu_cache()
    if wanted == "TPU":
        device_type, kind, count = "TPU", tpu.kind, tpu.devices
    elif torchtpu_runs:
        device_type, kind, count = "TPU", "TorchTPU", backends.device_count()
    elif wanted == "CPU":
        device_type, kind, count = "CPU", "XLA:CPU", int(os.environ.get("CPU_NUM_DEVICES", "1"))
    elif torch.cuda.is_available():
        device_type, kind, count = "CUDA", torch.cuda.get_device_name(0), torch.cuda.device_count()
    else:
        device_type, kind, count = "cpu", None, 1

    cpus = usable_cpus()
    processes = tpu.chips if wanted == "TPU" and tpu.chips else 1
    info = TpuInfo(
        platform=platform,
        device_type=device_type,
        device_kind=kind,
        num_devices=count,
        xla=use_xla,
        host_cpus=cpus,
        host_ram_gb=_host_ram_gb(),
        torch_version=torch.__version__,
        torch_xla_version=torch_xla_version,
        cache_dir=chosen_cache,
        cache_note=cache_note,
        num_workers=default_num_workers(processes),
        spmd=_choose_spmd(spmd, use_xla and count > 1),
        backend="xla" if use_xla else ("tpu (TorchTPU)" if torchtpu_runs else f"native ({chosen.name})"),
        backend_reason=reason,
    )
    if use_xla and (info.spmd or count == 1 or backends.in_launched_process()):
        backends.device()  # starts the runtime (no launch can follow here) and checks the autograd engine
    if verbose and info != _last_info:
        print(info.summary())
    _last_info = info
    return info


def _torchtpu_cache() -> tuple[str | None, str]:
    """TorchTPU's compile cache: its folder when set before torch started, else why it is off."""
    variable = "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"
    if os.environ.get(variable):
        return os.environ[variable], "on"
    return None, (
        f"off: TorchTPU reads {variable} when torch starts; set it before `import torch` "
        f"(first cell: import os; os.environ[{variable!r}] = '/kaggle/working/tpu_cache')"
    )


def choose_start_method(interactive: bool) -> str:
    """fork in a notebook (spawn cannot find functions defined there), spawn otherwise."""
    return "fork" if interactive else "spawn"


def is_interactive() -> bool:
    main = sys.modules.get("__main__")
    return hasattr(sys, "ps1") or bool(sys.flags.interactive) or not hasattr(main, "__file__")
