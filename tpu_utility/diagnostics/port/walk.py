"""The walk: one LibCST transformer over a cell that keeps the scopes and hands each node to its fixers.

It knows no rewrite itself: each fixer registers itself for the node types
it is tried on (``fixers/registry.py``), and ``fixers.apply`` tries them in their order.
What it keeps for them: the enclosing loops (does each run once per step?), the enclosing
tests (does each mention CUDA?), the device name each function scope holds, and the report.
Importing it imports LibCST (the package itself imports without it).
"""

from __future__ import annotations

import re
from typing import Any

from .. import fixers
from ..fixers.tree import code, libcst, mentions_cuda
from ..rules import RULES
from .report import Change, Left, PortReport, short

cst = libcst()
from libcst.metadata import PositionProvider  # noqa: E402  (after the friendly error above)

_source = code  # leave_alone's ``code`` argument is the text to show

# micro-steps (gradient accumulation): an inner loop over range() that runs the backward pass
_MICRO = re.compile(r"micro|accum", re.I)


def _body(loop: Any) -> list[Any]:
    return list(loop.body.body) if isinstance(loop.body, cst.IndentedBlock) else [loop.body]


def _own_code(loop: Any) -> str:
    """The code a loop runs itself, without the bodies of the loops inside it (a per-step loop's test)."""
    parts: list[str] = []

    class Own(cst.CSTVisitor):
        def visit_SimpleStatementLine(self, node: Any) -> bool:
            parts.append(code(node))
            return False

        def visit_For(self, node: Any) -> bool:
            return False

        def visit_While(self, node: Any) -> bool:
            return False

    for stmt in _body(loop):
        stmt.visit(Own())
    return "\n".join(parts)


def per_step(loop: Any) -> bool:
    """Whether a loop runs once per step: its own code steps, or an inner micro-step loop runs the backward pass."""
    own = _own_code(loop)
    if ".backward(" in own or "step(" in own:
        return True
    if isinstance(loop, cst.For) and "loader" in code(loop.iter).lower():
        return True
    inner: list[Any] = []

    class Loops(cst.CSTVisitor):
        def visit_For(self, node: Any) -> None:
            inner.append(node)

    for stmt in loop.body.body if isinstance(loop.body, cst.IndentedBlock) else []:
        stmt.visit(Loops())
    return any(code(node.iter).startswith("range(") and _MICRO.search(code(node.target) + code(node.iter))
               and ".backward(" in code(node.body) for node in inner)  # fmt: skip


class Porter(cst.CSTTransformer):
    """The transformer for one cell: scopes, the fixers' helpers, and one ``leave_`` per registered node type."""

    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, where: Any, plan: Any, report: PortReport) -> None:
        super().__init__()
        self.where, self.plan, self.report = where, plan, report  # where(line) names a line of this cell
        self.loops: list[bool] = []  # per enclosing loop: does it run per step?
        self.guards: list[bool] = []  # per enclosing if: does its test mention CUDA?
        self.device_stack: list[str | None] = [plan.device]
        self.classes = 0  # class bodies around the node (at import time when no function is around it either)
        self.reported: set[tuple[str, int]] = set()

    # ------------------------------------------------------------ the fixers' helpers
    def line(self, node: Any) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    short = staticmethod(short)

    def change(self, rule: str, original: Any, updated: Any) -> None:
        """Records a rewrite of ``original`` into ``updated`` (an inner rewrite on the line gives way)."""
        self.report.add(Change(rule, self.where(self.line(original)), short(code(original)), short(code(updated))))

    def note(self, rule: str, original: Any, after: str) -> None:
        """Records a change of a statement that says in words what became of it (moved, moved up)."""
        self.report.changes.append(Change(rule, self.where(self.line(original)), short(code(original)), after))

    def leave_alone(self, rule: str, original: Any, fix: str | None = None, code: str | None = None) -> None:
        """Reports a line left as written (once per rule and line), with the rule's fix unless given another."""
        key = (rule, self.line(original))
        if key not in self.reported:
            self.reported.add(key)
            self.report.left.append(Left(rule, self.where(key[1]), code or short(_source(original)),
                                         fix or RULES[rule].fix))  # fmt: skip

    def need(self, name: str) -> None:
        self.plan.needs.add(name)

    def device(self) -> str:
        """The code of the device in this scope: its name, else ``get_device()``."""
        name = self.device_stack[-1]
        if name:
            return name
        self.plan.needs.add("get_device")
        return "get_device()"

    # ------------------------------------------------------------------------ scopes
    def visit_FunctionDef(self, node: Any) -> None:
        self.device_stack.append(self.device_stack[-1])

    def leave_FunctionDef(self, original: Any, updated: Any) -> Any:
        self.device_stack.pop()
        return updated

    def visit_ClassDef(self, node: Any) -> None:
        self.classes += 1

    def leave_ClassDef(self, original: Any, updated: Any) -> Any:
        self.classes -= 1
        return updated

    def visit_For(self, node: Any) -> None:
        self.loops.append(per_step(node))

    def leave_For(self, original: Any, updated: Any) -> Any:
        self.loops.pop()
        return self._before(original, self._fixed("For", original, updated))

    def visit_While(self, node: Any) -> None:
        self.loops.append(per_step(node))

    def leave_While(self, original: Any, updated: Any) -> Any:
        self.loops.pop()
        return self._before(original, updated)

    def leave_With(self, original: Any, updated: Any) -> Any:
        return self._before(original, updated)

    def visit_If(self, node: Any) -> None:
        """A CUDA test guards its body, unless the port opens it to the accelerator (then its body runs on a TPU)."""
        self.guards.append(mentions_cuda(node.test) and not fixers.opened(node))

    def leave_If(self, original: Any, updated: Any) -> Any:
        self.guards.pop()
        return self._before(original, fixers.apply("If", self, original, updated) or updated)

    def visit_BooleanOperation(self, node: Any) -> None:
        """``torch.cuda.is_available() and torch.cuda.is_bf16_supported()``: the right side is guarded."""
        self.guards.append(isinstance(node.operator, cst.And) and "is_available()" in code(node.left))

    def leave_BooleanOperation(self, original: Any, updated: Any) -> Any:
        self.guards.pop()
        return updated

    # --------------------------------------------------- the node types fixers are registered for
    def _fixed(self, kind: fixers.NodeType, original: Any, updated: Any) -> Any:
        new = fixers.apply(kind, self, original, updated)
        return updated if new is None else new

    def leave_Call(self, original: Any, updated: Any) -> Any:
        return self._fixed("Call", original, updated)

    def leave_Arg(self, original: Any, updated: Any) -> Any:
        return self._fixed("Arg", original, updated)

    def leave_IfExp(self, original: Any, updated: Any) -> Any:
        return self._fixed("IfExp", original, updated)

    def leave_Assign(self, original: Any, updated: Any) -> Any:
        return self._fixed("Assign", original, updated)

    def leave_Assert(self, original: Any, updated: Any) -> Any:
        return self._fixed("Assert", original, updated)

    def leave_Subscript(self, original: Any, updated: Any) -> Any:
        return self._fixed("Subscript", original, updated)

    def leave_Import(self, original: Any, updated: Any) -> Any:
        return self._fixed("Import", original, updated)

    def leave_ImportFrom(self, original: Any, updated: Any) -> Any:
        return self._fixed("ImportFrom", original, updated)

    def leave_SimpleStatementLine(self, original: Any, updated: Any) -> Any:
        return self._before(original, self._fixed("SimpleStatementLine", original, updated))

    def _before(self, original: Any, result: Any) -> Any:
        """A statement with the line a fixer planned before it (``plan.before``), the change reported."""
        if id(original) not in self.plan.before or isinstance(result, cst.RemovalSentinel):
            return result
        rule, line = self.plan.before.pop(id(original))
        self.note(rule, original, f"{short(line.split('  # ')[0])} before it")
        head = cst.parse_statement(line + "\n")
        if isinstance(result, cst.FlattenSentinel):
            return cst.FlattenSentinel([head, *result.nodes])
        # the new line takes the statement's blank lines and comments above it
        return cst.FlattenSentinel([head.with_changes(leading_lines=result.leading_lines), result.with_changes(leading_lines=())])
