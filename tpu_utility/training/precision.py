"""Precision: fp32, bf16 (autocast where the backend has it, else the model and inputs cast) or fp16 with
torch's ``GradScaler``. One ``Precision`` value, made and checked once at the boundary (``Precision.of``), is
carried down: the memory plan reads its ``itemsize``, the runner applies it on its device (``on``: one
``PrecisionMode`` per run), a checkpoint records its ``name``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal, get_args

import torch
from torch.utils import _pytree as pytree

from .. import backend

Batch = Any  # a step's batch: tensors, or dicts, lists and tuples of them
PrecisionName = Literal["fp32", "bf16", "fp16"]


def _cast_floats(batch: Batch, dtype: torch.dtype) -> Batch:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, batch
    )


def check_precision(precision: Any, device: torch.device | None = None) -> None:
    """Refuses a precision that is not one of ``Precision``, and ``"fp16"`` where this backend has no float16 path.

    float16 autocast with torch's ``GradScaler`` runs on CUDA and the CPU (native backend);
    TPUs (torch_xla, TorchTPU) compute in bfloat16 and XLA:CPU has no autocast.

    Args:
        precision: The value given.
        device: The run's device, where it is known (naming the hardware under it); None
            names the backend's device type without starting its runtime.

    Raises:
        ValueError: the value, and for fp16 the device and the precisions it has.
    """
    Precision.named(precision)
    chosen = backend.current()
    if precision != "fp16" or chosen.compute.fp16_available():
        return
    if device is None and chosen.lazy:
        device = torch.device(chosen.device_type)  # "xla": its hardware is named without starting the runtime
    hardware = chosen.devices.hardware(device) if device is not None else None
    where = f"XLA:{hardware}" if chosen.lazy and hardware else hardware or chosen.device_type
    raise ValueError(
        f"precision='fp16' (float16 autocast and a GradScaler) has no path on {where} (the {chosen.name} backend): "
        f"use precision='bf16' (what TPUs compute in; it has float32's range, so no loss scaling is needed) or "
        f"precision='fp32'. fp16 runs on CUDA GPUs (and, slowly, the CPU)"
    )


@dataclass(frozen=True)
class Precision:
    """A run's precision, checked once where the user gives it and carried down as this value.

    Example:
        >>> # was: with torch.autocast("cuda", dtype=torch.bfloat16): ...
        >>> Precision.of("bf16").itemsize, Precision.of("fp32").dtype
        (2, torch.float32)
    """

    name: PrecisionName = "fp32"

    @classmethod
    def of(cls, value: Precision | str, device: torch.device | None = None) -> Precision:
        """``value`` (a name, or a Precision already checked) as a Precision; a name is checked here
        (``check_precision``: fp16 where the backend has no float16 path is refused)."""
        if isinstance(value, cls):
            return value
        check_precision(value, device)
        return cls(value)

    @classmethod
    def named(cls, value: Precision | str) -> Precision:
        """``value`` as a Precision, its name checked but not this backend's paths (a memory plan may be
        made here for other hardware)."""
        if isinstance(value, cls):
            return value
        if value not in get_args(PrecisionName):
            raise ValueError(f"precision must be one of {get_args(PrecisionName)}, but given {value!r}")
        return cls(value)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype activations are computed in."""
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]

    @property
    def itemsize(self) -> int:
        """Bytes of one activation element (the memory plan's unit)."""
        return self.dtype.itemsize

    def on(self, device: torch.device) -> PrecisionMode:
        """How this precision applies on ``device``: bf16 by autocast where the backend has it, else by casting
        the model and its inputs (XLA:CPU refuses autocast)."""
        if self.name != "bf16":
            return PrecisionMode(self.name, device)
        if backend.current().devices.is_lazy(device):  # XLA: its autocast on TPUs, else cast (XLA:CPU refuses autocast)
            return PrecisionMode("autocast" if backend.current().compute.bf16_autocast_available() else "cast", device)
        return PrecisionMode("autocast", device)


@dataclass
class PrecisionMode:
    """How the precision is applied on this device.

    ``mode``: "fp32"; bf16 by "autocast", or by "cast"ing model and inputs where the
    device has no bf16 autocast (XLA:CPU); "fp16": float16 autocast around the forward
    and the loss, and torch's ``GradScaler`` in training (``backward``, ``scaler``), whose
    state a checkpoint keeps (``state_dict``).

    Example:
        >>> # was: scaler = torch.cuda.amp.GradScaler()
        >>> #      with torch.autocast("cuda", dtype=torch.float16): loss = loss_fn(model(x), y)
        >>> #      scaler.scale(loss).backward(); scaler.step(opt); scaler.update()
        >>> precision = Precision.of("fp16").on(torch.device("cuda"))         # doctest: +SKIP
        >>> with precision.context():                                        # doctest: +SKIP
        ...     loss = loss_fn(model(x), y)
        >>> precision.backward(loss)                                         # doctest: +SKIP
        >>> step_optimizer(opt, scaler=precision.scaler)                     # doctest: +SKIP
    """

    mode: str  # "fp32", "autocast", "cast" or "fp16"
    device: torch.device

    @property
    def name(self) -> str:
        """The ``precision=`` value: "fp32", "bf16" or "fp16"."""
        return {"autocast": "bf16", "cast": "bf16"}.get(self.mode, self.mode)

    def context(self) -> Any:
        if self.mode not in ("autocast", "fp16"):
            return nullcontext()
        dtype = torch.float16 if self.mode == "fp16" else torch.bfloat16
        if backend.current().devices.owns(self.device):
            return backend.current().compute.autocast(self.device, dtype)
        return torch.autocast(self.device.type, dtype=dtype)

    def inputs(self, batch: Batch) -> Batch:
        return _cast_floats(batch, torch.bfloat16) if self.mode == "cast" else batch

    @cached_property
    def scaler(self) -> torch.amp.GradScaler | None:
        """torch's ``GradScaler`` under fp16 (made when training first asks; evaluate and predict never do), else None."""
        return torch.amp.GradScaler(self.device.type) if self.mode == "fp16" else None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, the loss scaled first under fp16 (``scaler.scale(loss).backward()``)."""
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the precision, and the GradScaler's state (``{}`` without one)."""
        return {"precision": self.name, "scaler": self.scaler.state_dict() if self.scaler is not None else {}}

    def load_state_dict(self, state: Mapping[str, Any], path: str) -> str | None:
        """Takes a checkpoint's GradScaler state, so a resumed fp16 run goes on with its scale.

        Returns what a change of precision since ``path`` was written means (a fresh
        scaler, or a scaler state left unused), for the caller to say; None if none.
        """
        saved, scaler_state = state.get("precision"), state.get("scaler") or {}
        if self.scaler is not None and scaler_state:
            self.scaler.load_state_dict(scaler_state)
        if saved == self.name or (saved is None and self.scaler is None):
            return None  # the same precision, or a checkpoint from before it was recorded and nothing to restore
        written = f"was written with precision={saved!r}" if saved else "records no precision (an earlier release)"
        change = f"{path} {written} and this run uses precision={self.name!r}"
        if self.scaler is not None and not scaler_state:
            fresh = f"a fresh GradScaler starts at scale {self.scaler.get_scale():g}"
            return f"{change}: {fresh} (halved at each step whose gradients overflow)"
        if scaler_state:
            unused = f"the checkpoint's GradScaler state (scale {scaler_state.get('scale'):g}) is left unused"
            return f"{change}: {unused}, as {self.name} scales no loss"
        return f"{change}: the weights and optimizer state go on in {self.name}"

    @property
    def label(self) -> str:
        return {"fp32": "fp32", "autocast": "bf16 (autocast)", "cast": "bf16 (model and inputs cast)",
                "fp16": "fp16 (autocast + GradScaler)"}[self.mode]  # fmt: skip

    def words(self, model: torch.nn.Module) -> str:
        """The summary's precision: what computes, and the dtypes the weights are held in where not all fp32.

        A model loaded in bf16 (``from_pretrained(..., dtype=torch.bfloat16)``) under the default
        ``precision="fp32"`` computes in bf16: "fp32" alone would say otherwise.

        Example:
            >>> PrecisionMode("fp32", torch.device("cpu")).words(torch.nn.Linear(2, 2).to(torch.bfloat16))
            "no autocast (precision='fp32'): computes in the weights' dtype | weights bf16"
        """
        held: dict[str, set[str]] = {}
        for parameter in model.parameters():
            short = str(parameter.dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
            held.setdefault(short, set()).add("trained" if parameter.requires_grad else "frozen")
        if set(held) <= {"fp32"}:
            return self.label
        label = "no autocast (precision='fp32'): computes in the weights' dtype" if self.mode == "fp32" else self.label
        parts = [f"{d}{'' if len(held) == 1 or len(roles) == 2 else f' ({next(iter(roles))})'}"
                 for d, roles in sorted(held.items())]  # fmt: skip
        return f"{label} | weights {', '.join(parts)}"
