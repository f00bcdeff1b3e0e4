"""find_lr(): an exponential learning-rate sweep that leaves the model as it was."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from . import xla
from .data import train_loader, unpack_loader
from .device import get_device, move_model
from .fit import _device_batches, _split_xy, resolve_optimizer


@dataclass
class LRFinderResult:
    """The sweep: learning rates, smoothed losses and a suggested ``max_lr``."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    suggested_lr: float = math.nan
    diverged: bool = False

    def plot(self, path: str | None = None) -> Any:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot(self.lrs, self.losses)
        ax.axvline(self.suggested_lr, color="tab:red", linestyle="--", label=f"suggested {self.suggested_lr:.1e}")
        ax.set(xscale="log", xlabel="learning rate", ylabel="smoothed loss", title="LR finder")
        ax.legend()
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig


def suggest_lr(lrs: list[float], losses: list[float]) -> float:
    """A tenth of the learning rate at the smoothed loss's minimum (a safe max_lr)."""
    if not losses:
        raise ValueError("the sweep recorded no loss; give more data or a larger num_steps")
    best = min(range(len(losses)), key=losses.__getitem__)
    return lrs[best] / 10


def find_lr(
    model: nn.Module,
    train_data: Any,
    *,
    loss_fn: Callable | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    batch_size: int | None = None,
    start_lr: float = 1e-7,
    end_lr: float = 10.0,
    num_steps: int = 100,
    smooth: float = 0.98,
    diverge_factor: float = 4.0,
    read_every: int = 10,
    seed: int = 0,
) -> LRFinderResult:
    """Sweeps the learning rate from ``start_lr`` to ``end_lr`` exponentially.

    Losses stay on the device and are read every ``read_every`` steps in one
    transfer; the sweep stops once the smoothed loss exceeds ``diverge_factor``
    times its minimum. The model's weights are restored afterwards.

    Returns:
        LRFinderResult with ``lrs``, smoothed ``losses``, ``suggested_lr`` and ``plot()``.

    Example:
        >>> # was: an lr_finder from another library, or guessing
        >>> result = find_lr(model, train_ds)                 # doctest: +SKIP
        >>> one_cycle_fit(model, train_ds, epochs=5, max_lr=result.suggested_lr)  # doctest: +SKIP
    """
    if not 0 < start_lr < end_lr:
        raise ValueError(f"need 0 < start_lr < end_lr, but given start_lr={start_lr}, end_lr={end_lr}")
    if num_steps < 2:
        raise ValueError(f"num_steps must be at least 2, but given {num_steps}")
    dataset, bs, collate, _ = unpack_loader(train_data, batch_size, "train_data")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    make_opt, _ = resolve_optimizer(optimizer)

    device = get_device()
    move_model(model, device)
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.manual_seed(seed)
    opt = make_opt(model.parameters())
    loader = train_loader(dataset, bs, replicas=1, rank=0, seed=seed, collate_fn=collate, num_workers=0)
    ratio = (end_lr / start_lr) ** (1 / (num_steps - 1))
    result = LRFinderResult()
    pending: list[tuple[float, torch.Tensor]] = []
    avg, best, step = 0.0, math.inf, 0
    model.train()
    try:
        while step < num_steps and not result.diverged:
            loader.sampler.set_epoch(step)
            for batch in _device_batches(loader, device, None):
                lr = start_lr * ratio**step
                for group in opt.param_groups:
                    group["lr"] = lr
                x, y = _split_xy(batch, "find_lr")
                loss = loss_fn(model(x).float(), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                pending.append((lr, loss.detach()))
                step += 1
                if len(pending) == read_every or step == num_steps:
                    values = xla.to_cpu([torch.stack([t for _, t in pending])])[0].tolist()
                    for (lr_i, _), value in zip(pending, values):
                        if not math.isfinite(value):
                            result.diverged = True
                            break
                        avg = smooth * avg + (1 - smooth) * value
                        smoothed = avg / (1 - smooth ** (len(result.losses) + 1))
                        result.lrs.append(lr_i)
                        result.losses.append(smoothed)
                        best = min(best, smoothed)
                        if smoothed > diverge_factor * best:
                            result.diverged = True
                            break
                    pending.clear()
                if step >= num_steps or result.diverged:
                    break
    finally:
        model.load_state_dict(saved)
        opt.zero_grad(set_to_none=True)
    result.suggested_lr = suggest_lr(result.lrs, result.losses)
    return result
