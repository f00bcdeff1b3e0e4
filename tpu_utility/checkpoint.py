"""Checkpoints that load anywhere: CPU tensors only, written atomically, checked on load.

A checkpoint is a plain dict of CPU tensors, numbers, strings, lists and dicts,
so ``torch.load(path, weights_only=True)`` reads it on a machine without
torch_xla. It is written to a temporary file and renamed over the old one, so a
crash while writing leaves the previous checkpoint whole; the next save removes
the temporaries a killed save left. torch's zip format stores a CRC-32 of every
record; ``load_checkpoint`` checks them, so flipped bytes or a truncated file
are an error naming the file, not silently wrong weights.

For a hand-written loop (was ``torch.save(model.state_dict(), path)`` and
``torch.load(path, map_location=xla_device)``, which fails)::

    save_checkpoint("ckpt.pt", model=model, optimizer=optimizer, epoch=epoch)
    state = load_checkpoint("ckpt.pt", model=model, optimizer=optimizer)  # onto their device
"""

from __future__ import annotations

import collections.abc
import contextlib
import io
import os
import zipfile
from collections import Counter, OrderedDict
from typing import IO, Any

import torch
from torch.utils import _pytree as pytree

from . import backend, remote
from .arguments import close_name
from .files import atomic_write, remove_stale_temporaries

CHECKPOINT_NAME = "last.pt"
_LEGACY_MAGIC = b"\x80\x02\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # torch.save(..., _use_new_zipfile_serialization=False)
_LEAVES = (bool, int, float, complex, str, bytes, bytearray, type(None), torch.Size)  # exact types: no numpy scalars
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)


def to_cpu(tree: Any) -> Any:
    """The same structure with every tensor copied to the host (one transfer on XLA; a sharded one from its shards).

    A copy also of what is already on the CPU: a snapshot of a CPU model's weights
    must not change as the model trains on.
    """
    leaves, spec = pytree.tree_flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    moved = backend.state_to_cpu([leaves[i] for i in positions])
    for i, tensor in zip(positions, moved):
        leaves[i] = tensor.clone() if leaves[i].device.type == "cpu" else tensor
    return pytree.tree_unflatten(leaves, spec)


def _check_loadable(value: Any, where: str) -> None:
    """Refuses, before writing, what ``torch.load(weights_only=True)`` could not read back."""
    if type(value) in _LEAVES or isinstance(value, (torch.Tensor, torch.dtype, torch.device)):
        return
    if type(value) not in _CONTAINERS:
        hint = " (use torch.from_numpy(x) or x.tolist())" if type(value).__module__ == "numpy" else ""
        raise TypeError(
            f"{where} is a {type(value).__module__}.{type(value).__qualname__}; a checkpoint holds tensors, "
            f"numbers, strings, None and dicts/lists/tuples of them, so that torch.load(path, "
            f"weights_only=True) can read it{hint}"
        )
    if isinstance(value, dict):
        for key, item in value.items():
            _check_loadable(key, f"{where} key {key!r}")
            _check_loadable(item, f"{where}[{key!r}]")
    else:
        for position, item in enumerate(value):
            _check_loadable(item, f"{where}[{position}]")


def save_atomic(obj: Any, path: str) -> None:
    """torch.save to a temporary file in the same folder, then rename over ``path``.

    Temporaries that an earlier, killed save left in that folder are removed first.
    """
    _check_loadable(obj, "the checkpoint")
    _write(obj, path)


def _write(obj: Any, path: str) -> None:
    """``save_atomic`` for a state already checked."""
    if not remote.is_url(path):  # a URL is one whole-object put: no folder to make, no temporaries
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        remove_stale_temporaries(folder, old_suffixes=(".pt",))  # earlier releases wrote .tmp-XXXXXXXX.pt
    was = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(True)  # the checksums load_checkpoint checks
    tensors = [leaf for leaf in pytree.tree_leaves(obj) if isinstance(leaf, torch.Tensor)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    size = sum(storages.values())  # what the file holds (each storage once), for a disk-full error
    try:
        with atomic_write(path, size=size) as f:
            torch.save(obj, f)
    finally:
        torch.serialization.set_crc32_options(was)


def save_checkpoint(path: str, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                    **extra: Any) -> None:  # fmt: skip
    """Saves a model, an optimizer and any other state as CPU tensors, atomically.

    The file loads with ``load_checkpoint`` onto any device, or with plain
    ``torch.load(path, weights_only=True)`` on a machine without torch_xla.

    Under a multi-process launch (``torch_xla.launch``, ``one_cycle_fit(strategy="mp")``
    or CUDA DDP) call it from every process: only the master (ordinal 0) copies
    the state to the host and writes the file, then all processes meet at a
    rendezvous, so none reads the file before it is whole (like
    ``xm.save(..., master_only=True)``). The replicas hold the same weights, so
    one copy is the checkpoint.

    Args:
        path: The file to write (its folder is created).
        model: Stored as ``"model"``: its ``state_dict()``.
        optimizer: Stored as ``"optimizer"``: its ``state_dict()``.
        **extra: Anything else (epoch, scheduler state, metrics): tensors, numbers,
            strings, None, and dicts, lists and tuples of them.

    Raises:
        TypeError: a model or optimizer of the wrong type, or a value that
            ``weights_only`` loading could not read back (a numpy array, an object);
            an extra name close to ``model`` or ``optimizer`` while that one is not
            given (``optimiser=``, ``optimizer_state=``: ``load_checkpoint`` would find
            no optimizer in the file), or a model or optimizer given under another name.

    Example:
        >>> # was: torch.save({"model": model.state_dict(), "epoch": epoch}, "ckpt.pt")
        >>> save_checkpoint("ckpt.pt", model=model, optimizer=optimizer, epoch=epoch)  # doctest: +SKIP
    """
    _check_extra(extra, {"model": model, "optimizer": optimizer})
    state: dict[str, Any] = {}
    if model is not None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, but given {type(model).__name__}")
        state["model"] = model.state_dict()
    if optimizer is not None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, but given {type(optimizer).__name__}")
        state["optimizer"] = optimizer.state_dict()
        state["optimizer_class"] = class_name(optimizer)  # named if another optimizer loads it
    state.update(extra)
    _check_loadable(state, "the checkpoint")  # on every process: the same error everywhere, before the rendezvous
    if backend.rank() == 0:
        _write(to_cpu(state), path)
    backend.barrier("tpu_utility.save_checkpoint")


def _check_extra(extra: dict[str, Any], parameters: dict[str, Any]) -> None:
    """Refuses an extra that was meant as ``model=`` or ``optimizer=``: stored under its own name, it would
    not be what ``load_checkpoint(path, model, optimizer)`` restores."""
    for key, value in extra.items():
        kind = "model" if isinstance(value, torch.nn.Module) else "optimizer" if isinstance(value, torch.optim.Optimizer) else None
        if kind is not None:
            raise TypeError(
                f"save_checkpoint got {key}= holding a {class_name(value)}; {'an' if kind == 'optimizer' else 'a'} "
                f"{kind} is saved as {kind}= (its "
                f"state_dict, which load_checkpoint(path, {kind}={kind}) restores). Extra state must be tensors, "
                f"numbers, strings or containers of them (for a second {kind}: {key}={key}.state_dict())"
            )
        near = close_name(key, [name for name, given in parameters.items() if given is None])
        if near is not None:
            raise TypeError(
                f"save_checkpoint got {key}=, close to its parameter {near}=, which was not given; stored as "
                f"{key!r} it would not be what load_checkpoint(path, {near}=...) restores. Give {near}=..., "
                f"or store this state under a name not close to {near!r}"
            )


class DamagedCheckpointError(ValueError):
    """A checkpoint file that cannot be read back; ``why`` says what is wrong with it."""

    def __init__(self, path: str, why: str) -> None:
        super().__init__(
            f"checkpoint {path} is damaged ({why}); it cannot be loaded. Delete it to start again, or "
            f"restore a copy (a save interrupted by a crash never damages the previous file)"
        )
        self.path, self.why = path, why

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # picklable, for a launch's worker errors
        return type(self), (self.path, self.why)


def _damaged(path: str, why: str) -> DamagedCheckpointError:
    return DamagedCheckpointError(path, why)


def _check_file(source: str | IO[bytes], path: str) -> None:
    """Checks the zip structure and every record's CRC-32 (torch.load itself checks neither)."""
    try:
        with zipfile.ZipFile(source) as archive:
            records = archive.infolist()
            if not any(r.CRC for r in records if r.file_size):
                return  # written with torch's CRC-32 turned off: nothing to check
            bad = archive.testzip()
    except zipfile.BadZipFile as e:
        raise _damaged(path, f"truncated or not a torch.save file: {e}") from None
    except (OSError, EOFError, ValueError) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    if bad is not None:
        raise _damaged(path, f"the bytes of record {bad!r} do not match their checksum")


# Hyperparameters torch fills in itself when a state_dict from another release lacks them.
_FILLED_IN = {"foreach", "fused", "maximize", "differentiable", "capturable", "decoupled_weight_decay", "amsgrad",
              "nesterov", "initial_lr"}  # fmt: skip


def class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_optimizer_state(saved: Any, saved_class: Any, optimizer: torch.optim.Optimizer, path: str) -> None:
    """Refuses another kind of optimizer's state (Adam's into SGD), which torch fails on with a KeyError."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)):
        return  # not an optimizer state_dict: torch's own error says so
    hyperparameters = set().union(*groups) - {"params"}
    missing = sorted(set(optimizer.defaults) - hyperparameters - _FILLED_IN)
    if missing:
        known = isinstance(saved_class, str)
        was = saved_class if known else f"an optimizer with hyperparameters {sorted(hyperparameters)}"
        raise ValueError(
            f"{path} holds the state of {was}, but the optimizer given is {class_name(optimizer)}, which needs "
            f"{missing} that state lacks. Give the kind of optimizer it was saved from"
            f"{f' ({saved_class.rsplit(chr(46), 1)[-1]})' if known else ''}, or load only the model "
            f"(optimizer=None) and start a fresh {type(optimizer).__qualname__}"
        )


_ZIP_MAGIC = b"PK\x03\x04"  # how torch.save's zip archive starts, also when its end is cut off


def _refuse_other_file(path: str, head: bytes) -> None:
    """A file that never was a checkpoint (a CSV, a log, a pickle) is named as such, not as damaged."""
    if not head or head.startswith(_ZIP_MAGIC) or _LEGACY_MAGIC.startswith(head[: len(_LEGACY_MAGIC)]):
        return  # empty, or the start of a checkpoint cut short: damaged
    text = head.decode("utf-8", "replace")
    if b"\x00" not in head and sum(c.isprintable() or c in "\r\n\t" for c in text) >= 0.95 * len(text):
        first = text.splitlines()[0][:60] if text.strip() else text[:60]
        what = f"a text file (it starts {first!r}: a CSV such as history.csv, or a log?)"
    elif head.startswith(b"\x80"):
        what = "a pickle that torch.save did not write (pickle.dump?)"
    else:
        return  # binary, but not a checkpoint's start: overwritten or cut, named as damaged
    raise ValueError(
        f"{path} is not a torch.save checkpoint but {what}; it is not damaged, just not a checkpoint. Give the "
        f"path of a file save_checkpoint or one_cycle_fit wrote (last.pt, best.pt), or the folder holding last.pt"
    )


def load_state_into(state: dict[str, Any], path: str, model: torch.nn.Module | None,
                    optimizer: torch.optim.Optimizer | None) -> None:  # fmt: skip
    """Loads a checkpoint's ``model`` / ``optimizer`` entries into them; ``path`` names it in errors."""
    for key, target in (("model", model), ("optimizer", optimizer)):
        if target is not None and key not in state:
            keys = ", ".join(map(repr, list(state)[:12])) + (", ..." if len(state) > 12 else "")
            raise ValueError(
                f"{path} has no {key!r} entry (it holds {keys}); save it with save_checkpoint(path, {key}=...)"
                + (", or load a bare state_dict with model.load_state_dict(load_checkpoint(path))" if key == "model" else "")
            )
    if optimizer is not None:  # before anything is loaded: a refusal leaves the model as it was
        _check_optimizer_state(state["optimizer"], state.get("optimizer_class"), optimizer, path)
    if model is not None:
        model.load_state_dict(state["model"])  # copies into the parameters, on their device
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])  # torch moves state to each parameter's device
        backend.shard_optimizer_state(optimizer)  # a sharded parameter's state sliced as it is (FSDP2)
        if backend.is_fused_optimizer(optimizer):  # except "step", which the fused XLA op needs there too
            for param, param_state in optimizer.state.items():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].to(param.device)


def _check_load_arguments(path: Any, model: Any, optimizer: Any) -> None:
    """load_checkpoint's arguments, before any file is read: a path, and objects to load into (not state dicts)."""
    if isinstance(path, bool) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(
            f"load_checkpoint needs the path of a checkpoint file or folder (a str or os.PathLike), but given "
            f"{path!r} of type {type(path).__name__}; for example load_checkpoint('checkpoints/last.pt', model=model)"
        )
    for name, value, kind in (("model", model, torch.nn.Module), ("optimizer", optimizer, torch.optim.Optimizer)):
        if value is None or isinstance(value, kind):
            continue
        if isinstance(value, collections.abc.Mapping):
            raise TypeError(
                f"load_checkpoint's {name}= is what the checkpoint is loaded into, but given a state dict "
                f"({type(value).__name__} of {len(value)} entries); pass the {name} itself "
                f"(load_checkpoint(path, {name}={name})), or read the file's entry: load_checkpoint(path)[{name!r}]"
            )
        if not callable(getattr(value, "load_state_dict", None)):
            raise TypeError(
                f"load_checkpoint's {name}= must be a {kind.__module__}.{kind.__qualname__} to load into, but given "
                f"{type(value).__name__}, which has no load_state_dict"
            )


def load_checkpoint(path: str, model: torch.nn.Module | None = None,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:  # fmt: skip
    """Loads a checkpoint onto the CPU, without unpickling code, and optionally into a model and optimizer.

    Works for files from ``save_checkpoint``, ``one_cycle_fit(checkpoint_dir=...)``
    (give the folder or its ``last.pt``) and plain ``torch.save`` of CPU tensors.
    A model or optimizer given is loaded in place on the device it is on (XLA,
    CUDA or CPU); optimizer state follows its parameters.

    Args:
        path: The file, or a folder holding ``last.pt``; a URL (``gs://bucket/run``)
            is read through fsspec.
        model: Loaded from the ``"model"`` entry.
        optimizer: Loaded from the ``"optimizer"`` entry.

    Returns:
        The whole checkpoint, tensors on the CPU.

    Raises:
        FileNotFoundError: no such file.
        TypeError: ``path`` is not a str or path (None, say), or ``model`` / ``optimizer`` is
            a state dict rather than the object to load into.
        ValueError: the file is damaged (truncated, bytes changed), is not a checkpoint
            at all (a CSV or text file, named as such), or a model or optimizer is given
            but the file has no entry for it (the message lists the keys it holds).

    Example:
        >>> # was: model.load_state_dict(torch.load("ckpt.pt", map_location=xla_device))  (fails on XLA)
        >>> state = load_checkpoint("ckpt.pt", model=model, optimizer=optimizer)  # doctest: +SKIP
        >>> start_epoch = state["epoch"] + 1                                        # doctest: +SKIP
    """
    _check_load_arguments(path, model, optimizer)
    source: Any = path
    if remote.is_url(path):
        if remote.is_folder(path):
            path = remote.join(path, CHECKPOINT_NAME)
        if not remote.exists(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist")
        source = io.BytesIO(remote.read_bytes(path))  # checked and loaded from memory, as a local file is
    else:
        if os.path.isdir(path):
            path = source = os.path.join(path, CHECKPOINT_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"checkpoint {path} does not exist")
    if zipfile.is_zipfile(source):
        _check_file(source, path)
    else:
        with contextlib.nullcontext(source) if isinstance(source, io.BytesIO) else open(path, "rb") as f:
            head = f.read(512)
        if not head.startswith(_LEGACY_MAGIC):
            _refuse_other_file(path, head)
            raise _damaged(path, "truncated or not a torch.save file")
    if isinstance(source, io.BytesIO):
        source.seek(0)  # the checks above read it
    try:
        state = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as e:  # pickle, zip and storage errors: KeyError, EOFError, RuntimeError, OSError...
        if isinstance(e, torch.serialization.pickle.UnpicklingError) and "weights_only" in str(e):
            raise  # a whole file holding objects: torch's message says what to allow
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    if model is not None or optimizer is not None:
        if not isinstance(state, dict):
            raise TypeError(f"{path} holds a {type(state).__name__}, not a dict with 'model' / 'optimizer' entries")
        load_state_into(state, path, model, optimizer)
    return state

