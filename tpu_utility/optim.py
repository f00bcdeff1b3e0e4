"""step_optimizer(): the line that replaces ``optimizer.step()`` (and ``scaler.step(optimizer)``)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from . import backend

# Optimizers already checked, with the layout of their parameter groups when checked and
# whether their parameters are on XLA: both cost a pass over the parameters, so they run
# once per optimizer (again only if its groups change), not every step.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _parameters(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _group_layout(optimizer: Any) -> tuple:
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def on_xla(optimizer: Any) -> bool:
    """Whether the optimizer's parameters are on XLA; checks them the first time (``check_on_device``)."""
    layout = _group_layout(optimizer)
    known = _CHECKED.get(optimizer)
    if known is not None and known[0] == layout:
        return known[1]
    params = _parameters(optimizer)
    check_on_device(params)
    answer = any(backend.is_lazy(p.device) for p in params)
    try:
        _CHECKED[optimizer] = (layout, answer)
    except TypeError:  # not weak-referenceable: checked every step
        pass
    return answer


def check_on_device(params: list[torch.Tensor]) -> None:
    """Raises RuntimeError if XLA is in use but the optimizer holds CPU parameters.

    Moving a model to XLA replaces its parameters with new tensors, so an optimizer
    built before ``model.to(device)`` keeps the old CPU ones: their gradients stay
    None and ``step()`` changes nothing, silently. CPU parameters that do have
    gradients are a model really trained on the CPU, and pass.
    """
    if backend.runtime_started():
        on_cpu = [p for p in params if p.device.type == "cpu"]
        if on_cpu and all(p.grad is None for p in on_cpu):
            raise RuntimeError(
                f"step_optimizer: {len(on_cpu)} of the optimizer's {len(params)} parameters are on the "
                f"cpu, without gradients, while XLA is in use: the optimizer was built before "
                f"model.to(device), which replaced the model's parameters with XLA copies, so step() "
                f"would update the stale CPU tensors and the model would never learn. Build the "
                f"optimizer after the move:\n"
                f"    model = model.to(device)\n"
                f"    optimizer = torch.optim.AdamW(model.parameters(), lr=...)"
            )


def _check_arguments(optimizer: Any, max_grad_norm: Any, scaler: Any) -> None:
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (with param_groups and step()), "
            f"but given {optimizer!r} of type {type(optimizer).__name__}"
        )
    if max_grad_norm is not None and not (
        isinstance(max_grad_norm, (int, float)) and not isinstance(max_grad_norm, bool) and max_grad_norm > 0
    ):
        raise ValueError(f"max_grad_norm must be a positive number or None, but given {max_grad_norm!r}")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise TypeError(
            f"scaler must be a torch.amp.GradScaler (or tpu_utility.grad_scaler(...)) or None, "
            f"but given {scaler!r} of type {type(scaler).__name__}"
        )


def step_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    scaler: torch.amp.GradScaler | None = None,
    barrier: bool | None = None,
    max_grad_norm: float | None = None,
    optimizer_args: dict[str, Any] | None = None,
) -> Any:
    """Steps the optimizer; on XLA it first averages gradients over all replicas.

    Off XLA this is exactly ``optimizer.step()`` (after the optional clip), or
    ``scaler.step(optimizer); scaler.update()`` with a scaler.

    On XLA it also cuts the lazy graph after the step, so a hand-written loop
    compiles its step once. Inside ``device_loader``, which cuts the graph at each
    batch too, the loader then skips its cut: one cut per step either way.

    Args:
        optimizer: The optimizer built on the model's (device) parameters.
        scaler: A ``torch.amp.GradScaler`` (a real one for CUDA fp16, or the
            pass-through from ``grad_scaler``). With an enabled scaler this does
            ``scaler.step(optimizer)`` and ``scaler.update()``: delete your
            ``scaler.update()`` line. Gradients are all-reduced before they are
            unscaled, so every replica sees the same inf/NaN check and skips alike.
        barrier: Cut and run the lazy XLA graph after the step
            (``torch_xla.sync()``). None (the default) means True on XLA; False
            leaves the cut to torch_xla's own MpDeviceLoader. Ignored off XLA.
        max_grad_norm: Clip the total gradient norm to this value, after the
            all-reduce (and after unscaling) so every replica clips the same gradients.
        optimizer_args: Keyword arguments for ``optimizer.step``.

    Returns:
        Whatever ``optimizer.step`` returns.

    Raises:
        TypeError: ``optimizer`` is not an optimizer, or ``scaler`` not a GradScaler.
        ValueError: ``max_grad_norm`` is not a positive number.
        RuntimeError: XLA is in use but the optimizer's parameters are on the
            CPU (it was built before ``model.to(device)``).

    Example:
        >>> loss.backward()                    # doctest: +SKIP
        >>> # was: optimizer.step()
        >>> step_optimizer(optimizer)          # doctest: +SKIP
    """
    _check_arguments(optimizer, max_grad_norm, scaler)
    xla_params = on_xla(optimizer)
    scaling = scaler is not None and scaler.is_enabled()
    if xla_params:
        backend.reduce_gradients(optimizer)
    if max_grad_norm is not None:
        if scaling:
            scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(_parameters(optimizer), max_grad_norm)  # it skips those without grads
    if scaling:
        result = scaler.step(optimizer, **(optimizer_args or {}))
        scaler.update()
    else:
        result = optimizer.step(**(optimizer_args or {}))
    if xla_params and barrier is not False:
        backend.sync()
        backend.skip_next_loader_sync()  # a device_loader's next batch need not cut the graph again
    return result
