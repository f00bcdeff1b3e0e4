"""``python -m tpu_utility.port IN [-o OUT] [--diff] [--no-check]``: your program or notebook, rewritten for today's TPUs.

It reads a CUDA training loop or a Kaggle TPU kernel written for torch_xla 1.x and
writes a copy that runs on today's torch_xla (2.8 and 2.9) with the package's
hand-loop kit, then prints every change (``line: before -> after`` and why) and
every line it left that still costs speed or breaks on XLA, with the fix::

    python -m tpu_utility.port kernel.ipynb            # writes kernel_tpu.ipynb beside it
    python -m tpu_utility.port train.py -o train_xla.py
    python -m tpu_utility.port train.py --diff         # prints a unified diff, writes nothing
    python -m tpu_utility.port train.py -- --epochs 1   # its arguments, for the run of its first 3 steps on XLA:CPU
    python -m tpu_utility.port train.py --no-check      # port only: the report says "not run"
    python -m tpu_utility.port chargpt.py      # and the modules of its folder it imports: FOLDER_tpu/ (port/program.py)
    python -m tpu_utility.port mingpt/         # every .py file of a folder: mingpt_tpu/

The input is never changed. Edits are made on the concrete syntax tree (LibCST), so
comments and formatting stay; a notebook keeps its cells, markdown and metadata, and
only changed code cells lose their outputs. IPython lines (``!pip``, ``%matplotlib``)
pass through untouched; a cell that still does not parse is left as it is and named.
The pitfalls and their fixes come from ``tpu_utility.diagnostics.rules``, the table
``doctor`` and ``check`` read too. The summary's "expected to run unchanged on XLA: yes" is a run's
word: the written program's first optimizer steps ran on XLA:CPU (``port/check.py``); without a run
it says "not run: <why>" or "nothing to run".
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from typing import Sequence

from ..fixers.tree import PORT_INSTALL
from .cells import port_cells
from .report import EXIT_CHECK_FAILED, EXIT_DOES_NOT_PARSE, EXIT_LEFT_BREAKS, EXIT_RUNS, EXIT_USAGE, Change, Left, PortReport

__all__ = ["Change", "Left", "PortReport", "default_output", "main", "port_file", "port_program", "port_source",
           "EXIT_RUNS", "EXIT_LEFT_BREAKS", "EXIT_USAGE", "EXIT_DOES_NOT_PARSE", "EXIT_CHECK_FAILED"]

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
    new = port_cells([source], indexed=False, report=report)[0]
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
        after = port_cells(before, indexed=False, report=report, ipython=False)  # a .py file has no magics
    else:
        try:
            import nbformat
        except ModuleNotFoundError as error:
            raise ModuleNotFoundError(f"porting a notebook needs nbformat: {PORT_INSTALL}") from error
        notebook = nbformat.read(path, as_version=4)
        code = [c for c in notebook.cells if c.cell_type == "code"]
        numbers = [i + 1 for i, c in enumerate(notebook.cells) if c.cell_type == "code"]
        before = [c.source for c in code]
        after = port_cells(before, indexed=True, report=report)
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


def port_program(path: str, output: str | None = None, diff: bool = False) -> tuple[PortReport, str]:
    """Ports a program: a folder's ``.py`` files, or an entry script with the modules of its folder it imports.

    An entry whose own modules need nothing is written as ``port_file`` writes it. Otherwise (and for a
    folder) the output is a ported copy of the folder's Python files, ``FOLDER_tpu`` beside it (or
    ``output``), with one report whose lines are named by their file (``mylib/trainer.py, line 12``).

    Args:
        path: A folder, or the program's entry ``.py`` script (or a notebook, ported alone).
        output: The output folder (or, for a program of one file, the output file); None for the default.
        diff: Write nothing; return a unified diff instead.

    Returns:
        The report (its ``output`` the ported entry, the folder for a folder), and the diff ("" unless ``diff``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``output`` is inside the program's folder, or a ``.py`` file for a program of several.

    Example:
        >>> report, _ = port_program("chargpt.py")   # and mingpt/trainer.py, where the device is chosen  # doctest: +SKIP
        >>> print(report.text())                     # doctest: +SKIP
    """
    import shutil

    from . import program as programs

    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path!r}")
    folder = os.path.isdir(path)
    if not folder and not path.endswith(".py"):
        return port_file(path, output, diff)
    root = os.path.abspath(path if folder else os.path.dirname(os.path.abspath(path)))
    out = os.path.abspath(output) if output and (folder or not output.endswith(".py")) else root.rstrip(os.sep) + "_tpu"
    found = programs.folder_program(root, out) if folder else programs.find_program(path)
    if not folder and len(found.files) == 1:
        return port_file(path, output, diff)
    ported: dict[str, tuple[str, str | None, PortReport]] = {}
    for file in found.files:
        with open(file, encoding="utf-8") as f:
            before = f.read()
        report = PortReport(file)
        after = port_cells([before], indexed=False, report=report, ipython=False)[0]
        ported[file] = (before, after, report)
    if not folder and all(after is None and not report.left for _, after, report in list(ported.values())[1:]):
        return port_file(path, output, diff)  # the program's own modules need nothing: one file, as before
    if output and output.endswith(".py"):
        raise ValueError(f"{path!r} is a program of {len(found.files)} files (it imports its own modules, which the "
                         f"port changes): -o names the output folder, not a file, but given {output!r}")
    if out == root or out.startswith(root + os.sep):
        raise ValueError(f"output {out!r} is inside the program's folder {root!r}: port never changes its input")
    entry = out if folder else os.path.join(out, os.path.relpath(os.path.abspath(path), root))
    merged = programs.merge(found, {f: r for f, (_, _, r) in ported.items()}, path, None if diff else entry)
    text = ""
    if diff:
        for file, (before, after, _) in ported.items():
            if after is not None:
                label = os.path.relpath(file, os.path.dirname(root))
                text += "".join(difflib.unified_diff(before.splitlines(True), after.splitlines(True), label, label + " (ported)"))
        return merged, text
    for file in programs.folder_program(root, out).files:  # the folder's Python files, ported or as they are
        target = os.path.join(out, os.path.relpath(file, root))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        before, after, _ = ported.get(file, (None, None, None))
        if after is not None:
            with open(target, "w", encoding="utf-8") as f:
                f.write(after)
        else:
            shutil.copyfile(file, target)
    return merged, text


def _renumber(where: str, numbers: list[int]) -> str:
    return re.sub(r"^cell (\d+)", lambda m: f"cell {numbers[int(m.group(1)) - 1]}", where)


def main(argv: Sequence[str] | None = None) -> int:
    """The command. Its exit status says whether the output is expected to run unchanged (docs/port.md).

    0: written, and expected to run unchanged on XLA: what is left only costs speed.
    1: written, but the report names lines left that stop the program on XLA or change what it computes.
    2: nothing written: a bad path or argument, or LibCST/nbformat missing.
    3: written, but part of the input does not parse (the report names where and why): nothing ported there.
    4: written, and ``--check`` ran its first steps: they stopped, or did not run on XLA (port/check.py).
    """
    parser = argparse.ArgumentParser(prog="python -m tpu_utility.port", description=__doc__.split("\n")[0])
    parser.add_argument("input", help="a .py script (with the modules of its folder it imports), an .ipynb notebook, "
                        "or a folder (never changed)")
    parser.add_argument("-o", "--output", help="where to write (default: beside the input, _tpu before the suffix)")
    parser.add_argument("--diff", action="store_true", help="print a unified diff and write nothing")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="run the output's first optimizer steps on XLA:CPU before saying it runs (the default; "
                        "--no-check skips the run, and the report says it did not run); exit 4 if they stop or do "
                        "not run on XLA")
    parser.add_argument("--check-steps", type=int, default=3, help="optimizer steps the check runs (default 3)")
    parser.add_argument("--check-timeout", type=float, default=600, help="seconds the check may run (default 600)")
    parser.epilog = "after --: the program's own arguments, for --check (train.py --check -- --epochs 1)"
    argv = list(sys.argv[1:] if argv is None else argv)
    program_args = argv[argv.index("--") + 1:] if "--" in argv else []
    args = parser.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.check_steps < 1:
        print(f"tpu_utility.port: --check-steps must be 1 or more, but given {args.check_steps}", file=sys.stderr)
        return EXIT_USAGE
    try:
        report, text = port_program(args.input, args.output, args.diff)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as error:
        print(f"tpu_utility.port: {error}", file=sys.stderr)
        return EXIT_USAGE
    if args.diff:
        print(text, end="")
    checked = ""
    if report.status() != EXIT_RUNS:
        report.ran = "no: the port left lines that stop it"
    elif args.diff:
        report.ran = "not run: --diff writes nothing to run"
    elif not args.check:
        report.ran = "not run: --no-check"
    elif os.path.isdir(args.input):
        report.ran = "nothing to run: a folder has no entry point (port its entry script to run the program)"
    else:
        report.ran, checked = _run(report, args, program_args)
    print(report.text())
    if checked:
        print(checked)
    return report.exit_status()


def _run(report: PortReport, args: argparse.Namespace, program_args: list[str]) -> tuple[str, str]:
    """The word for the written program: its first steps run on XLA:CPU (port/check.py), and what the run said."""
    from .check import dry_run, entry_point, notebook_script

    path = report.output
    if path.endswith(".ipynb"):  # its code cells in order, as one script beside it (removed after)
        script = os.path.splitext(path)[0] + ".check.py"
        with open(script, "w", encoding="utf-8") as f:
            f.write(notebook_script(path))
        try:
            result = dry_run(script, args.check_steps, program_args, args.check_timeout)
        finally:
            os.remove(script)
    else:
        with open(path, encoding="utf-8") as f:
            if not entry_point(f.read()):
                return "nothing to run: a module without an entry point (it only defines names)", ""
        result = dry_run(path, args.check_steps, program_args, args.check_timeout)
    if result.ok:
        return f"yes: its first {args.check_steps} optimizer step(s) ran on XLA:CPU (or it ran to its end there)", result.text
    if result.ok is None:
        return f"not run: {result.why}", result.text
    return "no: its run on XLA:CPU failed (check below)", result.text
    if args.check and report.status() == EXIT_RUNS:
        from .check import dry_run

        result = dry_run(report.output, args.check_steps, program_args, args.check_timeout)
        print(result.text)
        return EXIT_RUNS if result.ok else EXIT_CHECK_FAILED
    if args.check:
        print(f"check: not run: the port itself says the output does not run unchanged (exit {report.status()})")
    return report.status()
