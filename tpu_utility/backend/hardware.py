"""Hardware probe: TPU chips on the PCI bus and the PJRT device asked for.

Nothing here imports torch_xla or starts a runtime: it reads sysfs and the
environment, so a notebook cell can look before it launches on all cores.
"""

from __future__ import annotations

import functools
import glob
import math
import os
from dataclasses import dataclass

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of TPU chips (as torch_xla._internal.tpu lists them) and the
# number of XLA devices (cores) each chip exposes under PJRT.
_TPU_PCI_KINDS = {
    "0x0027": ("v2/v3", 2),
    "0x005e": ("v4", 1),
    "0x0063": ("v5e", 1),
    "0x0062": ("v5p", 1),
    "0x006f": ("v6e", 1),
    "0x0076": ("7x", 1),
}


# High-bandwidth memory of one XLA device (one core of a v2/v3 chip, one chip from v4 on), in GiB, as
# Google's Cloud TPU pages give it per chip.
_TPU_DEVICE_MEMORY_GIB = {"v2": 8, "v3": 16, "v2/v3": 8, "v4": 32, "v5e": 16, "v5litepod": 16, "v5p": 95,
                          "v6e": 32, "7x": 192}  # fmt: skip
MEMORY_ENV = "TPU_UTILITY_DEVICE_MEMORY_GB"


@dataclass(frozen=True)
class TpuHardware:
    """TPU chips attached to this host, found without starting any runtime."""

    chips: int
    kind: str | None
    cores_per_chip: int

    @property
    def devices(self) -> int:
        return self.chips * self.cores_per_chip


@functools.lru_cache(maxsize=None)
def _scan_pci(pci_root: str) -> tuple[int, str | None, int]:
    chips, kind, cores = 0, None, 1
    for vendor_path in sorted(glob.glob(os.path.join(pci_root, "*", "vendor"))):
        try:
            with open(vendor_path) as f:
                if f.read().strip() != _GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(os.path.dirname(vendor_path), "device")) as f:
                device_id = f.read().strip()
        except OSError:
            continue
        if device_id in _TPU_PCI_KINDS:
            chips += 1
            kind, cores = _TPU_PCI_KINDS[device_id]
    return chips, kind, cores


def detect_tpu(pci_root: str = "/sys/bus/pci/devices") -> TpuHardware:
    """Counts TPU chips on the PCI bus: reading sysfs (once per process), so nothing is started."""
    chips, kind, cores = _scan_pci(pci_root)
    accelerator = os.environ.get("TPU_ACCELERATOR_TYPE")  # e.g. "v3-8" on TPU VMs
    if chips and accelerator:
        kind = accelerator.split("-")[0]
    return TpuHardware(chips, kind, cores)


def pjrt_device() -> str | None:
    """The PJRT device the user (or setup_tpu) chose, upper-cased, or None."""
    value = os.environ.get("PJRT_DEVICE")
    return value.split("_")[0].upper() if value else None




def memory_override(variable: str = MEMORY_ENV) -> int | None:
    """Bytes of memory per device that ``TPU_UTILITY_DEVICE_MEMORY_GB`` sets (GiB, fractions allowed), or None;
    ``variable``: another such variable (the host's RAM, ``TPU_UTILITY_HOST_MEMORY_GB``).

    The one place this variable is read: every memory plan (generation's KV cache, training's) asks here.

    Raises:
        ValueError: a value that is not a positive number, named with the variable.
    """
    value = os.environ.get(variable)
    if value is None or not value.strip():
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not 0 < gib < math.inf:
        per = " per device" if variable == MEMORY_ENV else ""
        raise ValueError(f"{variable} must be a positive number of GiB{per} (e.g. 16), but is {value!r}")
    return int(gib * 2**30)


def tpu_device_memory(kind: str | None) -> int | None:
    """Bytes of memory of one XLA device of a TPU of ``kind`` ("v5e", "v4", ...), or None for a kind not in the table."""
    gib = _TPU_DEVICE_MEMORY_GIB.get((kind or "").lower())
    return gib * 2**30 if gib else None


# Peak dense bf16 matrix throughput of one device, FLOP/s, as the vendors' data sheets give it (TPU: per chip,
# one XLA device from v4 on; CUDA: the SXM part unless the name says PCIe; T4 has no bf16: its fp16 peak).
# The denominator of MFU; a name not here gives no MFU rather than a guess.
PEAK_BF16_FLOPS = {
    "v4": 275e12, "v5e": 197e12, "v5litepod": 197e12, "v5p": 459e12, "v6e": 918e12,
    "H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L4": 121e12, "T4": 65e12,
}  # fmt: skip
DEVICE_NAME_ENV = "TPU_UTILITY_DEVICE_NAME"


def peak_flops(name: str | None) -> float | None:
    """The peak bf16 FLOP/s of one device called ``name`` (a TPU kind, "v5e", or a CUDA device name,
    "NVIDIA H100 80GB HBM3"), or None where the table does not know it.

    A CUDA name matches a table entry as a whole word ("L4" is not "L40S"); the longest entry that
    matches wins ("H100 PCIe" over "H100").

    Example:
        >>> peak_flops("v5e"), peak_flops("NVIDIA H100 PCIe"), peak_flops("NVIDIA L40S")
        (197000000000000.0, 756000000000000.0, None)
    """
    if not name:
        return None
    words = f" {name.replace('-', ' ')} ".lower()
    found = [key for key in PEAK_BF16_FLOPS if f" {key.lower()} " in words]
    return PEAK_BF16_FLOPS[max(found, key=len)] if found else None


def device_name_override() -> str | None:
    """The device name ``TPU_UTILITY_DEVICE_NAME`` sets (for MFU where the chip is not detected), or None."""
    value = os.environ.get(DEVICE_NAME_ENV, "").strip()
    return value or None
