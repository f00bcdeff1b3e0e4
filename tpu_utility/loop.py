"""Hand-written training loops on XLA: batches, evaluation and all cores.

A loop written for CUDA needs three things on XLA that ``optimizer.step()``
never had to do: cut the lazy graph once per step (or it grows and recompiles
every step), keep every batch the same shape (or each new shape compiles), and
spread the batch over the cores. This module gives each as one line::

    from tpu_utility import device_loader, get_device, inference_mode, masked_loader, use_all_cores
    cores = use_all_cores()                 # optional, first: SPMD over every core
    device = get_device()                   # was: torch.device("cuda")
    for x, y in device_loader(loader):      # was: for x, y in loader:
        ...                                 # any update: optimizer, scaler or p.data.add_
    for (x, y), mask in device_loader(masked_loader(valid_loader)):
        correct += ((model(x).argmax(1) == y) & mask).sum()   # every sample once
    with inference_mode():                  # was: with torch.inference_mode(): (fails on XLA)

Off XLA ``device_loader`` moves each batch to the device and nothing else, so the
same loop runs on CUDA and CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any, Callable, Iterable, Iterator, Literal, get_args

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from . import backend
from .data.buckets import BucketBatchSampler
from .data.loaders import eval_loader, refuse_one_pass, unpack_loader, user_stacklevel
from .device import get_device, move_to_device

StartMethod = Literal["auto", "fork", "spawn"]


def _batch_size(loader: Any) -> int | None:
    size = getattr(loader, "batch_size", None)
    return size if isinstance(size, int) else None


class DeviceLoader:
    """Iterates a loader's batches on the device; see ``device_loader``."""

    def __init__(self, loader: Iterable, device: torch.device) -> None:
        self.loader, self.device = loader, device
        self._passes = 0

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        self._passes += 1
        if self._passes > 1:  # a generator or iterator, read to its end: a second epoch would get no batches
            refuse_one_pass(self.loader, "device_loader's loader", "the DataLoader itself (or a list of batches), "
                            "not iter(loader); or a new generator each epoch, device_loader(... for ...) in the loop")
        if not backend.is_lazy(self.device):
            return (move_to_device(batch, self.device) for batch in self.loader)
        cores = backend.global_device_count() if backend.is_spmd() else None
        size = _batch_size(self.loader)
        if cores and size is not None and size % cores:
            raise ValueError(
                f"batch_size={size} does not split evenly over the {cores} cores of the SPMD mesh; "
                f"use a multiple of {cores}, such as {cores * max(1, size // cores)} (the loader's batch is "
                f"the global batch)"
            )
        return iter(backend.device_loader(self.loader, self.device, cores))


def device_loader(loader: Iterable, device: torch.device | None = None) -> DeviceLoader:
    """Batches on the device, ready before the step needs them, one graph per step.

    On XLA this is torch_xla's MpDeviceLoader: batches are copied to the device
    in the background and the lazy graph is cut once per batch, so any step
    compiles once, including a hand-written update with no optimizer
    (``p.data.add_(p.grad, alpha=-lr)``). Together with ``step_optimizer`` the
    graph is still cut once per step. Under SPMD (``use_all_cores()``) each
    batch is sharded along its first dimension over every core: the loader's
    ``batch_size`` is the global batch and must be a multiple of the cores.

    On CUDA and CPU it moves each batch to the device (``non_blocking``), and
    that is all. Tensors in tuples, lists and dicts are moved; other values pass.

    Args:
        loader: A DataLoader, or any iterable of batches (``len`` is used if it has one).
        device: The device; None for ``get_device()``.

    Returns:
        An iterable with ``len(loader)`` batches, re-iterable every epoch.

    Raises:
        TypeError: ``loader`` is a map-style Dataset (single samples) or not iterable; or, at
            its second pass, a generator or iterator (read once: epoch 2 would get no batches).
        ValueError: Under SPMD, ``loader.batch_size`` is not a multiple of the cores; a
            ``BucketBatchSampler`` with more or fewer lengths than the dataset has samples
            (one whose lengths are in another order is warned about).

    Example:
        >>> # was: for x, y in loader:
        >>> for x, y in device_loader(loader):   # doctest: +SKIP
        ...     x, y = x.to(device), y.to(device)  # may stay: a no-op now
    """
    if isinstance(loader, Dataset) and not isinstance(loader, IterableDataset):
        raise TypeError(
            f"device_loader takes a DataLoader (or any iterable of batches), but given the dataset "
            f"{type(loader).__name__}, whose items are single samples; batch it first: "
            f"device_loader(DataLoader(dataset, batch_size=64, drop_last=True))"
        )
    if not hasattr(loader, "__iter__"):
        raise TypeError(f"device_loader takes an iterable of batches, but given {type(loader).__name__}")
    if isinstance(loader, DataLoader) and isinstance(loader.batch_sampler, BucketBatchSampler):
        loader.batch_sampler.check_dataset(loader.dataset, "loader", loader.collate_fn, stacklevel=user_stacklevel())
    device = get_device() if device is None else torch.device(device)
    return DeviceLoader(loader, device)


def _check_sampler(loader: DataLoader) -> None:
    """A loader's sampler may only order the data: one that selects samples would be ignored."""
    sampler = loader.sampler
    if isinstance(sampler, SequentialSampler):
        return
    if isinstance(sampler, RandomSampler) and not sampler.replacement:
        if sampler.num_samples == len(sampler.data_source):
            return
    if isinstance(sampler, DistributedSampler):
        if (sampler.num_replicas, sampler.rank) == (backend.world_size(), backend.rank()):
            return  # replaced by a DistributedSampler over the padded set, same replicas
    raise ValueError(
        f"masked_loader needs the loader's samples to be its whole dataset, but its sampler is a "
        f"{type(sampler).__name__}, which may select a subset; wrap the subset as a dataset instead: "
        f"masked_loader(torch.utils.data.Subset(dataset, indices), batch_size)"
    )


def masked_loader(data: Any, batch_size: int | None = None) -> DataLoader:
    """Full-size evaluation batches with a mask, so each sample counts exactly once.

    A short last batch has a shape of its own, and on XLA a graph of its own:
    compiled again in every evaluation. This loader pads the dataset by
    repeating samples so every batch is full and yields ``(batch, mask)``, where
    ``mask`` (bool, one per sample) is False for the padding. Weight every sum
    by it. With several processes (``launch``) each gets its own part and the
    padding, so a sum over replicas counts each sample once. Under SPMD the one
    loader serves every core: give the global batch size.

    Args:
        data: A Dataset, or a DataLoader whose dataset, batch size, collate_fn,
            workers and other settings (``worker_init_fn``, ``generator``...) are kept
            (its shuffling is not: evaluation order does not matter).
        batch_size: For a Dataset (default 64); for a DataLoader it must be None or
            equal to its own.

    Returns:
        A DataLoader of ``(batch, mask)``; wrap it in ``device_loader``.

    Raises:
        TypeError: ``data`` has no ``__len__``.
        ValueError: ``data`` is empty, ``batch_size`` is invalid or conflicts with the
            loader's, or the loader's sampler selects a subset.

    Example:
        >>> # was: for x, y in valid_loader:
        >>> for (x, y), mask in device_loader(masked_loader(valid_loader)):   # doctest: +SKIP
        ...     correct += ((model(x).argmax(1) == y) & mask).sum()
        ...     seen += mask.sum()
    """
    if isinstance(data, DataLoader):
        _check_sampler(data)
        if not isinstance(data.batch_sampler, (BatchSampler, BucketBatchSampler)):
            raise ValueError(
                f"masked_loader needs a loader with a fixed batch_size, but given one with a "
                f"{type(data.batch_sampler).__name__}"
            )
        if getattr(data.batch_sampler, "drop_last", data.drop_last):
            warnings.warn(
                f"masked_loader: the loader's drop_last=True is not used ({type(data.batch_sampler).__name__}); "
                f"the last batch is padded and masked instead, so every sample counts once",
                stacklevel=2,
            )
    # the sampler only orders the whole dataset (checked above): the padded loader's own replaces it
    spec = dataclasses.replace(unpack_loader(data, batch_size, "data"), sampler=None)
    loader = eval_loader(spec, spec.batch_size, replicas=backend.world_size(), rank=backend.rank())
    loader.collate_fn = _IndexMask(loader.collate_fn)
    return loader


class _IndexMask:
    """Turns the padded loader's ``(batch, indices)`` into ``(batch, mask)``; picklable for workers."""

    def __init__(self, collate_fn: Callable[[list], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, items: list) -> tuple[Any, torch.Tensor]:
        batch, indices = self.collate_fn(items)
        return batch, indices >= 0  # padding carries index -1


INFERENCE_MODE_ERROR = "Cannot set version_counter for inference tensor"


def inference_mode(device: torch.device | str | None = None) -> Any:
    """``torch.inference_mode()`` where it works; ``torch.no_grad()`` on XLA.

    On XLA an evaluation under ``torch.inference_mode()`` stops with ``RuntimeError:
    Cannot set version_counter for inference tensor`` at the first ``nn.Linear``:
    the layer transposes its weight, a tensor made outside inference mode, and
    torch_xla's view of it asks for a version counter that inference mode has
    switched off (the same failure as any backend whose views go through a
    wrapper, pytorch/pytorch#170419). ``no_grad`` skips the same autograd work,
    and XLA compiles the same graph either way, so nothing is lost.

    Args:
        device: The device the evaluation runs on; default: XLA when it is in use
            (without starting its runtime), else plain ``torch.inference_mode()``.

    Returns:
        A context manager (also a decorator, as ``@inference_mode()``). Used bare as
        ``@inference_mode``, as ``@torch.inference_mode`` may be, it returns the
        decorated function, run under it.

    Example:
        >>> # was: with torch.inference_mode():
        >>> with inference_mode():
        ...     output = model(x)        # doctest: +SKIP
    """
    if callable(device) and not isinstance(device, (str, torch.device)):  # @inference_mode, without ()
        function = device

        @functools.wraps(function)
        def under_inference_mode(*args: Any, **kwargs: Any) -> Any:
            with inference_mode():  # the mode decided at the call, when the device is known
                return function(*args, **kwargs)

        return under_inference_mode
    on_xla = backend.is_lazy(device) if device is not None else backend.xla_requested()
    return torch.no_grad() if on_xla else torch.inference_mode()


def use_all_cores() -> int:
    """Runs this process's XLA work on every core (SPMD); returns the number of cores.

    One process drives the whole device mesh: the model is replicated on every
    core and ``device_loader`` shards each batch over them, so a hand-written
    loop trains on all cores unchanged. Make the loader's ``batch_size`` the
    global batch (per-core batch x cores). ``make_sampler`` keeps returning None,
    as there is one process. Call it first, before ``get_device()`` or moving
    anything to the device. Off XLA it does nothing and returns 1.

    Returns:
        The number of cores in the mesh.

    Raises:
        RuntimeError: Called inside a process started by ``launch`` (one core each).

    Example:
        >>> cores = use_all_cores()                       # doctest: +SKIP
        >>> device = get_device()                         # doctest: +SKIP
        >>> loader = DataLoader(train_ds, batch_size=64 * cores, shuffle=True, drop_last=True)  # doctest: +SKIP
        >>> for x, y in device_loader(loader): ...        # doctest: +SKIP
    """
    if not backend.xla_requested():
        return 1
    if backend.in_launched_process():
        raise RuntimeError(
            "use_all_cores() was called inside a process started by launch(), which already runs one "
            "process per core; use one or the other"
        )
    backend.use_spmd()
    return backend.global_device_count()


def launch(fn: Callable[..., Any], args: tuple = (), start_method: StartMethod = "auto", nprocs: int | None = None) -> None:
    """Runs ``fn(index, *args)`` once per core (or GPU), each in its own process.

    Inside ``fn``, ``get_device()`` is that process's core, ``make_sampler``
    returns its DistributedSampler, ``step_optimizer`` averages gradients over
    all processes and ``device_loader`` / ``masked_loader`` serve its part. The
    alternative, one process for every core, is ``use_all_cores()``.
    On CUDA it starts one process per GPU under ``torch.distributed`` (nccl);
    ``step_optimizer`` averages there too, but ``DistributedDataParallel``, as in
    any DDP loop, is faster (it averages during the backward; ``step_optimizer``
    then reduces nothing itself). With one device (a plain
    CPU, one GPU, one XLA device whose runtime ``setup_tpu()`` started),
    ``fn(0, *args)`` runs here, once.

    Args:
        fn: The function to run; it gets the process index first.
        args: More arguments for ``fn``.
        start_method: "fork" (works with functions defined in a notebook), "spawn"
            (a script's functions), or "auto": fork in a notebook, else spawn.
        nprocs: Processes off XLA (torch_xla starts one per chip itself): None is one
            per device; on the CPU any number of gloo processes (for testing DDP code).

    Raises:
        ValueError: ``start_method`` is not one of "auto", "fork", "spawn".
        RuntimeError: The XLA runtime already started in this process (restart the
            kernel and launch before touching the device).

    Example:
        >>> def train(index):                  # doctest: +SKIP
        ...     device = get_device()
        ...     sampler = make_sampler(train_ds)
        ...     ...
        >>> launch(train)                      # doctest: +SKIP
    """
    if start_method not in get_args(StartMethod):
        raise ValueError(f"start_method must be one of {get_args(StartMethod)}, but given {start_method!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, but given {fn!r} of type {type(fn).__name__}")
    chosen = backend.current()
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ValueError(f"nprocs must be None or a positive int, but given {nprocs!r}")
    if nprocs is not None and chosen.lazy:
        raise ValueError(f"nprocs={nprocs} cannot be chosen on XLA: torch_xla starts one process per chip; leave it None")
    processes = nprocs or chosen.devices.device_count()
    if not chosen.lazy and processes == 1:
        fn(0, *args)
        return
    if start_method == "auto":
        from .environment import choose_start_method, is_interactive

        start_method = choose_start_method(is_interactive())
    backend.launch(fn, args, processes, start_method)
