"""``python -m tpu_utility.port IN [-o OUT] [--diff]``: your script or notebook, rewritten for today's TPUs.

It reads a CUDA training loop or a Kaggle TPU kernel written for torch_xla 1.x and
writes a copy that runs on today's torch_xla (2.8 and 2.9) with the package's
hand-loop kit, then prints every change (``line: before -> after`` and why) and
every line it left that still costs speed or breaks on XLA, with the fix::

    python -m tpu_utility.port kernel.ipynb            # writes kernel_tpu.ipynb beside it
    python -m tpu_utility.port train.py -o train_xla.py
    python -m tpu_utility.port train.py --diff         # prints a unified diff, writes nothing

The input is never changed. Edits are made on the concrete syntax tree (LibCST), so
comments and formatting stay; a notebook keeps its cells, markdown and metadata, and
only changed code cells lose their outputs. IPython lines (``!pip``, ``%matplotlib``)
pass through untouched; a cell that still does not parse is left as it is and named.
The pitfalls and their fixes come from ``tpu_utility.diagnostics.rules``, the table
``doctor`` and ``check`` read too.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from . import fixers
from .fixers.tree import PORT_INSTALL, code as _code, cuda_string, dotted as _dotted, libcst as _libcst
from .rules import COLLECT_ON_DEVICE, LOWERED_REPLACEMENTS, RULES, SOURCE_FALLBACKS

EXIT_RUNS, EXIT_LEFT_BREAKS, EXIT_USAGE, EXIT_DOES_NOT_PARSE = 0, 1, 2, 3
_MAGIC = re.compile(r"^(\s*)([%!].*)$")
_MARK = "pass  # tpu_utility.port: IPython line {}"
_OPTIMIZERS = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "LBFGS",
               "SparseAdam", "Lamb", "LAMB", "Lion", "Adafactor", "create_optimizer", "create_optimizer_v2"}  # fmt: skip
_OPTIMIZER_NAME = re.compile(r"(^|\.)(opt|optim|optimizer|optimiser)(_?\w*)?$")
_RUNTIME = {"xm.xrt_world_size", "xm.get_ordinal", "xm.get_local_ordinal", "xm.is_master_ordinal", "xm.xla_device",
            "xr.world_size", "xr.global_ordinal", "xr.local_ordinal", "torch_xla.device", "make_sampler"}  # fmt: skip
_READS = {"item", "cpu", "numpy", "tolist"}
_PRINTS = {"print", "xm.master_print", "tqdm.write"}
_TENSOR_NAME = re.compile(r"^(loss|losses|logits|outputs?|preds?|predictions|probs|acc)(_\w+)?$")
_ENV_SETUP = re.compile(r"env-setup\.py|pip[3]? install[^#]*\b(torch_xla|torch-xla|cloud-tpu-client)\b|torch_xla-1\.|"
                        r"tpu-pytorch/wheels")
_KIT = ("get_device", "move_model", "step_optimizer", "autocast", "grad_scaler", "make_sampler", "inference_mode")
# micro-steps (gradient accumulation): an inner loop over range() that runs the backward pass
_MICRO = re.compile(r"micro|accum", re.I)


# ----------------------------------------------------------------- the report
@dataclass
class Change:
    """One rewrite: where, the code before and after, and the rule behind it."""

    rule: str
    where: str
    before: str
    after: str

    def __str__(self) -> str:
        why = RULES[self.rule].cost if self.rule in RULES else "the rewrites above use it"
        return f"  {self.where}: {self.before} -> {self.after}\n      why: {why}"


@dataclass
class Left:
    """A line the port kept that still costs speed or breaks on XLA, with the fix."""

    rule: str
    where: str
    code: str
    fix: str

    def __str__(self) -> str:
        return f"  {self.where}: {self.code}\n      [{self.rule}] {RULES[self.rule].cost}\n      fix: {self.fix}"


@dataclass
class PortReport:
    """What ``port`` changed, what it left, and what it could not read."""

    source: str
    output: str | None = None
    changes: list[Change] = field(default_factory=list)
    left: list[Left] = field(default_factory=list)
    untouched: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # code that does not parse: where, why; nothing ported there

    def host_syncs(self) -> list[Left]:
        return [item for item in self.left if item.rule == "host_sync"]

    def breaking(self) -> list[Left]:
        """What was left that stops the program on XLA or makes it compute something else there."""
        return [item for item in self.left if RULES[item.rule].breaks]

    def status(self) -> int:
        """The command's exit status: 0 expected to run unchanged, 1 lines left that break, 3 does not parse."""
        return EXIT_DOES_NOT_PARSE if self.failed else EXIT_LEFT_BREAKS if self.breaking() else EXIT_RUNS

    def summary(self) -> str:
        changed = len({c.where for c in self.changes if c.rule != "imports"})
        left, breaking = len({i.where for i in self.left}), len({i.where for i in self.breaking()})
        verdict = {EXIT_RUNS: "yes (what is left only costs speed)",
                   EXIT_LEFT_BREAKS: f"no: {breaking} line(s) left stop it or change what it computes on XLA",
                   EXIT_DOES_NOT_PARSE: "no: part of the input does not parse, and nothing was ported there"}  # fmt: skip
        return (f"summary: {changed} line(s) changed, {left} left; expected to run unchanged on XLA: "
                f"{verdict[self.status()]} (exit {self.status()})")

    def text(self) -> str:
        lines = [f"tpu_utility.port: {self.source} -> {self.output or '(diff only, nothing written)'}"]
        if self.failed:
            lines.append(f"does not parse ({len(self.failed)}): left as it is, nothing ported there")
            lines += [f"  {f}" for f in self.failed]
        lines.append(f"changed ({len(self.changes)}):")
        lines += [str(c) for c in self.changes] or ["  nothing"]
        lines.append(f"left as written ({len(self.left)}): still slow or wrong on XLA")
        lines += [str(item) for item in self.left] or ["  nothing"]
        if self.untouched:
            lines.append(f"not Python, passed through untouched ({len(self.untouched)}):")
            lines += [f"  {u}" for u in self.untouched]
        lines.append(self.summary())
        return "\n".join(lines)


def _add(report: PortReport, change: Change) -> None:
    """Records a change; one that contains an earlier one on its line (an inner rewrite) replaces it."""
    report.changes = [c for c in report.changes if not (c.where == change.where and c.before in change.before)]
    report.changes.append(change)


def _short(code: str, limit: int = 100) -> str:
    one = " ".join(" ".join(line for line in code.splitlines() if not line.strip().startswith("#")).split())
    return one if len(one) <= limit else one[: limit - 3] + "..."


# ------------------------------------------------------------- IPython lines
def _mask_magics(source: str) -> tuple[str, list[str]]:
    """Replaces ``!``/``%`` lines with a ``pass`` marker (so the cell parses) and returns them."""
    magics: list[str] = []
    lines = source.split("\n")
    for i, line in enumerate(lines):
        found = _MAGIC.match(line)
        if found:
            lines[i] = found.group(1) + _MARK.format(len(magics))
            magics.append(line)
    return "\n".join(lines), magics


def _unmask(code: str, magics: list[str]) -> str:
    lines = code.split("\n")
    for i, line in enumerate(lines):
        if "# tpu_utility.port: IPython line " in line:
            lines[i] = magics[int(line.rsplit(" ", 1)[1])]
    return "\n".join(lines)


# -------------------------------------------------------------- the porting
@dataclass
class _Cell:
    index: int | None  # notebook cell number (1-based), None for a script
    source: str
    magics: list[str] = field(default_factory=list)
    wrapper: Any = None  # libcst MetadataWrapper, None when the cell is not Python
    result: str | None = None

    def where(self, line: int) -> str:
        return f"line {line}" if self.index is None else f"cell {self.index}, line {line}"


@dataclass
class _Plan:
    """Decisions that span statements or cells, made before rewriting."""

    xm: set[str] = field(default_factory=set)  # names bound to torch_xla.core.xla_model
    xmp: set[str] = field(default_factory=set)  # names bound to torch_xla.distributed.xla_multiprocessing
    optimizers: set[str] = field(default_factory=set)  # code of names holding an optimizer
    samplers: dict[str, str] = field(default_factory=dict)  # make_sampler(...)'s name (None with one replica) -> shuffle
    device: str | None = None  # the module-level name of the device
    insert_before: dict[int, tuple[str, str]] = field(default_factory=dict)  # id(stmt) -> (code, model name)
    remove: set[int] = field(default_factory=set)  # id(stmt) of statements that move
    relocate: dict[int, Any] = field(default_factory=dict)  # id(stmt) -> updated stmt, moved into the spawned fn
    spawned: str | None = None  # the function a multi-process launch runs
    stuck: list[Any] = field(default_factory=list)  # top-level blocks that ask the runtime but cannot move
    imported: dict[str, str] = field(default_factory=dict)  # `from torch.x import y as z`: z -> torch.x.y
    needs: set[str] = field(default_factory=set)  # imports the rewrites need
    lines: list[str] = field(default_factory=list)  # other import lines the rewrites need
    models: set[str] = field(default_factory=set)  # names the program uses as modules (fixers.move_model)
    hf_adamw: set[str] = field(default_factory=set)  # names bound to transformers.AdamW


def _is_cuda(node: Any) -> bool:
    return cuda_string(node) is not None


def _mentions_cuda(node: Any) -> bool:
    code = _code(node)
    return "cuda" in code


def _canonical(name: str, plan: _Plan) -> str:
    """``xm.foo`` for any alias of xla_model (``import torch_xla.core.xla_model as tx`` -> ``tx.foo``)."""
    head, _, rest = name.partition(".")
    if head in plan.xm:
        return f"xm.{rest}"
    if head in plan.xmp:
        return f"xmp.{rest}"
    if name.startswith("torch_xla.core.xla_model."):
        return "xm." + name[len("torch_xla.core.xla_model."):]
    if head in plan.imported:
        return plan.imported[head] + (f".{rest}" if rest else "")
    return name


def _uses(node: Any) -> set[str]:
    cst = _libcst()
    names: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Name(self, n: Any) -> None:
            names.add(n.value)

    node.visit(Names())
    return names


def _calls(node: Any, plan: _Plan) -> set[str]:
    cst = _libcst()
    found: set[str] = set()

    class Calls(cst.CSTVisitor):
        def visit_Call(self, n: Any) -> None:
            found.add(_canonical(_dotted(n.func), plan))

    node.visit(Calls())
    return found


def _own_code(loop: Any) -> str:
    """The code a loop runs itself, without the bodies of the loops inside it (a per-step loop's test)."""
    cst = _libcst()
    parts: list[str] = []

    class Own(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node: Any) -> bool:
            parts.append(_code(node))
            return False

        def visit_For(self, node: Any) -> bool:
            return False

        def visit_While(self, node: Any) -> bool:
            return False

    for stmt in loop.body.body if isinstance(loop.body, cst.IndentedBlock) else [loop.body]:
        stmt.visit(Own())
    return "\n".join(parts)


def _per_step(loop: Any) -> bool:
    """Whether a loop runs once per step: its own code steps, or an inner micro-step loop runs the backward pass."""
    cst = _libcst()
    own = _own_code(loop)
    if ".backward(" in own or "step(" in own:
        return True
    if isinstance(loop, cst.For) and "loader" in _code(loop.iter).lower():
        return True
    inner: list[Any] = []

    class Loops(cst.CSTVisitor):
        def visit_For(self, node: Any) -> None:
            inner.append(node)

    for stmt in loop.body.body if isinstance(loop.body, cst.IndentedBlock) else []:
        stmt.visit(Loops())
    return any(_code(node.iter).startswith("range(") and _MICRO.search(_code(node.target) + _code(node.iter))
               and ".backward(" in _code(node.body) for node in inner)  # fmt: skip


def _assigned(stmt: Any) -> list[str]:
    """Names a simple ``a = ...`` / ``a, b = ...`` statement binds."""
    cst = _libcst()
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1:
        return []
    small = stmt.body[0]
    targets = []
    if isinstance(small, cst.Assign):
        targets = [t.target for t in small.targets]
    elif isinstance(small, (cst.AnnAssign, cst.AugAssign)):
        targets = [small.target]
    names = []
    for target in targets:
        if isinstance(target, cst.Name):
            names.append(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            names += [e.value.value for e in target.elements if isinstance(e.value, cst.Name)]
    return names


def _value(stmt: Any) -> Any:
    cst = _libcst()
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            return small.value
        if isinstance(small, cst.Expr):
            return small.value
    return None


def _moves_model(stmt: Any) -> tuple[str, str] | None:
    """(model, device code) for ``model.to(device)`` / ``model = model.to(device)`` / ``model.cuda()``."""
    cst = _libcst()
    value = _value(stmt)
    if isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute) and value.func.attr.value in ("to", "cuda"):
        model = _dotted(value.func.value)
        if model and "." not in model:
            device = _code(value.args[0].value) if value.func.attr.value == "to" and value.args else ""
            return model, device
    return None


def _builds_optimizer(stmt: Any) -> str | None:
    """The model whose parameters ``opt = AdamW(model.parameters(), ...)`` takes, if the statement is that."""
    cst = _libcst()
    value = _value(stmt)
    if not (isinstance(value, cst.Call) and _dotted(value.func).rsplit(".", 1)[-1] in _OPTIMIZERS):
        return None
    for arg in value.args:
        inner = arg.value
        if isinstance(inner, cst.Call) and isinstance(inner.func, cst.Attribute) and inner.func.attr.value in (
            "parameters", "named_parameters"):  # fmt: skip
            return _dotted(inner.func.value) or None
        if isinstance(inner, cst.Name):
            return inner.value
    return None


def _analyse(cells: list[_Cell], plan: _Plan) -> None:
    cst = _libcst()
    modules = [c.wrapper.module for c in cells if c.wrapper is not None]
    for module in modules:

        class Imports(cst.CSTVisitor):
            def visit_Import(self, node: Any) -> None:
                for alias in node.names:
                    name = _dotted(alias.name)
                    bound = alias.asname.name.value if alias.asname else name
                    if name == "torch_xla.core.xla_model":
                        plan.xm.add(bound)
                    if name == "torch_xla.distributed.xla_multiprocessing":
                        plan.xmp.add(bound)

            def visit_ImportFrom(self, node: Any) -> None:
                module = _dotted(node.module) if node.module is not None else ""
                if module.split(".")[0] == "torch" and not isinstance(node.names, cst.ImportStar):
                    for alias in node.names:
                        bound = alias.asname.name.value if alias.asname else alias.name.value
                        plan.imported[bound] = f"{module}.{alias.name.value}"

            def visit_Assign(self, node: Any) -> None:
                if isinstance(node.value, cst.Call):
                    callee = _dotted(node.value.func).rsplit(".", 1)[-1]
                    if callee in _OPTIMIZERS:
                        plan.optimizers.update(_dotted(t.target) for t in node.targets if _dotted(t.target))

        module.visit(Imports())
    for module in modules:
        for analyse in fixers.ANALYSES:
            analyse(module, plan)
    # the device's module-level name, and the function a multi-process launch runs
    top = [(cell, stmt) for cell in cells if cell.wrapper is not None for stmt in cell.wrapper.module.body]
    for _, stmt in top:
        value = _value(stmt)
        names = _assigned(stmt)
        if names and value is not None and plan.device is None and _device_expression(value, plan):
            plan.device = names[0]
        if isinstance(value, cst.Call) and _canonical(_dotted(value.func), plan) in ("xmp.spawn", "torch_xla.launch"):
            if value.args and isinstance(value.args[0].value, cst.Name):
                plan.spawned = value.args[0].value.value
    _plan_blocks(cells, plan)


def _device_expression(value: Any, plan: _Plan) -> bool:
    cst = _libcst()
    if isinstance(value, cst.IfExp):
        return _mentions_cuda(value.test)
    if isinstance(value, cst.Call):
        callee = _canonical(_dotted(value.func), plan)
        if callee == "torch.device":
            return bool(value.args) and (_is_cuda(value.args[0].value) or isinstance(value.args[0].value, cst.IfExp))
        return callee in ("xm.xla_device", "torch_xla.device", "get_device")
    return False


def _plan_blocks(cells: list[_Cell], plan: _Plan) -> None:
    """The optimizer-before-move order and the runtime-before-spawn statements, per block of statements."""
    cst = _libcst()
    top = [stmt for cell in cells if cell.wrapper is not None for stmt in cell.wrapper.module.body]
    blocks = [top]
    for stmt in top:
        for node in _function_defs(stmt):
            if isinstance(node.body, cst.IndentedBlock):
                blocks.append(list(node.body.body))
    for block in blocks:
        _plan_move_first(block, plan)
    defined = {node.name.value for stmt in top for node in _function_defs(stmt)}
    if plan.spawned in defined:
        _plan_relocation(top, plan)


def _function_defs(stmt: Any) -> list[Any]:
    cst = _libcst()
    found = []

    class Defs(cst.CSTVisitor):
        def visit_FunctionDef(self, node: Any) -> None:
            found.append(node)

    stmt.visit(Defs())
    return found


def _plan_move_first(block: list[Any], plan: _Plan) -> None:
    """An optimizer built before its model moves: the move goes first (the Hugging Face course's order)."""
    defined: set[str] = set()
    for i, stmt in enumerate(block):
        model = _builds_optimizer(stmt)
        if model:
            for later in block[i + 1:]:
                moved = _moves_model(later)
                if moved and moved[0] == model:
                    device = moved[1] if moved[1] in defined else "get_device()"
                    if device == "get_device()":
                        plan.needs.add("get_device")
                    plan.needs.add("move_model")  # keeps tied weights tied (fixers.move_model)
                    plan.insert_before[id(stmt)] = (f"move_model({model}, {device})", model)
                    if _assigned(later) == []:  # a bare model.to(device) is now done; model = model.to(...) stays
                        plan.remove.add(id(later))
                    break
        defined.update(_assigned(stmt))


def _plan_relocation(top: list[Any], plan: _Plan) -> None:
    """Top-level statements that ask the XLA runtime before the launch move into the launched function."""
    cst = _libcst()
    moving: list[Any] = []
    bound: set[str] = set()
    for stmt in top:
        value = _value(stmt)
        if isinstance(value, cst.Call) and _canonical(_dotted(value.func), plan) in ("xmp.spawn", "torch_xla.launch"):
            break
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            continue  # they run later, in the launched process
        asks = bool(_calls(stmt, plan) & _RUNTIME) or bool(_uses(stmt) & bound)
        if not asks:
            continue
        if isinstance(stmt, cst.SimpleStatementLine):
            moving.append(stmt)
            bound.update(_assigned(stmt))
        else:
            plan.stuck.append(stmt)
    for stmt in moving:
        plan.relocate[id(stmt)] = None


class _Porter:
    """Builds the LibCST transformer for one cell (kept as a factory so libcst is imported lazily)."""

    @staticmethod
    def make(cell: _Cell, plan: _Plan, report: PortReport) -> Any:
        cst = _libcst()
        from libcst.metadata import PositionProvider

        class Transformer(cst.CSTTransformer):
            METADATA_DEPENDENCIES = (PositionProvider,)

            def __init__(self) -> None:
                super().__init__()
                self.loops: list[bool] = []  # per enclosing loop: does it run per step?
                self.guards: list[bool] = []  # per enclosing if: does its test mention CUDA?
                self.device_stack: list[str | None] = [plan.device]
                self.reported: set[tuple[str, int]] = set()
                self.plan = plan

            # ------------------------------------------------------ helpers
            def line(self, node: Any) -> int:
                return self.get_metadata(PositionProvider, node).start.line

            def change(self, rule: str, original: Any, updated: Any) -> None:
                _add(report, Change(rule, cell.where(self.line(original)), _short(_code(original)), _short(_code(updated))))

            def leave_alone(self, rule: str, original: Any, fix: str | None = None, code: str | None = None) -> None:
                key = (rule, self.line(original))
                if key not in self.reported:
                    self.reported.add(key)
                    report.left.append(Left(rule, cell.where(key[1]), code or _short(_code(original)),
                                            fix or RULES[rule].fix))  # fmt: skip

            def need(self, name: str) -> None:
                plan.needs.add(name)

            def device(self) -> str:
                name = self.device_stack[-1]
                if name:
                    return name
                plan.needs.add("get_device")
                return "get_device()"

            # ------------------------------------------------------- scopes
            def visit_FunctionDef(self, node: Any) -> None:
                self.device_stack.append(self.device_stack[-1])

            def leave_FunctionDef(self, original: Any, updated: Any) -> Any:
                self.device_stack.pop()
                return updated

            def visit_For(self, node: Any) -> None:
                self.loops.append(_per_step(node))

            def leave_For(self, original: Any, updated: Any) -> Any:
                self.loops.pop()
                return updated

            def visit_While(self, node: Any) -> None:
                self.loops.append(_per_step(node))

            def leave_While(self, original: Any, updated: Any) -> Any:
                self.loops.pop()
                return updated

            def visit_If(self, node: Any) -> None:
                self.guards.append(_mentions_cuda(node.test))

            def leave_If(self, original: Any, updated: Any) -> Any:
                self.guards.pop()
                test, body = _code(original.test), _code(original.body)
                if _mentions_cuda(original.test) and re.search(r"autocast|GradScaler|\bamp\b", body):
                    self.leave_alone("cuda_guard", original, code=f"if {_short(test)}:")
                return fixers.apply("If", self, original, updated) or updated

            def visit_BooleanOperation(self, node: Any) -> None:
                """``torch.cuda.is_available() and torch.cuda.is_bf16_supported()``: the right side is guarded."""
                self.guards.append(isinstance(node.operator, cst.And) and "is_available()" in _code(node.left))

            def leave_BooleanOperation(self, original: Any, updated: Any) -> Any:
                self.guards.pop()
                return updated

            def leave_Assert(self, original: Any, updated: Any) -> Any:
                return fixers.apply("Assert", self, original, updated) or updated

            def leave_Import(self, original: Any, updated: Any) -> Any:
                return fixers.apply("Import", self, original, updated) or updated

            # ------------------------------------------------- statements
            def leave_SimpleStatementLine(self, original: Any, updated: Any) -> Any:
                key = id(original)
                if key in plan.relocate:  # its blank lines stay behind, its comments go with it
                    plan.relocate[key] = updated.with_changes(
                        leading_lines=[line for line in updated.leading_lines if line.comment is not None])
                    report.changes.append(Change("runtime_before_spawn", cell.where(self.line(original)),
                                                 _short(_code(original)),
                                                 f"(moved into {plan.spawned}(), which the launch runs)"))  # fmt: skip
                    return cst.RemovalSentinel.REMOVE
                if key in plan.remove:
                    report.changes.append(Change("optimizer_params", cell.where(self.line(original)),
                                                 _short(_code(original)), "(moved up, before the optimizer is built)"))  # fmt: skip
                    return cst.RemovalSentinel.REMOVE
                if key in plan.insert_before:
                    code, _ = plan.insert_before[key]
                    moved = cst.parse_statement(f"{code}  # tpu_utility.port: before the optimizer is built\n")
                    report.changes.append(Change("optimizer_params", cell.where(self.line(original)),
                                                 _short(_code(original)), f"{code}; {_short(_code(updated))}"))  # fmt: skip
                    return cst.FlattenSentinel([moved, updated])
                return fixers.apply("SimpleStatementLine", self, original, updated) or self._sets_epoch(original, updated)

            def _sets_epoch(self, original: Any, updated: Any) -> Any:
                value = _value(updated)
                if (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
                        and value.func.attr.value == "set_epoch" and _dotted(value.func.value) in plan.samplers):  # fmt: skip
                    name = _dotted(value.func.value)
                    guarded = cst.parse_statement(f"if {name} is not None:  # one replica: make_sampler gave None\n"
                                                  f"    {_code(value)}\n")  # fmt: skip
                    self.change("distributed_sampler", original, guarded)
                    return guarded
                return updated

            def leave_Assign(self, original: Any, updated: Any) -> Any:
                updated = fixers.apply("Assign", self, original, updated) or updated
                target = _code(original.targets[0].target).replace(" ", "")
                if re.fullmatch(r"os\.environ\[['\"]XLA_(USE|DOWNCAST)_BF16['\"]\]", target):
                    self.leave_alone("xla_use_bf16", original)
                if isinstance(updated.value, cst.Call) and _dotted(updated.value.func) == "make_sampler":
                    shuffle = next((_code(a.value) for a in updated.value.args[1:]
                                    if a.keyword is None or a.keyword.value == "shuffle"), "True")  # fmt: skip
                    for name in _assigned(cst.SimpleStatementLine([updated])):
                        plan.samplers[name] = shuffle
                return updated

            def leave_ImportFrom(self, original: Any, updated: Any) -> Any:
                """``from torch.cuda.amp import autocast, GradScaler``: the kit's names replace these."""
                fixed = fixers.apply("ImportFrom", self, original, updated)
                if fixed is not None:
                    return fixed
                module = _dotted(updated.module) if updated.module is not None else ""
                if module not in ("torch", "torch.amp", "torch.cuda.amp") or isinstance(updated.names, cst.ImportStar):
                    return updated
                kept = [a for a in updated.names if a.name.value not in ("autocast", "GradScaler")]
                if len(kept) == len(updated.names):
                    return updated
                if not kept:
                    self.change("cuda_amp", original, cst.Name("removed"))
                    return cst.RemovalSentinel.REMOVE
                new = updated.with_changes(names=[*kept[:-1], kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
                self.change("cuda_amp", original, new)
                return new

            # -------------------------------------------------- expressions
            def leave_IfExp(self, original: Any, updated: Any) -> Any:
                fixed = fixers.apply("IfExp", self, original, updated)
                if fixed is not None:
                    return fixed
                if _mentions_cuda(original.test) and ("cuda" in _code(original.body)):
                    new = cst.parse_expression("get_device()")
                    plan.needs.add("get_device")
                    self.change("cuda_device", original, new)
                    return new
                return updated

            def leave_Arg(self, original: Any, updated: Any) -> Any:
                if updated.keyword is not None and updated.keyword.value == "device" and _is_cuda(updated.value):
                    new = updated.with_changes(value=cst.parse_expression(self.device()))
                    self.change("cuda_device", original, new)
                    return new
                return updated

            def leave_Call(self, original: Any, updated: Any) -> Any:
                name = _canonical(_dotted(updated.func), plan)
                last = updated.func.attr.value if isinstance(updated.func, cst.Attribute) else name.rsplit(".", 1)[-1]
                self._report_call(original, name, last)
                new = fixers.apply("Call", self, original, updated) or self._rewrite(updated, name, last)
                if new is not None:
                    return new
                return updated

            def _report_call(self, original: Any, name: str, last: str) -> None:
                if last in _READS and isinstance(original.func, cst.Attribute) and any(self.loops):
                    fix = RULES["host_sync"].fix + (f"; {COLLECT_ON_DEVICE}" if last != "item" else "")
                    self.leave_alone("host_sync", original, fix)
                if name in _PRINTS and any(self.loops) and self._prints_a_tensor(original):
                    self.leave_alone("host_sync", original)
                if last in SOURCE_FALLBACKS and (name.startswith(("torch.", "nn.", "F.")) or
                                                 isinstance(original.func, cst.Attribute)):  # fmt: skip
                    if last != "unique" or name.startswith("torch.") or not original.args:
                        self.leave_alone("cpu_fallback", original, LOWERED_REPLACEMENTS[SOURCE_FALLBACKS[last]])
                if name.startswith("torch.cuda.") and last not in ("is_available", "device_count"):
                    if not any(self.guards) and "amp." not in name:
                        self.leave_alone("cuda_call", original)

            @staticmethod
            def _prints_a_tensor(call: Any) -> bool:
                """A print of a name that holds a tensor by its name (loss, logits, outputs, preds), not a read of it."""
                found: list[str] = []

                class Names(cst.CSTVisitor):
                    def visit_Call(self, node: Any) -> bool:
                        return False  # loss.item() is counted as a read; len(x) is no sync

                    def visit_Attribute(self, node: Any) -> bool:
                        found.append(_dotted(node).rsplit(".", 1)[-1])
                        return False

                    def visit_Name(self, node: Any) -> None:
                        found.append(node.value)

                for arg in call.args:
                    arg.value.visit(Names())
                return any(_TENSOR_NAME.search(n) for n in found)

            def leave_Subscript(self, original: Any, updated: Any) -> Any:
                fixers.apply("Subscript", self, original, updated)  # reports only
                if any(isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.Comparison) for e in original.slice):
                    self.leave_alone("dynamic_shape", original)
                return updated

            def _rewrite(self, updated: Any, name: str, last: str) -> Any:
                args = updated.args
                # -- the device
                if name == "torch.device" and args and (_is_cuda(args[0].value) or _code(args[0].value) in (
                        "get_device()", "get_device().type", "str(get_device())")):  # fmt: skip
                    plan.needs.add("get_device")
                    return self._changed("cuda_device", updated, "get_device()")
                if last == "cuda" and isinstance(updated.func, cst.Attribute) and not name.startswith("torch.cuda"):
                    kept = [a for a in args if a.keyword is not None and a.keyword.value == "non_blocking"]
                    rest = "".join(f", {_code(a).strip().rstrip(',')}" for a in kept)
                    return self._changed("cuda_move", updated, f"{_code(updated.func.value)}.to({self.device()}{rest})")
                if last == "to" and isinstance(updated.func, cst.Attribute) and args and _is_cuda(args[0].value):
                    new = updated.with_changes(args=[args[0].with_changes(value=cst.parse_expression(self.device())),
                                                     *args[1:]])  # fmt: skip
                    return self._record("cuda_device", updated, new)
                # -- the optimizer step
                if last == "step" and isinstance(updated.func, cst.Attribute) and not args:
                    owner = _code(updated.func.value)
                    if owner in plan.optimizers or (_OPTIMIZER_NAME.search(owner) and "sched" not in owner):
                        plan.needs.add("step_optimizer")
                        return self._changed("optimizer_step", updated, f"step_optimizer({owner})")
                # -- mixed precision
                if name in ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "autocast") or (
                        name in ("partial", "functools.partial") and args and
                        _dotted(args[0].value) in ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast")):  # fmt: skip
                    return self._autocast(updated, name)
                if name in ("torch.cuda.amp.GradScaler", "torch.amp.GradScaler", "GradScaler"):
                    kept = [a for a in args if a.keyword is not None and a.keyword.value != "device"]
                    plan.needs.add("grad_scaler")
                    return self._changed("cuda_amp", updated, f"grad_scaler({', '.join(_code(a).strip().rstrip(',') for a in kept)})")
                if name == "torch.inference_mode":
                    plan.needs.add("inference_mode")
                    return self._record("inference_mode", updated, updated.with_changes(func=cst.Name("inference_mode")))
                # -- samplers
                if last == "DistributedSampler":
                    return self._sampler(updated)
                if last == "DataLoader":
                    return self._loader(updated)
                # -- torch_xla 1.x
                renamed = {"xm.xrt_world_size": ("xrt_world_size", "xr.world_size", "xr"),
                           "xm.get_ordinal": ("get_ordinal", "xr.global_ordinal", "xr"),
                           "xm.xla_device": ("xla_device", "torch_xla.device", "torch_xla"),
                           "xm.mark_step": ("mark_step", "torch_xla.sync", "torch_xla")}  # fmt: skip
                if name in renamed:
                    rule, new_name, module = renamed[name]
                    plan.needs.add(module)
                    kept = [a for a in args if not (a.keyword is not None and a.keyword.value == "devkind")]
                    return self._record(rule, updated, updated.with_changes(func=cst.parse_expression(new_name), args=kept))
                if name == "xmp.spawn":
                    kept = [a for i, a in enumerate(args)
                            if not ((a.keyword is not None and a.keyword.value == "nprocs") or (a.keyword is None and i == 2))]
                    if len(kept) != len(args):
                        last_arg = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                        return self._record("spawn_nprocs", updated, updated.with_changes(args=[*kept[:-1], last_arg]))
                return None

            def _autocast(self, updated: Any, name: str) -> Any:
                args = list(updated.args)
                if name in ("partial", "functools.partial"):
                    kept = [a for a in args[1:] if a.keyword is not None and a.keyword.value in ("dtype", "enabled")]
                    plan.needs.add("autocast")
                    text = ", ".join(["autocast", *(_code(a).strip().rstrip(",") for a in kept)])
                    return self._changed("cuda_amp", updated, f"{_code(updated.func)}({text})")
                # positional arguments by name: torch.cuda.amp.autocast(enabled, dtype), torch.autocast(device_type, dtype, enabled)
                order = ("enabled", "dtype") if name == "torch.cuda.amp.autocast" else ("device_type", "dtype", "enabled")
                named = {(a.keyword.value if a.keyword is not None else order[i] if i < len(order) else ""): a.value
                         for i, a in enumerate(args)}  # fmt: skip
                kept = [f"{k}={_code(named[k])}" for k in ("dtype", "enabled") if k in named]
                plan.needs.add("autocast")
                return self._changed("cuda_amp", updated, f"autocast({', '.join(kept)})")

            def _sampler(self, updated: Any) -> Any:
                args = updated.args
                if any(a.keyword is not None and a.keyword.value in ("num_replicas", "rank") for a in args):
                    return None  # a torch_xla kernel's: its world size and rank calls are ported one by one
                kept = [args[0]] + [a for a in args[1:] if a.keyword is not None and a.keyword.value in
                                    ("shuffle", "seed", "drop_last")]  # fmt: skip
                plan.needs.add("make_sampler")
                text = ", ".join(_code(a).strip().rstrip(",") for a in kept)
                return self._changed("distributed_sampler", updated, f"make_sampler({text})")

            def _loader(self, updated: Any) -> Any:
                sampler = next((a for a in updated.args if a.keyword is not None and a.keyword.value == "sampler"), None)
                if sampler is None or _dotted(sampler.value) not in plan.samplers:
                    return None
                name = _dotted(sampler.value)
                wanted = plan.samplers[name]
                if wanted == "False":
                    return None  # in order either way
                value = cst.parse_expression(f"{name} is None" if wanted == "True" else f"({wanted}) and {name} is None")
                given = next((a for a in updated.args if a.keyword is not None and a.keyword.value == "shuffle"), None)
                if given is not None:
                    args = [a.with_changes(value=value) if a is given else a for a in updated.args]
                else:
                    last = updated.args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
                    shuffle = cst.Arg(value, keyword=cst.Name("shuffle"), equal=cst.AssignEqual(
                        cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))  # fmt: skip
                    args = [*updated.args[:-1], last, shuffle]
                return self._record("distributed_sampler", updated, updated.with_changes(args=args))

            def _changed(self, rule: str, updated: Any, code: str) -> Any:
                return self._record(rule, updated, cst.parse_expression(code))

            def _record(self, rule: str, updated: Any, new: Any) -> Any:
                original = self._current  # the node being left (on_leave sets it)
                _add(report, Change(rule, cell.where(self.line(original)), _short(_code(original)), _short(_code(new))))
                return new

            def on_leave(self, original: Any, updated: Any) -> Any:
                self._current = original
                return super().on_leave(original, updated)

        return Transformer()


def _spawned_function_gets(module: Any, plan: _Plan, statements: list[Any]) -> Any:
    """Inserts the relocated statements (with a ``global`` line) at the top of the launched function."""
    cst = _libcst()
    names = ", ".join(sorted({n for s in statements for n in _assigned(s)}))
    head = [cst.parse_statement(f"global {names}  # tpu_utility.port: built here, in each launched process\n")]

    class Insert(cst.CSTTransformer):
        def leave_FunctionDef(self, original: Any, updated: Any) -> Any:
            if original.name.value != plan.spawned:
                return updated
            body = list(updated.body.body)
            start = 1 if body and _is_docstring(body[0]) else 0
            return updated.with_changes(body=updated.body.with_changes(body=[*body[:start], *head, *statements,
                                                                             *body[start:]]))  # fmt: skip

    return module.visit(Insert())


def _is_docstring(stmt: Any) -> bool:
    cst = _libcst()
    return isinstance(_value(stmt), (cst.SimpleString, cst.ConcatenatedString)) and isinstance(
        stmt.body[0], cst.Expr)


def _imports(plan: _Plan, existing: str) -> list[str]:
    lines = []
    if "torch_xla" in plan.needs and not re.search(r"^import torch_xla\s*$", existing, re.M):
        lines.append("import torch_xla")
    if "xr" in plan.needs and "torch_xla.runtime as xr" not in existing:
        lines.append("import torch_xla.runtime as xr")
    lines += [line for line in dict.fromkeys(plan.lines) if line not in existing]
    kit = [name for name in _KIT if name in plan.needs]
    if kit:
        lines.append(f"from tpu_utility import {', '.join(kit)}")
    return lines


def _add_imports(cells: list[_Cell], plan: _Plan, report: PortReport) -> None:
    """Puts the imports the rewrites need after the first block of imports (first cell with one)."""
    cst = _libcst()
    existing = "\n".join(c.result or "" for c in cells)
    lines = _imports(plan, existing)
    if not lines:
        return
    # after the user's own torch_xla imports (their environment variables come before them), else after the
    # first block of imports
    xla = re.compile(r"^(import torch_xla|from torch_xla)", re.M)
    target = next((c for c in cells if c.result is not None and xla.search(c.result)),
                  next((c for c in cells if c.result is not None and re.search(r"^(import|from) ", c.result, re.M)),
                       next((c for c in cells if c.result is not None), None)))  # fmt: skip
    if target is None:
        return
    module = cst.parse_module(target.result)
    body = list(module.body)
    at, seen, after_xla = 0, False, xla.search(target.result) is not None
    for i, stmt in enumerate(body):
        imports = isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
        if imports and (not after_xla or xla.match(_code(stmt).lstrip())):
            at, seen = i + 1, True
        elif not seen and isinstance(stmt, cst.SimpleStatementLine) and (_is_docstring(stmt) or "IPython line" in _code(stmt)):
            at = i + 1  # after a docstring or the IPython lines that open the cell
        elif not after_xla and not imports:
            break
    new = [cst.parse_statement(line + "  # tpu_utility.port\n") for line in lines]
    target.result = module.with_changes(body=[*body[:at], *new, *body[at:]]).code
    line = len(module.with_changes(body=body[:at]).code.splitlines()) + 1 if at else 1
    for n, code in enumerate(lines):
        report.changes.append(Change("imports", target.where(line + n), "(nothing)", code))


def _parse(cell: _Cell, ipython: bool, report: PortReport) -> None:
    """Parses a cell as it is, else (``ipython``) with its ``!``/``%`` lines masked; names it when neither parses.

    A ``.py`` file has no IPython lines: a continuation line that starts with ``%`` or ``!=`` is Python.
    """
    cst = _libcst()
    from libcst.metadata import MetadataWrapper

    text = cell.source
    try:
        module = cst.parse_module(text)
    except cst.ParserSyntaxError as error:
        module, failure = None, error
        if ipython:
            text, cell.magics = _mask_magics(cell.source)
            try:
                module = cst.parse_module(text)
            except cst.ParserSyntaxError as masked_error:
                failure = masked_error
        if module is None:
            try:  # Python's own message says why (LibCST's says where)
                compile(text, "<port>", "exec")
                line, why = failure.raw_line, _short(str(failure).splitlines()[0], 60)
            except SyntaxError as syntax:
                line, why = syntax.lineno or failure.raw_line, syntax.msg
            report.failed.append(f"{cell.where(line)}: {why}")
            cell.magics = []
            return
    cell.wrapper = MetadataWrapper(module, unsafe_skip_copy=True)


def _port_cells(sources: list[str], indexed: bool, report: PortReport, ipython: bool = True) -> list[str | None]:
    """Ports code cells (a script is one); returns each cell's new source, None where unchanged."""
    cst = _libcst()

    cells = []
    for n, source in enumerate(sources):
        cell = _Cell(n + 1 if indexed else None, source)
        first = source.lstrip().split("\n", 1)[0]
        if first.startswith("%%"):
            report.untouched.append(f"{cell.where(1).rsplit(',', 1)[0]}: a cell magic ({_short(first, 40)}): "
                                    f"left as it is")  # fmt: skip
        else:
            _parse(cell, ipython, report)
            for line in cell.magics:
                where = cell.where(source.split("\n").index(line) + 1)
                if _ENV_SETUP.search(line):
                    report.left.append(Left("env_setup", where, _short(line.strip()), RULES["env_setup"].fix))
                else:
                    report.untouched.append(f"{where}: {_short(line.strip(), 60)} (IPython)")
        cells.append(cell)
    plan = _Plan()
    _analyse(cells, plan)
    for cell in cells:
        if cell.wrapper is not None:
            cell.result = cell.wrapper.visit(_Porter.make(cell, plan, report)).code
    moved = [stmt for stmt in plan.relocate.values() if stmt is not None]
    if moved:
        for cell in cells:
            if cell.result is not None and re.search(rf"^def {plan.spawned}\(", cell.result, re.M):
                cell.result = _spawned_function_gets(cst.parse_module(cell.result), plan, moved).code
    for stmt in plan.stuck:
        report.left.append(Left("runtime_before_spawn", "before the launch", _short(_code(stmt)), RULES["runtime_before_spawn"].fix))
    _add_imports(cells, plan, report)
    report.changes.sort(key=lambda c: _order(c.where))
    report.left.sort(key=lambda item: _order(item.where))
    out: list[str | None] = []
    for cell in cells:
        new = None if cell.result is None else _unmask(cell.result, cell.magics)
        out.append(new if new is not None and new != cell.source else None)
    return out


def _order(where: str) -> tuple[int, int]:
    numbers = [int(n) for n in re.findall(r"\d+", where)]
    return (numbers[0], numbers[1]) if len(numbers) > 1 else (0, numbers[0] if numbers else 0)


# ----------------------------------------------------------------- entries
def port_source(source: str, name: str = "<source>") -> tuple[str, PortReport]:
    """Ports a script's text.

    Returns:
        The new text, and the report.

    Example:
        >>> new, report = port_source('device = torch.device("cuda")\\n')   # doctest: +SKIP
        >>> new                                                               # doctest: +SKIP
        'device = get_device()\\n'
    """
    report = PortReport(name)
    new = _port_cells([source], indexed=False, report=report)[0]
    return (source if new is None else new), report


def default_output(path: str) -> str:
    """``kernel.ipynb`` -> ``kernel_tpu.ipynb`` beside it."""
    stem, suffix = os.path.splitext(path)
    return f"{stem}_tpu{suffix}"


def port_file(path: str, output: str | None = None, diff: bool = False) -> tuple[PortReport, str]:
    """Ports a ``.py`` script or ``.ipynb`` notebook into ``output`` (or returns a diff); never changes ``path``.

    Args:
        path: The script or notebook.
        output: Where to write; None for ``default_output(path)``.
        diff: Write nothing; return a unified diff instead.

    Returns:
        The report, and the unified diff ("" unless ``diff``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` is not a .py or .ipynb file, or ``output`` is ``path``.

    Example:
        >>> # was: editing a forked notebook by hand, line by line
        >>> report, _ = port_file("kernel.ipynb")       # doctest: +SKIP
        >>> print(report.text())                        # doctest: +SKIP
    """
    suffix = os.path.splitext(path)[1]
    if suffix not in (".py", ".ipynb"):
        raise ValueError(f"port reads a .py script or an .ipynb notebook, but given {path!r}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    output = output or default_output(path)
    if os.path.abspath(output) == os.path.abspath(path):
        raise ValueError(f"output {output!r} is the input: port never changes its input; choose another -o")
    report = PortReport(path, None if diff else output)
    if suffix == ".py":
        with open(path, encoding="utf-8") as f:
            before = [f.read()]
        after = _port_cells(before, indexed=False, report=report, ipython=False)  # a .py file has no magics
    else:
        try:
            import nbformat
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(f"porting a notebook needs nbformat: {PORT_INSTALL}") from error
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        numbers = [i + 1 for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
        before = [c.source for c in code]
        after = _port_cells(before, indexed=True, report=report)
        # the report counts cells as the notebook shows them (markdown included)
        for item in [*report.changes, *report.left]:
            item.where = _renumber(item.where, numbers)
        report.untouched = [_renumber(u, numbers) for u in report.untouched]
        report.failed = [_renumber(f, numbers) for f in report.failed]
    text = ""
    if diff:
        for n, (old, new) in enumerate(zip(before, after)):
            if new is not None:
                label = path if suffix == ".py" else f"{path} (cell {numbers[n]})"
                old, new = (t if t.endswith("\n") else t + "\n" for t in (old, new))
                text += "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), label, label + " (ported)"))
        return report, text
    if suffix == ".py":
        with open(output, "w", encoding="utf-8") as f:
            f.write(after[0] if after[0] is not None else before[0])
    else:
        for cell, new in zip(code, after):
            if new is not None:
                cell.source, cell.outputs, cell.execution_count = new, [], None
        nbformat.write(notebook, output)
    return report, text


def _renumber(where: str, numbers: list[int]) -> str:
    return re.sub(r"^cell (\d+)", lambda m: f"cell {numbers[int(m.group(1)) - 1]}", where)


def main(argv: Sequence[str] | None = None) -> int:
    """The command. Its exit status says whether the output is expected to run unchanged (docs/port.md).

    0: written, and expected to run unchanged on XLA: what is left only costs speed.
    1: written, but the report names lines left that stop the program on XLA or change what it computes.
    2: nothing written: a bad path or argument, or LibCST/nbformat missing.
    3: written, but part of the input does not parse (the report names where and why): nothing ported there.
    """
    parser = argparse.ArgumentParser(prog="python -m tpu_utility.port", description=__doc__.split("\n")[0])
    parser.add_argument("input", help="a .py script or .ipynb notebook (never changed)")
    parser.add_argument("-o", "--output", help="where to write (default: beside the input, _tpu before the suffix)")
    parser.add_argument("--diff", action="store_true", help="print a unified diff and write nothing")
    args = parser.parse_args(argv)
    try:
        report, text = port_file(args.input, args.output, args.diff)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"tpu_utility.port: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.diff:
        print(text, end="")
    print(report.text())
    return report.status()
