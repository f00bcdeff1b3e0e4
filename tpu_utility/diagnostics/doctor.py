"""doctor(): run your own training (or evaluation) step as you run it, and say in
plain words what makes it slow or wrong on XLA, and how to fix it.

On XLA it reads torch_xla's counters; on the native backends (CPU, CUDA) and
TorchTPU, which run eagerly, it watches the step's aten ops (the backend's
``watch_host_syncs``) and the input shapes, names the host syncs and shape changes
with the same fixes, and lists what it cannot measure there (compiles, CPU
fallbacks) instead of calling the step clean of them.

doctor does not cut the lazy graph between your steps (only once at the end), so
what it measures is what your loop does. Per step it records:

* graph compilations, and which input shapes changed (a short last batch, changing
  sequence lengths: with the bucket lengths to pad to);
* a graph that grows from step to step because nothing in the step cuts it;
* compiles with unchanged shapes, told apart by how often they come: every step (a
  Python value baked into the graph, a device-resident dataset sliced with Python
  integers) or once (a learning rate leaving its initial value: a note, not a finding);
* host syncs, with the line of your code that caused each;
* ops that fell back to the host CPU, with a lowered replacement where one is known;

and checks, before running: that the model is on XLA at all, that the optimizer holds
the model's parameters, that tied weights are still tied, that the batch divides
across the cores, and whether a DataLoader ends with a short batch.

When your step raises, doctor raises :class:`DoctorError`, chained to your exception,
whose ``report`` holds what doctor had found before it.
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
from typing import Any, Callable, Iterable, Iterator, Literal, get_args

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader

from .. import backend
from ..backend import GraphCompile
from ..data.buckets import choose_buckets
from ..device import move_to_device
from ..loop import INFERENCE_MODE_ERROR
from ..optim import step_optimizer
from ..training.steps import LossStep
from .rules import COLLECT_ON_DEVICE, DOCTOR_KINDS, LOWERED_REPLACEMENTS, MEASURED_FIXES, NO_DYNAMIC_SHAPE, RULES

# a finding's kind: an id of the rules table's doctor rules (rules.DOCTOR_KINDS), named there only. A type
# checker cannot read a Literal built from a value, so Finding checks the kind when it is made.
Kind = Literal[DOCTOR_KINDS]  # type: ignore[valid-type]
Mode = Literal["train", "eval"]
_OWN_DIRS = tuple(
    os.path.dirname(m.__file__) + os.sep
    for m in (torch, sys.modules[__name__.split(".")[0]])
    if getattr(m, "__file__", None)
)
_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__repr__", "__format__")
_RECOMPILED_ELSEWHERE = ("under torch.compile(dynamic=False) (TorchTPU's way) and on XLA, though this eager backend "
                         "runs it uncompiled")  # fmt: skip
@dataclass
class Finding:
    """One problem: what it is, where it comes from, and what to change."""

    kind: Kind
    message: str
    fix: str
    where: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in DOCTOR_KINDS:
            raise ValueError(f"a finding's kind is one of rules.DOCTOR_KINDS {DOCTOR_KINDS}, but given {self.kind!r}")

    def __str__(self) -> str:
        lines = [f"[{self.kind}] {self.message}"]
        lines += [f"    at {w}" for w in self.where]
        lines.append(f"    fix: {self.fix}")
        return "\n".join(lines)


@dataclass
class DoctorReport:
    """What doctor measured, and its findings; ``clean`` when there are none.

    ``step_compiles`` holds the compiles of each measured step; ``graphs`` each compile's seconds and size in
    IR nodes, with its step (counting warm-up), where the backend times its compiles (XLA); ``notes`` say what
    was seen but needs no fix (a one-time compile); ``error`` is the exception your
    step raised (then doctor raised :class:`DoctorError` with this report).
    On an eager backend (native PyTorch, TorchTPU) ``compiles_per_step`` is None and
    ``unmeasured`` says what doctor could not see there, so ``clean`` means clean of
    what was measured: host syncs, input shape changes and the static checks.
    """

    steps: int
    warmup: int
    compiles_per_step: float | None
    host_syncs_per_step: float
    fallback_ops: list[str]
    findings: list[Finding] = field(default_factory=list)
    mode: Mode = "train"
    step_compiles: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: BaseException | None = None
    error_step: int | None = None
    measured_on: str = "xla"
    unmeasured: list[str] = field(default_factory=list)
    graphs: list[tuple[int, GraphCompile]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.findings and self.error is None

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def __str__(self) -> str:
        what = "" if self.mode == "train" else f" ({self.mode} step)"
        if self.compiles_per_step is None:
            lines = [
                f"doctor{what} on the {self.measured_on} backend (eager): {self.steps} steps after {self.warmup} "
                f"warm-up: {self.host_syncs_per_step:.2f} host syncs/step, compiles and CPU fallbacks not measured"
            ]
        else:
            lines = [
                f"doctor{what}: {self.steps} steps after {self.warmup} warm-up: {self.compiles_per_step:.2f} "
                f"compiles/step, {self.host_syncs_per_step:.2f} host syncs/step, CPU fallbacks: "
                f"{', '.join(self.fallback_ops) or 'none'}"
            ]
        if self.error is not None:
            lines.append(
                f"error: your step raised {type(self.error).__name__}: {self.error} (at step {self.error_step}, "
                f"counting warm-up); the findings below were made before it"
            )
        if self.clean and self.compiles_per_step is None:
            lines.append(
                "clean of what doctor sees on this backend: no host syncs, no input shape changes between steps, "
                "the optimizer owns the model's parameters, no split ties, the batch divides across the cores."
            )
        elif self.clean:
            lines.append(
                "clean: no recompiles, no host syncs, no CPU fallbacks, no graph growth, the optimizer owns the "
                "model's parameters, no split ties, the batch divides across the cores."
            )
        lines += map(str, self.findings)
        lines += [f"compiled at step {step} (counting warm-up): {g.seconds:.2f}s" + (f", {g.nodes:,} IR nodes" if g.nodes is not None else "")
                  for step, g in self.graphs]  # fmt: skip
        lines += [f"not measured: {u}" for u in self.unmeasured]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return "```\n" + str(self) + "\n```"

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # IPython's plain-text display
        printer.text(str(self))


class DoctorError(RuntimeError):
    """Your step raised inside doctor: ``report`` holds the findings made before it.

    The exception is chained (``__cause__``) to the error your step raised, so the
    traceback shows both your error and the report.
    """

    def __init__(self, report: DoctorReport) -> None:
        super().__init__(str(report))
        self.report = report


# ------------------------------------------------------------ static checks
def check_error(error: BaseException) -> Finding | None:
    """Names the cause and fix of an error your step raised, where one is known."""
    if isinstance(error, RuntimeError) and INFERENCE_MODE_ERROR in str(error):
        rule = RULES["inference_mode"]
        return Finding("inference_mode", f"the step runs under torch.inference_mode(): {rule.cost}", rule.fix)
    return None



def check_xla(model: nn.Module | None) -> Finding | None:
    """XLA must be in use and the model on it, else doctor has nothing to measure."""
    fix = RULES["not_on_xla"].fix
    if not backend.xla_requested():
        wanted = backend.pjrt_device()
        if not backend.XLA_INSTALLED:
            why = "torch_xla is not installed" + (f" (but PJRT_DEVICE={wanted!r} is set)" if wanted else "")
            fix = f"install it ({backend.INSTALL_HINT}), call setup_tpu() in the first cell, then {fix}"
        else:
            why = "PJRT_DEVICE is not set and no TPU is attached"
            fix = f"call setup_tpu() in the first cell (PJRT_DEVICE=CPU tries XLA on the host), then {fix}"
        return Finding("not_on_xla", f"{why}: nothing runs on XLA, so doctor measured nothing", fix)
    devices = sorted({p.device.type for p in model.parameters()}) if model is not None else []
    if devices and not any(backend.current().devices.is_lazy(d) for d in devices):
        return Finding(
            "not_on_xla",
            f"the model's parameters are on {', '.join(devices)}, not on the XLA device: the step runs on the "
            f"host CPU, so doctor measured nothing",
            fix,
        )
    return None


def check_device(model: nn.Module | None) -> Finding | None:
    """On an eager backend: the model must be on the backend's device (on the CPU backend it always is)."""
    devices = sorted({str(p.device) for p in model.parameters()}) if model is not None else []
    if not devices or any(backend.current().devices.owns(d) for d in devices):
        return None
    return Finding(
        "not_on_device",
        f"the model's parameters are on {', '.join(devices)}, not on the {backend.current().name} device "
        f"({backend.current().devices.device()}): the step runs on the host CPU, so doctor measured nothing",
        RULES["not_on_device"].fix,
    )


def check_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> Finding | None:
    """The optimizer must update the model's own (device) parameters."""
    own = {id(p) for p in model.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stray = [p for p in params if id(p) not in own]
    if not stray:
        return None
    first = next(iter(model.parameters()), None)
    model_place = f"the model on {first.device}" if first is not None else "the model has no parameters at all"
    return Finding(
        "optimizer_params",
        f"{len(stray)} of the optimizer's {len(params)} parameters are not the model's (they are on "
        f"{stray[0].device}, {model_place}): optimizer.step() updates copies and the model "
        f"does not learn. The optimizer was built before model.to(device).",
        RULES["optimizer_params"].fix,
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
        RULES["tied_weights"].fix,
        where=pairs,
    )


def check_batch_split(batch: Any, cores: int) -> Finding | None:
    sizes = [t.shape[0] for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor) and t.dim() > 0]
    if cores <= 1 or not sizes or sizes[0] % cores == 0:
        return None
    return Finding(
        "batch_split",
        f"the batch has {sizes[0]} samples, which does not divide across {cores} cores",
        MEASURED_FIXES["batch_split"].format(cores=cores, example=sizes[0] // cores * cores or cores),
    )


def _batch_size_fix(mode: Mode) -> str:
    return MEASURED_FIXES[f"recompile_{mode}"]


def check_last_batch(loader: Any, mode: Mode, ran: int) -> Finding | None:
    """A DataLoader without drop_last whose samples do not fill its last batch (``ran``: batches doctor ran)."""
    if not isinstance(loader, DataLoader) or loader.batch_size is None or loader.drop_last:
        return None
    try:
        samples = len(loader.sampler)
    except (TypeError, NotImplementedError):
        return None
    short = samples % loader.batch_size
    if not short:
        return None
    unseen = " (doctor did not run that batch; steps='all' runs the whole loader)" if len(loader) > ran else ""
    return Finding(
        "recompile",
        f"the loader's last batch holds {short} samples, the others {loader.batch_size}: a second shape, so a "
        f"second graph to compile{unseen}",
        _batch_size_fix(mode),
    )


# ------------------------------------------------------------------ tracing
def _skipped(filename: str) -> bool:
    return filename.startswith(_OWN_DIRS) or f"{os.sep}torch_xla{os.sep}" in filename


def _describe(frame: Any) -> str:
    code = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    where = f"{frame.f_code.co_filename}:{frame.f_lineno}"
    return f"{where}: {code}" if code else where


def _user_frame() -> str:
    frame = sys._getframe(2)
    while frame is not None and _skipped(frame.f_code.co_filename):
        frame = frame.f_back
    return "<unknown>" if frame is None else _describe(frame)


def _read_tracer(calls: Counter, state: threading.local) -> Callable[[str], Callable[[Callable], Callable]]:
    """Records the user line of every read of an XLA tensor's value (outermost call only)."""

    def make(name: str) -> Callable[[Callable], Callable]:
        def wrap(original: Callable) -> Callable:
            def traced(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if backend.current().devices.is_lazy(self.device) and not getattr(state, "inside", False):
                    calls[(name, _user_frame())] += 1
                    state.inside = True
                    try:
                        return original(self, *args, **kwargs)
                    finally:
                        state.inside = False
                return original(self, *args, **kwargs)

            return traced

        return wrap

    return make


def _python_ints(index: Any) -> tuple | None:
    """The Python integers in an index (slices and ints), or None when there are none."""
    parts = index if isinstance(index, tuple) else (index,)
    found: list[Any] = []
    for part in parts:
        if isinstance(part, slice):
            ints = tuple(v if isinstance(v, int) else None for v in (part.start, part.stop, part.step))
            found.append(ints if any(v is not None for v in ints) else None)
        elif isinstance(part, int) and not isinstance(part, bool):
            found.append(part)
        else:
            found.append(None)
    return tuple(found) if any(f is not None for f in found) else None


def _index_text(ints: tuple) -> str:
    def part(p: Any) -> str:
        if isinstance(p, tuple):
            return ":".join("" if v is None else str(v) for v in (p if p[2] is not None else p[:2]))
        return "..." if p is None else str(p)

    return "[" + ", ".join(map(part, ints)) + "]"


def _slice_tracer(now: dict[str, list[tuple]]) -> dict[str, Callable[[Callable], Callable]]:
    """Records, per user line, the Python integers XLA tensors are indexed with in this step."""

    def record(ints: tuple | None) -> None:
        frame = sys._getframe(2)
        if ints is not None and not _skipped(frame.f_code.co_filename):
            now.setdefault(_describe(frame), []).append(ints)

    def getitem(original: Callable) -> Callable:
        def traced(self: torch.Tensor, index: Any) -> Any:
            if backend.current().devices.is_lazy(self.device):
                record(_python_ints(index))
            return original(self, index)

        return traced

    def narrow(original: Callable) -> Callable:
        def traced(self: torch.Tensor, dim: int, start: Any, length: int) -> Any:
            if backend.current().devices.is_lazy(self.device) and isinstance(start, int) and isinstance(length, int):
                record((None,) * dim + ((start, start + length, None),))
            return original(self, dim, start, length)

        return traced

    return {"__getitem__": getitem, "narrow": narrow}


@contextlib.contextmanager
def _tracing(run: _Run) -> Iterator[None]:
    make_read = _read_tracer(run.reads, threading.local())
    wrappers = {name: make_read(name) for name in _READS}
    wrappers.update(_slice_tracer(run.slicing_now))
    with backend.patch_tensor_methods(wrappers):
        yield


# -------------------------------------------------------------- the running
def _default_step(model: nn.Module, optimizer: torch.optim.Optimizer | None, loss_fn: Callable | None,
                  mode: Mode) -> Callable:  # fmt: skip
    first = next(iter(model.parameters()), None)
    if first is None:
        raise ValueError(
            f"doctor(model, ...) runs the batch on the device of the model's parameters, but the "
            f"{type(model).__name__} given has none; pass your own step(batch) callable that moves the batch"
        )
    device = first.device
    total: list[torch.Tensor] = []
    step_loss = LossStep(loss_fn or nn.CrossEntropyLoss(), model_loss=loss_fn is None)  # dict batches too

    def train_step(batch: Any) -> None:
        batch = move_to_device(batch, device)
        optimizer.zero_grad(set_to_none=True)
        step_loss(model, batch).backward()
        step_optimizer(optimizer)

    def eval_step(batch: Any) -> None:
        batch = move_to_device(batch, device)
        with torch.no_grad():
            loss = step_loss(model, batch)
        total[:] = [total[0] + loss if total else loss]  # accumulated on the device
        backend.current().devices.sync()  # what device_loader does at each batch

    return train_step if mode == "train" else eval_step


def _shapes(batch: Any) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


@dataclass
class _Step:
    """What one run of the user's step did."""

    shapes: list[tuple[int, ...]]
    compiles: int
    pending: int
    graphs: list[GraphCompile] = field(default_factory=list)  # each compile's seconds and size, where timed


@dataclass
class _Run:
    """Everything doctor saw while running the step."""

    warmup: list[_Step] = field(default_factory=list)
    measured: list[_Step] = field(default_factory=list)
    reads: Counter = field(default_factory=Counter)
    slices: dict[str, list[tuple]] = field(default_factory=dict)  # line -> the indices of each step
    slicing_now: dict[str, list[tuple]] = field(default_factory=dict)  # line -> indices in this step
    created: int = 0
    host_syncs: int = 0
    fallbacks: list[str] = field(default_factory=list)
    eager: bool = False  # the backend counts nothing itself: doctor watches the step's ops
    syncs: Counter = field(default_factory=Counter)  # (kind, op, user line) -> count, from the backend's watch

    @property
    def records(self) -> list[_Step]:
        return self.warmup + self.measured


def _growing(pending: list[int]) -> bool:
    return len(pending) >= 2 and all(b > a for a, b in zip(pending, pending[1:]))


def _run_one(step: Callable, batch: Any, into: list[_Step]) -> None:
    diagnosis = backend.current().diagnosis
    before = diagnosis.compile_count()
    step(batch)
    compiled = diagnosis.compile_count() - before
    into.append(_Step(_shapes(batch), compiled, diagnosis.pending_ir_nodes(), diagnosis.last_compiles(compiled)))


def _run(step: Callable, plan: Iterator[Any], warmup: int, run: _Run) -> None:
    """Runs the step as the user does: no graph cut of ours between their steps."""
    for batch in itertools.islice(plan, warmup):
        _run_one(step, batch, run.warmup)
    backend.current().devices.wait()  # no cut of ours: the first measured step runs as every later one does
    backend.current().diagnosis.clear_counters()

    def record(kind: str, op: str) -> None:
        run.syncs[(kind, op, _user_frame())] += 1

    try:
        with _tracing(run), backend.current().diagnosis.watch_host_syncs(record):
            for batch in plan:
                _run_one(step, batch, run.measured)
                for line, indices in run.slicing_now.items():
                    run.slices.setdefault(line, []).append(tuple(indices))
                run.slicing_now.clear()
                if len(run.measured) >= 2 and len(run.records) >= 3 and _growing([s.pending for s in run.records]):
                    break  # every further step is slower still; the finding is clear
    finally:  # also when the step raised: the findings so far need these
        run.created = backend.current().diagnosis.tensors_created()
        run.host_syncs = backend.host_sync_count() + sum(run.syncs.values())
        run.fallbacks = backend.current().diagnosis.fallback_ops()
    backend.current().devices.sync()  # runs whatever the last step left pending (not counted as the step's)
    backend.current().devices.wait()


# ---------------------------------------------------------------- analysis
def _growth(run: _Run, mode: Mode) -> Finding | None:
    pending = [s.pending for s in run.measured]
    if not _growing(pending):
        pending = [s.pending for s in run.warmup]
        if len(run.measured) >= 2 or not _growing(pending):
            return None
    fix = MEASURED_FIXES[f"graph_growth_{mode}"]
    return Finding(
        "graph_growth",
        f"the graph grows every step ({' -> '.join(map(str, pending))} IR nodes pending after each step): nothing "
        f"in the step cuts the lazy graph, so XLA traces an ever larger graph and compiles it anew whenever "
        f"something finally runs it",
        fix,
    )


def _length_dim(records: list[_Step]) -> tuple[int, int] | None:
    """(input, dim) of the first non-batch dimension whose size changes between steps."""
    first = records[0].shapes
    for j, shape in enumerate(first):
        for d in range(1, len(shape)):
            if any(j < len(r.shapes) and len(r.shapes[j]) == len(shape) and r.shapes[j][d] != shape[d]
                   for r in records):  # fmt: skip
                return j, d
    return None


def _shape_recompiles(run: _Run, mode: Mode) -> Finding | None:
    records = run.records
    seen = [records[0].shapes]
    new_shape_compiles = new_shapes = 0
    for index, record in enumerate(records):
        if record.shapes not in seen:
            seen.append(record.shapes)
            if index >= len(run.warmup):
                new_shape_compiles += record.compiles
                new_shapes += 1
    if (new_shapes if run.eager else new_shape_compiles) == 0:
        return None
    # an eager backend compiles nothing: each new shape is named by what it costs where steps compile
    counted = (f"{new_shapes} new input shape(s)" if run.eager else f"{new_shape_compiles} graph compilation(s)")
    elsewhere = f" {_RECOMPILED_ELSEWHERE}" if run.eager else ""
    changed = [
        f"step {i + 1}: input {j} {records[i - 1].shapes[j]} -> {records[i].shapes[j]}"
        for i in range(1, len(records))
        for j in range(min(len(records[i].shapes), len(records[i - 1].shapes)))
        if records[i].shapes[j] != records[i - 1].shapes[j]
    ]
    measured = len(run.measured)
    length = _length_dim(records)
    if length is None:
        return Finding(
            "recompile",
            f"{counted} in {measured} steps after warm-up: input shapes changed between steps (the batch size: "
            f"a short last batch?)" + (f"; each new shape compiles a new graph{elsewhere}" if run.eager else ""),
            _batch_size_fix(mode),
            where=changed,
        )
    j, d = length
    lengths = [r.shapes[j][d] for r in records if j < len(r.shapes) and len(r.shapes[j]) > d]
    buckets = choose_buckets(lengths)
    sizes = {r.shapes[j][0] for r in records if j < len(r.shapes) and r.shapes[j]}
    also = f"; and the batch size changed too: {_batch_size_fix(mode)}" if len(sizes) > 1 else ""
    return Finding(
        "recompile",
        f"{counted} in {measured} steps after warm-up: input shapes changed between steps (sequence lengths: "
        f"dim {d} of input {j} took {len(set(lengths))} values, {min(lengths)}..{max(lengths)}); every new "
        f"length compiles a new graph{elsewhere}",
        MEASURED_FIXES["recompile_lengths"].format(buckets=buckets, also=also),
        where=changed,
    )


def _slicing(run: _Run) -> Finding | None:
    # a line whose indices differ from step to step (the same indices every step, as in an
    # unrolled loop over time steps, compile once)
    lines = {line: steps for line, steps in run.slices.items() if len(set(steps)) >= 2}
    if not lines:
        return None
    return Finding(
        "device_slicing",
        "a tensor on the XLA device is sliced with Python integers that change every step "
        "(data[i:i + bptt]): each new offset is baked into the graph, so every step compiles a new one",
        MEASURED_FIXES["device_slicing"],
        where=[f"{line}  (steps indexed {', '.join(_index_text(step[0]) for step in steps[:3])}, ...)"
               for line, steps in lines.items()],
    )


def _same_shape_compiles(run: _Run, explained: bool) -> tuple[Finding | None, list[str]]:
    """Compiles with shapes seen before: every step is a finding, once is a note."""
    seen: list[list[tuple[int, ...]]] = [r.shapes for r in run.warmup]
    steps = []
    for index, record in enumerate(run.measured, start=len(run.warmup) + 1):
        if record.shapes in seen and record.compiles:
            steps.append(index)
        seen.append(record.shapes)
    if not steps or explained:
        return None, []
    total = sum(run.measured[i - len(run.warmup) - 1].compiles for i in steps)
    if len(steps) >= 2 and len(steps) * 2 >= len(run.measured):
        return Finding(
            "recompile",
            f"{total} graph compilation(s) in {len(run.measured)} steps after warm-up, with the same input "
            f"shapes: a Python value that changes every step is baked into the graph, or the graph depends on data",
            MEASURED_FIXES["recompile_values"],
        ), []
    which = f"step {steps[0]} compiled once" if len(steps) == 1 else f"steps {', '.join(map(str, steps))} compiled"
    return None, [
        f"{which} with unchanged input shapes, not every step: a one-time change (for example a learning rate "
        f"leaving its initial value) costs one compile, not one per step; nothing to fix"
    ]


def _host_syncs(run: _Run) -> Finding | None:
    syncs = max(sum(run.reads.values()), run.host_syncs)
    if not syncs:
        return None
    where = [f"{n}x .{name}() {line}" for (name, line), n in sorted(run.reads.items(), key=lambda kv: -kv[1])]
    where += [f"{n}x {op} {line}" for (_, op, line), n in sorted(run.syncs.items(), key=lambda kv: -kv[1])]
    kinds = {kind for kind, _, _ in run.syncs}
    fix = RULES["host_sync"].fix
    if any(name in ("cpu", "numpy", "tolist") for name, _ in run.reads) or "copy" in kinds:
        fix += f"; {COLLECT_ON_DEVICE}"
    if any(f"transformers{os.sep}masking_utils" in line for line in where):
        fix += f"; {RULES['hf_mask_sync'].fix}"
    shaped = dict.fromkeys(op for kind, op, _ in run.syncs if kind == "shape")
    fix += "".join(f"; {LOWERED_REPLACEMENTS.get(op, f'{op}: {NO_DYNAMIC_SHAPE}')}" for op in shaped)
    return Finding(
        "host_sync",
        f"{syncs / len(run.measured):.2f} host sync(s) per step: each read of a device value waits for the "
        f"device and stalls the pipeline",
        fix,
        where=where,
    )


def _fallbacks(run: _Run) -> Finding | None:
    if not run.fallbacks:
        return None
    known = list(dict.fromkeys(LOWERED_REPLACEMENTS[op] for op in run.fallbacks if op in LOWERED_REPLACEMENTS))
    fix = MEASURED_FIXES["cpu_fallback_unknown"]
    return Finding(
        "cpu_fallback",
        f"{len(run.fallbacks)} op(s) have no XLA lowering and ran on the host CPU, copying tensors each way: "
        f"{', '.join(run.fallbacks)}",
        "; ".join(f"use {k}" for k in known) if known else fix,
    )


def _analyse(run: _Run, mode: Mode, model: nn.Module | None,
             static: list[Finding | None]) -> tuple[list[Finding | None], list[str]]:  # fmt: skip
    """Findings from the steps that ran (given the static ones, which may explain them)."""
    if not run.measured:
        return [], []
    if model is None and run.created == 0 and not run.eager:  # an eager backend counts no tensors
        return [_nothing_ran()], []
    growth = _growth(run, mode)
    if any(f is not None and f.kind == "optimizer_params" for f in static):
        growth = None  # its zero_grad() clears the copies, so the model's own gradients pile up: a symptom
    slicing = _slicing(run)
    shapes = _shape_recompiles(run, mode)
    same, notes = _same_shape_compiles(run, explained=growth is not None or slicing is not None)
    return [growth, shapes, same, slicing, _host_syncs(run), _fallbacks(run)], notes


def _nothing_ran() -> Finding:
    return Finding(
        "not_on_xla",
        "nothing in the step ran on XLA (it created no XLA tensor): the model and the batches stay on the CPU",
        RULES["not_on_xla"].fix,
    )


# ---------------------------------------------------------------- the entry
def _plan(batch: Any, batches: Iterable[Any] | None, steps: int | Literal["all"], warmup: int) -> Iterator[Any]:
    if batch is not None:
        if steps == "all":
            raise ValueError("steps='all' runs a whole loader: give batches=loader, not batch=")
        return itertools.repeat(batch, warmup + steps)
    if steps == "all":
        return iter(batches)
    pool = list(itertools.islice(iter(batches), warmup + steps))
    if not pool:
        raise ValueError("batches is empty")
    return itertools.islice(itertools.cycle(pool), warmup + steps)


def _check_arguments(steps: Any, warmup: Any, mode: Any, batch: Any, batches: Any) -> None:
    if (batch is None) == (batches is None):
        raise ValueError("give exactly one of batch= (one batch, reused) or batches= (several, used in turn)")
    for name, value, low in (("steps", steps, 1), ("warmup", warmup, 0)):
        allowed = f"an int >= {low}" + (" or 'all' (every batch of batches=)" if name == "steps" else "")
        if name == "steps" and value == "all":
            continue
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"{name} must be {allowed}, but given {value!r} ({type(value).__name__})")
        if isinstance(value, str) or value < low:
            raise ValueError(f"{name} must be {allowed}, but given {value!r}")
    if mode not in get_args(Mode):
        raise ValueError(f"mode must be one of {get_args(Mode)}, but given {mode!r}")


def _eager_notes() -> list[str]:
    """How doctor measured on an eager backend, where a reader could take it for something else."""
    name = backend.current().name
    notes = []
    if not backend.is_accelerated(backend.current().devices.device()):
        notes.append("on the CPU nothing waits for a host sync: doctor counts the ops that would make a GPU or "
                     "TPU wait")  # fmt: skip
    wanted = backend.pjrt_device()
    if wanted and not backend.XLA_INSTALLED:
        notes.append(f"PJRT_DEVICE={wanted!r} is set but torch_xla is not installed: doctor measured the step on "
                     f"the {name} backend; to measure it on XLA, install it ({backend.INSTALL_HINT}) and call "
                     f"setup_tpu() in the first cell")  # fmt: skip
    elif backend.XLA_INSTALLED:
        notes.append(f"torch_xla is installed but not in use (PJRT_DEVICE is not set and no TPU is attached): "
                     f"doctor measured the step on the {name} backend; to measure it on XLA, call setup_tpu() in "
                     f"the first cell (PJRT_DEVICE=CPU runs XLA on the host)")  # fmt: skip
    return notes


def _report(run: _Run, mode: Mode, findings: list[Finding | None], notes: list[str]) -> DoctorReport:
    measured = max(len(run.measured), 1)
    compiles = [s.compiles for s in run.measured]
    return DoctorReport(
        steps=len(run.measured),
        warmup=len(run.warmup),
        compiles_per_step=None if run.eager else sum(compiles) / measured,
        host_syncs_per_step=max(sum(run.reads.values()), run.host_syncs) / measured,
        fallback_ops=run.fallbacks,
        findings=[f for f in findings if f is not None],
        mode=mode,
        step_compiles=[] if run.eager else compiles,
        notes=notes + (_eager_notes() if run.eager else []),
        measured_on=backend.current().name,
        unmeasured=list(backend.current().diagnosis.unmeasured()),
        graphs=[(i, g) for i, s in enumerate(run.records, 1) for g in s.graphs],
    )


def _as_step(step: Any, model: nn.Module | None, optimizer: Any, loss_fn: Callable | None,
             mode: Mode) -> tuple[Callable[[Any], Any], nn.Module | None]:  # fmt: skip
    """(the step to run, the model): a model given as the step runs doctor's default step."""
    if isinstance(step, nn.Module):
        if optimizer is None and mode == "train":
            raise TypeError("doctor(model, ...) needs optimizer=...; or pass your own step(batch) callable")
        return _default_step(step, optimizer, loss_fn, mode), step
    if not callable(step):
        raise TypeError(f"step must be a callable step(batch) or an nn.Module, but given {step!r}")
    return step, model


def _first_batch(plan: Iterator[Any]) -> tuple[Iterator[Any], Any]:
    """The batches to run (the first one put back) and the first one."""
    first = next(plan, None)
    if first is None:
        raise ValueError("batches is empty")
    return itertools.chain([first], plan), first


def _static_findings(run: _Run, model: nn.Module | None, optimizer: Any) -> tuple[list[Finding | None], bool]:
    """The checks made before any step (optimizer, device, ties), and whether the model is where doctor can measure."""
    findings: list[Finding | None] = [check_device(model) if run.eager else check_xla(model)]
    if model is not None and optimizer is not None:
        findings.insert(0, check_optimizer(model, optimizer))
    if findings[-1] is not None:
        return findings, False
    if model is not None:
        findings.append(check_ties(model))
    return findings, True


def _failed(run: _Run, mode: Mode, model: nn.Module | None, findings: list[Finding | None],
            error: BaseException) -> DoctorError:  # fmt: skip
    """The error to raise when the step raised: the findings so far, the step that failed, and its cause."""
    report = _report(run, mode, findings + _analyse(run, mode, model, findings)[0] + [check_error(error)], [])
    report.error, report.error_step = error, len(run.records) + 1
    return DoctorError(report)


def doctor(
    step: Callable[[Any], Any] | nn.Module,
    batch: Any = None,
    *,
    batches: Iterable[Any] | None = None,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    loss_fn: Callable | None = None,
    steps: int | Literal["all"] = 4,
    warmup: int = 2,
    cores: int | None = None,
    mode: Mode = "train",
) -> DoctorReport:
    """Runs your training or evaluation step as you run it and reports what slows or breaks it on XLA.

    On XLA it reads torch_xla's counters (compiles, host syncs, CPU fallbacks,
    graph growth). On the native backends (CPU, CUDA) and TorchTPU, which run
    eagerly, it names the host syncs and the input shape changes (a recompile
    under ``torch.compile(dynamic=False)`` and on XLA) with the same fixes, and
    lists in ``report.unmeasured`` what it cannot see there. On the CPU nothing
    waits for a host sync: it counts the ops that would make a GPU or TPU wait.

    Args:
        step: Your step, ``step(batch)`` (forward, backward, optimizer step; or,
            with ``mode="eval"``, your evaluation of one batch), or a model, for
            which doctor runs ``loss_fn(model(x), y)``, backward and
            ``step_optimizer(optimizer)`` (with ``mode="eval"``: the loss under
            no_grad, accumulated on the device).
        batch: One batch, used for every step.
        batches: Or several batches (a list or a DataLoader), used in turn; this
            is how shape changes between steps show up.
        model, optimizer: Enable the device, optimizer and tied-weight checks (needed
            when ``step`` is a callable; ``step`` itself when it is a model).
        loss_fn: For the model form; default ``nn.CrossEntropyLoss()``.
        steps: Steps measured after warm-up, or ``"all"``: every batch of
            ``batches`` after the warm-up, the last (short) one included.
        warmup: Steps run first (the first steps compile by design).
        cores: Cores the batch is split over; default the cores in use.
        mode: ``"train"`` or ``"eval"``: which loop the step belongs to (the fixes
            differ: drop_last in training, a masked last batch in evaluation).

    Returns:
        DoctorReport: figures per step, findings (each with a fix) and notes;
        ``report.clean`` is True when there is nothing to fix among what was
        measured (``report.unmeasured`` lists the rest on an eager backend).

    Raises:
        DoctorError: your step raised; ``err.report`` holds the findings made
            before it and ``err.__cause__`` is your exception.
        ValueError, TypeError: a bad argument (named in the message).

    Example:
        >>> # was: a loop that ran 10x slower on TPU than on GPU, and no idea why
        >>> report = doctor(train_step, batches=train_loader, steps="all",    # doctest: +SKIP
        ...                 model=model, optimizer=optimizer)
        >>> print(report)                                                      # doctest: +SKIP
        >>> doctor(eval_step, batches=valid_loader, steps="all", mode="eval")  # doctest: +SKIP
    """
    _check_arguments(steps, warmup, mode, batch, batches)
    step, model = _as_step(step, model, optimizer, loss_fn, mode)
    run = _Run(eager=not backend.current().diagnosis.counters().measured)  # eager: the backend counts nothing, doctor watches
    findings, measurable = _static_findings(run, model, optimizer)
    if not measurable:  # not on the device: nothing to measure
        return _report(run, mode, findings, [])
    plan, first = _first_batch(_plan(batch, batches, steps, warmup))
    if cores is None:
        chosen = backend.current()
        cores = chosen.sharding.global_device_count() if chosen.sharding.is_spmd() else chosen.processes.world_size()
    findings.append(check_batch_split(first, cores))
    try:
        _run(step, plan, warmup, run)
    except Exception as error:
        raise _failed(run, mode, model, findings, error) from error
    if not run.measured:
        raise ValueError(f"batches gave only {len(run.warmup)} batch(es): doctor needs more than warmup={warmup}")
    found, notes = _analyse(run, mode, model, findings)
    if steps != "all" and not any(f is not None and f.kind == "recompile" for f in found):
        found.append(check_last_batch(batches, mode, warmup + steps))
    return _report(run, mode, findings + found, notes)
