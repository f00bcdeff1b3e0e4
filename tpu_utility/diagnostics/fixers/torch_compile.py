"""``torch.compile(model, ...)`` -> ``compile_model(model, ...)``: torch.compile where it runs (CUDA, TorchTPU, the
CPU), the model itself on torch_xla, where inductor does not compile and XLA compiles the step on its own. So a
ported script keeps its compiled speed when it runs on a GPU again."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, libcst

# torch.compile's keywords that compile_model keeps; a call with others is dropped as before (XLA needs no compile)
KEPT = ("mode", "fullgraph", "dynamic", "backend")
_MARK = "pass  # tpu_utility.port: {} dropped: torch_xla compiles the step itself\n"


def _compiles(node: Any) -> bool:
    cst = libcst()
    return isinstance(node, cst.Call) and dotted(node.func) == "torch.compile" and bool(node.args)


@fixes("Call", order=90)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.compile(model, mode=..., fullgraph=..., dynamic=...)`` -> ``compile_model(model, ...)``, its options
    kept; with another option (``options=``, ``disable=``) -> ``model``."""
    cst = libcst()
    if not _compiles(updated) or updated.args[0].keyword is not None:
        return None
    rest = updated.args[1:]
    if all(a.keyword is not None and a.keyword.value in KEPT for a in rest):
        porter.need("compile_model")
        new = updated.with_changes(func=cst.Name("compile_model"))
    else:
        new = updated.args[0].value
    porter.change("torch_compile", original, new)
    return new


@fixes("SimpleStatementLine", order=40)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """``model = torch.compile(model, options=...)``, which the call's fixer left as ``model = model``: a ``pass``
    that says so."""
    cst = libcst()
    if len(original.body) != 1 or not isinstance(original.body[0], cst.Assign):
        return None
    before, after = original.body[0], updated.body[0]
    targets = [code(t.target) for t in after.targets]
    if not _compiles(before.value) or targets != [code(after.value)]:
        return None
    return cst.parse_statement(_MARK.format(code(before.value))).with_changes(leading_lines=updated.leading_lines)
