"""Replicas that must agree, checked once: what each process of a multi-process run was given.

Each replica of a launch (ours, ``torchrun``, ``torch_xla.launch``) builds its own loaders,
model and resume point from what its own process was given. Where those differ, the
replicas either train apart without a word (one node resumes at epoch 3, the other starts
afresh) or meet in collectives of different sizes, where gloo aborts the interpreter. So,
before any step, every replica sends a short description of what it has in one
all-gather, and all of them compare the same gathered values: a difference is the same
``ReplicaMismatch`` on every replica, naming the ranks, the values and the fix.

What is compared (``describe_fit``): the number of samples and batches per epoch of the
training and validation data, a digest of a few of their samples (the same dataset on
every replica, or each its own shard), the trainable parameters' count and shapes, the
arguments that shape the run, and the resume point (epoch, step, run id).
``predict`` and ``evaluate`` compare their data alone (``data_differences``): the same
dataset is split over the replicas, and each replica given its own data computes alone.

Example:
    >>> describe_data([(torch.zeros(2), 0)] * 5)["samples"]
    5
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from .. import backend
from .events import Callback, TrainerLoop

CAPACITY = 8192  # bytes of JSON one replica sends; what is compared is short (digests, counts, names)
DIGEST_SAMPLES = 3  # samples read from each dataset for its digest: the first, the middle and the last


# ------------------------------------------------------- pure descriptions
def _leaf_bytes(leaf: Any) -> bytes:
    if isinstance(leaf, torch.Tensor):
        tensor = leaf.detach().cpu().contiguous()
        return f"{tensor.dtype}{tuple(tensor.shape)}".encode() + tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    if hasattr(leaf, "tobytes"):  # a numpy array, a PIL image
        return f"{type(leaf).__name__}{getattr(leaf, 'shape', getattr(leaf, 'size', ''))}".encode() + leaf.tobytes()
    return repr(leaf).encode()


def sample_digest(dataset: Any, indices: Sequence[int]) -> str:
    """A short digest of ``dataset[i]`` for each index, read under fixed seeds.

    Random augmentation drawn from torch, ``random`` or numpy gives the same sample on
    every replica this way, so equal datasets give equal digests; the random states are
    put back afterwards.
    """
    digest = hashlib.blake2b(digest_size=8)
    python_state = random.getstate()
    numpy_random = _numpy_random()
    numpy_state = numpy_random.get_state() if numpy_random is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            for i in indices:
                torch.manual_seed(i)
                random.seed(i)
                if numpy_random is not None:
                    numpy_random.seed(i)
                for leaf in pytree.tree_leaves(dataset[i]):
                    digest.update(_leaf_bytes(leaf))
    finally:
        random.setstate(python_state)
        if numpy_random is not None:
            numpy_random.set_state(numpy_state)
    return digest.hexdigest()


def _numpy_random() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - torch ships with numpy in every supported stack
        return None
    return numpy.random


def describe_data(dataset: Any) -> dict[str, Any]:
    """``{"samples": len, "digest": ...}``: the length and a digest of the first, middle and last samples."""
    n = len(dataset)
    indices = sorted({0, n // 2, n - 1}) if n else []
    return {"samples": n, "digest": sample_digest(dataset, indices[:DIGEST_SAMPLES])}


def parameter_shapes(model: torch.nn.Module) -> str:
    """The trainable parameters' count, and a digest of their names and shapes."""
    named = [(k, tuple(p.shape)) for k, p in model.named_parameters() if p.requires_grad]
    text = ";".join(f"{k}:{shape}" for k, shape in named)
    count = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{count:,} in {len(named)} tensors ({hashlib.blake2b(text.encode(), digest_size=6).hexdigest()})"


def differences(given: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Each key whose value is not the same on every replica, with every replica's value (rank order)."""
    keys = list(dict.fromkeys(k for values in given for k in values))
    found = {}
    for key in keys:
        values = [values.get(key) for values in given]
        if len({json.dumps(v, sort_keys=True) for v in values}) > 1:
            found[key] = values
    return found


def by_rank(values: list[Any]) -> str:
    """``rank 0: 100; rank 1: 57``, ranks with one value grouped (``ranks 0, 2: 100``)."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(json.dumps(value) if not isinstance(value, str) else value, []).append(rank)
    return "; ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {v}" for v, r in groups.items())


# What to do about a difference, by the first word of its key.
FIXES = {
    "train_data": "give every replica the same train_data: one_cycle_fit splits it over the replicas itself, so a "
                  "per-rank file list, filter or cache would leave each replica training on part of its own part",
    "valid_data": "give every replica the same valid_data: each evaluates its share and the figures are summed",
    "data": "give every replica the same data (it is split over the replicas), or each its own (each then "
            "computes alone)",
    "resume": "every replica must read the same checkpoint_dir: a folder all nodes share, or a bucket "
              "(checkpoint_dir='gs://bucket/run', through fsspec); a node whose disk has no last.pt starts afresh. "
              "Copy the folder to every node, or resume from the shared one",
    "parameters": "build the same model on every replica",
    "argument": "call one_cycle_fit with the same arguments on every replica",
}


class ReplicaMismatch(ValueError):
    """The replicas of one run were given different things; raised alike on every replica, before any step."""


def mismatch(what: str, found: dict[str, list[Any]]) -> ReplicaMismatch:
    replicas = len(next(iter(found.values())))
    lines = [f"  {key}: {by_rank(values)}" for key, values in found.items()]
    fixes = list(dict.fromkeys(FIXES[key.split()[0]] for key in found if key.split()[0] in FIXES))
    return ReplicaMismatch(
        f"the {replicas} replicas of this {what} were given different things, so they would not compute one "
        f"result together (nothing has run yet):\n" + "\n".join(lines) + "\n" + "\n".join(f"Fix: {f}." for f in fixes)
    )


def resume_point(loop: TrainerLoop) -> str:
    """Where this replica's run starts: afresh, or after a checkpoint's epoch (its step and run id).

    Not the path: nodes may hold copies of one checkpoint in folders of their own.
    """
    if not loop.start_epoch:
        return "epoch 1, afresh" + (" (no last.pt found)" if loop.last_path else "")
    run = next((c.run_id for c in loop.events.callbacks if hasattr(c, "run_id")), "?")
    return f"after epoch {loop.start_epoch} (step {loop.step}) of run {run}"


def describe_fit(loop: TrainerLoop, arguments: dict[str, Any]) -> dict[str, Any]:
    """What one replica of a one_cycle_fit run was given: its data, model, arguments and resume point."""
    plan = loop.plan
    train = describe_data(plan.train.dataset)
    values = {"train_data samples": train["samples"], "train_data batches per epoch": loop.batches,
              "train_data sampled digest": train["digest"]}  # fmt: skip
    if plan.valid is not None:
        valid = describe_data(plan.valid.dataset)
        values.update({"valid_data samples": valid["samples"], "valid_data batches": len(loop.valid_loader),
                       "valid_data sampled digest": valid["digest"]})  # fmt: skip
    values["parameters (trainable)"] = parameter_shapes(loop.model)
    values.update({f"argument {k}": v for k, v in arguments.items()})
    values["resume point"] = resume_point(loop)
    return values


class ReplicaAgreement(Callback):
    """Checks, before the first step and after a resume, that every replica was given the same run.

    One all-gather of a short description per replica (``describe_fit``); nothing with one
    replica. Fires after ``Checkpoints`` (order 10), so the resume point is known.

    Args:
        arguments: The arguments that shape the run (``one_cycle_fit``'s checkpoint fingerprint and config).
    """

    order = 15

    def __init__(self, arguments: dict[str, Any]) -> None:
        self.arguments = arguments

    def on_fit_start(self, loop: TrainerLoop) -> None:
        topology = loop.runner.topology
        if topology.replicas < 2:  # one process, or one program over a mesh: nothing to agree on
            return
        check(describe_fit(loop, self.arguments), loop.device, "one_cycle_fit run")


# ---------------------------------------------------------- the collective
def gather(values: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Every replica's ``values`` (JSON-able), in rank order, by one all-gather of a fixed-size buffer."""
    text = json.dumps(values, default=str).encode()
    if len(text) > CAPACITY:
        raise ValueError(f"the replica description is {len(text)} bytes, over {CAPACITY}: {text[:200]!r}...")
    buffer = torch.zeros(1, CAPACITY, dtype=torch.int32)
    buffer[0, : len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(torch.int32)
    chosen = backend.current()
    gathered = chosen.devices.to_cpu(chosen.processes.all_gather([buffer.to(device)]))[0]
    out = []
    for row in gathered:
        raw = bytes(row.to(torch.uint8).tolist()).rstrip(b"\0")
        out.append(json.loads(raw.decode()))
    return out


def check(values: dict[str, Any], device: torch.device, what: str) -> None:
    """Raises ``ReplicaMismatch`` on every replica if any of ``values`` differs between them."""
    found = differences(gather(values, device))
    if found:
        raise mismatch(what, found)


def data_differences(dataset: Any, device: torch.device) -> list[str]:
    """Every replica's data (its length and sampled digest) where they differ, else ``[]`` (and with one replica)."""
    if backend.current().processes.world_size() == 1:
        return []
    data = describe_data(dataset)
    described = f"{data['samples']} samples, sampled digest {data['digest']}"
    return differences(gather({"data": described}, device)).get("data", [])
