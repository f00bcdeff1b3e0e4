"""Version policy: which torch, torch_xla, torchvision and torch-tpu releases go together.

Read from installed metadata, never by importing the packages (importing torch_xla
starts work; a mismatched one fails at import with an undefined symbol).

Example:
    >>> from tpu_utility.backend.versions import fix_command
    >>> fix_command("2.8.0")
    'pip install "torch==2.8.0" "torch_xla[tpu]==2.8.0" "torchvision==0.23.0"'
"""

from __future__ import annotations

import importlib.metadata
import importlib.util

import torch

def module_installed(name: str) -> bool:
    """Whether ``name`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # an import hook that refuses it counts as absent
        return False


# torch, torch_xla and torchvision of each torch_xla release, by "major.minor". torch_xla
# is built for one torch release and torchvision for one torch release; 2.9 is torch_xla's
# last release (torch 2.10+ has none: TorchTPU, the `torch_tpu` package, follows it).
XLA_RELEASES: dict[str, tuple[str, str, str]] = {
    "2.5": ("2.5.1", "2.5.1", "0.20.1"),
    "2.6": ("2.6.0", "2.6.0", "0.21.0"),
    "2.7": ("2.7.0", "2.7.0", "0.22.0"),
    "2.8": ("2.8.0", "2.8.0", "0.23.0"),
    "2.9": ("2.9.0", "2.9.0", "0.24.0"),
}
_LAST_XLA_RELEASE = "2.9"


def _release(version: str | None) -> str | None:
    """ "2.8.0+cu128" -> "2.8"; None stays None."""
    return ".".join(version.split("+")[0].split(".")[:2]) if version else None


def _newer_than_last_release(version: str) -> bool:
    try:
        return [int(p) for p in _release(version).split(".")] > [int(p) for p in _LAST_XLA_RELEASE.split(".")]
    except ValueError:
        return False


def fix_command(torch_version: str, xla_version: str | None = None) -> str:
    """The pip command that installs a working torch/torch_xla/torchvision trio.

    It keeps the installed torch_xla's release where one exists, else the installed
    torch's, else (torch 2.10+, which has no torch_xla) the last release, 2.9.
    """
    release = next(
        (r for r in (_release(xla_version), _release(torch_version)) if r in XLA_RELEASES), _LAST_XLA_RELEASE
    )
    torch_pin, xla_pin, vision_pin = XLA_RELEASES[release]
    command = f'pip install "torch=={torch_pin}" "torch_xla[tpu]=={xla_pin}" "torchvision=={vision_pin}"'
    if _newer_than_last_release(torch_version):
        last_torch, last_xla, _ = XLA_RELEASES[_LAST_XLA_RELEASE]
        command += f"  # torch {torch_version} has no torch_xla: the last, {last_xla}, is for torch {last_torch}"
    return command


# TorchTPU (Google's `torch-tpu` distribution) supports these torch releases; another
# project ships an unrelated module also named `torch_tpu`, so the distribution decides.
TORCH_TPU_DISTRIBUTION = "torch-tpu"
TORCH_TPU_TORCH_RANGE = ("2.11", "2.15")


def torch_tpu_installed() -> bool:
    """True when Google's TorchTPU (the ``torch-tpu`` distribution) is installed; found without importing it.

    A module named ``torch_tpu`` from another distribution does not count.
    """
    return installed_version(TORCH_TPU_DISTRIBUTION) is not None and module_installed("torch_tpu")


def torch_supports_torch_tpu(torch_version: str) -> bool:
    """Whether torch-tpu 0.2 runs beside this torch (2.11 to 2.15)."""
    try:
        found = tuple(int(p) for p in _release(torch_version).split("."))
    except (AttributeError, ValueError):
        return False
    low, high = (tuple(int(p) for p in r.split(".")) for r in TORCH_TPU_TORCH_RANGE)
    return low <= found <= high


INSTALL_HINT = fix_command(torch.__version__)


def installed_version(package: str) -> str | None:
    """A package's installed version, read from its metadata without importing it."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_versions(torch_version: str, xla_version: str | None, torchvision_version: str | None = None) -> None:
    """Raises RuntimeError with the pip command to fix it if the releases differ.

    torch_xla and torchvision are each built against one torch release; a mismatch
    fails at import with an undefined-symbol or missing-operator error, so we check
    the metadata first. Nothing is checked without torch_xla.
    """
    if xla_version is None:
        return
    torch_release = _release(torch_version)
    problem = None
    if _release(xla_version) != torch_release:
        problem = f"torch {torch_version} does not match torch_xla {xla_version}: torch_xla only works with"
    elif torchvision_version and torch_release in XLA_RELEASES:
        wanted = _release(XLA_RELEASES[torch_release][2])
        if _release(torchvision_version) != wanted:
            problem = (
                f"torchvision {torchvision_version} does not match torch {torch_version} (it needs "
                f"torchvision {wanted}.x): torchvision only works with"
            )
    if problem:
        raise RuntimeError(
            f"{problem} the torch release it was built for. Fix it with:\n"
            f"    {fix_command(torch_version, xla_version)}\n"
            f"then restart the kernel."
        )


