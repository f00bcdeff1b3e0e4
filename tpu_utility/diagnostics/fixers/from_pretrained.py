"""Hugging Face loads placed by ``device_map`` (never XLA).

``from_pretrained(name, device_map="auto")`` puts the model on CUDA or the CPU, and
``batch.to(model.device)`` follows it: the whole run stays on the host. The keyword goes and
the loaded model is moved with ``move_model`` (which keeps tied embeddings tied), so
``model.device`` is the XLA device and the batches follow it there. A 4-bit or 8-bit load
(``BitsAndBytesConfig``, ``load_in_4bit``/``load_in_8bit``) is the ``quantized_base`` fixer's, which
runs first (bitsandbytes has no XLA kernels).
"""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, keyword, libcst

@fixes("Call", order=100)
def fix_call(porter: Porter, original: Any, updated: Any) -> Any:
    """``X.from_pretrained(..., device_map=...)`` -> ``move_model(X.from_pretrained(...), get_device())``."""
    cst = libcst()
    last = dotted(updated.func).rsplit(".", 1)[-1]
    if last != "from_pretrained":
        return None
    placed = keyword(updated, "device_map")
    if placed is None or code(placed.value).strip("'\"") == "cpu":
        return None
    args = [a for a in updated.args if a is not placed]
    args[-1] = args[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    porter.need("move_model")
    porter.need("get_device")  # the device line may come after the load
    new = cst.parse_expression(f"move_model({code(updated.with_changes(args=args))}, get_device())")
    porter.change("device_map", original, new)
    return new
