"""The 2020-era setup lines (``!python pytorch-xla-env-setup.py``, ``!pip install cloud-tpu-client``): reported, never run."""

from __future__ import annotations

import re

from .registry import magic

_ENV_SETUP = re.compile(r"env-setup\.py|pip[3]? install[^#]*\b(torch_xla|torch-xla|cloud-tpu-client)\b|torch_xla-1\.|"
                        r"tpu-pytorch/wheels")


@magic(order=10)
def fix_magic(line: str) -> str | None:
    """The rule an IPython line (``!...``, ``%...``) breaks, None when it is only passed through."""
    return "env_setup" if _ENV_SETUP.search(line) else None
