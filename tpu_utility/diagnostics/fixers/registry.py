"""The fixers' registry: each module under ``fixers/`` registers its hooks where they are written.

As pyupgrade's plugins do, a fixer module says itself what it handles, with a decorator::

    @fixes("Call", order=170)
    def fix_call(porter: Porter, original: cst.Call, updated: cst.Call) -> cst.BaseExpression | None: ...

and the pipeline (``fixers.apply``, ``port/plan.py``, ``port/cells.py``) reads the registry,
so a new fixer is one module. A module is one fixer: one concern, its hooks recorded under
its name (``REGISTRY``). The hooks:

* ``@fixes(node_type, order)``: ``fix(porter, original, updated)`` on each LibCST node of that
  type the walk leaves; it returns the node that replaces ``updated``, a RemovalSentinel, or
  None to let the next fixer look (a fixer that only reports returns None). The fixers of one
  node type are tried by ``order``, lowest first; those that only report come first, as they
  always run. Two fixers of one node type never share an order: the order is explicit.
* ``@analysis(order)``: ``analyse(module, plan)``, over every cell before the walk.
* ``@planning(order)``: ``plan_top(top_level_statements, plan)``, once over all cells' top level.
* ``@finishing(order)``: ``after(results, plan) -> (results, [(rule, code) left])``, over the cells' new sources.
* ``@opening``: ``opens(if_node) -> bool``: whether an ``if``'s CUDA test becomes the accelerator
  test (its body then runs on a TPU: no guard).
* ``@magic(order)``: ``rule_of(ipython_line) -> rule id or None``, over a cell's IPython lines.

The registry imports nothing of the porter (``port/`` imports this package): ``Porter`` below
states what a fixer may use of the walk's transformer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    import libcst as cst

# the LibCST node types the walk hands to fixers (port/walk.py has one leave_ a type)
NodeType = Literal["Call", "Arg", "IfExp", "Assign", "If", "Assert", "Subscript", "Import", "ImportFrom",
                   "SimpleStatementLine", "For"]  # fmt: skip
Hook = Literal["analyse", "plan", "after_walk", "opens", "magic"]


class Porter(Protocol):
    """What a fixer may use of the walk (``port.walk.Porter``): the plan, the report, the scopes."""

    plan: Any  # port.plan.Plan (port/ imports the fixers, so not named here)
    loops: list[bool]  # per enclosing loop: does it run per step?
    guards: list[bool]  # per enclosing test: does it mention CUDA?
    classes: int  # class bodies around the node
    device_stack: list[str | None]  # the device's name in each enclosing function scope

    def line(self, node: cst.CSTNode) -> int: ...

    def short(self, text: str, width: int = ...) -> str: ...

    def change(self, rule: str, original: cst.CSTNode, updated: cst.CSTNode) -> None: ...

    def note(self, rule: str, original: cst.CSTNode, after: str) -> None: ...

    def leave_alone(self, rule: str, original: cst.CSTNode, fix: str | None = None, code: str | None = None) -> None: ...

    def need(self, name: str) -> None: ...

    def device(self) -> str: ...


# a fixer: the node that replaces ``updated``, a RemovalSentinel, or None (the next fixer looks)
Fix = Callable[[Porter, "cst.CSTNode", "cst.CSTNode"], Any]
Analyse = Callable[["cst.Module", Any], None]  # (a cell, the plan)
PlanTop = Callable[[list["cst.CSTNode"], Any], None]  # (all cells' top-level statements, the plan)
AfterWalk = Callable[[list["str | None"], Any], "tuple[list[str | None], list[tuple[str, str]]]"]
Opens = Callable[["cst.If"], bool]
Magic = Callable[[str], "str | None"]
FixT = TypeVar("FixT", bound=Fix)
AnalyseT = TypeVar("AnalyseT", bound=Analyse)
PlanTopT = TypeVar("PlanTopT", bound=PlanTop)
AfterWalkT = TypeVar("AfterWalkT", bound=AfterWalk)
OpensT = TypeVar("OpensT", bound=Opens)
MagicT = TypeVar("MagicT", bound=Magic)
H = TypeVar("H", bound=Callable[..., Any])


@dataclass
class Fixer:
    """One module's hooks (one concern): its fixes by node type and its other hooks, each with its order."""

    name: str  # the module's name under fixers/
    fixes: dict[NodeType, tuple[int, Fix]] = field(default_factory=dict)
    hooks: dict[Hook, tuple[int | None, Callable[..., Any]]] = field(default_factory=dict)


REGISTRY: dict[str, Fixer] = {}  # module name -> its fixer


def _fixer(function: Callable[..., Any]) -> Fixer:
    name = function.__module__.rsplit(".", 1)[-1]
    return REGISTRY.setdefault(name, Fixer(name))


def _clash(order: int, taken: list[tuple[Any, Callable[..., Any]]], what: str, function: Callable[..., Any]) -> None:
    for other_order, other in taken:
        if other_order == order and other is not function:
            raise ValueError(f"{function.__module__}.{function.__name__} and {other.__module__}.{other.__name__} "
                             f"both ask for order {order} on {what}: give each its own place")  # fmt: skip


def fixes(node_type: NodeType, order: int) -> Callable[[FixT], FixT]:
    """Registers a fixer for a node type, tried at ``order`` among that type's fixers (lowest first)."""

    def register(function: FixT) -> FixT:
        _clash(order, [f.fixes[node_type] for f in REGISTRY.values() if node_type in f.fixes], node_type, function)
        _fixer(function).fixes[node_type] = (order, function)
        fixers_of.cache_clear()
        return function

    return register


def _hook(kind: Hook, order: int | None) -> Callable[[H], H]:
    def register(function: H) -> H:
        if order is not None:
            _clash(order, [f.hooks[kind] for f in REGISTRY.values() if kind in f.hooks], kind, function)
        _fixer(function).hooks[kind] = (order, function)
        hooks.cache_clear()
        return function

    return register


def analysis(order: int) -> Callable[[AnalyseT], AnalyseT]:
    """Registers ``analyse(module, plan)``, run over every cell before the walk at ``order`` (lowest first)."""
    return _hook("analyse", order)


def planning(order: int) -> Callable[[PlanTopT], PlanTopT]:
    """Registers ``plan_top(top_level_statements, plan)``, run once before the walk at ``order`` (lowest first)."""
    return _hook("plan", order)


def finishing(order: int) -> Callable[[AfterWalkT], AfterWalkT]:
    """Registers ``after(results, plan)``, run over the cells' new sources once the walk is done, at ``order``."""
    return _hook("after_walk", order)


def magic(order: int) -> Callable[[MagicT], MagicT]:
    """Registers ``rule_of(line)``: the rule an IPython line breaks, or None (the first rule found counts)."""
    return _hook("magic", order)


def opening(function: OpensT) -> OpensT:
    """Registers ``opens(if_node)``: whether the port turns an ``if``'s CUDA test into the accelerator test
    (any one saying so is enough, so these have no order)."""
    return _hook("opens", None)(function)


@functools.cache  # the walk asks for every node; a registration clears it
def fixers_of(node_type: NodeType) -> tuple[Fix, ...]:
    """The fixers of a node type, in their order."""
    found = [f.fixes[node_type] for f in REGISTRY.values() if node_type in f.fixes]
    return tuple(function for _, function in sorted(found, key=lambda pair: pair[0]))


@functools.cache
def hooks(kind: Hook) -> tuple[Callable[..., Any], ...]:
    """The hooks of a kind, in their order (those without one by module name)."""
    found = [(f.hooks[kind][0] or 0, f.name, f.hooks[kind][1]) for f in REGISTRY.values() if kind in f.hooks]
    return tuple(function for _, _, function in sorted(found, key=lambda t: (t[0], t[1])))
