"""torch_xla 1.x names gone or deprecated on 2.8 and 2.9: ``xm.xrt_world_size()`` -> ``xr.world_size()`` and the rest.

The old and new names are ``rules.py``'s (each rule's ``replaces`` and ``fix``), the
table ``check`` reads too; the module a new name needs (``xr``, ``torch_xla``) is its first part.
"""

from __future__ import annotations

from typing import Any

from ..rules import RULES
from .registry import Porter, fixes
from .tree import call_names, libcst

_RENAMED = ("xrt_world_size", "get_ordinal", "xla_device", "mark_step")


def renames() -> dict[str, tuple[str, str, str]]:
    """Old name -> (rule, new name, module the new name needs), from the table: ``xm.get_ordinal`` -> ``xr.global_ordinal``."""
    found = {}
    for rule in _RENAMED:
        old, new = RULES[rule].replaces.removesuffix("()"), RULES[rule].fix.removesuffix("()")
        found[old] = (rule, new, new.split(".", 1)[0])
    return found


@fixes("Call", order=200)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``xm.xla_device(devkind=...)`` -> ``torch_xla.device()`` (``devkind`` is gone with it)."""
    name, _ = call_names(updated, porter.plan)
    table = renames()
    if name not in table:
        return None
    rule, new_name, module = table[name]
    porter.need(module)
    kept = [a for a in updated.args if not (a.keyword is not None and a.keyword.value == "devkind")]
    new = updated.with_changes(func=libcst().parse_expression(new_name), args=kept)
    porter.change(rule, original, new)
    return new
