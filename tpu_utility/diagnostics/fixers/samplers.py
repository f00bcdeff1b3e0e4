"""``DistributedSampler(ds)`` -> ``make_sampler(ds, ...)``, which gives None with one replica; its loader and ``set_epoch`` follow.

The loader of a sampler that may be None shuffles itself then (``shuffle=sampler is None``),
and ``sampler.set_epoch(epoch)`` runs only when there is a sampler. A torch_xla kernel's
sampler (``num_replicas=xm.xrt_world_size()``) keeps its form: its calls are renamed one by one.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import assigned, call_names, code, dotted, keyword, libcst, own, value


@fixes("Call", order=190)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``DistributedSampler(ds, shuffle=...)`` and a ``DataLoader(..., sampler=<a make_sampler's name>)``."""
    if own(updated, porter.plan):
        return None  # the program's own class DistributedSampler / DataLoader shadows torch's
    last = call_names(updated, porter.plan)[1]
    if last == "DistributedSampler":
        return _sampler(porter, original, updated)
    if last == "DataLoader":
        return _loader(porter, original, updated)
    return None


def _sampler(porter: Porter, original: Any, updated: Any) -> Any:
    args = updated.args
    if any(a.keyword is not None and a.keyword.value in ("num_replicas", "rank") for a in args):
        return None  # a torch_xla kernel's: its world size and rank calls are ported one by one
    kept = [args[0]] + [a for a in args[1:] if a.keyword is not None and a.keyword.value in ("shuffle", "seed", "drop_last")]
    porter.need("make_sampler")
    new = libcst().parse_expression(f"make_sampler({', '.join(code(a).strip().rstrip(',') for a in kept)})")
    porter.change("distributed_sampler", original, new)
    return new


def _loader(porter: Porter, original: Any, updated: Any) -> Any:
    cst = libcst()
    sampler = keyword(updated, "sampler")
    if sampler is None or dotted(sampler.value) not in porter.plan.samplers:
        return None
    name = dotted(sampler.value)
    wanted = porter.plan.samplers[name]
    if wanted == "False":
        return None  # in order either way
    shuffled = cst.parse_expression(f"{name} is None" if wanted == "True" else f"({wanted}) and {name} is None")
    given = keyword(updated, "shuffle")
    if given is not None:
        args = [a.with_changes(value=shuffled) if a is given else a for a in updated.args]
    else:
        last = updated.args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        shuffle = cst.Arg(shuffled, keyword=cst.Name("shuffle"), equal=cst.AssignEqual(
            cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))  # fmt: skip
        args = [*updated.args[:-1], last, shuffle]
    new = updated.with_changes(args=args)
    porter.change("distributed_sampler", original, new)
    return new


@fixes("Assign", order=30)
def fix_assign(porter: Porter, original: Any, updated: Any) -> Any:
    """``sampler = make_sampler(ds, shuffle)`` (as the call's fixer left it): the plan learns the name and its shuffle."""
    cst = libcst()
    if isinstance(updated.value, cst.Call) and dotted(updated.value.func) == "make_sampler":
        shuffle = next((code(a.value) for a in updated.value.args[1:]
                        if a.keyword is None or a.keyword.value == "shuffle"), "True")  # fmt: skip
        for name in assigned(cst.SimpleStatementLine([updated])):
            porter.plan.samplers[name] = shuffle
    return None


@fixes("SimpleStatementLine", order=60)
def fix_statement(porter: Porter, original: Any, updated: Any) -> Any:
    """``sampler.set_epoch(epoch)`` -> ``if sampler is not None: sampler.set_epoch(epoch)``."""
    cst = libcst()
    call = value(updated)
    if (isinstance(call, cst.Call) and isinstance(call.func, cst.Attribute) and call.func.attr.value == "set_epoch"
            and dotted(call.func.value) in porter.plan.samplers):  # fmt: skip
        name = dotted(call.func.value)
        guarded = cst.parse_statement(f"if {name} is not None:  # one replica: make_sampler gave None\n    {code(call)}\n")
        porter.change("distributed_sampler", original, guarded)
        return guarded
    return None
