"""tpu_utility: move a PyTorch training loop from CUDA to TPUs with a few edited lines.

    from tpu_utility import setup_tpu, get_device, step_optimizer, make_sampler, one_cycle_fit
    info = setup_tpu()                # platform, versions, PJRT device, compile cache
    device = get_device()             # was: torch.device("cuda")
    sampler = make_sampler(train_ds)  # DistributedSampler when several cores, else None
    step_optimizer(opt)               # was: opt.step()
    history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=5, max_lr=3e-3, cores="all")

Importing this package never imports torch_xla; it works without it (CUDA, else CPU).
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from .amp import autocast, grad_scaler
from .buckets import BucketBatchSampler, BucketCollate, choose_buckets, group_batches, padding_waste
from .cache import CachedDataset, cache_dataset
from .checkpoint import load_checkpoint, save_checkpoint
from .data import make_sampler
from .device import get_device
from .doctor import DoctorError, DoctorReport, doctor
from .environment import TpuInfo, setup_tpu
from .fit import one_cycle_fit
from .history import EpochRecord, History
from .loop import device_loader, inference_mode, launch, masked_loader, use_all_cores
from .lr_finder import LRFinderResult, find_lr
from .optim import step_optimizer
from .predict import evaluate, predict
from .presize import PresizeReport, presize_images
from .schedule import one_cycle, one_cycle_curve


def __getattr__(name: str):  # noqa: ANN202
    # check() is imported on first use, so `python -m tpu_utility.check` runs a module not imported yet
    if name == "check":
        from .check import check

        globals()["check"] = check  # the function, not the submodule the import just bound
        return check
    raise AttributeError(f"module 'tpu_utility' has no attribute {name!r}")


try:
    __version__ = _version("tpu_utility")  # the installed metadata (pyproject.toml's version)
except _PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "autocast",
    "BucketBatchSampler",
    "BucketCollate",
    "cache_dataset",
    "CachedDataset",
    "check",
    "choose_buckets",
    "device_loader",
    "doctor",
    "DoctorError",
    "DoctorReport",
    "EpochRecord",
    "evaluate",
    "find_lr",
    "get_device",
    "grad_scaler",
    "group_batches",
    "History",
    "inference_mode",
    "launch",
    "load_checkpoint",
    "LRFinderResult",
    "make_sampler",
    "masked_loader",
    "one_cycle",
    "one_cycle_curve",
    "one_cycle_fit",
    "padding_waste",
    "predict",
    "presize_images",
    "PresizeReport",
    "save_checkpoint",
    "setup_tpu",
    "step_optimizer",
    "TpuInfo",
    "use_all_cores",
]
