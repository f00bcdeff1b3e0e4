"""tpu_utility: move a PyTorch training loop from CUDA to TPUs with a few edited lines.

    from tpu_utility import setup_tpu, get_device, step_optimizer, make_sampler, one_cycle_fit
    info = setup_tpu()                # platform, versions, PJRT device, compile cache
    device = get_device()             # was: torch.device("cuda")
    sampler = make_sampler(train_ds)  # DistributedSampler when several cores, else None
    step_optimizer(opt)               # was: opt.step()
    history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=5, max_lr=3e-3, cores="all")

Importing this package never imports torch_xla; it works without it (CUDA, else CPU).
"""

from .cache import CachedDataset, cache_dataset
from .checkpoint import load_checkpoint
from .data import make_sampler
from .device import get_device
from .doctor import DoctorReport, doctor
from .environment import TpuInfo, setup_tpu
from .fit import one_cycle_fit
from .history import EpochRecord, History
from .lr_finder import LRFinderResult, find_lr
from .optim import step_optimizer
from .predict import evaluate, predict
from .presize import PresizeReport, presize_images
from .schedule import one_cycle, one_cycle_curve

__all__ = [
    "cache_dataset",
    "CachedDataset",
    "doctor",
    "DoctorReport",
    "EpochRecord",
    "evaluate",
    "find_lr",
    "get_device",
    "History",
    "load_checkpoint",
    "LRFinderResult",
    "make_sampler",
    "one_cycle",
    "one_cycle_curve",
    "one_cycle_fit",
    "predict",
    "presize_images",
    "PresizeReport",
    "setup_tpu",
    "step_optimizer",
    "TpuInfo",
]
