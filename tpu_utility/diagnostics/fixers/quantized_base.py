"""A QLoRA load (bitsandbytes' 8-bit or 4-bit base): the kit's int8 base, ``quantize_base``, in its place.

``from_pretrained(name, load_in_8bit=True)`` becomes ``quantize_base(from_pretrained(name))``: the linear
layers stored as int8 with a scale per output channel, which LoRA wraps as it wraps bitsandbytes' layers
(``tpu_utility.quantization``). A load given a ``BitsAndBytesConfig`` (inline, or a name the program binds to
one and uses only as loads' ``quantization_config``) is rewritten the same way, and its ``device_map`` goes
(``move_model(..., get_device())``, as the ``from_pretrained`` fixer does). The config's line stays (it builds
without bitsandbytes) and the report says what became of it: a 4-bit config (``load_in_4bit``, NF4, double
quantization) is said to be mapped to the int8 base (4-bit is not built: int8 halves a bf16 base), and its
``bnb_*`` options, which have no equivalent here, are named. A config used any other way (given to a trainer,
returned) is left, named with the line to write.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, analysis, fixes
from .tree import code, dotted, keyword, libcst

_FLAGS = ("load_in_8bit", "load_in_4bit")
_LOADER = "load_quantized(path)"


def _on(call: Any, name: str) -> bool:
    flag = keyword(call, name)
    return flag is not None and code(flag.value) != "False"


def _is_config(node: Any) -> bool:
    cst = libcst()
    return (isinstance(node, cst.Call) and dotted(node.func).rsplit(".", 1)[-1] == "BitsAndBytesConfig"
            and any(_on(node, f) for f in _FLAGS))  # fmt: skip


def _int8_fix(load: str) -> str:
    return (f"an int8 base under LoRA on XLA: {load} (tpu_utility.quantize_base), or {_LOADER} to quantize "
            f"a checkpoint one tensor at a time; 4-bit is not built: int8 halves a bf16 base")  # fmt: skip


def _options(config: Any) -> str:
    """What a config asks beyond its width, which the int8 base does not map (named, not dropped in silence)."""
    dropped = [f"{a.keyword.value}={code(a.value)}" for a in config.args if a.keyword is not None and a.keyword.value not in _FLAGS]
    return f"; not mapped: {', '.join(dropped)}" if dropped else ""


@analysis(order=75)
def analyse(module: Any, plan: Any) -> None:
    """``plan.bnb_configs``: name -> the ``BitsAndBytesConfig(...)`` call it is bound to, for names used only as
    a ``from_pretrained``'s ``quantization_config`` (those loads are rewritten; other uses leave the config)."""
    cst = libcst()
    bound: dict[str, Any] = {}
    loads: dict[str, int] = {}
    refs: dict[str, int] = {}

    class Configs(cst.CSTVisitor):
        def visit_Assign(self, node: Any) -> None:
            if len(node.targets) == 1 and isinstance(node.targets[0].target, cst.Name) and _is_config(node.value):
                bound[node.targets[0].target.value] = node.value

        def visit_Call(self, node: Any) -> None:
            given = keyword(node, "quantization_config")
            if not dotted(node.func).endswith("from_pretrained") or given is None:
                return
            if isinstance(given.value, cst.Name):
                loads[given.value.value] = loads.get(given.value.value, 0) + 1
            elif _is_config(given.value):
                plan.bnb_inline.add(id(given.value))

        def visit_Name(self, node: Any) -> None:
            refs[node.value] = refs.get(node.value, 0) + 1

    module.visit(Configs())
    # each name is seen once where it is bound and once per load; any other reference is another use
    plan.bnb_configs = {name: call for name, call in bound.items() if loads.get(name) and refs[name] == 1 + loads[name]}


@fixes("Call", order=95)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``X.from_pretrained(..., load_in_8bit=True)`` or with a ``BitsAndBytesConfig`` -> ``quantize_base(X.from_pretrained(...))``."""
    cst = libcst()
    configs = porter.plan.bnb_configs
    last = dotted(updated.func).rsplit(".", 1)[-1]
    if _is_config(updated):
        if id(original) in porter.plan.bnb_inline:
            return None  # the load around it says what became of it
        name = next((n for n, call in configs.items() if call is original), None)
        if name is None:  # given to something other than a load: named, with the kit's call
            porter.leave_alone("bitsandbytes", original, fix=_int8_fix("quantize_base(AutoModelForCausalLM."
                                                                       "from_pretrained(name))"))  # fmt: skip
        else:
            four = " 4-bit asked: mapped to the int8 base (int8 weights, a scale per output channel)" if _on(updated, "load_in_4bit") else ""
            porter.note("int8_base", original, f"{name} is no longer read: the load given it is quantize_base(...)"
                                               f";{four or ' 8-bit: the int8 base'}{_options(updated)}")  # fmt: skip
        return None
    if last != "from_pretrained":
        return None
    given = keyword(updated, "quantization_config")
    config = None
    if given is not None:
        config = given.value if _is_config(given.value) else configs.get(getattr(given.value, "value", None))
        if config is None:  # a config this fixer cannot see: named
            plain = code(updated.with_changes(args=[a for a in updated.args if a is not given]))
            porter.leave_alone("bitsandbytes", original, fix=_int8_fix(f"quantize_base({plain})"))
            return updated
    elif not any(_on(updated, f) for f in _FLAGS):
        return None
    placed = keyword(updated, "device_map")
    moved = placed is not None and code(placed.value).strip("'\"") != "cpu"  # device_map="cpu" stays as given
    dropped = (*_FLAGS, "quantization_config", *(("device_map",) if moved else ()))
    args = [a for a in updated.args if a.keyword is None or a.keyword.value not in dropped]
    if args:
        args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    new = f"quantize_base({code(updated.with_changes(args=args))})"
    porter.need("quantize_base")
    if moved:
        porter.need("move_model")
        porter.need("get_device")
        new = f"move_model({new}, get_device())"
    new_node = cst.parse_expression(new)
    porter.change("int8_base", original, new_node)
    inline = config is not None and given is not None and config is given.value
    if _on(updated, "load_in_4bit") or (inline and _on(config, "load_in_4bit")):
        porter.note("int8_base", original, "4-bit asked (load_in_4bit): mapped to the int8 base, int8 weights with a "
                                           "scale per output channel (4-bit is not built: int8 halves a bf16 base)"
                                           + (_options(config) if inline else ""))  # fmt: skip
    return new_node
