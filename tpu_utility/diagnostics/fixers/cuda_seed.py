"""``torch.cuda.manual_seed(seed)`` / ``manual_seed_all``: harmless without CUDA (torch queues it), but it seeds nothing on a TPU.

A program that also calls ``torch.manual_seed`` keeps the line as it is (it seeds CUDA where
there is CUDA). One that seeds only CUDA gets ``torch.manual_seed(seed)``, which seeds every
device's generator, and the report says so. Neither stops the port.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import call_names, canonical, dotted, libcst

_SEEDS = {"torch.cuda.manual_seed", "torch.cuda.manual_seed_all"}
FINE = {"manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed"}  # cuda_call leaves these here


@analysis(order=60)
def analyse(module: Any, plan: Any) -> None:
    """``plan.seeds_all_devices``: the program calls ``torch.manual_seed`` itself."""
    cst = libcst()

    class Seeds(cst.CSTVisitor):
        def visit_Call(self, node: Any) -> None:
            if canonical(dotted(node.func), plan) == "torch.manual_seed":
                plan.seeds_all_devices = True

    module.visit(Seeds())


@fixes("Call", order=35)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``torch.cuda.manual_seed_all(seed)`` -> ``torch.manual_seed(seed)`` where the program seeds only CUDA."""
    name, _ = call_names(updated, porter.plan)
    if name not in _SEEDS or porter.plan.seeds_all_devices:
        return None
    new = updated.with_changes(func=libcst().parse_expression("torch.manual_seed"))
    porter.change("cuda_seed", original, new)
    return new
