"""Legacy typed-tensor constructors chosen by a CUDA test: ``Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor``.

eriklindernoren/PyTorch-GAN's idiom (every one of its GANs): ``Tensor(n, 1).fill_(1.0)``,
``Tensor(np.random.normal(...))`` and ``imgs.type(Tensor)`` build the batches. There is no XLA
tensor type, so the name becomes a constructor of the CPU type whose result moves to the device
(``lambda *args: torch.FloatTensor(*args).to(device)``: sizes and data alike, as the legacy
constructor takes them), and each ``x.type(Tensor)`` becomes ``x.to(device, torch.float32)``.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import code, dotted, libcst

_DTYPES = {"FloatTensor": "float32", "DoubleTensor": "float64", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
           "LongTensor": "int64", "IntTensor": "int32", "ShortTensor": "int16", "ByteTensor": "uint8",
           "CharTensor": "int8", "BoolTensor": "bool"}  # fmt: skip


def cuda_type(node: Any) -> str | None:
    """``FloatTensor`` for ``A if test else B`` with ``torch.cuda.FloatTensor`` in a branch, else None."""
    if not isinstance(node, libcst().IfExp):
        return None
    for branch in (node.body, node.orelse):
        head, _, last = dotted(branch).rpartition(".")
        if head == "torch.cuda" and last in _DTYPES:
            return last
    return None


@analysis(order=65)
def analyse(module: Any, plan: Any) -> None:
    """``plan.tensor_types``: names bound to a CUDA-or-CPU tensor type -> its type's name."""
    cst = libcst()

    class Types(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            kind = cuda_type(node.value)
            if kind:
                plan.tensor_types.update({dotted(t.target): kind for t in node.targets if dotted(t.target)})

    module.visit(Types())


@fixes("IfExp", order=5)
def fix_ifexp(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.cuda.FloatTensor if cuda else torch.FloatTensor`` -> a constructor on the device."""
    kind = cuda_type(original)
    if kind is None:
        return None
    new = libcst().parse_expression(f"lambda *args: torch.{kind}(*args).to({porter.device()})")
    porter.change("cuda_tensor_type", original, new)
    return new


@fixes("Call", order=36)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``imgs.type(Tensor)`` of such a name -> ``imgs.to(device, torch.float32)``."""
    cst = libcst()
    func = updated.func
    if not (isinstance(func, cst.Attribute) and func.attr.value == "type" and len(updated.args) == 1
            and updated.args[0].keyword is None):  # fmt: skip
        return None
    kind = porter.plan.tensor_types.get(code(updated.args[0].value).strip())
    if kind is None:
        return None
    new = cst.parse_expression(f"{code(func.value)}.to({porter.device()}, torch.{_DTYPES[kind]})")
    porter.change("cuda_tensor_type", original, new)
    return new
