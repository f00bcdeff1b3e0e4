"""Small questions about a LibCST tree that the porter and its fixers share."""

from __future__ import annotations

import re
from typing import Any, Container

PORT_INSTALL = 'pip install libcst nbformat  (or pip install "tpu_utility[port]")'


def libcst() -> Any:
    """LibCST, imported when the porter runs (the package imports without it)."""
    try:
        import libcst as cst
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"python -m tpu_utility.port needs LibCST: {PORT_INSTALL}") from error
    return cst


def dotted(node: Any) -> str:
    """``a.b.c`` for Name/Attribute chains, "" otherwise."""
    cst = libcst()
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else ""
    return ""


def code(node: Any) -> str:
    """The source of a node."""
    return libcst().Module(body=[]).code_for_node(node)


def cuda_string(node: Any) -> str | None:
    """``"cuda"`` or ``"cuda:N"`` when the node is that string literal, else None."""
    if not isinstance(node, libcst().SimpleString):
        return None
    value = node.evaluated_value
    return value if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")) else None


def device_string(cuda: str) -> str:
    """The code of the ported device as the string a program keeps: ``cuda`` -> the type, ``cuda:0`` -> the device."""
    return "get_device().type" if cuda == "cuda" else "str(get_device())"


def keyword(call: Any, name: str) -> Any:
    """The argument ``name=...`` of a call, or None."""
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def drop_imported(porter: Any, rule: str, original: Any, updated: Any, names: Container[str]) -> Any:
    """``from m import a, b`` without ``names``, the change recorded as ``rule``: the new line, the line's removal
    when no name is left, or None when it imports none of ``names``."""
    cst = libcst()
    kept = [a for a in updated.names if a.name.value not in names]
    if len(kept) == len(updated.names):
        return None
    if not kept:
        porter.change(rule, original, cst.Name("removed"))
        return cst.RemovalSentinel.REMOVE
    new = updated.with_changes(names=[*kept[:-1], kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)])
    porter.change(rule, original, new)
    return new


# optimizers by the name a program calls to build one
OPTIMIZERS = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "RMSprop", "LBFGS",
              "SparseAdam", "Lamb", "LAMB", "Lion", "Adafactor", "create_optimizer", "create_optimizer_v2"}  # fmt: skip
LAUNCHES = ("xmp.spawn", "torch_xla.launch")


# code that picks the device or moves to it: a CUDA string, torch.device, a move (a branch's body: cuda_available, cuda_flag)
DECIDES_DEVICE = re.compile(r"""\.(cuda|to)\(|move_model\(|get_device\(|torch\.device\(|current_accelerator\(|['"]cuda""")


def mentions_cuda(node: Any) -> bool:
    """Whether the node's code says ``cuda`` anywhere (a test, a branch)."""
    return "cuda" in code(node)


def canonical(name: str, plan: Any) -> str:
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


def own(call: Any, plan: Any) -> bool:
    """Whether a call's function is one the program defines itself (``class Generator(nn.Module)``): not torch's."""
    return dotted(call.func).split(".")[0] in plan.defined


def call_names(call: Any, plan: Any) -> tuple[str, str]:
    """(canonical dotted name, last part) of a call's function: ``torch.cuda.amp.autocast``, ``autocast``."""
    name = canonical(dotted(call.func), plan)
    last = call.func.attr.value if isinstance(call.func, libcst().Attribute) else name.rsplit(".", 1)[-1]
    return name, last


def uses(node: Any) -> set[str]:
    """Every name the node's code uses."""
    cst = libcst()
    names: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Name(self, n: Any) -> None:
            names.add(n.value)

    node.visit(Names())
    return names


def calls(node: Any, plan: Any) -> set[str]:
    """The canonical names of every function the node's code calls."""
    cst = libcst()
    found: set[str] = set()

    class Calls(cst.CSTVisitor):
        def visit_Call(self, n: Any) -> None:
            found.add(canonical(dotted(n.func), plan))

    node.visit(Calls())
    return found


def assigned(stmt: Any) -> list[str]:
    """Names a simple ``a = ...`` / ``a, b = ...`` statement binds."""
    cst = libcst()
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


def value(stmt: Any) -> Any:
    """The value of a one-statement line (``a = <value>``, ``<value>``), None for anything else."""
    cst = libcst()
    if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1:
        small = stmt.body[0]
        if isinstance(small, (cst.Assign, cst.AnnAssign)):
            return small.value
        if isinstance(small, cst.Expr):
            return small.value
    return None


def function_defs(stmt: Any) -> list[Any]:
    """Every function defined in a statement, nested ones included."""
    cst = libcst()
    found = []

    class Defs(cst.CSTVisitor):
        def visit_FunctionDef(self, node: Any) -> None:
            found.append(node)

    stmt.visit(Defs())
    return found


def is_docstring(stmt: Any) -> bool:
    """Whether a statement is a bare string (a docstring)."""
    cst = libcst()
    return isinstance(value(stmt), (cst.SimpleString, cst.ConcatenatedString)) and isinstance(stmt.body[0], cst.Expr)


def launched(stmt: Any, plan: Any) -> bool:
    """Whether a statement is the multi-process launch (``xmp.spawn(fn, ...)``, ``torch_xla.launch(fn)``)."""
    call = value(stmt)
    return isinstance(call, libcst().Call) and canonical(dotted(call.func), plan) in LAUNCHES
