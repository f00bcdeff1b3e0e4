"""The plan: what the port decides over all cells before it rewrites any (aliases, optimizers, the device, the launch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import fixers
from ..fixers.tree import OPTIMIZERS, assigned, canonical, cuda_string, dotted, launched, libcst, mentions_cuda, value
from ..fixers.tensor_type import cuda_type


@dataclass
class Plan:
    """Decisions that span statements or cells, made before rewriting."""

    xm: set[str] = field(default_factory=set)  # names bound to torch_xla.core.xla_model
    xmp: set[str] = field(default_factory=set)  # names bound to torch_xla.distributed.xla_multiprocessing
    optimizers: set[str] = field(default_factory=set)  # code of names holding an optimizer
    samplers: dict[str, str] = field(default_factory=dict)  # make_sampler(...)'s name (None with one replica) -> shuffle
    device: str | None = None  # the module-level name of the device
    insert_before: dict[int, tuple[str, str]] = field(default_factory=dict)  # id(stmt) -> (code, model name)
    remove: set[int] = field(default_factory=set)  # id(stmt) of statements that move
    relocate: dict[int, Any] = field(default_factory=dict)  # id(stmt) -> updated stmt, moved into the spawned fn
    spawned: str | None = None  # the function a multi-process launch runs
    stuck: list[Any] = field(default_factory=list)  # top-level blocks that ask the runtime but cannot move
    imported: dict[str, str] = field(default_factory=dict)  # `from torch.x import y as z`: z -> torch.x.y
    needs: set[str] = field(default_factory=set)  # names the rewrites need imported: torch_xla, xr, the kit's (port.imports)
    imports: list[tuple[str, str | None, str | None]] = field(default_factory=list)  # others: (module, name, alias)
    models: set[str] = field(default_factory=set)  # names the program uses as modules (fixers.move_model)
    hf_adamw: set[str] = field(default_factory=set)  # names bound to transformers.AdamW
    hf_trainers: set[str] = field(default_factory=set)  # names bound to transformers' or trl's Trainer classes
    launches: bool = False  # the program starts processes itself (fixers.import_device)
    host_values: set[str] = field(default_factory=set)  # names bound to DataFrames, arrays, lists (fixers.dynamic_shape)
    device_flags: set[str] = field(default_factory=set)  # names bound to a comparison of device metrics (fixers.bookkeeping)
    defined: set[str] = field(default_factory=set)  # classes and functions the program defines: they shadow torch's names
    opt_outs: dict[str, str] = field(default_factory=dict)  # use_accel = not args.no_accel and ...: name -> the opt-out's code
    sparse: set[str] = field(default_factory=set)  # names bound to sparse tensors (fixers.sparse)
    device_modules: set[str] = field(default_factory=set)  # names bound to getattr(torch, device_type, ...) (fixers.device_calls)
    before: dict[int, tuple[str, str]] = field(default_factory=dict)  # id(stmt) -> (rule, a line the walk puts before it)
    named: dict[int, str] = field(default_factory=dict)  # id(stmt) -> the rule a fixer names it by in the walk
    seeds_all_devices: bool = False  # the program calls torch.manual_seed itself (fixers.cuda_seed)
    device_tests: set[str] = field(default_factory=set)  # `if train_on_gpu: model.cuda()`: names so tested (fixers.cuda_flag)
    tensor_types: dict[str, str] = field(default_factory=dict)  # Tensor = torch.cuda.FloatTensor if ...: name -> type
    bnb_configs: dict[str, Any] = field(default_factory=dict)  # bnb = BitsAndBytesConfig(...) only given to loads (fixers.quantized_base)
    bnb_inline: set[int] = field(default_factory=set)  # id() of BitsAndBytesConfig(...) written in a load's call (fixers.quantized_base)


def _names(module: Any, plan: Plan) -> None:
    """The aliases of xla_model and xla_multiprocessing, names imported from torch, and names holding an optimizer."""
    cst = libcst()

    class Names(cst.CSTVisitor):
        def visit_Import(self, node: Any) -> None:
            for alias in node.names:
                name = dotted(alias.name)
                bound = alias.asname.name.value if alias.asname else name
                if name == "torch_xla.core.xla_model":
                    plan.xm.add(bound)
                if name == "torch_xla.distributed.xla_multiprocessing":
                    plan.xmp.add(bound)

        def visit_ClassDef(self, node: Any) -> None:
            plan.defined.add(node.name.value)  # class Generator(nn.Module) is the user's, not torch.Generator

        def visit_FunctionDef(self, node: Any) -> None:
            plan.defined.add(node.name.value)

        def visit_ImportFrom(self, node: Any) -> None:
            module = dotted(node.module) if node.module is not None else ""
            if module.split(".")[0] == "torch" and not isinstance(node.names, cst.ImportStar):
                for alias in node.names:
                    bound = alias.asname.name.value if alias.asname else alias.name.value
                    plan.imported[bound] = f"{module}.{alias.name.value}"

        def visit_Assign(self, node: Any) -> None:
            if isinstance(node.value, cst.Call) and dotted(node.value.func).rsplit(".", 1)[-1] in OPTIMIZERS:
                plan.optimizers.update(dotted(t.target) for t in node.targets if dotted(t.target))

    module.visit(Names())


def _device_expression(node: Any, plan: Plan) -> bool:
    cst = libcst()
    if isinstance(node, cst.IfExp):  # a device, not a flag (cuda = True if torch.cuda.is_available() else False)
        flag = all(isinstance(b, cst.Name) and b.value in ("True", "False") for b in (node.body, node.orelse))
        return mentions_cuda(node.test) and not flag and cuda_type(node) is None  # nor a tensor type (fixers.tensor_type)
    if isinstance(node, cst.Call):
        callee = canonical(dotted(node.func), plan)
        if callee == "torch.device":
            return bool(node.args) and (cuda_string(node.args[0].value) is not None or isinstance(node.args[0].value, cst.IfExp))
        return callee in ("xm.xla_device", "torch_xla.device", "get_device")
    return False


def make_plan(modules: list[Any]) -> Plan:
    """The plan for the parsed cells (in order): names first, then each fixer's analysis, the device, the launch."""
    plan = Plan()
    for module in modules:
        _names(module, plan)
    for name in plan.defined:  # the program's own class or function shadows a name imported from torch
        plan.imported.pop(name, None)
    for module in modules:
        for analyse in fixers.analyses():
            analyse(module, plan)
    top = [stmt for module in modules for stmt in module.body]
    for stmt in top:
        names = assigned(stmt)
        if names and value(stmt) is not None and plan.device is None and _device_expression(value(stmt), plan):
            plan.device = names[0]
        if launched(stmt, plan) and value(stmt).args and isinstance(value(stmt).args[0].value, libcst().Name):
            plan.spawned = value(stmt).args[0].value.value
    for plan_top in fixers.plans():
        plan_top(top, plan)
    return plan
