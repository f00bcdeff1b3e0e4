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

# the hand-loop kit: the lines that replace CUDA's in a loop you keep
from .amp import autocast, grad_scaler
from .checkpoint import load_checkpoint, save_checkpoint
from .compiler import Compile, compile_model
from .device import device_type, get_device, move_model
from .environment import TpuInfo, setup_tpu
from .loop import device_loader, inference_mode, launch, masked_loader, use_all_cores
from .optim import step_optimizer
from .sharding import FSDP, shard_model
from .huggingface import device_checkpointing, packed_attention, static_masks
from .export import export_pretrained
from .quantization import dequantize_base, load_quantized, quantize_base
from .scan import scan_layers

# data preparation: fixed shapes, caches, images shrunk once
from .data import (BucketBatchSampler, BucketCollate, CachedDataset, PackedDataset, PresizeReport, cache_dataset,
                   choose_buckets, group_batches, make_sampler, padding_waste, presize_images)

# the trainer: one call that trains, keeps the best epoch and predicts (or generates)
from .training import (EMA, Callback, ChunkedLoss, CSVLogger, DeviceBytes, EpochMetric, EpochRecord, GradientCheckpointing, History,
                       Loop, LRFinderResult, MemoryPlan, StopFit, TensorBoardLogger, device_bytes, evaluate, find_lr,
                       generate, memory_plan,
                       OneCycle, one_cycle, one_cycle_curve, one_cycle_fit, predict)

# diagnosis: doctor (run time), check (this machine); `python -m tpu_utility.port` (your source)
from .diagnostics import DoctorError, DoctorReport, doctor
from .diagnostics.check import check


try:
    __version__ = _version("tpu_utility")  # the installed metadata (pyproject.toml's version)
except _PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "autocast",
    "Callback",
    "CSVLogger",
    "EMA",
    "BucketBatchSampler",
    "BucketCollate",
    "cache_dataset",
    "compile_model",
    "Compile",
    "CachedDataset",
    "check",
    "choose_buckets",
    "device_checkpointing",
    "device_loader",
    "dequantize_base",
    "device_type",
    "doctor",
    "DoctorError",
    "DoctorReport",
    "EpochMetric",
    "EpochRecord",
    "evaluate",
    "export_pretrained",
    "find_lr",
    "FSDP",
    "generate",
    "get_device",
    "grad_scaler",
    "GradientCheckpointing",
    "ChunkedLoss",
    "group_batches",
    "History",
    "inference_mode",
    "StopFit",
    "TensorBoardLogger",
    "launch",
    "load_checkpoint",
    "load_quantized",
    "Loop",
    "LRFinderResult",
    "make_sampler",
    "masked_loader",
    "memory_plan",
    "device_bytes",
    "DeviceBytes",
    "MemoryPlan",
    "move_model",
    "one_cycle",
    "shard_model",
    "one_cycle_curve",
    "OneCycle",
    "one_cycle_fit",
    "PackedDataset",
    "packed_attention",
    "padding_waste",
    "predict",
    "quantize_base",
    "scan_layers",
    "presize_images",
    "PresizeReport",
    "save_checkpoint",
    "setup_tpu",
    "static_masks",
    "step_optimizer",
    "TpuInfo",
    "use_all_cores",
]
