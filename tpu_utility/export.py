"""A fine-tuned Hugging Face model out of the chips, as a folder ``from_pretrained`` loads anywhere.

On XLA, ``model.save_pretrained(folder)`` needs the weights on the host (safetensors reads a
storage pointer XLA tensors do not have), and peft's ``merge_and_unload()`` on the device
builds a new model that holds device tensors and mutates the adapter model the run returned.
``export_pretrained`` copies the model to the CPU in one transfer (a sharded model's shards put
together on the host, never whole on a device), merges the adapters there when asked, and
writes safetensors in the dtype the model holds: a GPU box, a CPU or a Kaggle dataset then
loads the folder with ``AutoModelForCausalLM.from_pretrained`` (or, for an adapter,
``PeftModel.from_pretrained``). The model given stays as it is, where it is.

Example:
    >>> history = one_cycle_fit(lora_model, train_ds, epochs=2, max_lr=2e-4)                # doctest: +SKIP
    >>> # was: history.model.merge_and_unload().save_pretrained("out")  (fails on XLA)
    >>> export_pretrained(history.model, "out", merge_lora=True)                             # doctest: +SKIP
    >>> export_pretrained(model, "out", checkpoint="run/best.pt")   # after the fact, from a run's file  # doctest: +SKIP
"""

from __future__ import annotations

import copy
import glob
import os
import shutil
import tempfile
from typing import Any

import torch
from torch import nn

from . import backend
from .checkpoint import load_checkpoint
from .compiler import compiled_parts
from .huggingface import SavedThroughCpu, base_model, is_transformers_model
from .quantization import dequantize_base


def _is_peft(model: nn.Module) -> bool:
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def cpu_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the CPU, its weights fetched in one transfer (a sharded model's put together on
    the host); tied weights stay tied, and the device holds no second copy at any time."""
    found: dict[int, torch.Tensor] = {}
    for _, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        found.setdefault(id(tensor), tensor)
    on_cpu = backend.current().devices.state_to_cpu([t.detach() for t in found.values()])
    memo: dict[int, Any] = {}
    for tensor, host in zip(found.values(), on_cpu):
        host = host.clone() if host.data_ptr() == tensor.data_ptr() else host  # on the CPU already: a copy of its own
        memo[id(tensor)] = nn.Parameter(host, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else host
    copied = copy.deepcopy(model, memo)
    for module in copied.modules():  # save_pretrained through the CPU (device.move_model) is not needed here
        if isinstance(module.__dict__.get("save_pretrained"), SavedThroughCpu):
            del module.__dict__["save_pretrained"]
    return copied


def export_pretrained(model: nn.Module, folder: str | os.PathLike[str], *, merge_lora: bool = False,
                      checkpoint: str | os.PathLike[str] | None = None) -> str:  # fmt: skip
    """Writes a fine-tuned transformers or peft model as a Hugging Face folder (safetensors) that loads anywhere.

    The model may be on XLA (one core, all cores, ``strategy="fsdp"``'s shards), CUDA or the
    CPU; it is copied to the host and left as it is. The weights keep the dtype the model holds
    (bf16 or fp32 as trained).

    Args:
        model: A transformers ``PreTrainedModel`` or a peft model of one (LoRA, prompt tuning), or
            ``torch.compile`` of one (the module inside is written).
        folder: A local folder, written whole and then renamed into place: an earlier export there is
            replaced whole (files the export does not write, a tokenizer's or a README, are kept) or, if
            the call is killed, left whole; a kill between the two renames leaves the folder absent and
            both exports in hidden ``.NAME.export-*`` folders beside it, cleared by the next export there.
        merge_lora: False: a peft model writes its adapter alone (``adapter_model.safetensors``,
            loaded with ``PeftModel.from_pretrained(base, folder)``). True: the adapters are
            merged into the base weights (peft's ``merge_and_unload``) on the CPU copy and the
            folder is a plain transformers model (``AutoModelForCausalLM.from_pretrained``).
        checkpoint: A file ``one_cycle_fit(checkpoint_dir=...)`` or ``save_checkpoint`` wrote
            (``best.pt``, ``last.pt``, or the folder holding ``last.pt``): its model weights
            are exported in place of ``model``'s own (``model`` gives the architecture), for a
            notebook that stopped after training.

    Returns:
        The folder, as a string.

    Raises:
        TypeError: ``model`` is not a transformers model or a peft model of one.
        ValueError: ``merge_lora=True`` for a model without adapters, or for adapters peft
            cannot merge (prompt tuning), named; ``folder`` is a file, or a place no folder can be
            written (named with the system's reason), checked before the model is copied.

    Example:
        >>> # was: model.merge_and_unload().save_pretrained("out")  on a CUDA box
        >>> export_pretrained(history.model, "out", merge_lora=True)   # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("out")               # anywhere  # doctest: +SKIP
    """
    model = compiled_parts(model)[0]  # torch.compile's wrapper: the module inside is the model
    if not is_transformers_model(base_model(model)):
        raise TypeError(f"export_pretrained writes a transformers model or a peft model of one, but given "
                        f"{type(model).__name__}; save other models with save_checkpoint")  # fmt: skip
    if not isinstance(merge_lora, bool):
        raise TypeError(f"merge_lora must be True or False, but given {merge_lora!r}")
    if merge_lora and not (_is_peft(model) and callable(getattr(model, "merge_and_unload", None))):
        what = f"a peft {type(model).__name__}, whose adapters peft cannot merge" if _is_peft(model) else (
            f"{type(model).__name__}, which has no adapters")  # fmt: skip
        raise ValueError(f"merge_lora=True merges LoRA adapters into the base weights, but the model is {what}; "
                         f"give merge_lora=False to write it as it is")  # fmt: skip
    folder = os.fspath(folder)
    staging = _staging_folder(folder)  # before the copy: a file or an unwritable place is said at once
    try:
        copied = cpu_copy(model)
        if checkpoint is not None:
            load_checkpoint(os.fspath(checkpoint), model=copied)
        if merge_lora:  # an int8 base (quantize_base) is dequantized first: peft merges into float weights
            copied = dequantize_base(copied).merge_and_unload()
        copied.save_pretrained(staging)  # safetensors: transformers 5 writes nothing else, peft by default
        _replace(folder, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return folder


_WRITTEN = (".safetensors", ".bin", ".pt", ".pth", ".index.json", "config.json")  # an export's weights and configs


def _staging_folder(folder: str) -> str:
    """A new empty folder beside ``folder`` to write the export into; an earlier killed export's are removed."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"export_pretrained writes a folder, but folder={folder!r} is a file; give a new folder's "
                         f"path (or an earlier export's, which is replaced)")  # fmt: skip
    parent, name = os.path.split(os.path.abspath(folder))
    try:
        os.makedirs(parent, exist_ok=True)
        for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.export-*")):
            shutil.rmtree(stale, ignore_errors=True)
        return tempfile.mkdtemp(prefix=f".{name}.export-", dir=parent)
    except OSError as error:
        raise ValueError(f"export_pretrained cannot write folder={folder!r}: {error.strerror or error} "
                         f"({error.filename or parent}); give a folder in a writable place") from error


def _replace(folder: str, staging: str) -> None:
    """``staging`` renamed to ``folder``; an earlier export there goes whole (its other files are kept)."""
    if not os.path.isdir(folder):
        os.rename(staging, folder)
        return
    written = set(os.listdir(staging))
    for entry in os.listdir(folder):  # a tokenizer saved there, a README: not the export's to drop
        if entry not in written and not entry.endswith(_WRITTEN):
            source, target = os.path.join(folder, entry), os.path.join(staging, entry)
            if os.path.isdir(source):
                shutil.copytree(source, target, symlinks=True)
            else:
                shutil.copy2(source, target)
    old = f"{staging}-replaced"
    os.rename(folder, old)
    os.rename(staging, folder)
    shutil.rmtree(old, ignore_errors=True)
