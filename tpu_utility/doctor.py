"""doctor(): run a few steps of your own training step and say, in plain words,
what makes it slow or wrong on XLA, and how to fix it.

It counts, after warm-up and with torch_xla's metrics cleared:

* graph compilations per step (and which input shapes changed between steps);
* host syncs per step, with the line of your code that caused each;
* ops that fell back to the host CPU;

and checks, before running:

* that the optimizer holds the model's parameters (not copies left on the CPU
  because it was built before ``model.to(device)``);
* that weights which look tied are still one tensor after the move;
* that the batch divides across the cores in use.
"""

from __future__ import annotations

import contextlib
import itertools
import linecache
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Literal

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import xla
from .optim import step_optimizer

Kind = Literal["recompile", "host_sync", "cpu_fallback", "optimizer_params", "tied_weights", "batch_split"]
_OWN_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.rpartition(".")[0]])
    if getattr(m, "__file__", None)
)
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__")


@dataclass
class Finding:
    """One problem: what it is, where it comes from, and what to change."""

    kind: Kind
    message: str
    fix: str
    where: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"[{self.kind}] {self.message}"]
        lines += [f"    at {w}" for w in self.where]
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


@dataclass
class DoctorReport:
    """What doctor measured, and its findings; ``clean`` when there are none."""

    steps: int
    warmup: int
    compiles_per_step: float
    host_syncs_per_step: float
    fallback_ops: list[str]
    findings: list[Finding] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def __str__(self) -> str:
        head = (
            f"doctor: {self.steps} steps after {self.warmup} warm-up: {self.compiles_per_step:.2f} compiles/step, "
            f"{self.host_syncs_per_step:.2f} host syncs/step, CPU fallbacks: {', '.join(self.fallback_ops) or 'none'}"
        )
        if self.clean:
            return head + "\nclean: no recompiles, no host syncs, no CPU fallbacks, the optimizer owns the " \
                          "model's parameters, no split ties, the batch divides across the cores."  # fmt: skip
        return "\n".join([head, *map(str, self.findings)])

    def _repr_markdown_(self) -> str:
        return "```\n" + str(self) + "\n```"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython's plain-text display
        printer.text(str(self))


# ------------------------------------------------------------ static checks
def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> Finding | None:
    """The optimizer must update the model's own (device) parameters."""
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stray = [p for p in params if id(p) not in own]
    if not stray:
        return None
    model_device = next(model.parameters()).device
    return Finding(
        "optimizer_params",
        f"{len(stray)} of the optimizer's {len(params)} parameters are not the model's (they are on "
        f"{stray[0].device}, the model on {model_device}): optimizer.step() updates copies and the model "
        f"does not learn. The optimizer was built before model.to(device).",
        "build the optimizer after the move: model.to(device); optimizer = AdamW(model.parameters())",
    )


def check_ties(model: nn.Module) -> Finding | None:
    """Distinct parameters of one shape with identical, non-constant values look like split ties."""
    by_shape: dict[tuple[int, ...], list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters():
        if p.numel() > 1 and p.dim() >= 2:
            by_shape.setdefault(tuple(p.shape), []).append((name, p))
    pairs = []
    for group in by_shape.values():
        for (name_a, a), (name_b, b) in itertools.combinations(group, 2):
            with torch.no_grad():
                if torch.equal(a, b) and not torch.equal(a, a.flatten()[0].expand_as(a)):
                    pairs.append(f"{name_a} == {name_b}")
    if not pairs:
        return None
    return Finding(
        "tied_weights",
        f"{len(pairs)} pair(s) of parameters hold identical values but are separate tensors: tied weights "
        f"that model.to(device) split apart, so they will now train independently",
        "re-tie after the move (model.out.weight = model.emb.weight), or move with "
        "tpu_utility.device.move_model(model, device), which keeps ties",
        where=pairs,
    )


def check_batch_split(batch: Any, cores: int) -> Finding | None:
    sizes = [t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if cores <= 1 or not sizes or sizes[0] % cores == 0:
        return None
    return Finding(
        "batch_split",
        f"the batch has {sizes[0]} samples, which does not divide across {cores} cores",
        f"use a batch size that is a multiple of {cores} (for example {sizes[0] // cores * cores or cores})",
    )


# --------------------------------------------------------- host-sync tracing
def _user_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_OWN_DIRS) or f"{os.sep}torch_xla{os.sep}" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    return f"{frame.f_code.co_filename}:{frame.f_lineno}: {code}" if code else f"{frame.f_code.co_filename}:{frame.f_lineno}"


@contextlib.contextmanager
def _trace_reads(calls: Counter) -> Iterator[None]:
    """Records the user line of every read of an XLA tensor's value (outermost call only)."""
    state = threading.local()
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    own = {name for name in _READS if name in torch.Tensor.__dict__}

    def wrap(name: str, original: Callable) -> Callable:
        def traced(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.device.type == "xla" and not getattr(state, "inside", False):
                calls[(name, _user_frame())] += 1
                state.inside = True
                try:
                    return original(self, *args, **kwargs)
                finally:
                    state.inside = False
            return original(self, *args, **kwargs)

        return traced

    for name, original in originals.items():
        setattr(torch.Tensor, name, wrap(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            if name in own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # inherited from TensorBase; nothing of ours stays


# ---------------------------------------------------------------- the entry
def _default_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss_fn: Callable) -> Callable:
    device = next(model.parameters()).device

    def step(batch: Any) -> None:
        x, y = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, tuple(batch))
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        step_optimizer(optimizer)

    return step


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def doctor(
    step: Callable[[Any], Any] | nn.Module,
    batch: Any = None,
    *,
    batches: Iterable[Any] | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable | None = None,
    steps: int = 4,
    warmup: int = 2,
    cores: int | None = None,
) -> DoctorReport:
    """Runs your training step a few times and reports what slows or breaks it on XLA.

    Args:
        step: Your step, ``step(batch)`` (forward, backward, optimizer step), or
            a model, for which doctor runs ``loss_fn(model(x), y)``, backward and
            ``step_optimizer(optimizer)``.
        batch: One batch, used for every step.
        batches: Or several batches (a list or a DataLoader), used in turn; this
            is how shape changes between steps show up.
        model, optimizer: Enable the optimizer and tied-weight checks (needed when
            ``step`` is a callable; ``step`` itself when it is a model).
        loss_fn: For the model form; default ``nn.CrossEntropyLoss()``.
        steps: Steps measured after warm-up.
        warmup: Steps run first (the first steps compile by design).
        cores: Cores the batch is split over; default the cores in use.

    Returns:
        DoctorReport: figures per step and findings, each with a fix;
        ``report.clean`` is True when there is nothing to fix.

    Example:
        >>> # was: a loop that ran 10x slower on TPU than on GPU, and no idea why
        >>> report = doctor(train_step, batches=[next(it) for _ in range(6)],   # doctest: +SKIP
        ...                 model=model, optimizer=optimizer)
        >>> print(report)                                                      # doctest: +SKIP
    """
    if isinstance(step, nn.Module):
        model = step
        if optimizer is None:
            raise TypeError("doctor(model, ...) needs optimizer=...; or pass your own step(batch) callable")
        step = _default_step(model, optimizer, loss_fn or nn.CrossEntropyLoss())
    elif not callable(step):
        raise TypeError(f"step must be a callable step(batch) or an nn.Module, but given {step!r}")
    if (batch is None) == (batches is None):
        raise ValueError("give exactly one of batch= (one batch, reused) or batches= (several, used in turn)")
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, but given steps={steps}, warmup={warmup}")
    pool = [batch] if batch is not None else list(itertools.islice(iter(batches), warmup + steps))
    if not pool:
        raise ValueError("batches is empty")
    plan = list(itertools.islice(itertools.cycle(pool), warmup + steps))

    findings: list[Finding] = []
    if model is not None and optimizer is not None:
        findings.append(check_optimizer(model, optimizer))
    if model is not None:
        findings.append(check_ties(model))
    if cores is None:
        cores = xla.global_device_count() if xla.is_spmd() else xla.world_size()
    findings.append(check_batch_split(plan[0], cores))

    for b in plan[:warmup]:
        step(b)
        xla.sync()
    xla.wait_device_ops()
    xla.clear_metrics()
    reads: Counter = Counter()
    with _trace_reads(reads):
        for b in plan[warmup:]:
            step(b)
            xla.sync()
    xla.wait_device_ops()
    compiles = xla.compile_count()
    local_scalar = xla.host_sync_count()
    fallbacks = xla.fallback_ops()

    if compiles:
        shapes = [_shapes(b) for b in plan]
        changed = [
            f"step {i + 1}: input {j} {shapes[i - 1][j]} -> {shapes[i][j]}"
            for i in range(1, len(plan))
            for j in range(min(len(shapes[i]), len(shapes[i - 1])))
            if shapes[i][j] != shapes[i - 1][j]
        ]
        findings.append(Finding(
            "recompile",
            f"{compiles} graph compilation(s) in {steps} steps after warm-up"
            + (": input shapes changed between steps" if changed else ", with the same input shapes: a Python "
               "value that changes every step is baked into the graph, or the graph depends on data"),
            "keep shapes fixed: DataLoader(..., drop_last=True), pad variable lengths to a few fixed sizes"
            if changed else "pass changing values as device tensors, not Python numbers; avoid data-dependent "
                            "Python branches inside the step",
            where=changed,
        ))  # fmt: skip
    syncs = sum(reads.values())
    if syncs or local_scalar:
        where = [f"{n}x .{name}() {line}" for (name, line), n in sorted(reads.items(), key=lambda kv: -kv[1])]
        findings.append(Finding(
            "host_sync",
            f"{max(syncs, local_scalar) / steps:.2f} host sync(s) per step: each read of a device value waits "
            f"for the device and stalls the pipeline",
            "keep values on the device (running_loss += loss.detach()) and read them once per epoch",
            where=where,
        ))  # fmt: skip
    if fallbacks:
        findings.append(Finding(
            "cpu_fallback",
            f"{len(fallbacks)} op(s) have no XLA lowering and ran on the host CPU, copying tensors each way: "
            f"{', '.join(fallbacks)}",
            "replace them with ops XLA lowers (see the names), or compute them outside the step, once per epoch",
        ))  # fmt: skip
    return DoctorReport(
        steps=steps,
        warmup=warmup,
        compiles_per_step=compiles / steps,
        host_syncs_per_step=max(syncs, local_scalar) / steps,
        fallback_ops=fallbacks,
        findings=[f for f in findings if f is not None],
    )
