"""Programs, not files: an entry script and the modules of its own folder it imports, ported as one.

minGPT's ``chargpt.py`` has no device code: ``mingpt/trainer.py`` picks ``'cuda' if ... else 'cpu'``
and moves the model. Porting the entry file alone says "0 changed" and the program trains on the
CPU. Here an entry's local imports are followed as Python would resolve them from the script's
folder (``import utils``, ``from mingpt.trainer import Trainer``, ``from .model import GPT``, packages'
``__init__.py``), and each of those modules is ported too. When any of them changes (or has a line
left), the output is a ported copy of the program's Python files, ``FOLDER_tpu/`` beside the folder
(or ``-o DIR``), the entry under its own name, with one report for the whole program; a program whose
own modules need nothing keeps the single-file output (``train_tpu.py``). ``python -m tpu_utility.port
FOLDER`` ports every ``.py`` file of a folder the same way. Only ``.py`` files are copied: data the
program reads stays where it is (run it from the same working directory).
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field

from .report import PortReport

_SKIP = {"__pycache__", ".git", ".ipynb_checkpoints", ".venv", "venv", "node_modules"}


@dataclass
class Program:
    """An entry's folder and the Python files of it that the port reads."""

    root: str  # the program's folder (the entry's, as sys.path[0] is for a script)
    files: list[str] = field(default_factory=list)  # absolute paths, the entry first


def _module_files(dotted: str, base: str) -> list[str]:
    """The files ``import a.b.c`` runs from ``base``: ``a/__init__.py``, ``a/b/__init__.py``, ``a/b/c.py`` (those there)."""
    found, parts = [], dotted.split(".") if dotted else []
    for i in range(1, len(parts) + 1):
        stem = os.path.join(base, *parts[:i])
        for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
            if os.path.isfile(candidate):
                found.append(candidate)
    return found


def local_imports(path: str, root: str) -> list[str]:
    """The program's own modules (files under ``root``) that ``path`` imports, as Python resolves them."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # the port names a file that does not parse; its imports are not followed
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found += _module_files(alias.name, root)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .model import GPT: relative to this file's package
                base = os.path.dirname(path)
                for _ in range(node.level - 1):
                    base = os.path.dirname(base)
            else:
                base = root
            module = node.module or ""
            found += _module_files(module, base)
            for alias in node.names:  # from mingpt import model: a submodule
                found += _module_files(f"{module}.{alias.name}" if module else alias.name, base)
    inside = os.path.abspath(root) + os.sep
    return [os.path.abspath(f) for f in dict.fromkeys(found) if os.path.abspath(f).startswith(inside)]


def find_program(entry: str) -> Program:
    """The entry script and, transitively, the modules of its folder it imports (in the order found)."""
    root = os.path.dirname(os.path.abspath(entry))
    program = Program(root, [os.path.abspath(entry)])
    for path in program.files:  # grows as it is read
        program.files += [f for f in local_imports(path, root) if f not in program.files]
    return program


def folder_program(folder: str, output: str) -> Program:
    """Every ``.py`` file of a folder (not its output, caches or environments), sorted."""
    root, out = os.path.abspath(folder), os.path.abspath(output)
    files = []
    for here, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP and os.path.join(here, d) != out)
        files += [os.path.join(here, n) for n in sorted(names) if n.endswith(".py")]
    return Program(root, files)


def merge(program: Program, reports: dict[str, PortReport], source: str, output: str | None) -> PortReport:
    """One report for the program: each file's lines named by its path in the folder."""
    merged = PortReport(source, output)
    for path, report in reports.items():
        name = os.path.relpath(path, program.root)
        for item in [*report.changes, *report.left]:
            item.where = f"{name}, {item.where}"
        merged.changes += report.changes
        merged.left += report.left
        merged.untouched += [f"{name}, {u}" for u in report.untouched]
        merged.failed += [f"{name}, {f}" for f in report.failed]
    return merged
