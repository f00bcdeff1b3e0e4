"""get_device(): the line that replaces ``torch.device("cuda")``, and a model
move that keeps tied weights tied."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import backend
from .huggingface import save_through_cpu
from .backend.base import move_to_device  # noqa: F401 - the hand-loop kit's name for it


def _check_index(index: int, count: int, what: str) -> None:
    if isinstance(index, bool) or not isinstance(index, int):
        raise TypeError(f"index must be an int or None, but given {index!r} ({type(index).__name__})")
    if not 0 <= index < count:
        raise ValueError(f"index must be between 0 and {count - 1} ({count} {what}), but given {index}")


def _accelerator() -> tuple[int, torch.device] | None:
    """(device count, current device) of torch.accelerator (CUDA, MPS, XPU...), or None.

    On a torch without ``torch.accelerator`` (before 2.6), CUDA's.
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        if not torch.cuda.is_available():
            return None
        return torch.cuda.device_count(), torch.device("cuda", torch.cuda.current_device())
    if not accelerator.is_available():
        return None
    kind = accelerator.current_accelerator().type
    current = getattr(accelerator, "current_device_index", None) or accelerator.current_device_idx  # torch 2.6
    return accelerator.device_count(), torch.device(kind, current())


def get_device(index: int | None = None) -> torch.device:
    """The device to train on: XLA (TPU) when there is one, else CUDA (or another accelerator), else CPU.

    XLA is used when a TPU is attached or ``PJRT_DEVICE`` is set (and torch_xla
    is installed). Inside a multi-core launch it returns that process's device.

    It stands in one-for-one for ``torch.accelerator``'s device choice (as in
    pytorch/examples): always a ``torch.device`` (never None), the accelerator's
    when there is one (XLA, which ``torch.accelerator`` does not know, first),
    else ``cpu``; ``get_device().type != "cpu"`` answers ``is_available()``.

    Args:
        index: One core (like Lightning's ``tpu_cores=[5]``) or one GPU. None takes
            the default device of this process.

    Returns:
        torch.device: ``xla:N``, ``cuda:N`` or ``cpu``.

    Raises:
        ValueError: ``index`` is outside the devices this process can address.
        TypeError: ``index`` is not an int.
        RuntimeError: ``PJRT_DEVICE=TPU`` but no TPU is attached.
        ModuleNotFoundError: ``PJRT_DEVICE`` is set but torch_xla is not installed
            (the same error as ``setup_tpu()``; we never quietly fall back to the CPU).

    Example:
        >>> # was: device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        >>> # or: device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else cpu
        >>> device = get_device()
        >>> model = MyModel().to(device)    # doctest: +SKIP
    """
    wanted = backend.pjrt_device()
    if wanted is not None and not backend.XLA_INSTALLED:
        raise ModuleNotFoundError(f"PJRT_DEVICE={wanted!r} needs torch_xla. Install it with: {backend.INSTALL_HINT}")
    if backend.xla_requested():
        if index is None:
            return backend.device()
        _check_index(index, backend.addressable_device_count(), "XLA devices in this process")
        return backend.device(index)
    found = _accelerator()
    if found is not None:
        count, current = found
        if index is None:
            return torch.device(current.type, current.index)
        _check_index(index, count, f"{current.type.upper()} devices")
        return torch.device(current.type, index)
    if index is not None:
        _check_index(index, 1, "CPU device; no TPU or GPU found")
    return torch.device("cpu")


def device_type() -> str:
    """The type of the device ``get_device()`` gives ("xla", "cuda", "mps", "cpu"), without starting the XLA runtime.

    For a device chosen when a module is imported (a config class's ``device``, a module-level line
    of a program that launches processes): ``get_device()`` there starts the XLA runtime in the
    launching process, and the launch then refuses ('Runtime is already initialized'). The type is
    a device string: ``torch.device(device_type())`` and ``x.to(device_type())`` land on the
    process's own device when they are used.

    Returns:
        str: The device type, as ``get_device().type`` would give it.

    Raises:
        ModuleNotFoundError: ``PJRT_DEVICE`` is set but torch_xla is not installed.

    Example:
        >>> class args:
        ...     device = device_type()   # was: "cuda" if torch.cuda.is_available() else "cpu"
        >>> model = MyModel().to(args.device)   # doctest: +SKIP
    """
    wanted = backend.pjrt_device()
    if wanted is not None and not backend.XLA_INSTALLED:
        raise ModuleNotFoundError(f"PJRT_DEVICE={wanted!r} needs torch_xla. Install it with: {backend.INSTALL_HINT}")
    return backend.current().device_type


def tied_parameter_groups(model: nn.Module) -> list[list[str]]:
    """Names of parameters that are one tensor (tied weights), grouped."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


def _set_parameter(model: nn.Module, name: str, param: nn.Parameter) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, param)


def refuse_meta_weights(model: nn.Module, device: torch.device) -> None:
    """Refuses to move a model whose weights are still on the ``meta`` device (built under
    ``torch.device("meta")``, never loaded): they hold no values, and torch's own advice, ``to_empty()``,
    would give uninitialised ones."""
    if torch.device(device).type == "meta":
        return
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise ValueError(
            f"{type(model).__name__}'s weights are still on the meta device ({len(empty)} tensors, {empty[0]} the "
            f"first): they hold no values to move to {device}. Load the weights (from_pretrained, "
            f"load_state_dict(state, assign=True)) first; to_empty() would leave them uninitialised"
        )


def move_model(model: nn.Module, device: torch.device) -> nn.Module:
    """``model.to(device)`` that keeps tied weights tied.

    Moving to XLA replaces each parameter with a new one, so an output layer that
    shares the embedding weight (GPT-2, Gemma, Bloom, any model with
    ``tie_word_embeddings=True`` or ``self.head.weight = self.embed.weight``) gets its
    own copy and the tie is silently lost: two matrices train where the model has one.
    The ties are recorded before the move and restored after it. On CUDA and the CPU
    ``model.to`` keeps ties itself, and this is the same call. On XLA a Hugging Face
    or peft model's ``save_pretrained`` is made to save a CPU copy of the weights
    (safetensors cannot read XLA tensors), so ``model.save_pretrained(dir)`` works there.

    Args:
        model: the module to move, in place.
        device: where to, as ``get_device()`` gives it.

    Returns:
        The same module, for chaining as ``model.to`` is.

    Example:
        >>> model = move_model(GPT2LMHeadModel(config), get_device())  # was: model.to("cuda")  # doctest: +SKIP
    """
    refuse_meta_weights(model, device)
    groups = tied_parameter_groups(model)
    model.to(device)
    for names in groups:
        keep = model.get_parameter(names[0])
        for name in names[1:]:
            _set_parameter(model, name, keep)
    if backend.is_lazy(device):  # save_pretrained reads storage pointers, which XLA tensors lack
        save_through_cpu(model)
    return model
