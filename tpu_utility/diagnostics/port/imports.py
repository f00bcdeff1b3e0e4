"""The imports the rewrites need, added by LibCST's own ``AddImportsVisitor``.

What no cell imports already (``from tpu_utility import *`` counts) LibCST's
``AddImportsVisitor`` adds at the end of a block of imports, merging a name
into that block's ``from M import ...`` line where it has one. What is chosen here is only
where LibCST looks: the cell (the one with the program's torch_xla imports, else its first
imports, else its first Python cell: the first of these not after the first cell that uses it), and
in it the block of imports LibCST is given. That block is the one holding the first torch_xla
import: a kernel sets ``os.environ[...]`` between its first imports and ``import torch_xla``,
and those lines must run before torch_xla is imported. Without torch_xla imports it is the
first import, after the ``!pip``/``%`` lines that open a notebook cell (a ``!pip install``
must run before what it installs is imported). A line added whole is marked
``# tpu_utility.port``; the report lists every added or merged line.
"""

from __future__ import annotations

from typing import Any

from ..fixers.tree import code, dotted, libcst
from .report import Change, PortReport

_Item = tuple  # (module, name or None, alias or None), as LibCST's ImportItem takes them
_MODULES = {"torch_xla": ("torch_xla", None, None), "xr": ("torch_xla.runtime", None, "xr")}  # else tpu_utility's
_MARK = "# tpu_utility.port"


def _items(plan: Any) -> list[_Item]:
    """What the plan needs, as (module, name, alias): ``porter.need(name)`` and the fixers' own ``plan.imports``."""
    needs = [_MODULES.get(name, ("tpu_utility", name, None)) for name in sorted(plan.needs)]
    return list(dict.fromkeys([*needs, *plan.imports]))


def _bound(item: _Item) -> str:
    """The name an import binds: ``xr``, ``torch_xla``, ``get_device``."""
    module, name, alias = item
    return alias or name or module.split(".")[0]


def _read(module: Any) -> tuple[set[str], list[Any]]:
    """The names a cell uses and its import statements (at any depth), in one walk."""
    cst = libcst()
    names: set[str] = set()
    imports: list[Any] = []

    class Read(cst.CSTVisitor):
        def visit_Name(self, node: Any) -> None:
            names.add(node.value)

        def visit_Import(self, node: Any) -> None:
            imports.append(node)

        def visit_ImportFrom(self, node: Any) -> None:
            imports.append(node)

    module.visit(Read())
    return names, imports


def _missing(items: list[_Item], imports: list[Any]) -> list[_Item]:
    """The items that none of ``imports`` (the program's import nodes) imports; ``from M import *`` has M's names.

    Read here from LibCST's evaluated names rather than by its ``GatherImportsVisitor``, whose construction alone
    costs 10-20 ms (it scans its class for matcher decorators), a port of a small program five times over.
    """
    cst = libcst()
    have: set[_Item] = set()
    for node in imports:
        if isinstance(node, cst.Import):
            have.update((a.evaluated_name, None, a.evaluated_alias) for a in node.names)
        elif not node.relative and node.module is not None:  # the program's own modules import nothing we add
            module = dotted(node.module)
            names = node.names
            have.update([(module, "*", None)] if isinstance(names, cst.ImportStar) else
                        [(module, a.evaluated_name, a.evaluated_alias) for a in names])  # fmt: skip
    return [item for item in items if item not in have and not (item[1] and (item[0], "*", None) in have)]


def _is_import(stmt: Any) -> bool:
    """A line holding one import: what LibCST counts in a block of imports."""
    cst = libcst()
    return isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 and isinstance(
        stmt.body[0], (cst.Import, cst.ImportFrom))


def _imports_torch_xla(stmt: Any) -> bool:
    cst = libcst()
    if not isinstance(stmt, cst.SimpleStatementLine):
        return False
    names = [dotted(s.module) if s.module is not None else "" for s in stmt.body if isinstance(s, cst.ImportFrom)]
    names += [dotted(a.name) for s in stmt.body if isinstance(s, cst.Import) for a in s.names]
    return any(name.split(".")[0] == "torch_xla" for name in names)


def _anchor(body: list[Any]) -> int | None:
    """Where the part of a cell LibCST is given starts: the block of imports holding the first torch_xla
    import (after it, when that line holds more than one statement), else the first import; None when the cell
    has no top-level import."""
    at = next((i for i, stmt in enumerate(body) if _imports_torch_xla(stmt)), None)
    if at is not None and not _is_import(body[at]):
        return at + 1
    at = next((i for i, stmt in enumerate(body) if _is_import(stmt)), None) if at is None else at
    while at and _is_import(body[at - 1]):
        at -= 1
    return at


def _opening(body: list[Any]) -> int:
    """The index after the masked IPython lines that open a cell (``cells._MARK``)."""
    return next((i for i, stmt in enumerate(body) if "tpu_utility.port: IPython line" not in code(stmt)), len(body))


def _text(stmt: Any) -> str:
    return code(stmt.with_changes(leading_lines=())).strip()


def _marked(before: list[Any], after: list[Any]) -> tuple[list[Any], dict[int, tuple[str, str]]]:
    """LibCST's result with each line it added whole marked; and index -> (the line before, after) for those it
    added or merged.

    LibCST adds lines at the end of the block and rewrites a line only inside it, so a changed statement at an
    index where the input had an import is a merge, and any other new one is added whole.
    """
    cst = libcst()
    kept = {_text(stmt) for stmt in before}
    body, changed = list(after), {}
    for i, stmt in enumerate(after):
        if _text(stmt) in kept:
            continue
        merged = i < len(before) and _is_import(before[i])
        changed[i] = (_text(before[i]) if merged else "(nothing)", _text(stmt))
        if not merged or stmt.trailing_whitespace.comment is None:  # a comment the user wrote stays
            newline = stmt.trailing_whitespace.newline
            body[i] = stmt.with_changes(trailing_whitespace=cst.TrailingWhitespace(cst.SimpleWhitespace("  "),
                                                                                   cst.Comment(_MARK), newline))
    return body, changed


def _add(cell: Any, module: Any, items: list[_Item], report: PortReport) -> None:
    """Adds ``items`` to a cell (parsed: ``module``) with ``AddImportsVisitor``; reports each line added or merged.

    LibCST is given the cell from its anchor to the statement after that block of imports (where it may add a
    blank line); it changes nothing further on.
    """
    cst = libcst()
    from libcst.codemod import CodemodContext
    from libcst.codemod.visitors import AddImportsVisitor, ImportItem

    body = list(module.body)
    at = _anchor(body)
    at = _opening(body) if at is None else at
    end = next((i for i in range(at, len(body)) if not _is_import(body[i])), len(body)) + 2  # a docstring, a statement
    part = module.with_changes(body=body[at:end])
    added = part.visit(AddImportsVisitor(CodemodContext(), [ImportItem(*item) for item in items]))
    new, changed = _marked(list(part.body), list(added.body))
    body = [*body[:at], *new, *body[end:]]
    for i, (before, after) in changed.items():
        head = module.with_changes(body=body[: at + i], footer=()).code  # the code above the line
        line = len(head.splitlines()) + len(body[at + i].leading_lines) + 1
        report.changes.append(Change("imports", cell.where(line), before, after))
    cell.result = module.with_changes(body=body).code


def add_imports(cells: list[Any], plan: Any, report: PortReport) -> None:
    """Adds the imports the rewrites need: each in the cell with the user's torch_xla imports, else the first cell
    with imports, else the first Python cell; the first of these that does not come after the first cell using it."""
    cst = libcst()
    ported = [c for c in cells if c.result is not None]
    if not ported or not (plan.needs or plan.imports):
        return
    modules = [cst.parse_module(c.result) for c in ported]
    read = [_read(module) for module in modules]
    items = _missing(_items(plan), [node for _, imports in read for node in imports])
    items = [item for item in items if any(_bound(item) in names for names, _ in read)]  # a rewrite made it unused
    if not items:
        return
    xla = next((i for i, module in enumerate(modules) if any(_imports_torch_xla(stmt) for stmt in module.body)), None)
    first = next((i for i, module in enumerate(modules) if any(_is_import(stmt) for stmt in module.body)), None)
    targets: dict[int, list[_Item]] = {}
    for item in items:
        use = next((i for i, (names, _) in enumerate(read) if _bound(item) in names), len(modules))
        target = next(i for i in (xla, first, 0) if i is not None and i <= use)
        targets.setdefault(target, []).append(item)
    for i, wanted in sorted(targets.items()):
        _add(ported[i], modules[i], wanted, report)
