"""The CUDA DDP branch of a single-file trainer (nanoGPT's): named, line by line; the single-process path is ported.

``init_process_group(backend="nccl")``, ``device = f"cuda:{ddp_local_rank}"`` and
``DDP(model, device_ids=[ddp_local_rank])`` run under ``torchrun`` only; on a TPU there is no
nccl and no CUDA device. Each is named (the port's exit 1) with the package's multi-process path;
without ``torchrun`` the program takes its single-process path, which the other fixers port.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, keyword, libcst

_WRAPPERS = {"DDP", "DistributedDataParallel"}


def _nccl(call: Any) -> bool:
    backend = keyword(call, "backend") or (call.args[0] if call.args and call.args[0].keyword is None else None)
    return backend is not None and "nccl" in code(backend.value)


@fixes("Call", order=40)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``init_process_group("nccl")``, ``DDP(model, device_ids=[...])``."""
    last = dotted(updated.func).rsplit(".", 1)[-1]
    if (last == "init_process_group" and _nccl(updated)) or (last in _WRAPPERS and keyword(updated, "device_ids")):
        porter.leave_alone("ddp_nccl", original)
    return None


@fixes("Assign", order=20)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``device = f"cuda:{local_rank}"``."""
    cst = libcst()
    value = original.value
    if isinstance(value, cst.FormattedString) and value.parts and isinstance(value.parts[0], cst.FormattedStringText) \
            and value.parts[0].value.startswith("cuda:"):  # fmt: skip
        porter.leave_alone("ddp_nccl", original)
    return None
