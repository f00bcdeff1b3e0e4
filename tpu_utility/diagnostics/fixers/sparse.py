"""Sparse tensors on the device (pytorch/examples gcn's ``torch.eye(n).to_sparse().to(device)``): moved dense.

XLA has no sparse layout ('SparseXLA' backend: NotImplementedError), and ``torch.sparse.mm`` /
``torch.spmm`` take dense tensors too, so a move of a sparse tensor becomes a move of its dense
form (``.to_dense().to(device)``), said in the report. A sparse tensor made on the device
(``torch.sparse_coo_tensor(..., device=device)``) is named.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import assigned, call_names, code, dotted, keyword, libcst

_MAKES = ("to_sparse", "to_sparse_coo", "to_sparse_csr", "to_sparse_csc", "sparse_coo_tensor", "sparse_csr_tensor")


def _sparse(node: Any, plan: Any) -> bool:
    """Whether an expression is a sparse tensor: made by one of ``_MAKES``, or a name bound to one."""
    text = code(node)
    return any(f"{make}(" in text for make in _MAKES) or dotted(node) in plan.sparse


@analysis(order=50)
def analyse(module: Any, plan: Any) -> None:
    """``plan.sparse``: names bound to a sparse tensor (``adj = ... .to_sparse()``)."""
    cst = libcst()

    class Bindings(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            if any(f"{make}(" in code(node.value) for make in _MAKES) and not code(node.value).rstrip().endswith(
                    "to_dense()"):  # fmt: skip
                plan.sparse.update(assigned(cst.SimpleStatementLine([node])))
                plan.sparse.update(dotted(t.target) for t in node.targets if dotted(t.target))

    module.visit(Bindings())


@fixes("Call", order=45)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``<sparse>.to(device)`` / ``<sparse>.cuda()`` -> ``<sparse>.to_dense().to(device)``; a sparse tensor made on the device is named."""
    cst = libcst()
    name, last = call_names(updated, porter.plan)
    if last in ("sparse_coo_tensor", "sparse_csr_tensor") and keyword(updated, "device") is not None:
        porter.leave_alone("sparse_on_device", original)
        return None
    if not isinstance(updated.func, cst.Attribute) or last not in ("to", "cuda") or not updated.args and last == "to":
        return None
    receiver = updated.func.value
    if not _sparse(receiver, porter.plan):
        return None
    dense = cst.Call(cst.Attribute(receiver, cst.Name("to_dense")))
    if last == "cuda":  # .cuda() is cuda_move's, but this one moves dense
        new = cst.parse_expression(f"{code(dense)}.to({porter.device()})")
    else:
        new = updated.with_changes(func=updated.func.with_changes(value=dense))
    porter.change("sparse_device", original, new)
    return new
