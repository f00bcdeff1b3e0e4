"""Which backend a user asked for: ``setup_tpu(backend=...)`` or ``TPU_UTILITY_BACKEND``.

Pure state and checks, no torch: ``api`` and ``xla`` read it. ``"auto"`` leaves the
choice to what is installed and attached (``api``'s order); ``"native"`` is PyTorch's
own devices (CUDA or another ``torch.accelerator``, else the CPU) even where torch_xla
set ``PJRT_DEVICE`` when something imported it (``"auto"`` chooses it too in a process that
already joined a gloo or nccl job); ``"xla"`` is torch_xla (the TPU, else
XLA on the host CPU); ``"tpu"`` is TorchTPU.

Example:
    >>> # was: os.environ.pop("PJRT_DEVICE") before anything imported torch_xla
    >>> from tpu_utility.backend import choice
    >>> choice.check("native", "setup_tpu(backend=...)")
    'native'
"""

from __future__ import annotations

import os
import sys
from typing import Literal, get_args

BackendName = Literal["auto", "native", "xla", "tpu"]
VARIABLE = "TPU_UTILITY_BACKEND"

# What PJRT_DEVICE was, and whether torch_xla was loaded, when tpu_utility was imported: torch_xla's own
# import sets PJRT_DEVICE=CPU on a machine without a TPU, and the setup summary says so.
_PJRT_AT_IMPORT = os.environ.get("PJRT_DEVICE")
_XLA_LOADED_AT_IMPORT = "torch_xla" in sys.modules

_asked: str | None = None


def check(name: object, where: str) -> str:
    """Returns ``name`` when it is a backend name, else raises ValueError naming ``where`` and the allowed ones."""
    if name not in get_args(BackendName):
        raise ValueError(f"{where} must be one of {get_args(BackendName)}, but given {name!r}")
    return str(name)


def runs_xla(name: str) -> bool | None:
    """True when ``name`` asks for torch_xla, False when it rules it out, None for "auto" (what is attached decides)."""
    return None if name == "auto" else name == "xla"


def ask(name: str) -> str:
    """Records ``setup_tpu(backend=name)`` for this process (already checked); returns what it replaces."""
    global _asked
    previous = _asked or "auto"
    _asked = None if name == "auto" else name
    return previous


def asked() -> tuple[str, str]:
    """(name, where it was asked): ``setup_tpu``'s argument first, then the environment variable, else "auto"."""
    if _asked is not None:
        return _asked, f"setup_tpu(backend={_asked!r})"
    return from_environment()


def inputs() -> tuple[str | None, ...]:
    """What the choice is made from and may change in a process, read without checking anything:
    ``setup_tpu``'s argument, ``TPU_UTILITY_BACKEND``, ``PJRT_DEVICE`` and the native job joined."""
    return _asked, os.environ.get(VARIABLE), os.environ.get("PJRT_DEVICE"), native_job()


def native_job() -> str | None:
    """The backend of the ``torch.distributed`` job this process is in ("gloo", "nccl"...); None outside one,
    or in torch_xla's own ("xla"). A group the package joined (``join_job``, ``launch``) or the user made.

    With ``"auto"`` such a process stays on the native backend: torch_xla imported after it joined
    (``from transformers import ...`` imports it) sets ``PJRT_DEVICE``, which must not move the rest of
    the job to XLA. Read from ``sys.modules``: without torch.distributed imported there is no group.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    group = str(dist.get_backend())
    return None if group == "xla" else group


def from_environment() -> tuple[str, str]:
    """(name, where) from ``TPU_UTILITY_BACKEND``, or ("auto", "") when it is not set."""
    value = os.environ.get(VARIABLE)
    if value:
        return check(value.lower(), VARIABLE), f"{VARIABLE}={value}"
    return "auto", ""


def pjrt_origin() -> str:
    """Who set ``PJRT_DEVICE``, as the summary says it: torch_xla's import, or the environment."""
    value = os.environ.get("PJRT_DEVICE")
    if value == "CPU" and _PJRT_AT_IMPORT is None and not _XLA_LOADED_AT_IMPORT and "torch_xla" in sys.modules:
        return "PJRT_DEVICE=CPU was set by torch_xla when it was imported"
    if value == "CPU" and _XLA_LOADED_AT_IMPORT and _PJRT_AT_IMPORT == "CPU":
        return "PJRT_DEVICE=CPU is set (torch_xla sets it when it is imported on a machine without a TPU)"
    return f"PJRT_DEVICE={value} is set"
