"""step_optimizer(): the line that replaces ``optimizer.step()``."""

from __future__ import annotations

from typing import Any

import torch

from . import xla


def _parameters(optimizer: Any) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def step_optimizer(
    optimizer: torch.optim.Optimizer,
    *,
    barrier: bool | None = None,
    max_grad_norm: float | None = None,
    optimizer_args: dict[str, Any] | None = None,
) -> Any:
    """Steps the optimizer; on XLA it first averages gradients over all replicas.

    Off XLA this is exactly ``optimizer.step()`` (after the optional clip).

    Args:
        optimizer: The optimizer built on the model's (device) parameters.
        barrier: Whether to cut and run the lazy XLA graph after the step
            (``torch_xla.sync()``). None chooses: True with one replica, as a
            hand-written single-core loop needs (otherwise the graph grows every
            step); False with several replicas, where torch_xla's MpDeviceLoader
            cuts the graph at each batch. Ignored off XLA.
        max_grad_norm: Clip the total gradient norm to this value, after the
            all-reduce so every replica clips the same gradients.
        optimizer_args: Keyword arguments for ``optimizer.step``.

    Returns:
        Whatever ``optimizer.step`` returns.

    Raises:
        TypeError: ``optimizer`` is not an optimizer.
        ValueError: ``max_grad_norm`` is not a positive number.

    Example:
        >>> loss.backward()                    # doctest: +SKIP
        >>> # was: optimizer.step()
        >>> step_optimizer(optimizer)          # doctest: +SKIP
    """
    if not (hasattr(optimizer, "param_groups") and callable(getattr(optimizer, "step", None))):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer (with param_groups and step()), "
            f"but given {optimizer!r} of type {type(optimizer).__name__}"
        )
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None, but given {max_grad_norm!r}")
    params = _parameters(optimizer)
    on_xla = any(p.device.type == "xla" for p in params)
    if on_xla:
        xla.reduce_gradients(optimizer)
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_grad_norm)
    result = optimizer.step(**(optimizer_args or {}))
    if on_xla and (barrier if barrier is not None else xla.world_size() == 1):
        xla.sync()
    return result
