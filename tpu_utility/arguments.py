"""Keyword arguments checked against the names a callee takes, so a misspelt one is refused, not dropped."""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable, Iterable, Mapping


def close_name(name: str, names: Iterable[str]) -> str | None:
    """The name in ``names`` that ``name`` most likely misspells (difflib), or None."""
    found = difflib.get_close_matches(name, list(names), n=1, cutoff=0.6)
    return found[0] if found else None


def parameter_names(function: Callable, leave_out: Iterable[str] = ("self",)) -> list[str]:
    """The names ``function`` takes by keyword (not ``*args`` / ``**kwargs``)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    skipped = set(leave_out)
    return [p.name for p in inspect.signature(function).parameters.values() if p.kind in kinds and p.name not in skipped]


def check_keywords(given: Mapping[str, Any], allowed: Iterable[str], where: str) -> None:
    """Refuses a keyword that ``where`` does not take, naming the one it is close to and all it takes.

    Example:
        >>> check_keywords({"pad_vaule": 0}, ["pad_value", "overflow"], "BucketCollate.from_lengths")
        Traceback (most recent call last):
        ...
        TypeError: BucketCollate.from_lengths got pad_vaule=, which it does not take; did you mean pad_value=? It takes pad_value, overflow
    """
    names = list(allowed)
    for key in given:
        if key not in names:
            near = close_name(key, names)
            hint = f"; did you mean {near}=?" if near else ";"
            raise TypeError(f"{where} got {key}=, which it does not take{hint} It takes {', '.join(names)}")
