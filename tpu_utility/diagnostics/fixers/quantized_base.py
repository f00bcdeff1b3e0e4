"""A QLoRA load (bitsandbytes' 8-bit or 4-bit base): the kit's int8 base, ``quantize_base``, in its place.

``from_pretrained(name, load_in_8bit=True)`` becomes ``quantize_base(from_pretrained(name))``:
the linear layers stored as int8 with a scale per output channel, which LoRA wraps as
bitsandbytes' layers (``tpu_utility.quantization``). A ``BitsAndBytesConfig`` (a line of its own,
or a load given one) is named with the line to write: its options (double quantization, the
compute dtype, 4-bit NF4) have no one-to-one equivalent here. A load that also places the model
(``device_map``) is the ``from_pretrained`` fixer's.
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, keyword, libcst

_FLAGS = ("load_in_8bit", "load_in_4bit")
_LOADER = "load_quantized(path)"


def _on(call: Any, name: str) -> bool:
    flag = keyword(call, name)
    return flag is not None and code(flag.value) != "False"


def _int8_fix(load: str) -> str:
    return (f"an int8 base under LoRA on XLA: {load} (tpu_utility.quantize_base), or {_LOADER} to quantize "
            f"a checkpoint one tensor at a time; 4-bit is not built: int8 halves a bf16 base")  # fmt: skip


@fixes("Call", order=95)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``X.from_pretrained(..., load_in_8bit=True)`` -> ``quantize_base(X.from_pretrained(...))``; configs named."""
    last = dotted(updated.func).rsplit(".", 1)[-1]
    if last == "BitsAndBytesConfig" and any(_on(updated, f) for f in _FLAGS):
        porter.leave_alone("bitsandbytes", original, fix=_int8_fix("quantize_base(AutoModelForCausalLM."
                                                                   "from_pretrained(name))"))  # fmt: skip
        return updated  # named here, with the kit's call
    if last != "from_pretrained" or keyword(updated, "device_map") is not None:
        return None
    config = keyword(updated, "quantization_config")
    if not any(_on(updated, f) for f in _FLAGS) and config is None:
        return None
    args = [a for a in updated.args if a.keyword is None or a.keyword.value not in (*_FLAGS, "quantization_config")]
    if args:
        args[-1] = args[-1].with_changes(comma=libcst().MaybeSentinel.DEFAULT)
    plain = code(updated.with_changes(args=args))
    if config is not None or _on(updated, "load_in_4bit"):
        porter.leave_alone("bitsandbytes", original, fix=_int8_fix(f"quantize_base({plain})"))
        return updated
    porter.need("quantize_base")
    new = libcst().parse_expression(f"quantize_base({plain})")
    porter.change("int8_base", original, new)
    return new
