"""The Colab TPU of 2020: ``COLAB_TPU_ADDR`` and ``google.colab``, reported by cell and line (nothing to rewrite)."""

from __future__ import annotations

from typing import Any

from .registry import Porter, fixes
from .tree import code, dotted, libcst


@fixes("Assert", order=10)
def fix_assert(porter: Porter, original: Any, updated: Any) -> Any:
    """``assert os.environ['COLAB_TPU_ADDR']``: a KeyError on every TPU of today."""
    if "COLAB_TPU_ADDR" in code(original.test):
        porter.leave_alone("colab_tpu_addr", original)
    return None


@fixes("Subscript", order=10)
def fix_subscript(porter: Porter, original: Any, updated: Any) -> Any:
    """``os.environ['COLAB_TPU_ADDR']`` outside an assert (``'grpc://' + os.environ[...]``)."""
    if "COLAB_TPU_ADDR" in code(original) and dotted(original.value).endswith("environ"):
        porter.leave_alone("colab_tpu_addr", original)
    return None


@fixes("Import", order=10)
@fixes("ImportFrom", order=10)
def fix_import(porter: Porter, original: Any, updated: Any) -> Any:
    """``from google.colab import drive`` / ``import google.colab``."""
    cst = libcst()
    if isinstance(original, cst.ImportFrom):
        names = [dotted(original.module)] if original.module is not None else []
    else:
        names = [dotted(alias.name) for alias in original.names]
    if any(name == "google.colab" or name.startswith("google.colab.") for name in names):
        porter.leave_alone("colab_only", original)
    return None
