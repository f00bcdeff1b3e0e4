"""A boolean-mask index (``x[x > 0]``): a data-dependent shape, reported with the masked form.

Not for host values: a name bound to a DataFrame, an array, a list or a Python number (``df =
pd.read_csv(...)``, ``folds = np.arange(5)``, ``losses = []``, ``best = 0.0``, and what is
sliced from them) is no tensor, and ``df[df["fold"] != 0]`` (a column by its name) is pandas.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import dotted, libcst

_HOST_MODULES = {"pd", "pandas", "np", "numpy", "math", "random"}
_HOST_CALLS = {"float", "int", "round", "len", "list", "dict", "set", "sorted", "range", "str"}
_HOST_METHODS = {"item", "tolist", "numpy", "to_numpy", "values", "copy", "reset_index", "merge", "groupby"}


def root(node: Any) -> str:
    """The leftmost name of an attribute, call or subscript chain (``df`` of ``df["a"].values[0]``), "" if none."""
    cst = libcst()
    while isinstance(node, (cst.Attribute, cst.Call, cst.Subscript)):
        node = node.func if isinstance(node, cst.Call) else node.value
    return node.value if isinstance(node, cst.Name) else ""


def _host(node: Any, known: set[str]) -> bool:
    """Whether an expression gives a host value: a literal, a DataFrame/array/list, a Python number, or one of ``known``."""
    cst = libcst()
    if isinstance(node, (cst.List, cst.ListComp, cst.Dict, cst.DictComp, cst.Set, cst.SetComp, cst.Integer,
                         cst.Float, cst.SimpleString, cst.FormattedString)):  # fmt: skip
        return True
    if isinstance(node, cst.UnaryOperation):
        return _host(node.expression, known)
    if isinstance(node, cst.BinaryOperation):  # acc = correct / total of Python numbers
        return _host(node.left, known) and _host(node.right, known)
    if isinstance(node, cst.Call) and dotted(node.func) in _HOST_CALLS:
        return True
    if isinstance(node, cst.Call) and dotted(node.func) in ("max", "min", "abs"):
        return all(_host(a.value, known) for a in node.args)
    if isinstance(node, (cst.Call, cst.Attribute)):
        last = node.func if isinstance(node, cst.Call) else node
        if isinstance(last, cst.Attribute) and last.attr.value in _HOST_METHODS:
            return True
    head = root(node)
    return head in _HOST_MODULES or head in known


@analysis(order=20)
def analyse(module: Any, plan: Any) -> None:
    """``plan.host_values``: the names bound only to host values (in order; a later tensor binding removes one)."""
    cst = libcst()

    class Assigns(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            names = {t.target.value for t in node.targets if isinstance(t.target, cst.Name)}
            if _host(node.value, plan.host_values):
                plan.host_values.update(names)
            else:  # bound to something else too: it may hold a tensor
                plan.host_values.difference_update(names)

        def visit_AugAssign(self, node: Any) -> None:
            if isinstance(node.target, cst.Name) and not _host(node.value, plan.host_values):
                plan.host_values.discard(node.target.value)  # total = 0.0; total += loss: a tensor now

    module.visit(Assigns())


def _pandas_filter(subscript: Any, plan: Any) -> bool:
    """``df[df["fold"] != 0]``, ``df[df.fold == k]``, or any mask index of a host value."""
    cst = libcst()
    if root(subscript.value) in plan.host_values:
        return True
    for element in subscript.slice:
        left = element.slice.value.left
        if isinstance(left, cst.Subscript) and any(isinstance(e.slice, cst.Index) and isinstance(
                e.slice.value, (cst.SimpleString, cst.FormattedString)) for e in left.slice):  # fmt: skip
            return True
        if root(left) in plan.host_values:
            return True
    return False


@fixes("Subscript", order=20)
def fix_subscript(porter: Porter, original: Any, updated: Any) -> Any:
    """``x[<comparison>]`` of a tensor."""
    cst = libcst()
    masks = [e for e in original.slice if isinstance(e.slice, cst.Index) and isinstance(e.slice.value, cst.Comparison)]
    if masks and not _pandas_filter(original.with_changes(slice=masks), porter.plan):
        porter.leave_alone("dynamic_shape", original)
    return None
