"""A model's move keeps its tied weights: ``model.to(device)`` -> ``move_model(model, device)``.

On XLA ``model.to`` replaces each parameter with a new one, so an output layer tied to the
embedding by assignment (GPT-2, nanoGPT, Hugging Face models with tied embeddings) gets its
own copy and trains apart from it. ``move_model`` is ``model.to`` on CUDA and the CPU, so
every move of a model the port sees (and the one it writes) uses it: a program cannot be
known to have no ties. A model is a name on which the program calls what only modules have
(``.parameters()``, ``.train()``, ``.eval()``, ``.configure_optimizers()``, ...).
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import code, cuda_string, dotted, libcst

_MODULE_ONLY = {"parameters", "named_parameters", "train", "eval", "configure_optimizers",
                "print_trainable_parameters", "gradient_checkpointing_enable", "get_input_embeddings",
                "tie_weights", "modules", "named_modules"}  # fmt: skip


def _unchained(node: Any, methods: set[str] | None = None) -> Any:
    """The receiver under a chain of methods that return the module (``model`` of ``model.to(device).train()``)."""
    cst = libcst()
    methods = methods or {*_CHAINED, "to", "cuda"}
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in methods:
        node = node.func.value
    return node


@analysis(order=10)
def analyse(module: Any, plan: Any) -> None:
    """Adds to ``plan.models`` the names the program uses as modules."""
    cst = libcst()
    found: set[str] = set()

    class Uses(cst.CSTVisitor):
        def visit_Call(self, node: Any) -> None:
            if isinstance(node.func, cst.Attribute) and node.func.attr.value in _MODULE_ONLY:
                name = dotted(_unchained(node.func.value))
                if name:
                    found.add(name)

    module.visit(Uses())
    plan.models.update(found - plan.optimizers)


def _device_argument(call: Any) -> Any:
    """The device a ``.to(...)`` call moves to (positional or ``device=``), None for a dtype or anything else."""
    args = [a for a in call.args if a.keyword is None or a.keyword.value == "device"]
    if len(call.args) != 1 or not args:
        return None
    text = code(args[0].value)
    return args[0].value if ("device" in text or cuda_string(args[0].value) or "get_device()" in text) else None


def _moved(porter: Porter, original: Any, model: Any, device: Any) -> Any:
    porter.need("move_model")
    new = libcst().parse_expression(f"move_model({code(model)}, {code(device)})")
    porter.change("tied_weights", original, new)
    return new


def _move(updated: Any) -> tuple[Any, Any] | None:
    """(model expression, device) for ``<model>.to(device)``."""
    cst = libcst()
    if isinstance(updated, cst.Call) and isinstance(updated.func, cst.Attribute) and updated.func.attr.value == "to":
        device = _device_argument(updated)
        if device is not None:
            return updated.func.value, device
    return None


_CHAINED = {"train", "eval", "float", "half", "bfloat16", "double", "requires_grad_"}  # module methods that return it


def _is_model(node: Any, models: set[str]) -> bool:
    """A model's name, or a chain of module methods on it (``model.train()``, ``model.eval().float()``)."""
    return dotted(_unchained(node, _CHAINED)) in models


@fixes("Call", order=120)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``model.to(device)`` / ``model.cuda()`` / ``model.train().to(device)`` for a name the program uses as a model."""
    cst = libcst()
    if not isinstance(updated.func, cst.Attribute) or not _is_model(updated.func.value, porter.plan.models):
        return None
    if updated.func.attr.value == "cuda" and not any(a.keyword is None for a in updated.args):
        return _moved(porter, original, updated.func.value, cst.parse_expression(porter.device()))
    found = _move(updated)
    return _moved(porter, original, *found) if found else None


@fixes("Assign", order=60)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``model = Net().to(device)``: the target is the model, built in the same line."""
    if not any(dotted(t.target) in porter.plan.models for t in original.targets):
        return None
    found = _move(updated.value)
    if found is None or not isinstance(found[0], libcst().Call):
        return None  # a name's move is the call fixer's (xmp.MpModelWrapper's .to gives the model: no module)
    return updated.with_changes(value=_moved(porter, original.value, *found))
