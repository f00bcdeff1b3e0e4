"""The porting tool's fixers, one concern a module, each registered for the LibCST node types it leaves.

A fixer is ``fix(porter, original, updated)``: it returns the node that replaces
``updated``, or None to let the next fixer look (a fixer that only reports returns None).
``porter`` is the walk's transformer (``tpu_utility.diagnostics.port.walk``): ``porter.plan``
(decisions made before the walk), ``porter.change(rule, original, new)``,
``porter.note(rule, original, after)``, ``porter.leave_alone(rule, original)``,
``porter.device()``, ``porter.need(name)`` (an import the output needs), ``porter.loops`` and
``porter.guards`` (per enclosing loop: runs per step; per enclosing test: mentions CUDA).
An analysis is ``analyse(module, plan)``, run over every cell before the walk; a plan is
``plan_top(top_level_statements, plan)``, run once over all cells' top-level statements.
The texts (cost, fix) of every rule are in ``tpu_utility.diagnostics.rules``.
"""

from __future__ import annotations

from typing import Any, Callable

from . import (amp, bookkeeping, colab, cpu_fallback, cuda_available, cuda_call, cuda_device, cuda_flag, cuda_guard,
               cuda_move, ddp, device_calls, device_strings, dynamic_shape, env_setup, from_pretrained, generator,
               hogwild, host_sync, import_device, inference_mode, launch, move_model, optimizer_order, optimizer_step,
               samplers, spawn_nprocs, torch_compile, transformers_api, xla_renames, xla_use_bf16)  # fmt: skip

Fixer = Callable[[Any, Any, Any], Any]

# node type -> fixers, in the order they are tried (those that only report come first: they always run)
FIXERS: dict[str, tuple[Fixer, ...]] = {
    "Call": (host_sync.fix_call, cpu_fallback.fix_call, cuda_call.fix_call, ddp.fix_call, hogwild.fix_call,
             bookkeeping.fix_call, device_calls.fix_call, generator.fix_call, torch_compile.fix_call,
             from_pretrained.fix_call, device_strings.fix_call, move_model.fix_call, transformers_api.fix_call, cuda_device.fix_call,
             cuda_move.fix_call, optimizer_step.fix_call, amp.fix_call, inference_mode.fix_call, samplers.fix_call,
             xla_renames.fix_call, spawn_nprocs.fix_call),
    "Arg": (cuda_device.fix_arg,),
    "IfExp": (device_strings.fix_ifexp, cuda_device.fix_ifexp),
    "Assign": (xla_use_bf16.fix_assign, ddp.fix_assign, samplers.fix_assign, device_strings.fix_assign,
               cuda_flag.fix_assign, move_model.fix_assign),
    "If": (cuda_guard.fix_if, bookkeeping.fix_if, cuda_available.fix_if, cuda_flag.fix_if),
    "Assert": (colab.fix_assert,),
    "Subscript": (colab.fix_subscript, dynamic_shape.fix_subscript),
    "Import": (colab.fix_import,),
    "ImportFrom": (colab.fix_import, transformers_api.fix_import, amp.fix_import),
    "SimpleStatementLine": (launch.fix_statement, import_device.fix_statement, optimizer_order.fix_statement, torch_compile.fix_statement,
                            device_calls.fix_statement, samplers.fix_statement),
}  # fmt: skip
ANALYSES = (move_model.analyse, dynamic_shape.analyse, bookkeeping.analyse, import_device.analyse)
PLANS = (optimizer_order.plan_top, launch.plan_top)
MAGICS = (env_setup.fix_magic,)


def opened(node: Any) -> bool:
    """Whether an ``if``'s CUDA test becomes the accelerator test (its body then runs on a TPU: no guard)."""
    return cuda_available.decides_device(node) or cuda_flag.opens(node)


def apply(kind: str, porter: Any, original: Any, updated: Any) -> Any:
    """The first fixer's replacement for ``updated``, or None when no fixer of ``kind`` rewrites it."""
    for fix in FIXERS.get(kind, ()):
        new = fix(porter, original, updated)
        if new is not None:
            return new
    return None
