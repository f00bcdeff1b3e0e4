"""Memory plan: the bytes one chip needs to train a model, replicated and sharded, before anything compiles.

    plan = memory_plan(model, cores=8, batch_size=4, seq_len=1024, optimizer="adamw")
    print(plan)                       # a table: parameters, gradients, optimizer state, activations
    plan.fits_replicated, plan.fits_sharded

The model may live on the ``meta`` device (``with torch.device("meta"): AutoModelForCausalLM.from_config(cfg)``),
so a 7B plan costs no RAM. The math is plain functions of numbers (``optimizer_states``, from the one optimizer
table in ``optimizers.py``, ``shard_bytes``, ``activation_bytes``, ``host_bytes``), tested alone; the chip's memory comes from the backend (its hardware table,
the GPU's own, or ``TPU_UTILITY_DEVICE_MEMORY_GB``), the host's from ``/proc/meminfo`` (``MemAvailable``) or
``TPU_UTILITY_HOST_MEMORY_GB``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, get_args

import torch
from torch import nn

from .. import backend
from ..backend.hardware import memory_override, tpu_device_memory
from ..huggingface import base_model
from ..quantization import Int8Linear
from .precision import Precision, PrecisionName
from ..sharding import FSDP, largest_block
from .optimizers import optimizer_states
from .strategies import Spmd, Strategy, sharding_of
from .strategies.base import Column, shard_bytes
from .trace import TracedStep, TraceUnavailable, trace_step

# the share of a chip's memory a plan may fill: XLA's own buffers, fragmentation and the compiler's temporaries
# take the rest (generation's KV-cache check leaves the same)
HEADROOM = 0.9
# added to a step's peak: the allocator's rounding of each block and the kernels' workspaces (a traced step is
# 0.97-1.00 of a GPU's measured peak)
MARGIN = 0.04
GB = 1e9
PlanMethod = Literal["trace", "estimate"]  # how memory_plan finds the activations: a traced step, or the formulas
HOST_MEMORY_ENV = "TPU_UTILITY_HOST_MEMORY_GB"  # the host's available RAM in GiB, read in place of /proc/meminfo


# ----------------------------------------------------------------- pure math
def host_bytes(params: int, state: int, copies: int, checkpoints: bool) -> int:
    """Host RAM a sharded run needs at its peak: ``copies`` whole models before they are sharded (one per process
    that builds one), or, with checkpoints, the whole parameters and optimizer state a save gathers on the host.

    Example:
        >>> host_bytes(10, 20, 1, False), host_bytes(10, 20, 1, True), host_bytes(10, 20, 4, True)
        (10, 30, 40)
    """
    return max(copies * params, params + state if checkpoints else 0)


@dataclass(frozen=True)
class TransformerShape:
    """The sizes of a decoder stack that set its activations (a transformers config's names)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_width: int  # key/value heads x head size
    vocab: int

    @classmethod
    def of(cls, config: Any) -> TransformerShape | None:
        """From a transformers config (its text part), or None where it lacks a decoder's sizes."""
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        try:
            hidden, layers, heads = text.hidden_size, text.num_hidden_layers, text.num_attention_heads
        except AttributeError:
            return None
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv = (getattr(text, "num_key_value_heads", None) or heads) * head_dim
        inner = getattr(text, "intermediate_size", None) or 4 * hidden
        return cls(hidden, inner, layers, heads, kv, getattr(text, "vocab_size", 0) or 0)


def activation_bytes(shape: TransformerShape, tokens: int, itemsize: int, checkpointing: bool,
                     weights_itemsize: int = 4, loss_chunk: int | None = None) -> int:
    """The bytes a training step of a decoder saves for backward, for ``tokens`` = batch x seq_len (the fallback
    where a step cannot be traced; the weights' autocast copies are counted apart, by ``memory_plan``).

    Linear in the tokens: attention through sdpa/flash keeps its output and one log-sum-exp per head, not the
    ``seq x seq`` probabilities. Per token and layer: each norm's input and normalised value in the residual's
    dtype (``weights_itemsize``); the linear layers' inputs in the activation dtype (under autocast each of q, k,
    v, gate and up casts its own copy); q, k, v and the attention output; the MLP's gate, activation, up and
    product. With per-block checkpointing a layer keeps its input alone. At the loss: the final norm, the head's
    input, and the fp32 log-softmax of the logits (``vocab`` x 4 bytes), whatever the activation dtype; with a
    loss computed in chunks of ``loss_chunk`` tokens (``ChunkedLoss``), one chunk's log-softmax instead.
    Measured against ``saved_tensors_hooks`` on the CPU (Llama, GQA, Gemma) it is within 3%.

    Example:
        >>> s = TransformerShape(hidden=64, intermediate=256, layers=2, heads=4, kv_width=64, vocab=100)
        >>> activation_bytes(s, 32, 2, checkpointing=False) > activation_bytes(s, 32, 2, checkpointing=True)
        True
    """
    a, r, h = itemsize, weights_itemsize, shape.hidden
    inputs = 5 if a < r else 2  # autocast: q, k, v, gate and up each cast their input; else one per norm output
    per_layer = 4 * r * h + inputs * a * h + 2 * a * h + 2 * a * shape.kv_width + 4 * a * shape.intermediate + 4 * shape.heads
    kept = shape.layers * (r * h if checkpointing else per_layer)
    head = 2 * r * h + a * h + 16  # final norm, head input, token ids and targets
    logits = min(loss_chunk or tokens, tokens) * 4 * shape.vocab  # the fp32 log-softmax: all tokens', or a chunk's
    return tokens * (kept + head) + logits


def loss_bytes(tokens: int, vocab: int) -> int:
    """The loss's temporaries at a step's peak beyond what it saves: the logits upcast to fp32 and their fp32
    gradient, ``tokens x vocab x 4`` bytes each (what a large vocabulary costs; Gemma's 256k is most of a step).

    Example:
        >>> loss_bytes(8 * 1024, 256_000) / 1e9
        16.777216
    """
    return 2 * tokens * vocab * 4


# ---------------------------------------------------------------- the plan
@dataclass(frozen=True)
class Term:
    """One row of a plan: bytes per chip, replicated and sharded."""

    name: str
    replicated: int
    sharded: int


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per chip to train a model, replicated on every chip and sharded over ``cores``.

    ``checkpointing``: whether each column's step checkpoints its blocks (None without activations);
    ``if_checkpointed``: the activations each column would have with every block checkpointed (the formulas).
    ``terms``: parameters, gradients, optimizer state, activations and the allocator's margin (and, sharded,
    one block gathered). ``replicated``/``sharded``: their sums. ``device_memory``: one chip's bytes, or None
    where unknown (the CPU); ``fits_*`` compare with ``HEADROOM`` of it (True where unknown). ``method``: how
    the activations were found ("traced one step ...", "estimate (formulas): <why not traced>", or none).
    """

    terms: tuple[Term, ...]
    cores: int
    device_memory: int | None
    notes: tuple[str, ...] = ()
    method: str = "parameters, gradients and optimizer state only"
    checkpointing: tuple[bool, bool] | None = None  # (replicated, sharded) where activations are planned
    if_checkpointed: Term | None = None  # the activations with each block checkpointed (formulas), where planned

    @property
    def replicated(self) -> int:
        return sum(t.replicated for t in self.terms)

    @property
    def sharded(self) -> int:
        return sum(t.sharded for t in self.terms)

    @property
    def usable(self) -> float | None:
        return None if self.device_memory is None else HEADROOM * self.device_memory

    @property
    def fits_replicated(self) -> bool:
        return self.usable is None or self.replicated <= self.usable

    @property
    def fits_sharded(self) -> bool:
        return self.usable is None or self.sharded <= self.usable

    def term(self, name: str) -> Term:
        return next(t for t in self.terms if t.name == name)

    def dominant(self, sharded: bool = True) -> str:
        """The largest row's name (``sharded``: of the sharded column)."""
        return max(self.terms, key=lambda t: t.sharded if sharded else t.replicated).name

    def __str__(self) -> str:
        rows = [("", "replicated", f"sharded / {self.cores}")]
        rows += [(t.name, _gb(t.replicated), _gb(t.sharded)) for t in self.terms]
        rows.append(("total per chip", _gb(self.replicated), _gb(self.sharded)))
        if self.device_memory is not None:
            yes = lambda ok: "fits" if ok else "does not fit"  # noqa: E731
            rows.append((f"chip: {_gb(self.device_memory)} ({HEADROOM:.0%} usable)", yes(self.fits_replicated),
                         yes(self.fits_sharded)))  # fmt: skip
        widths = [max(len(r[k]) for r in rows) for k in range(3)]
        lines = [f"{r[0]:<{widths[0]}}  {r[1]:>{widths[1]}}  {r[2]:>{widths[2]}}" for r in rows]
        return "\n".join(lines + [f"  {note}" for note in (f"method: {self.method}", *self.notes)])

    def summary(self) -> str:
        """The plan in one line, as ``one_cycle_fit``'s summary says it: per chip replicated and sharded, and the
        chip's usable bytes."""
        usable = f" of {_gb(self.usable)} usable" if self.usable is not None else ""
        how = "traced" if self.method.startswith("traced") else "estimate" if self.method.startswith("estimate") \
            else "no activations"
        return (f"memory plan ({how}): {_gb(self.replicated)} replicated, {_gb(self.sharded)} sharded over "
                f"{self.cores}{usable} per chip")


def _gb(n: float) -> str:
    """Bytes in GB (10**9, as model sizes are quoted), or MB/kB below one GB."""
    for unit, size in (("GB", GB), ("MB", 1e6)):
        if n >= size or unit == "GB" and n == 0:
            return f"{n / size:.2f} {unit}"
    return f"{n / 1e3:.2f} kB"


def memory_plan(
    model: nn.Module,
    *,
    cores: int | str = "all",
    batch_size: int = 64,
    seq_len: int | None = None,
    optimizer: str | Callable[..., torch.optim.Optimizer] = "adamw",
    precision: PrecisionName | Precision = "fp32",
    checkpointing: bool | None = None,
    device_memory: int | float | str | None = None,
    fsdp: Any = None,
    method: PlanMethod = "trace",
    chunked_loss: Any = None,
) -> MemoryPlan:
    """Bytes per chip to train ``model``: replicated on every chip, and sharded (FSDP) over ``cores``.

    Parameters are counted in their own dtype (a bf16 model keeps bf16 weights), gradients and optimizer
    state for the trainable ones only (a LoRA model's adapters), in the same dtype, as torch keeps them.
    Activations are estimated for transformers decoders when ``seq_len`` is given (per chip: each holds
    ``batch_size`` rows in both columns); sharded, one block's parameters and gradients are gathered at a
    time and counted too. The model is only read: it may live on the ``meta`` device.

    Args:
        model: The model, on any device (``meta`` included); a peft model counts its trainable adapters.
        cores: Chips to shard over: an int, or "all" (the backend's devices, counted without starting it).
        batch_size: Rows per chip, as ``one_cycle_fit``'s ``batch_size`` (its default 64).
        seq_len: Tokens per row; None leaves activations out (noted in the table).
        optimizer: As ``one_cycle_fit`` takes it: "adamw" (two moments), "adam", "sgd" (momentum 0.9:
            one buffer), a class or a ``functools.partial`` of one.
        precision: "fp32" (activations in fp32) or "bf16"/"fp16" (activations in 16 bits; the weights
            stay in their own dtype, as autocast leaves them).
        checkpointing: Per-block gradient checkpointing in both columns. None: the run's own: replicated, the
            model's setting (``gradient_checkpointing_enable()``, or the ``GradientCheckpointing`` callback: give
            True); sharded, ``fsdp``'s (``strategy="fsdp"`` checkpoints each block unless ``FSDP(checkpoint=False)``).
        device_memory: One chip's bytes (16e9; less than a GB is refused as a unit slip), a size ("16GB",
            "16 GiB") or a TPU kind ("v5e", "v4", "v5p", "v6e"); None asks the backend (its hardware table,
            a GPU's own memory, or ``TPU_UTILITY_DEVICE_MEMORY_GB``).
        fsdp: The sharded run's options, as ``strategy=`` is given them: ``FSDP(...)`` (None: its defaults, which
            checkpoint each block), or another sharded strategy's (``Mesh2D(...)``); the sharded column is what one
            device of that strategy holds (``strategies``: each says it).
        method: "trace" (one step of a transformers causal LM traced on fake tensors, ``trace_step``; where it
            cannot run, the formulas, and the plan says why) or "estimate" (the formulas alone: instant).
        chunked_loss: The run's ``ChunkedLoss(...)`` callback, or None: the loss's logits rows count one chunk's
            tokens, not all of them (traced as ``ChunkedLoss`` runs it, or by the formulas).

    Returns:
        A ``MemoryPlan``: ``.replicated`` and ``.sharded`` (bytes per chip), ``.fits_replicated`` and
        ``.fits_sharded``, ``.terms``; ``print(plan)`` shows the table, and in its notes the host RAM a
        sharded run needs (the model whole before it is sharded; a checkpoint's gathered state).

    Raises:
        ValueError: a bad core count, batch size, precision, TPU kind or device_memory (under a GB: a unit slip).

    Example:
        >>> # was: loading the 7B model to find out, minutes later, that it does not fit a chip
        >>> from transformers import AutoConfig, AutoModelForCausalLM   # doctest: +SKIP
        >>> with torch.device("meta"):                                  # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained("google/gemma-7b"),
        ...                                              dtype=torch.bfloat16)
        >>> plan = memory_plan(model, cores=8, batch_size=1, seq_len=1024, device_memory="v5e")  # doctest: +SKIP
        >>> print(plan)                                                 # doctest: +SKIP
        >>> plan.fits_replicated, plan.fits_sharded                     # doctest: +SKIP
        (False, True)
    """
    shards = _check_cores(cores)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive int, but given {value!r}")
    precision = Precision.named(precision)
    if method not in get_args(PlanMethod):
        raise ValueError(f"method must be one of {get_args(PlanMethod)}, but given {method!r}")
    # the two columns: one replica on every chip, and what one chip of the sharded strategy holds (its own figures)
    columns = (Strategy(), fsdp if isinstance(fsdp, Strategy) else sharding_of(FSDP() if fsdp is None else fsdp, shards))
    # read, not imported: ChunkedLoss is a train step's callback, a layer above the plan
    loss_chunk = getattr(chunked_loss, "chunk_tokens", None)
    if chunked_loss is not None and not (isinstance(loss_chunk, int) and type(chunked_loss).__name__ == "ChunkedLoss"):
        raise TypeError(f"chunked_loss must be the run's ChunkedLoss(...) or None, but given {chunked_loss!r}")
    states, opt_name = optimizer_states(optimizer)
    params = list({id(p): p for p in model.parameters()}.values())  # tied weights once
    trainable = [p for p in params if p.requires_grad]
    row = lambda name, ps, k: Term(name, *(c.held(model, ps) * k for c in columns))  # noqa: E731
    terms = [row("parameters", params, 1), row("gradients", trainable, 1),
             row(f"optimizer state ({opt_name}, {states} per parameter)", trainable, states)]  # fmt: skip
    dequantized = max((m.weight.numel() * m.weight_scale.element_size() for m in model.modules()
                       if isinstance(m, Int8Linear)), default=0)  # fmt: skip
    if dequantized:  # an int8 base (quantize_base): each matmul makes its layer's weight float for a moment
        terms.append(Term("one layer dequantized (transient)", dequantized, dequantized))
    notes = _state_notes(params, trainable, states)
    how, checkpointed, if_checkpointed = "parameters, gradients and optimizer state only", None, None
    shape = TransformerShape.of(getattr(model, "config", None)) if getattr(model, "config", None) is not None else None
    if shape is not None and seq_len is not None:
        inner = base_model(model)  # transformers 5 renamed the flag; the old name warns
        own = bool(getattr(inner, "is_activation_checkpointing", None) or getattr(inner, "gradient_checkpointing", False))
        checkpointed = tuple(c.checkpoints(own) if checkpointing is None else checkpointing for c in columns)
        run = _Run(model, shape, batch_size, seq_len, optimizer, precision, own, chunked_loss)
        how, rows, more = _activations(run, columns, checkpointed, terms[1], method)
        if dequantized and how.startswith("traced"):  # the traced step holds each layer's dequantized weight
            terms = [t for t in terms if not t.name.startswith("one layer dequantized")]
        terms.append(rows)
        notes += more
        with_ckpt = _estimate(model, shape, batch_size * seq_len, precision, True, loss_chunk)
        if_checkpointed = Term("activations with each block checkpointed (estimate)", with_ckpt, with_ckpt)
        terms.append(Term(f"allocator rounding and workspaces ({MARGIN:.0%})",
                          math.ceil(MARGIN * sum(t.replicated for t in terms)),
                          math.ceil(MARGIN * sum(t.sharded for t in terms))))  # fmt: skip
        if backend.current().lazy:  # the compiler schedules the step's buffers, not torch's allocator
            notes.append("XLA schedules a step's memory itself: its buffer assignment of a small Llama's step on "
                         "XLA:CPU peaked 1.3-1.45x the traced step (docs/large_models.md): leave room on XLA")
        notes.append(f"activations: checkpointing {'on' if checkpointed[0] else 'off'} replicated, "
                     f"{'on' if checkpointed[1] else 'off'} sharded"
                     + (f" (strategy='{columns[1].name}' checkpoints each block by default: FSDP(checkpoint=False) turns it "
                        f"off)" if checkpointing is None and checkpointed[1] != checkpointed[0] else ""))  # fmt: skip
    else:
        notes.append("activations not counted: " + ("give seq_len" if shape is not None else
                                                     "no transformers decoder config to estimate them from"))
    gathered = columns[1].gathered(model)  # a sharded block's weights and gradients, whole for a moment
    if gathered:
        terms.append(Term("one block gathered (sharded only)", 0, gathered))
    return MemoryPlan(tuple(terms), shards, _device_memory(device_memory), tuple(notes), how, checkpointed,
                      if_checkpointed)


def _state_notes(params: list[nn.Parameter], trainable: list[nn.Parameter], states: int) -> list[str]:
    """The plan's notes on the model's state: the host RAM a sharded run needs, the frozen parameters."""
    whole = lambda ps, k: sum(p.numel() * p.element_size() * k for p in ps)  # noqa: E731
    size, state = whole(params, 1), whole(trainable, states)
    notes = [f"host RAM: {_gb(size)} to hold the model whole before it is sharded, "
             f"{_gb(host_bytes(size, state, 1, True))} while a checkpoint gathers its parameters and optimizer state"]
    frozen = len(params) - len(trainable)
    if frozen:
        notes.append(f"{sum(p.numel() for p in trainable):,} of {sum(p.numel() for p in params):,} parameters train "
                     f"({frozen} frozen tensors keep no gradient or optimizer state)")  # fmt: skip
    return notes


@dataclass(frozen=True)
class _Run:
    """The step a plan's activations are for: the model, its decoder's sizes, the batch, optimizer and precision."""

    model: nn.Module
    shape: TransformerShape
    batch_size: int
    seq_len: int
    optimizer: Any
    precision: Precision
    own: bool  # the model checkpoints its blocks itself
    chunked_loss: Any  # the run's ChunkedLoss, or None

    @property
    def loss_chunk(self) -> int | None:
        return getattr(self.chunked_loss, "chunk_tokens", None)


def _activations(run: _Run, columns: tuple[Strategy, Strategy], checkpointed: tuple[bool, ...], gradients: Term,
                 method: str) -> tuple[str, Term, list[str]]:  # fmt: skip
    """The activations' row of each column (a traced step where it can be, else the formulas): how they were found,
    the row, and the notes."""
    steps, why = {}, None
    if method == "trace":
        try:
            for ckpt in set(checkpointed):
                steps[ckpt] = trace_step(run.model, tokens=(run.batch_size, run.seq_len), optimizer=run.optimizer,
                                         precision=run.precision, checkpointing=ckpt and not run.own,
                                         loss=run.chunked_loss.traced_loss() if run.chunked_loss else None)  # fmt: skip
        except TraceUnavailable as error:
            steps, why = {}, str(error)
    else:
        why = "method='estimate'"
    chunks = f", the loss in chunks of {run.loss_chunk}" if run.loss_chunk else ""
    tokens = f"{run.batch_size} x {run.seq_len} tokens"
    if steps:
        seconds = sum(step.seconds for step in steps.values())
        rows = [_traced_row(steps[ckpt], getattr(gradients, c.column() if i else "replicated"), c.cores if i else 1)
                for i, (c, ckpt) in enumerate(zip(columns, checkpointed))]  # fmt: skip
        saved = [_gb(steps[ckpt].saved) for ckpt in checkpointed]
        return (f"traced one step ({tokens}{chunks} on fake tensors, {seconds:.1f} s)",
                Term("activations and temporaries at the step's peak (traced)", *rows),
                [f"saved for backward: {saved[0]} replicated, {saved[1]} sharded (of the peak's activations)"])  # fmt: skip
    estimate = functools.partial(_estimate, run.model, run.shape, run.batch_size * run.seq_len, run.precision,
                                 loss_chunk=run.loss_chunk)  # fmt: skip
    return (f"estimate (formulas): {why}",
            Term(f"activations and temporaries ({tokens}{chunks}, estimate)", *(estimate(c) for c in checkpointed)), [])


@dataclass(frozen=True)
class DeviceBytes:
    """What one device holds of a placed model, from the shards themselves: parameters, gradients, optimizer state."""

    parameters: int
    gradients: int
    optimizer_state: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state

    def __str__(self) -> str:
        return (f"parameters {_gb(self.parameters)}, gradients {_gb(self.gradients)}, optimizer state "
                f"{_gb(self.optimizer_state)}: {_gb(self.total)} on one device")  # fmt: skip


def device_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> DeviceBytes:
    """The bytes one device holds of ``model`` once it is placed (and sharded): its parameters, their gradients
    and ``optimizer``'s state, each tensor counted by the shard this device (this process) keeps, so a plan's
    sharded column can be checked against what the run really holds.

    Under XLA's SPMD (``strategy="fsdp"`` on a mesh) the shard of the first device is read from the live
    sharding; under FSDP2 (native backend, one process per device) each ``DTensor``'s local shard; a tensor not
    sharded counts whole. Gradients not yet made (before the first backward) count 0.

    Args:
        model: The model as training holds it (``one_cycle_fit`` returns it gathered back: call this from a
            callback, ``loop.model`` and ``loop.optimizer``, to see the sharded run).
        optimizer: Its optimizer, or None for parameters and gradients alone.

    Returns:
        A ``DeviceBytes``: ``.parameters``, ``.gradients``, ``.optimizer_state``, ``.total``; ``print`` says them.

    Example:
        >>> # was: torch.cuda.memory_allocated() after the first step, on one GPU
        >>> model = nn.Linear(10, 10)
        >>> print(device_bytes(model))
        parameters 440.00 B, gradients 0.00 GB, optimizer state 0.00 GB: 440.00 B on one device
    """
    held = backend.current().sharding.held_bytes
    params = list({id(p): p for p in model.parameters()}.values())
    grads = [p.grad for p in params if p.grad is not None]
    state = [] if optimizer is None else [t for s in optimizer.state.values() for t in s.values()
                                          if isinstance(t, torch.Tensor)]  # fmt: skip
    return DeviceBytes(sum(held(params)), sum(held(grads)), sum(held(state)))


def first_length(dataset: Any) -> int | None:
    """The tokens of a token dataset's first row (its ``input_ids``), the ``seq_len`` a run's plan uses; None
    for other data (images, tensors), whose activations the plan leaves out.

    Example:
        >>> first_length([{"input_ids": [1, 2, 3], "labels": [1, 2, 3]}]), first_length([(torch.zeros(3), 1)])
        (3, None)
    """
    try:
        row = dataset[0]
    except Exception:  # an iterable dataset, or one that cannot be indexed: no length to plan with
        return None
    ids = row.get("input_ids") if isinstance(row, dict) or hasattr(row, "keys") else None
    if isinstance(ids, torch.Tensor):
        return int(ids.shape[-1]) if ids.dim() else None
    return len(ids) if isinstance(ids, (list, tuple)) and ids else None


def auto_shards(plan: MemoryPlan) -> str:
    """For ``strategy="auto"`` on several cores: why FSDP is chosen (the plan's figures) when one replica cannot
    fit a chip and a shard can; "" otherwise (and where the chip's memory is unknown), which leaves the run
    replicated. ``plan``: the run's, with activations where the batch's length is known.

    Example:
        >>> auto_shards(memory_plan(nn.Linear(4, 4), cores=4))   # the CPU: no chip memory to compare with
        ''
    """
    return Spmd(plan.cores, may_shard=True).settled(plan).why  # the strategy decides what "auto" becomes, and why


def fitting_batch_size(state: float, activations: float, batch_size: int, usable: float) -> int:
    """The largest batch per chip whose step fits ``usable`` bytes, activations being linear in the batch
    (``activations`` for ``batch_size`` rows; ``state`` the bytes that do not grow with it); 0 where none does.

    Example:
        >>> fitting_batch_size(state=10, activations=40, batch_size=8, usable=30)   # 5 bytes a row, 20 to spare
        4
    """
    per_row = activations / batch_size
    room = usable / (1 + MARGIN) - state
    return max(0, min(batch_size, int(room // per_row))) if per_row > 0 else batch_size


def refuse_replicating(model: nn.Module, plan: MemoryPlan, batch_size: int, column: Column = "replicated") -> None:
    """Refuses, before anything compiles, a run that cannot fit one chip (its strategy's ``column()`` of the plan:
    replicated, or sharded over ``cores``), naming the figures and the ways out: sharding, a batch size or checkpointing that would fit,
    LoRA, bf16, more chips.

    ``plan``: the run's (``memory_plan`` of its cores, ``batch_size`` per chip, optimizer and precision), with
    activations where the batch's length is known; without them a refusal counts the parameters, gradients and
    optimizer state alone, so it is never a guess. Nothing is checked where the chip's memory is unknown (the
    CPU without ``TPU_UTILITY_DEVICE_MEMORY_GB``).

    Raises:
        ValueError: the plan's replicated (or sharded) figure, the chip's memory, and the ways out.
    """
    cores, sharded = plan.cores, column == "sharded"
    if plan.fits_sharded if sharded else plan.fits_replicated:
        return
    act = next((t for t in plan.terms if t.name.startswith("activations")), None)
    smaller = []
    if act is not None:  # the batch and the checkpointing that would fit, where activations are planned
        size = lambda t: getattr(t, column)  # noqa: E731
        state = sum(size(t) for t in plan.terms if t is not act and not t.name.startswith("allocator"))
        fits = fitting_batch_size(state, size(act), batch_size, plan.usable)
        if 0 < fits < batch_size:
            smaller.append(f"batch_size={fits} per chip (a step of {batch_size} needs {_gb(size(act))} of "
                           f"activations)")  # fmt: skip
        if not plan.checkpointing[sharded]:
            checkpointed = size(plan.if_checkpointed)
            with_ckpt = fitting_batch_size(state, checkpointed, batch_size, plan.usable)
            if with_ckpt == batch_size:
                smaller.append(f"checkpointing each block (the GradientCheckpointing callback, or strategy='fsdp', "
                               f"which checkpoints by default): {_gb(checkpointed)} of activations")  # fmt: skip
            elif with_ckpt > fits:
                smaller.append(f"checkpointing each block with batch_size={with_ckpt} per chip")
    if sharded:
        raise ValueError(
            f"{type(model).__name__} does not fit the chips even sharded: strategy='fsdp' over {cores} cores needs "
            f"{_gb(plan.sharded)} per chip, mostly {plan.dominant()} ({_gb(plan.term(plan.dominant()).sharded)}), "
            f"but a chip has {_gb(plan.device_memory)} ({HEADROOM:.0%} usable; {backend.MEMORY_ENV} sets it). Ways "
            f"out: {'; '.join(smaller + [''])}more chips, LoRA adapters (peft), a bf16 model, an optimizer with less "
            f"state (sgd). memory_plan(model, ...) prints the table"
        )
    state = [t for t in plan.terms if not t.name.startswith("one block")]
    parts = ", ".join(f"{t.name} {_gb(t.replicated)}" for t in state)
    ways = list(smaller)
    if cores > 1 and plan.fits_sharded:
        ways.insert(0, f"shard it over the {cores} cores with strategy='fsdp' ({_gb(plan.sharded)} per chip)")
    elif cores > 1:
        ways.append(f"sharded over {cores} cores it still needs {_gb(plan.sharded)} per chip, mostly "
                    f"{plan.dominant()}: more chips")  # fmt: skip
    else:
        ways.append("sharding needs several cores (cores='all', strategy='fsdp')")
    if plan.term("gradients").replicated > 0.01 * plan.term("parameters").replicated:
        ways.append("train LoRA adapters (peft), which keeps gradients and optimizer state for them alone")
    if any(p.dtype == torch.float32 for p in model.parameters()):
        ways.append("load the model in bf16 (dtype=torch.bfloat16: half the bytes of fp32)")
    raise ValueError(
        f"{type(model).__name__} cannot be replicated on one chip: it needs {_gb(plan.replicated)} per chip "
        f"({parts}{'; activations not counted' if act is None else ''}), but a chip has {_gb(plan.device_memory)} "
        f"({HEADROOM:.0%} usable; {backend.MEMORY_ENV} sets it). Ways out: {'; '.join(ways)}. "
        f"memory_plan(model, ...) prints the table"
    )


def host_memory() -> int | None:
    """The host's available RAM in bytes: ``TPU_UTILITY_HOST_MEMORY_GB`` (GiB) when set, else ``MemAvailable`` of
    ``/proc/meminfo``; None where neither is there (nothing is checked then).

    Raises:
        ValueError: the variable set to something other than a positive number, named with its value.

    Example:
        >>> import os
        >>> os.environ["TPU_UTILITY_HOST_MEMORY_GB"] = "64"
        >>> host_memory() == 64 * 2**30
        True
        >>> del os.environ["TPU_UTILITY_HOST_MEMORY_GB"]
    """
    given = memory_override(HOST_MEMORY_ENV)
    if given is not None:
        return given
    try:
        with open("/proc/meminfo") as info:
            found = [line.split()[1] for line in info if line.startswith("MemAvailable:")]
    except OSError:
        return None
    return int(found[0]) * 1024 if found else None


def refuse_host_shortage(model: nn.Module, optimizer: Any, processes: int, checkpoints: bool) -> None:
    """Refuses, before training, a sharded run whose host cannot hold the model whole to load it for sharding
    (``processes`` copies, one per process that builds it) or, with ``checkpoints``, the parameters and optimizer
    state a save gathers whole on the host (``host_bytes``).

    In one process the model's own parameters already on the host count as loaded: they are freed when it
    moves to its device (launched processes each load a copy beside the caller's, which stays). ``HEADROOM`` of the available RAM is used, as of a chip's. Nothing is checked where the host's
    memory is unknown.

    Raises:
        ValueError: the bytes needed, of what, the bytes available, and the ways out.
    """
    available = host_memory()
    if available is None:
        return
    params = list({id(p): p for p in model.parameters()}.values())
    states, opt_name = optimizer_states(optimizer)
    size = sum(p.numel() * p.element_size() for p in params)
    state = sum(p.numel() * p.element_size() * states for p in params if p.requires_grad)
    loaded = sum(p.numel() * p.element_size() for p in params if p.device.type == "cpu") if processes == 1 else 0
    needed = host_bytes(size, state, processes, checkpoints)
    if needed <= HEADROOM * available + loaded:
        return
    copies = f"{processes} processes each load" if processes > 1 else "the host loads"
    what = f"{copies} the whole model ({_gb(size)}) before it is sharded"
    if checkpoints:
        what += f"; each checkpoint gathers its parameters and {opt_name} state whole on the host ({_gb(size + state)})"
    raise ValueError(
        f"not enough host RAM to load {type(model).__name__} for sharding: {what}, so the host needs {_gb(needed)}, "
        f"but {_gb(available)} is available ({HEADROOM:.0%} usable"
        + (f", plus the {_gb(loaded)} the model holds there now" if loaded else "")
        + f"; {HOST_MEMORY_ENV} sets it). Ways out: a host with more RAM, a bf16 model (dtype=torch.bfloat16), "
        f"LoRA adapters (peft: optimizer state for them alone)"
        + (", no checkpoint_dir (nothing gathered on the host)" if checkpoints else "")
        + (", fewer processes" if processes > 1 else "")
    )


def _check_cores(cores: Any) -> int:
    if cores == "all":
        return backend.current().devices.device_count()
    if isinstance(cores, bool) or not isinstance(cores, int) or cores < 1:
        raise ValueError(f"cores must be 'all' or an int >= 1, but given {cores!r}")
    return cores


_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kMGT]i?B)\s*$", re.IGNORECASE)
_UNITS = {"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def _device_memory(given: int | float | str | None) -> int | None:
    """One chip's bytes from ``device_memory=``: bytes (at least a GB: fewer is a unit slip), a size such as
    "16GB" or "16 GiB", or a TPU kind; None asks the backend.

    Example:
        >>> _device_memory("16GB"), _device_memory("16 GiB"), _device_memory(16e9)
        (16000000000, 17179869184, 16000000000)
    """
    allowed = "one chip's bytes (16e9), a size such as '16GB' or '16 GiB', or a TPU kind ('v4', 'v5e', 'v5p', 'v6e')"
    if isinstance(given, str):
        size = _SIZE.match(given)
        found = int(float(size[1]) * _UNITS[size[2].lower()]) if size else tpu_device_memory(given)
        if not found:
            raise ValueError(f"device_memory must be {allowed}, but given {given!r}")
        return found
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)) or not 1 <= given < math.inf:
            raise ValueError(f"device_memory must be {allowed}, but given {given!r}")
        if given < GB:
            raise ValueError(f"device_memory={given!r} is {given!r} bytes, less than a GB: a unit slip? device_memory "
                             f"is one chip's bytes; give {given:g}e9 or '{given:g}GB' for {given:g} GB, or a TPU kind "
                             f"('v5e')")  # fmt: skip
        return int(given)
    chosen = backend.current()
    return chosen.devices.device_memory(torch.device(chosen.device_type))


def _traced_row(step: TracedStep, gradients: int, shards: int) -> int:
    """A column's activation row from a traced step, such that the column sums to its peak: the larger of
    forward and backward's peak (the column's parameters and optimizer state, the share of its ``gradients``
    made by then, the activations) and the optimizer step's (all of them, and the step's temporaries, which
    shrink with the shards), less the column's parameters, gradients and optimizer state."""
    made = gradients * step.backward_gradients // max(step.gradients, 1)
    return max(made + step.activations - gradients, step.temporaries // shards)


def _estimate(model: nn.Module, shape: TransformerShape, tokens: int, precision: Precision, checkpointing: bool,
              loss_chunk: int | None = None) -> int:  # fmt: skip
    """The formulas' activations at a step's peak: what backward keeps (``_saved_estimate``), the loss's fp32
    temporaries (``loss_bytes``: of all tokens, or of one chunk of ``loss_chunk``) and, checkpointed, one block's
    activations while backward recomputes it."""
    kept = _saved_estimate(model, shape, tokens, precision, checkpointing, loss_chunk)
    if checkpointing:
        weights, itemsize = _itemsizes(model, precision)
        one = dataclasses.replace(shape, layers=1)
        kept += activation_bytes(one, tokens, itemsize, False, weights) - activation_bytes(one, tokens, itemsize, True, weights)
    return kept + loss_bytes(min(loss_chunk or tokens, tokens), shape.vocab)


def _saved_estimate(model: nn.Module, shape: TransformerShape, tokens: int, precision: Precision,
                    checkpointing: bool, loss_chunk: int | None = None) -> int:  # fmt: skip
    """The formulas' bytes saved for backward: ``activation_bytes`` and, under autocast, the cast copy of each
    weight a matmul uses (the head's; the blocks' unless checkpointed)."""
    weights, itemsize = _itemsizes(model, precision)
    copies = 0
    if itemsize < weights:
        block = largest_block(model)
        copies = shape.vocab * shape.hidden + (0 if checkpointing else shape.layers * sum(p.numel() for p in block if p.dim() > 1))
    return activation_bytes(shape, tokens, itemsize, checkpointing, weights, loss_chunk) + copies * itemsize


def _itemsizes(model: nn.Module, precision: Precision) -> tuple[int, int]:
    """(the weights' itemsize, the activations'): autocast computes in 16 bits over fp32 weights, a bf16 model
    in bf16 whatever the precision."""
    weights = max((p.element_size() for p in model.parameters() if p.is_floating_point()), default=4)
    return weights, min(precision.itemsize, weights)


__all__ = ["memory_plan", "MemoryPlan", "device_bytes", "DeviceBytes", "first_length", "fitting_batch_size", "loss_bytes", "MARGIN", "auto_shards", "refuse_replicating", "refuse_host_shortage", "host_bytes",
           "host_memory", "HOST_MEMORY_ENV", "Term", "TransformerShape", "activation_bytes", "optimizer_states",
           "shard_bytes", "HEADROOM"]  # fmt: skip
