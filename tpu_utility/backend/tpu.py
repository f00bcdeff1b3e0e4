"""The TorchTPU backend (``torch-tpu``, device ``tpu``): a thin layer over the native one.

TorchTPU works like CUDA: eager by default, one process per chip (each sees its
own chip as ``tpu:0``), ``torch.distributed`` with the ``tpu_dist`` process-group
backend, ``torch.autocast("tpu", torch.bfloat16)``. What differs from the native
backend is said here and nowhere else:

* the launch environment is set with ``torch.tpu.distributed.set_tpu_launch_env``
  before the processes start;
* every process uses device index 0;
* only ``torch.accelerator.*`` is called: on torch >= 2.11 ``torch.tpu.is_available``,
  ``device_count``, ``current_device``, ``set_device``, ``synchronize`` (and on 2.13
  ``get_rng_state``/``initial_seed``) raise RuntimeError when called from user code.
  ``STRICT_INTERNAL`` lists them; a test fails if any is called.

It cannot execute without a TPU; on CPU the tests check detection, the launch
call, the error translation and the native path it builds on.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch

from .base import Found
from .hardware import TpuHardware
from .native import NativeBackend, NativeCompute, NativeDevices, NativeDiagnosis, NativeProcesses

# torch.tpu functions that raise from user code on torch >= 2.11 (2.13 adds the rng pair).
STRICT_INTERNAL = (
    "is_available", "device_count", "current_device", "set_device", "synchronize", "get_rng_state", "initial_seed",
)  # fmt: skip

# TorchTPU's compile caches are fixed once torch initialises the backend: setup_tpu sets
# these before that, or says it is too late.
CACHE_VARIABLES = ("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT",)


class TorchTpuDevices(NativeDevices):
    """``tpu:0`` in every process; a TPU under it."""

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("tpu", 0 if index is None else index)

    def hardware(self, device: torch.device) -> str | None:
        return "TPU" if self.owns(device) else None


class TorchTpuProcesses(NativeProcesses):
    """The launch environment set before the processes spawn; fork refused."""

    def launch(self, fn: Callable[..., Any], args: tuple, nprocs: int, start_method: str) -> None:
        if start_method == "fork":
            raise RuntimeError(
                "TorchTPU cannot fork a process after the TPU was touched; run the training from a script "
                "(spawn), or use one process (cores=1)"
            )
        set_launch_env(nprocs)
        super().launch(fn, args, nprocs, "spawn")


class TorchTpuCompute(NativeCompute):
    """bfloat16 autocast on ``tpu`` (a float16 request becomes bfloat16)."""

    def bf16_autocast_available(self) -> bool:
        return True

    def fp16_available(self) -> bool:
        """TPUs compute in bfloat16 (its autocast turns a float16 request into bfloat16): no float16 to scale."""
        return False

    compile_backend = "tpu"  # TorchTPU's graph mode

    def autocast(self, device: torch.device, dtype: torch.dtype) -> Any:
        return torch.autocast("tpu", dtype=torch.bfloat16 if dtype == torch.float16 else dtype)

    def compile_cache(self, folder: str, given: str | None, enabled: bool | None) -> tuple[str | None, str]:
        """TorchTPU's own compile cache: its folder when ``CACHE_VARIABLES`` was set before torch started, else why it
        is off (TorchTPU reads it once, when torch starts; ``setup_tpu``'s folder and ``compile_cache`` cannot move it)."""
        variable = CACHE_VARIABLES[0]
        if os.environ.get(variable):
            return os.environ[variable], "on"
        return None, (
            f"off: TorchTPU reads {variable} when torch starts; set it before `import torch` "
            f"(first cell: import os; os.environ[{variable!r}] = '/kaggle/working/tpu_cache')"
        )

    def torch_compile(self, model: torch.nn.Module, options: dict[str, Any]) -> torch.nn.Module:
        """``torch.compile(model, backend="tpu", dynamic=False)``: TorchTPU compiles static shapes (a new shape is
        a new graph, as on XLA; buckets keep them few)."""
        return super().torch_compile(model, {"dynamic": False, **options})


class TorchTpuDiagnosis(NativeDiagnosis):
    """Host syncs watched as natively; what TorchTPU does not count, said."""

    def found(self, tpu: TpuHardware) -> Found:
        """TorchTPU's chips, one process each."""
        return Found("TPU", "TorchTPU", self.backend.devices.device_count(), "tpu (TorchTPU)")

    def unmeasured(self) -> tuple[str, ...]:
        """Host syncs are watched as on every native backend; TorchTPU's compiles and host fallbacks are not."""
        return (
            "graph compilations while doctor watches: TorchTPU runs eagerly unless the step is compiled "
            "(one_cycle_fit's compile=, compile_model), and a compiled step runs uncompiled inside doctor's dispatch "
            "mode; the input shape changes that would recompile it are named",
            "ops that fall back to the host CPU: TorchTPU does not count them where Python can read them",
        )


class TorchTpuBackend(NativeBackend):
    """TorchTPU: device ``tpu`` (``tpu:0`` in every process), ``tpu_dist``, bf16 autocast."""

    Devices = TorchTpuDevices
    Processes = TorchTpuProcesses
    Compute = TorchTpuCompute
    Diagnosis = TorchTpuDiagnosis

    def __init__(self) -> None:
        super().__init__("tpu", "tpu_dist")

    def __repr__(self) -> str:
        return "TorchTpuBackend()"


def set_launch_env(nprocs: int) -> None:
    """``torch.tpu.distributed.set_tpu_launch_env(nproc_per_node=nprocs)``: one chip per process."""
    distributed = importlib.import_module("torch.tpu.distributed")
    distributed.set_tpu_launch_env(nproc_per_node=nprocs)


def translate_error(error: BaseException) -> BaseException:
    """A TorchTPU error that users meet, with the fix added; others unchanged."""
    text = str(error)
    if "predates the oldest supported release" in text or "Failed to load the backend extension: torch_tpu" in text:
        return RuntimeError(
            f"{text}\ntorch_tpu is installed beside a torch it does not support (it needs torch 2.11 to 2.15). "
            f"Either uninstall it (pip uninstall torch-tpu) to use torch_xla, or set "
            f"TORCH_DEVICE_BACKEND_AUTOLOAD=0 before starting Python so that import torch skips it."
        )
    if "No TPU" in text or "no TPU" in text:
        return RuntimeError(f"{text}\nTorchTPU needs a TPU to run; on this machine use torch_xla or the CPU.")
    return error
