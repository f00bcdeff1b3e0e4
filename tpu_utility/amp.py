"""Mixed precision that ports: ``autocast`` and ``grad_scaler`` for any device.

A CUDA loop written with ``torch.autocast`` and ``torch.amp.GradScaler`` runs
on XLA after changing only the two lines that create them::

    scaler = grad_scaler(device)                         # was: torch.amp.GradScaler("cuda")
    for x, y in loader:
        with autocast(device, dtype=torch.float16):      # was: torch.autocast("cuda", dtype=torch.float16)
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)                           # unchanged: all-reduce and graph cut on XLA
        scaler.update()

What each device gets::

    device               autocast                                     scaler
    CUDA                 the dtype given (float16 by default)         real GradScaler for float16
    TPU (XLA)            bfloat16 (a float16 request becomes bf16)    pass-through
    XLA on the host CPU  none: torch_xla's autocast is TPU-only       pass-through
    CPU                  none: float32, as CUDA autocast on a CPU     pass-through

bfloat16 has float32's exponent range, so no loss scaling is needed: the
pass-through scaler scales by 1 and its ``step`` is ``step_optimizer``. Where
autocast is off, the loop runs in float32 and says so once.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from . import backend
from .arguments import check_keywords, parameter_names
from .device import get_device
from .optim import step_optimizer

Kind = Literal["torch", "backend", "off"]
_DTYPES = (torch.float16, torch.bfloat16)
_SAID: set[str] = set()


def _check_dtype(dtype: Any) -> None:
    if dtype is not None and dtype not in (*_DTYPES, torch.float32):
        raise ValueError(f"dtype must be None, torch.float16, torch.bfloat16 or torch.float32, but given {dtype!r}")


def _say_once(message: str) -> None:
    if message not in _SAID:
        _SAID.add(message)
        warnings.warn(message, stacklevel=3)


@dataclass(frozen=True)
class AutocastPlan:
    """What ``autocast`` does on a device: which autocast, which dtype, and why."""

    kind: Kind
    dtype: torch.dtype | None
    note: str | None = None


def plan_autocast(device_type: str, dtype: torch.dtype | None, hardware: str | None = None) -> AutocastPlan:
    """The autocast for a device: torch's on CUDA, the backend's bfloat16 on TPUs, none elsewhere.

    Pure: ``hardware`` is what the backend reports under the device ("TPU" for a
    TPU through torch_xla or TorchTPU, "CPU" for XLA on the host CPU, None for an
    eager device that is its own hardware).

    Raises:
        ValueError: ``dtype`` is not None, torch.float16, torch.bfloat16 or torch.float32.
        TypeError: a keyword ``torch.amp.GradScaler`` does not take (checked on every
            device, though only CUDA float16 uses them).
    """
    _check_dtype(dtype)
    if dtype == torch.float32:  # torch.autocast warns and runs without autocast: the same here, on every device
        return AutocastPlan("off", None, "autocast: dtype=torch.float32 asked for no mixed precision; the loop runs in float32")
    if device_type == "cuda":
        return AutocastPlan("torch", dtype or torch.float16)
    if hardware == "TPU":
        note = None
        if dtype == torch.float16:
            note = (
                "autocast: TPUs compute in bfloat16, so float16 was asked for and bfloat16 is used "
                "(no loss scaling needed)"
            )
        return AutocastPlan("backend", torch.bfloat16, note)
    if hardware is not None:
        return AutocastPlan(
            "off", None,
            f"autocast: torch_xla's autocast supports TPUs only, so on XLA:{hardware} the loop runs in float32",
        )  # fmt: skip
    return AutocastPlan("off", None, f"autocast: no mixed precision on {device_type}; the loop runs in float32")


def autocast(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, enabled: bool = True
) -> AbstractContextManager:
    """The mixed-precision context for ``device``: bf16 on TPU, your dtype on CUDA.

    Use it where the CUDA loop had ``torch.autocast("cuda", ...)``. On a TPU it is
    torch_xla's bfloat16 autocast (a float16 request becomes bfloat16, said
    once). On XLA running on the host CPU (torch_xla's autocast refuses it) and on
    a plain CPU there is no autocast: the loop runs in float32 and this says so
    once. Pair it with ``grad_scaler``.

    Args:
        device: The training device; None for ``get_device()``.
        dtype: torch.float16 or torch.bfloat16; None means float16 on CUDA (torch's
            default) and bfloat16 on TPU. torch.float32 means no autocast, said once
            (torch.autocast warns and runs without it).
        enabled: False gives a context that does nothing (``autocast(..., enabled=use_amp)``).

    Returns:
        A context manager, new at each call.

    Raises:
        ValueError: ``dtype`` is not None, torch.float16, torch.bfloat16 or torch.float32.
        TypeError: ``enabled`` is not a bool.

    Example:
        >>> # was: with torch.autocast("cuda", dtype=torch.float16):
        >>> with autocast(device, dtype=torch.float16):   # doctest: +SKIP
        ...     loss = loss_fn(model(x), y)
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, but given {enabled!r} of type {type(enabled).__name__}")
    device = get_device() if device is None else torch.device(device)
    plan = plan_autocast(device.type, dtype, backend.hardware(device))
    if not enabled:
        return nullcontext()
    if plan.note:
        _say_once(plan.note)
    if plan.kind == "backend":
        return backend.autocast(device, plan.dtype)
    if plan.kind == "torch":
        return torch.autocast(device.type, dtype=plan.dtype)
    return nullcontext()


class PassThroughScaler(torch.amp.GradScaler):
    """A GradScaler that does not scale, for devices that need no loss scaling.

    It is a disabled ``torch.amp.GradScaler`` (``scale`` returns its input,
    ``unscale_`` and ``update`` do nothing, ``get_scale()`` is 1.0, ``state_dict()``
    is empty and loading a real scaler's state is ignored), except that
    ``step(optimizer)`` is ``step_optimizer(optimizer)``: on XLA it averages the
    gradients over replicas and cuts the graph, so the loop's
    ``scaler.step(optimizer)`` line stays as it was.

    Gradient clipping: a CUDA loop's ``scaler.unscale_(opt)``,
    ``clip_grad_norm_(model.parameters(), 1.0)``, ``scaler.step(opt)`` still
    runs, but under a multi-process launch it clips each replica's own gradient
    before ``step`` averages them, so the averaged gradient is not the one
    clipped. Replace the three lines with
    ``step_optimizer(opt, scaler=scaler, max_grad_norm=1.0)``, which clips after
    the all-reduce (and unscales first on CUDA).
    """

    def __init__(self) -> None:
        super().__init__("cpu", enabled=False)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        if args:
            if len(args) > 1 or "closure" in kwargs:
                raise TypeError(
                    f"step takes the optimizer and at most a closure, but given {len(args) + 1} positional arguments"
                )
            kwargs = {"closure": args[0], **kwargs}
        return step_optimizer(optimizer, optimizer_args=kwargs)


def grad_scaler(
    device: torch.device | str | None = None, dtype: torch.dtype | None = None, **kwargs: Any
) -> torch.amp.GradScaler:
    """A loss scaler when the device needs one (CUDA float16), else a pass-through.

    Use it where the CUDA loop created ``torch.amp.GradScaler()``; the loop's
    ``scaler.scale(loss).backward()``, ``scaler.step(optimizer)``,
    ``scaler.update()``, ``unscale_`` and ``state_dict`` lines stay.

    Args:
        device: The training device; None for ``get_device()``.
        dtype: The autocast dtype the loop uses; None means float16 on CUDA.
            bfloat16 needs no scaling anywhere.
        **kwargs: ``torch.amp.GradScaler`` arguments (``init_scale``,
            ``growth_interval``...), used when a real scaler is made.

    Returns:
        ``torch.amp.GradScaler("cuda", **kwargs)`` for CUDA float16, else a
        ``PassThroughScaler`` (a GradScaler too).

    Raises:
        ValueError: ``dtype`` is not None, torch.float16 or torch.bfloat16.

    Example:
        >>> # was: scaler = torch.amp.GradScaler("cuda")
        >>> scaler = grad_scaler(device)   # doctest: +SKIP
    """
    _check_dtype(dtype)
    # checked on every device: off CUDA float16 the arguments are unused, but a misspelt one is still a mistake
    check_keywords(kwargs, parameter_names(torch.amp.GradScaler.__init__, ("self", "device")), "grad_scaler")
    device = get_device() if device is None else torch.device(device)
    if device.type == "cuda" and dtype in (None, torch.float16):
        return torch.amp.GradScaler("cuda", **kwargs)
    return PassThroughScaler()
