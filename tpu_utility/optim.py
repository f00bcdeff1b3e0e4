"""step_optimizer(): the line that replaces ``optimizer.step()`` (and ``scaler.step(optimizer)``)."""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

from . import backend
from .sharding import refuse_replaced

# Optimizers already checked, with the layout of their parameter groups when checked and
# whether their parameters are on XLA: both cost a pass over the parameters, so they run
# once per optimizer (again only if its groups change), not every step.
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Several processes off XLA: whether step_optimizer averages an optimizer's gradients, decided at
# its first step whose gradients tell (see _averages), with the layout of the groups it was for.
_AVERAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Two replicas' gradient figures closer than this (relative) are the same gradients: the figures
# are float32 reductions, which another thread count moves by ~1e-7; another batch moves them by
# far more (about 1/sqrt(batch)).
_SAME_GRADIENTS_RTOL = 1e-5


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
    refuse_replaced(params)  # built before shard_model moved the model: said by name
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


def _gradient_figures(params: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This replica's [tensors, values // 2**20, values % 2**20, gradients, sum of |g_i|, sum of i * |g_i|].

    Replicas whose gradients were already averaged (DDP) hold the same gradients and so the
    same figures; replicas that each hold their own batch's gradients do not. float32 on
    ``device`` (MPS and TPUs have no float64), the counts split to stay exact.
    """
    norms = torch.zeros(len(params), dtype=torch.float32, device=device)
    for i, p in enumerate(params):
        if p.grad is not None:
            g = p.grad.detach()
            g = g.coalesce().values() if g.is_sparse else g
            low = g.dtype in (torch.float16, torch.bfloat16)  # a float16 norm past 65504 would read inf
            norms[i] = torch.linalg.vector_norm(g, dtype=torch.float32 if low else None).to(device)
    place = torch.arange(1, len(params) + 1, dtype=torch.float32, device=device)
    values = sum(p.numel() for p in params)
    counts = [len(params), values >> 20, values & (2**20 - 1), sum(p.grad is not None for p in params)]
    head = torch.tensor(counts, dtype=torch.float32, device=device)
    return torch.cat([head, norms.sum().view(1), (place * norms).sum().view(1)])


def _decide_averaging(optimizer: Any, chosen: backend.Backend) -> bool | None:
    """Compares the replicas' gradients (one all_gather): True if they differ, False if they agree,
    None if this step cannot tell (an overflow under a GradScaler, or no gradients yet).

    Every replica sees the same gathered figures, so every replica decides alike.
    """
    params = [p for p in _parameters(optimizer) if p.requires_grad]
    figures = _gradient_figures(params, chosen.devices.device()).unsqueeze(0)
    rows = chosen.processes.all_gather([figures])[0].cpu().double()
    world = len(rows)
    shapes = rows[:, :3]
    if (shapes != shapes[0]).any():
        held = "; ".join(f"rank {r}: {int(n)} tensors, {int(high) * 2**20 + int(low):,} values"
                         for r, (n, high, low) in enumerate(shapes.tolist()))  # fmt: skip
        raise RuntimeError(
            f"step_optimizer: the {world} processes' optimizers hold different trainable parameters ({held}), so "
            f"they are not replicas of one model and their gradients cannot be averaged. Build the same model "
            f"and optimizer in every process; to train a separate model in each process, call optimizer.step() "
            f"there instead (step_optimizer averages over the processes)."
        )
    figures = rows[:, 4:]
    if not torch.isfinite(figures).all() or not figures.any():
        return None
    same = bool((rows[:, 3] == rows[0, 3]).all()) and torch.allclose(
        figures, figures[:1].expand_as(figures), rtol=_SAME_GRADIENTS_RTOL, atol=0.0
    )
    if not same and chosen.processes.rank() == 0:
        warnings.warn(
            f"step_optimizer: the {world} processes' gradients differ and nothing averaged them (the model is not "
            f"in DistributedDataParallel), so step_optimizer averages them at every step from now on: the "
            f"processes train one model, as on XLA. DistributedDataParallel(model) is faster (it averages "
            f"during the backward), and step_optimizer then leaves the gradients alone.",
            stacklevel=4,
        )
    return not same


def _averages(optimizer: Any) -> bool:
    """Whether this step averages the gradients over the processes: a multi-process run off XLA
    whose gradients differ (nobody averaged them: the model is not in DDP).

    The first step whose gradients tell decides, once per optimizer (again if its groups
    change); a step that cannot tell averages, to be safe, and the next one looks again.
    One process, or XLA (whose step always averages): False, with no collective.
    """
    chosen = backend.current()
    if chosen.lazy or chosen.processes.world_size() == 1:
        return False
    layout = _group_layout(optimizer)
    known = _AVERAGING.get(optimizer)
    if known is not None and known[0] == layout:
        return known[1]
    # sharded parameters (FSDP2): their gradients were reduce-scattered to the mean during the backward
    differ = False if chosen.sharding.sharded(_parameters(optimizer)) else _decide_averaging(optimizer, chosen)
    if differ is None:
        return True
    try:
        _AVERAGING[optimizer] = (layout, differ)
    except TypeError:  # not weak-referenceable: compared every step
        pass
    return differ


def _unscaled(scaler: torch.amp.GradScaler, optimizer: Any) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` already ran in this step (torch keeps it in a private dict)."""
    stage = getattr(scaler, "_per_optimizer_states", {}).get(id(optimizer), {}).get("stage")
    return getattr(stage, "name", None) == "UNSCALED"


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
    """Steps the optimizer; with several replicas it first averages their gradients.

    One process: this is exactly ``optimizer.step()`` (after the optional clip),
    or ``scaler.step(optimizer); scaler.update()`` with a scaler.

    Several processes (``launch``, a ``torchrun`` job, one per XLA core) are
    replicas of one model: each holds its own batch's gradients, and the step
    averages them first, so every replica takes the same step and the weights
    stay equal. On XLA this is ``xm.reduce_gradients`` at every step. Elsewhere
    (``torch.distributed``: gloo on the CPU, nccl on CUDA) the first step compares
    the replicas' gradients (one small all_gather): equal gradients were already
    averaged (the model is in ``DistributedDataParallel``, which averages during
    the backward) and nothing more is done; different ones are averaged at every
    step from then on (one all-reduce; said once, since DDP is the faster way).

    Clip with ``max_grad_norm``, which clips the averaged gradients: a
    ``clip_grad_norm_`` of your own before this call clips each replica's own
    (as before ``xm.optimizer_step``); inside DDP it is right as it is.

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
            CPU (it was built before ``model.to(device)``); the processes'
            optimizers hold different parameters; or ``scaler.unscale_(optimizer)``
            ran before gradients that this step averages (use ``max_grad_norm``).

    Example:
        >>> loss.backward()                    # doctest: +SKIP
        >>> # was: optimizer.step()
        >>> step_optimizer(optimizer)          # doctest: +SKIP
    """
    _check_arguments(optimizer, max_grad_norm, scaler)
    return take_step(optimizer, True if on_xla(optimizer) else None, scaler, barrier, max_grad_norm, optimizer_args)


def take_step(optimizer: torch.optim.Optimizer, reduce: bool | None, scaler: torch.amp.GradScaler | None,
              barrier: bool | None, max_grad_norm: float | None, optimizer_args: dict[str, Any] | None) -> Any:  # fmt: skip
    """``step_optimizer`` less its checks, for a loop that checked its arguments once, before its first
    step: nothing is asked again at every step.

    ``reduce``: True for an optimizer on XLA (``on_xla(optimizer)``: its gradients reduced over the
    cores, the graph cut after the step), False for a process that trains alone (world size 1: no
    other gradients to average), None to average only where other processes' gradients differ.
    """
    scaling = scaler is not None and scaler.is_enabled()
    if reduce:
        backend.reduce_gradients(optimizer)
    elif reduce is None and _averages(optimizer):
        if scaling and _unscaled(scaler, optimizer):
            raise RuntimeError(
                f"step_optimizer: scaler.unscale_(optimizer) ran before step_optimizer, on this process's own "
                f"gradients, which step_optimizer averages over the {backend.world_size()} processes: their inf "
                f"checks would disagree (one process skips the step, another steps with inf) and the replicas "
                f"would part. Delete the unscale_ and clip_grad_norm_ lines and pass max_grad_norm= to "
                f"step_optimizer (it averages, unscales, then clips), or wrap the model in DistributedDataParallel."
            )
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
    if reduce and barrier is not False:
        backend.sync()
        backend.skip_next_loader_sync()  # a device_loader's next batch need not cut the graph again
    return result
