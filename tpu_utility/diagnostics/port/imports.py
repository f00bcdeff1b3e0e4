"""The import lines the rewrites need, placed where the program's own torch_xla imports are.

Not LibCST's ``AddImportsVisitor``: it puts new imports after the first block of imports, which
in a torch_xla kernel comes before the ``os.environ[...]`` lines that must run before
``import torch_xla``; it merges ``from tpu_utility import ...`` into a line the program has; and
it leaves no mark. Here each line goes after the program's torch_xla imports (else after its first
block of imports), marked ``# tpu_utility.port``, and the report lists it.
"""

from __future__ import annotations

import re
from typing import Any

from ..fixers.tree import code, is_docstring, libcst
from .report import Change, PortReport

_KIT = ("get_device", "move_model", "step_optimizer", "autocast", "grad_scaler", "make_sampler", "inference_mode")
_XLA = re.compile(r"^(import torch_xla|from torch_xla)", re.M)


def needed(plan: Any, existing: str) -> list[str]:
    """The import lines the plan needs that the program (``existing``: all its cells) does not have."""
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


def _where(body: list[Any], after_xla: bool) -> int:
    """The index in a module's body after which the new lines go."""
    cst = libcst()
    at, seen = 0, False
    for i, stmt in enumerate(body):
        imports = isinstance(stmt, cst.SimpleStatementLine) and all(isinstance(s, (cst.Import, cst.ImportFrom)) for s in stmt.body)
        if imports and (not after_xla or _XLA.match(code(stmt).lstrip())):
            at, seen = i + 1, True
        elif not seen and isinstance(stmt, cst.SimpleStatementLine) and (is_docstring(stmt) or "IPython line" in code(stmt)):
            at = i + 1  # after a docstring or the IPython lines that open the cell
        elif not after_xla and not imports:
            break
    return at


def add_imports(cells: list[Any], plan: Any, report: PortReport) -> None:
    """Puts the imports the rewrites need into the cell with the user's torch_xla imports (their environment
    variables come before them), else the first cell with imports, else the first Python cell."""
    cst = libcst()
    lines = needed(plan, "\n".join(c.result or "" for c in cells))
    ported = [c for c in cells if c.result is not None]
    target = next((c for c in ported if _XLA.search(c.result)),
                  next((c for c in ported if re.search(r"^(import|from) ", c.result, re.M)), ported[0] if ported else None))
    if not lines or target is None:
        return
    module = cst.parse_module(target.result)
    body = list(module.body)
    at = _where(body, _XLA.search(target.result) is not None)
    new = [cst.parse_statement(line + "  # tpu_utility.port\n") for line in lines]
    target.result = module.with_changes(body=[*body[:at], *new, *body[at:]]).code
    line = len(module.with_changes(body=body[:at]).code.splitlines()) + 1 if at else 1
    for n, text in enumerate(lines):
        report.changes.append(Change("imports", target.where(line + n), "(nothing)", text))
