"""The trainer: ``one_cycle_fit()`` trains, keeps the best epoch and hands back the model; ``predict()`` follows.

Read it top down:

- ``fit.py``: ``one_cycle_fit()``, the public entry; checks every argument once and plans the run.
- ``runner.py``: what one process needs to run a model on its share of the cores (device, loaders, evaluation and
  prediction), over three rooms: ``topology.py`` (how many cores, which strategy, who loads which samples),
  ``steps.py`` (what is called on a batch: the loss, evaluation and prediction steps) and ``precision.py``.
- ``trainer.py``: the epoch loop each process runs: the per-batch path, validation, one read per epoch; it fires events.
- ``builtins.py``: the callbacks one_cycle_fit's arguments become: schedule, stop rules, checkpoints, progress line.
- ``schedule.py``, ``monitor.py``, ``metrics.py``: the one-cycle policy, the best-epoch and stop rules, exact metrics.
- ``events.py``, ``callbacks.py``: the loop's events, the ``Callback`` base, and the shipped callbacks (EMA, gradient checkpointing, loggers).
- ``history.py``: ``History``, what ``one_cycle_fit`` returns.
- ``inference.py``: ``predict()`` and ``evaluate()`` in dataset order on any number of cores.
- ``generate.py``: ``generate()``, a causal LM's new tokens for every prompt with static shapes (buckets, one cache).
- ``memory.py``: ``memory_plan()``, the bytes per chip to train a model, replicated and sharded (``trace.py``
  traces the step it measures); ``device_bytes()``, what one device holds once the model is placed.
- ``strategies/``: each way of spreading a model over devices in its own module behind one ``Strategy``
  interface, and the one table from ``strategy=``'s words to them (FSDP's blocks and wrap from ``sharding``).
- ``lr_finder.py``: ``find_lr()``, the same loop with a learning-rate sweep for its schedule.
"""

from .callbacks import EMA, CSVLogger, GradientCheckpointing, TensorBoardLogger
from .chunked import ChunkedLoss
from .events import Callback, Loop, StopFit
from .fit import one_cycle_fit
from .generate import generate
from .history import EpochRecord, History
from .inference import evaluate, predict
from .lr_finder import LRFinderResult, find_lr
from .memory import DeviceBytes, MemoryPlan, device_bytes, memory_plan
from .metrics import EpochMetric
from .schedule import OneCycle, one_cycle, one_cycle_curve

__all__ = [
    "Callback",
    "ChunkedLoss",
    "CSVLogger",
    "EMA",
    "GradientCheckpointing",
    "TensorBoardLogger",
    "EpochMetric",
    "EpochRecord",
    "evaluate",
    "find_lr",
    "generate",
    "History",
    "Loop",
    "LRFinderResult",
    "memory_plan",
    "device_bytes",
    "DeviceBytes",
    "MemoryPlan",
    "one_cycle",
    "one_cycle_curve",
    "OneCycle",
    "one_cycle_fit",
    "predict",
    "StopFit",
]
