"""One training step traced on fake tensors: the bytes a chip holds at the step's peak, measured, not estimated.

    step = trace_step(model, tokens=(16, 1024), optimizer="adamw", precision="bf16", checkpointing=False)
    step.peak, step.saved, step.seconds

The model is copied onto fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes and dtypes, no
storage), so a 7B model on the ``meta`` device traces on a laptop. One step (forward, the model's own loss or ``ChunkedLoss``'s,
backward, the optimizer's step) runs after a first optimizer step has made the optimizer's state, under torch's
own tracker (``torch.distributed._tools.mem_tracker.MemTracker``), which records every storage alive at each op
and keeps the peak. Autocast, the attention implementation and per-block checkpointing are the run's. The trace
runs on the CPU's kernels (a fake CUDA tensor needs a CUDA driver), so it measures what the CPU's autocast and
attention kernels keep, which is what ``memory_plan`` reports and what the CPU tests compare with.

A traced step runs a backward on the CPU, which must not come before the XLA runtime starts in a process that
will train on XLA (pytorch/xla#4174), so there it traces only once the runtime runs (``setup_tpu()``).
Where it cannot run (a model that is not a transformers causal LM, a torch without the tracker, an op fake
tensors cannot run) ``TraceUnavailable`` says why, and ``memory_plan`` falls back to its formulas.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .. import backend
from ..huggingface import base_model, is_causal_lm
from ..sharding import block_classes
from .optimizers import named_optimizer
from .precision import Precision


class TraceUnavailable(RuntimeError):
    """A step that cannot be traced here; the message says why (``memory_plan`` prints it beside its estimate)."""


@dataclass(frozen=True)
class TracedStep:
    """What one traced training step held at its two peaks, and what backward kept.

    The step has two phases, each with its own peak: forward and backward (``backward_peak``: parameters,
    optimizer state, the gradients made by then, ``backward_gradients``, and the activations and temporaries),
    and the optimizer's step (``optimizer_peak``: parameters, all gradients, optimizer state and the step's
    temporaries). ``parameters``/``gradients``/``optimizer_state``: the tracker's counts of the model's state
    (frozen weights and buffers among the parameters). ``saved``: the bytes autograd saved for backward in the
    forward (each storage once, the parameters left out; with checkpointing, the blocks' inputs the checkpoints
    keep). ``device``: the fake device traced on.
    """

    backward_peak: int
    backward_gradients: int
    optimizer_peak: int
    parameters: int
    gradients: int
    optimizer_state: int
    saved: int
    device: str
    seconds: float

    @property
    def peak(self) -> int:
        """Every live byte at the step's peak: the larger of its two phases'."""
        return max(self.backward_peak, self.optimizer_peak)

    @property
    def activations(self) -> int:
        """Forward and backward's peak less the parameters, optimizer state and gradients held there."""
        return self.backward_peak - self.parameters - self.optimizer_state - self.backward_gradients

    @property
    def temporaries(self) -> int:
        """The optimizer step's peak less the parameters, gradients and optimizer state."""
        return max(0, self.optimizer_peak - self.parameters - self.optimizer_state - self.gradients)


def trace_step(
    model: nn.Module,
    *,
    tokens: tuple[int, int],
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    precision: str | Precision = "fp32",
    checkpointing: bool = False,
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None,
) -> TracedStep:
    """Traces one training step of ``model`` on fake tensors and returns the bytes it held at its peak.

    The model is only read (a fake copy is traced; it may live on ``meta``). A transformers causal LM gets a
    ``tokens`` (rows x length) batch of token ids as its ``input_ids`` and ``labels``, and its own loss, as
    ``one_cycle_fit`` trains it. ``checkpointing`` recomputes each block (``block_classes``) in backward, as
    ``strategy="fsdp"`` does; the model's own ``gradient_checkpointing_enable()`` is kept as it is.

    Args:
        model: A transformers causal LM (a peft model around one included), on any device.
        tokens: ``(batch_size, seq_len)``: rows per chip and tokens per row.
        optimizer: "adamw", "adam", "sgd" (momentum 0.9), or a factory of parameters (a class, a partial).
        precision: "fp32", "bf16" or "fp16" (autocast, the weights in their own dtype).
        checkpointing: Checkpoint each block.
        loss: ``(model, token_ids) -> loss`` in place of the model's own (``ChunkedLoss.traced_loss()``: the
            head and the cross-entropy over chunks of tokens), or None.

    Returns:
        A ``TracedStep``: ``.peak``, ``.activations``, ``.saved`` bytes and the seconds the trace took.

    Raises:
        TraceUnavailable: the model is not a causal LM, this torch has no ``MemTracker``, or an op failed on
            fake tensors (its message names the op).

    Example:
        >>> # was: run one step on the chip and read torch.cuda.max_memory_allocated()
        >>> step = trace_step(model, tokens=(8, 1024), precision="bf16")   # doctest: +SKIP
        >>> step.peak / 1e9                                                       # doctest: +SKIP
    """
    if not is_causal_lm(model):
        raise TraceUnavailable(f"{type(model).__name__} is not a transformers causal LM (no token batch to trace)")
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as error:  # torch without the tracker, or without torch.distributed
        raise TraceUnavailable(f"torch {torch.__version__} has no MemTracker ({error})") from None
    if backend.XLA_INSTALLED and backend.xla_requested() and not backend.runtime_started():
        raise TraceUnavailable("a traced step's backward before the XLA runtime starts would leave autograd no queue "
                               "for XLA devices in this process (pytorch/xla#4174); setup_tpu() first traces it")
    precision = Precision.named(precision)
    start = time.perf_counter()
    vocab = _vocab(model)
    try:
        with FakeTensorMode():
            fake = _fake_copy(model).train()  # as one_cycle_fit trains it: dropout's masks kept, say
            if checkpointing:
                _checkpoint_blocks(fake)
                config = getattr(base_model(fake), "config", None)  # the copy's own: as strategy="fsdp" does, no
                if getattr(config, "use_cache", False):  # KV cache, where a recomputed block would append to it
                    config.use_cache = False
            ids = torch.randint(0, vocab, tokens)
            opt = _optimizer(optimizer, fake)
            _make_state(fake, opt)
            tracker = MemTracker()
            tracker.track_external(fake, opt)
            saved = _Saved(fake)
            with tracker:  # forward and backward: the peak of the activations
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, _unpack), saved.blocks(checkpointing):
                    with _autocast(precision):
                        loss = fake(input_ids=ids, labels=ids).loss if loss is None else loss(fake, ids)
                loss.backward()
            backward = _by_kind(tracker.get_tracker_snapshot("peak"))
            with tracker:  # entered again: the peak starts afresh, from what is live now (the gradients); the step's
                opt.step()  # temporaries count as optimizer state there, so the state is read from the first phase
            optimizer = _by_kind(tracker.get_tracker_snapshot("peak"))
            opt.zero_grad()
    except TraceUnavailable:
        raise
    except Exception as error:  # an op fake tensors cannot run: the plan falls back to its formulas and says why
        raise TraceUnavailable(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}") from None
    return TracedStep(backward_peak=backward["Total"], backward_gradients=backward.get("Gradient", 0),
                      optimizer_peak=optimizer["Total"],
                      parameters=backward.get("Parameter", 0) + backward.get("Buffer", 0),
                      gradients=optimizer.get("Gradient", 0), optimizer_state=backward.get("Optstate", 0),
                      saved=saved.total, device="cpu", seconds=time.perf_counter() - start)  # fmt: skip


def _by_kind(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """The tracker's snapshot of its (one, fake CPU) device, keyed by the kinds' names ("Total", "Gradient"...)."""
    counts = max(snapshot.values(), key=lambda kinds: kinds.get("Total", 0))
    return {getattr(kind, "value", kind): size for kind, size in counts.items()}


def _vocab(model: nn.Module) -> int:
    config = getattr(base_model(model), "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if not vocab:
        raise TraceUnavailable(f"{type(model).__name__}'s config gives no vocab_size")
    return vocab


def _fake_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are fake CPU tensors of the same shapes and dtypes
    (made under the active ``FakeTensorMode``): nothing of the model's own storage is read or copied."""
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in memo:
            continue
        empty = torch.empty(tensor.shape, dtype=tensor.dtype)
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    fake = copy.deepcopy(model, memo)
    for module in fake.modules():  # frozen weights as buffers: the tracker hooks every parameter's gradient
        for name, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad:
                del module._parameters[name]
                module._buffers[name] = param
    return fake


def _checkpoint_blocks(model: nn.Module) -> None:
    """Each block of the class FSDP wraps recomputed in backward, as ``strategy="fsdp"`` checkpoints them."""
    from ..backend.base import Backend  # torch's own checkpoint: the trace runs on CPU kernels

    compute = Backend().compute
    for module in model.modules():
        if isinstance(module, block_classes(model)):
            compute.checkpoint_module(module)


def _optimizer(optimizer: Any, model: nn.Module) -> torch.optim.Optimizer:
    trainable = [p for p in model.parameters() if p.requires_grad]
    if isinstance(optimizer, str):
        return named_optimizer(optimizer).factory(trainable, lr=1e-3)
    made = optimizer(trainable)
    if not isinstance(made, torch.optim.Optimizer):
        raise TraceUnavailable(f"the optimizer factory gave {type(made).__name__}, not a torch.optim.Optimizer")
    return made


def _make_state(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """The optimizer's state made by a first step on zero gradients, as a run's second step finds it."""
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _autocast(precision: Precision) -> Any:
    if precision.name == "fp32":
        return torch.autocast("cpu", enabled=False)
    return torch.autocast("cpu", dtype=precision.dtype)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _Saved:
    """Sums the bytes autograd saves for backward, each storage once, the parameters left out; with
    checkpointing, the blocks' inputs (what a checkpoint keeps in place of the block's saved tensors)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
        self.seen: set[int] = set()
        self.total = 0

    def add(self, tensor: Any) -> None:
        if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            if storage._cdata not in self.params and storage._cdata not in self.seen:
                self.seen.add(storage._cdata)
                self.total += storage.nbytes()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor

    def blocks(self, checkpointing: bool) -> Any:
        from contextlib import ExitStack

        stack = ExitStack()
        if checkpointing:
            for module in self.model.modules():
                if isinstance(module, block_classes(self.model)):
                    handle = module.register_forward_pre_hook(self._inputs, with_kwargs=True)
                    stack.callback(handle.remove)
        return stack

    def _inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        for value in [*args, *kwargs.values()]:
            self.add(value)


__all__ = ["trace_step", "TracedStep", "TraceUnavailable"]
