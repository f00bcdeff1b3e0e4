"""Small questions about a LibCST tree that the porter and its fixers share."""

from __future__ import annotations

from typing import Any

PORT_INSTALL = 'pip install libcst nbformat  (or pip install "tpu_utility[port]")'


def libcst() -> Any:
    """LibCST, imported when the porter runs (the package imports without it)."""
    try:
        import libcst as cst
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(f"python -m tpu_utility.port needs LibCST: {PORT_INSTALL}") from error
    return cst


def dotted(node: Any) -> str:
    """``a.b.c`` for Name/Attribute chains, "" otherwise."""
    cst = libcst()
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else ""
    return ""


def code(node: Any) -> str:
    """The source of a node."""
    return libcst().Module(body=[]).code_for_node(node)


def cuda_string(node: Any) -> str | None:
    """``"cuda"`` or ``"cuda:N"`` when the node is that string literal, else None."""
    if not isinstance(node, libcst().SimpleString):
        return None
    value = node.evaluated_value
    return value if isinstance(value, str) and (value == "cuda" or value.startswith("cuda:")) else None


def device_string(cuda: str) -> str:
    """The code of the ported device as the string a program keeps: ``cuda`` -> the type, ``cuda:0`` -> the device."""
    return "get_device().type" if cuda == "cuda" else "str(get_device())"


def keyword(call: Any, name: str) -> Any:
    """The argument ``name=...`` of a call, or None."""
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)
