"""The cells of a program (a script is one): parsed (IPython lines masked), planned, walked, given their imports."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .. import fixers
from ..fixers.tree import code, libcst
from ..rules import RULES
from .report import Left, PortReport, short

_MAGIC = re.compile(r"^(\s*)([%!].*)$")
_MARK = "pass  # tpu_utility.port: IPython line {}"


@dataclass
class Cell:
    index: int | None  # notebook cell number (1-based), None for a script
    source: str
    magics: list[str] = field(default_factory=list)
    wrapper: Any = None  # libcst MetadataWrapper, None when the cell is not Python
    result: str | None = None

    def where(self, line: int) -> str:
        return f"line {line}" if self.index is None else f"cell {self.index}, line {line}"


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


def _unmask(text: str, magics: list[str]) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if "# tpu_utility.port: IPython line " in line:
            lines[i] = magics[int(line.rsplit(" ", 1)[1])]
    return "\n".join(lines)


def _parse(cell: Cell, ipython: bool, report: PortReport) -> None:
    """Parses a cell as it is, else (``ipython``) with its ``!``/``%`` lines masked; names it when neither parses.

    A ``.py`` file has no IPython lines: a continuation line that starts with ``%`` or ``!=`` is Python.
    """
    cst = libcst()
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
                line, why = failure.raw_line, short(str(failure).splitlines()[0], 60)
            except SyntaxError as syntax:
                line, why = syntax.lineno or failure.raw_line, syntax.msg
            report.failed.append(f"{cell.where(line)}: {why}")
            cell.magics = []
            return
    cell.wrapper = MetadataWrapper(module, unsafe_skip_copy=True)


def _read(n: int, source: str, indexed: bool, ipython: bool, report: PortReport) -> Cell:
    """A cell parsed, its IPython lines reported (a cell magic leaves the whole cell as it is)."""
    cell = Cell(n + 1 if indexed else None, source)
    first = source.lstrip().split("\n", 1)[0]
    if first.startswith("%%"):
        report.untouched.append(f"{cell.where(1).rsplit(',', 1)[0]}: a cell magic ({short(first, 40)}): left as it is")
        return cell
    _parse(cell, ipython, report)
    for line in cell.magics:
        where = cell.where(source.split("\n").index(line) + 1)
        rule = next((found for fix in fixers.magics() if (found := fix(line))), None)
        if rule:
            report.left.append(Left(rule, where, short(line.strip()), RULES[rule].fix))
        else:
            report.untouched.append(f"{where}: {short(line.strip(), 60)} (IPython)")
    return cell


def port_cells(sources: list[str], indexed: bool, report: PortReport, ipython: bool = True) -> list[str | None]:
    """Ports code cells (a script is one); returns each cell's new source, None where unchanged."""
    from .imports import add_imports
    from .plan import make_plan
    from .walk import Porter

    cells = [_read(n, source, indexed, ipython, report) for n, source in enumerate(sources)]
    plan = make_plan([c.wrapper.module for c in cells if c.wrapper is not None])
    for cell in cells:
        if cell.wrapper is not None:
            cell.result = cell.wrapper.visit(Porter(cell.where, plan, report)).code
    results, stuck = fixers.after_walk([c.result for c in cells], plan)
    for cell, result in zip(cells, results):
        cell.result = result
    for rule, text in stuck:
        report.left.append(Left(rule, "before the launch", short(text), RULES[rule].fix))
    add_imports(cells, plan, report)
    report.sort()
    out: list[str | None] = []
    for cell in cells:
        new = None if cell.result is None else _unmask(cell.result, cell.magics)
        out.append(new if new is not None and new != cell.source else None)
    return out
