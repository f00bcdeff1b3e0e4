"""Runner: what one process needs to run a model on its share of the cores.

``one_cycle_fit``, ``evaluate``, ``predict`` and ``find_lr`` each build one
``Runner`` per process. It holds the device, the model, the precision and the
data layout (``Topology``: single core, SPMD over a mesh of devices and hosts,
or one replica of a multi-process launch), builds the loaders for that layout,
turns host batches into device batches (sharded under SPMD), and runs the two
loops that never train: evaluation sums and prediction.

Who loads which samples is plain arithmetic (``Topology``), tested with
simulated process counts; the runner only asks torch_xla for the numbers.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from .. import backend
from ..compiler import EAGER, Compile, CompileDecision, compiled_parts
from ..data.loaders import LoaderSpec, eval_loader, real_counts, stop_workers, train_loader
from ..device import get_device, move_model, move_to_device
from ..huggingface import (base_model, check_transformers, give_back_checkpoint_functions, is_transformers_model,
                           packed_attention, restore_masks, restore_packed_attention, static_masks,
                           use_checkpoint_function)
from ..progress import progress_bar
from ..scan import scan_for_run
from .metrics import MetricSet
from .precision import Precision
from .steps import Batch, Step
from .strategies import Strategy

PREDICT_CHUNK = 16  # batches of outputs kept on the device between host transfers


@dataclass(frozen=True)
class Placement:
    """Where and how a model was found: device, train/eval mode, each tensor's dtype."""

    device: torch.device
    training: bool
    dtypes: dict[str, torch.dtype]

    @classmethod
    def of(cls, model: nn.Module) -> Placement:
        params = [p for p in model.parameters()]
        device = params[0].device if params else torch.device("cpu")
        return cls(device, model.training, {name: t.dtype for name, t in _tensors(model)})

    def restore_dtypes(self, model: nn.Module) -> None:
        """Gives each parameter and buffer its own found dtype back (after a bf16 cast)."""
        for name, tensor in _tensors(model):
            found = self.dtypes.get(name)
            if found is not None and tensor.dtype != found:
                tensor.data = tensor.data.to(found)

    def restore(self, model: nn.Module) -> None:
        move_model(model, self.device)
        self.restore_dtypes(model)
        model.train(self.training)


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


# ------------------------------------------------------------------ runner
class Runner:
    """One process's device, model, precision and data layout.

    Example:
        >>> runner = Runner(model, precision="bf16", strategy=Spmd(cores=4))   # doctest: +SKIP
        >>> loader = runner.eval_loader(unpack_loader(valid_ds, 64, "valid_data"))  # doctest: +SKIP
        >>> for batch, index in runner.batches(loader): ...          # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, precision: Precision | str = "fp32", strategy: Strategy | None = None,
                 compile: Compile | None = None) -> None:  # fmt: skip
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, but given {model!r}")
        model, self.own_compiled = _own_compiled(model, compile)
        if is_transformers_model(base_model(model)):
            check_transformers()
        self.compile = compile if compile is not None else EAGER
        self.decision = CompileDecision(False, "")  # decided for the run's length (compile_for)
        self._compiled_model: nn.Module | None = None
        self.found = Placement.of(model)
        self.strategy = strategy if strategy is not None else Strategy()  # one process, the whole model
        self.topology = self.strategy.topology()
        self.device = get_device()
        self.model = model
        self._train_model: nn.Module | None = None
        self._loaders: list[Any] = []  # the loaders built here, their workers stopped by ``stop_workers``
        self.precision = Precision.of(precision, self.device).on(self.device)
        self.found_weights = None
        if self.precision.mode == "cast":  # bf16 -> fp32 would not give the weights back exactly
            self.found_weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        move_model(model, self.device)
        if self.precision.mode == "cast":
            model.to(torch.bfloat16)
        # a decoder's layers compiled once and looped (XLA), their weights stacked for the run (given back after)
        self.scanned, self.scan_words = scan_for_run(model, self.compile.scan) if self.lazy else (None, "")
        self.strategy.enter(model)  # a sharding strategy shards the parameters in place; a replicated one does nothing
        # a transformers model's masks built on the device: no host read per forward on XLA (given back after)
        self.found_attention = static_masks(model) if self.lazy else None
        # packed rows (PackedDataset) attend within each sample, their masks built on the device (removed after)
        self.packed_attention = packed_attention(model)
        # gradient_checkpointing_enable()'s torch checkpoint fails on XLA: torch_xla's in its place (given back after)
        self.found_checkpointing = use_checkpoint_function(model, backend.current().compute.checkpoint_function()) if self.lazy else []

    @property
    def lazy(self) -> bool:
        """Whether the model's device builds graphs that a step boundary runs (XLA)."""
        return backend.current().devices.is_lazy(self.device)

    def restore_model(self) -> None:
        """Puts the model back on the device, dtype and mode it was found in."""
        self.strategy.leave(self.model)
        self.unstack_layers()
        self.found.restore(self.model)
        restore_masks(self.model, self.found_attention)
        restore_packed_attention(self.packed_attention)
        give_back_checkpoint_functions(self.found_checkpointing)
        if self.found_weights is not None:
            self.model.load_state_dict(self.found_weights)
        self.stop_workers()

    def unstack_layers(self) -> None:
        """The scanned layers' trained weights written back into the plain layers (see ``scan.scan_layers``)."""
        if self.scanned is not None:
            self.scanned.undo()
            self.scanned = None

    def stop_workers(self) -> None:
        """Stops the worker processes of the loaders built here, now (see ``data.loaders.stop_workers``)."""
        for loader in self._loaders:
            stop_workers(loader)
        self._loaders = []

    # -- loaders
    def train_loader(self, spec: LoaderSpec, seed: int) -> Any:
        loaders, index = self.topology.loaders
        loader = train_loader(spec, self.topology.loader_batch(spec.batch_size), replicas=loaders, rank=index, seed=seed)
        self._loaders.append(loader)
        return loader

    def eval_loader(self, spec: LoaderSpec) -> Any:
        loaders, index = self.topology.loaders
        loader = eval_loader(spec, self.topology.loader_batch(spec.batch_size), replicas=loaders, rank=index)
        self._loaders.append(loader)
        return loader

    def batches(self, loader: Any) -> Iterator[Batch]:
        """Device batches (sharded over the mesh under SPMD); Dataset errors reach the caller."""
        if self.lazy:
            spmd = self.topology.spmd
            devices = self.topology.devices if spmd else None
            return backend.current().devices.device_loader(loader, self.device, devices, minibatch=spmd and self.topology.hosts > 1)
        if self.device.type == "cpu":  # the loader's batches are where the model is: nothing to move
            return iter(loader)
        return (move_to_device(b, self.device) for b in loader)

    def first_batch(self, loader: Any) -> Batch:
        """The loader's first batch on the device, for checks before a run (traced, not run)."""
        return move_to_device(next(iter(loader)), self.device)

    def compile_for(self, steps: int) -> str:
        """Decides whether the steps of a run of ``steps`` steps are compiled (``compile=``; a model the caller
        compiled is trained as it is) before the first; returns the summary line's words for it."""
        if self.own_compiled is not None:
            self.decision = CompileDecision(True, "compiled by the caller (torch.compile(model)): trained as it is")
        else:
            self.decision = self.compile.decide(steps)
        self._train_model = self._compiled_model = None
        return self.decision.words

    @property
    def compiles(self) -> bool:
        """Whether the steps compile graphs as they run: XLA's lazy graphs, or torch.compile's."""
        return self.lazy or self.decision.on

    @property
    def train_model(self) -> nn.Module:
        """The model a training step calls: the backend's replica wrapper (DDP on CUDA/CPU) when replicas train,
        compiled where the run compiles (the wrapper around the model, which is left as it is)."""
        if self._train_model is None:
            own = self.decision.on and self.own_compiled is not None
            called = self.own_compiled if own else self.model
            if self.topology.replicas > 1:  # DDP; a model FSDP2 shards averages its gradients itself: as it is
                called = backend.current().processes.wrap_replica(called, self.device)
            ours = self.decision.on and not own  # torch.compile of DDP splits its graphs at the gradient buckets
            self._train_model = self._compile(_Training(called)) if ours else called
        return self._train_model

    @property
    def step_model(self) -> nn.Module:
        """The model an evaluation or prediction step calls: compiled where the run compiles."""
        if not self.decision.on:
            return self.model
        if self.own_compiled is not None:
            return self.own_compiled
        if self._compiled_model is None:
            self._compiled_model = self._compile(_Evaluation(self.model))
        return self._compiled_model

    def _compile(self, model: nn.Module) -> nn.Module:
        return backend.current().compute.torch_compile(model, self.compile.options)

    def run(self, step: Step, batch: Batch, training: bool = False) -> Any:
        """``step(model, batch)`` under this precision (the replica wrapper when ``training``), compiled where the
        run compiles."""
        model = self.train_model if training else self.step_model
        if self.precision.mode == "fp32":  # nothing to cast or enter
            return step(model, batch)
        batch = self.precision.inputs(batch)
        with self.precision.context():
            return step(model, batch)

    # -- the loops that do not train
    def eval_sums(self, loader: Any, metrics: MetricSet, eval_step: Step,
                  after_batch: Callable[[Batch], None] | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        """Evaluates every sample once; returns ``metrics.figures()`` (on the device, not read). ``after_batch``
        is called with each batch once it is traced (the loop's ``GraphLog``)."""
        self.model.eval()
        metrics.reset()
        counts = real_counts(loader)
        with torch.no_grad():
            for (batch, index), real in zip(self.batches(loader), counts):
                output, target = self.run(eval_step, batch)
                metrics.update(output.float(), target, index, real)
                if after_batch is not None:
                    after_batch(batch)
        if metrics.whole:  # every output and target, gathered to the host in one transfer
            if self.lazy:
                backend.current().devices.sync()  # the last batch's graph runs as every other batch's did (no new compile)
            parts, metrics.outputs = self._to_host(metrics.outputs), []
            metrics.finish(*_in_order(parts, sum(int((index >= 0).sum()) for _, index in parts)))
        return metrics.figures()

    def check_eval(self, loader: Any, metrics: MetricSet, eval_step: Step) -> None:
        """eval_step, the loss and every metric on the first batch, before any epoch is spent."""
        batch, _ = self.first_batch(loader)
        self.model.eval()
        with torch.no_grad():
            result = self.run(eval_step, batch)
            if not (isinstance(result, (tuple, list)) and len(result) == 2):
                raise TypeError(
                    f"eval_step must return (output, target), but returned {type(result).__name__}"
                    f"{f' of length {len(result)}' if hasattr(result, '__len__') else ''}"
                )
            output, target = result
            metrics.check(output.float() if isinstance(output, torch.Tensor) else output, target)

    def predict(self, loader: Any, step: Step, tta: Sequence[Callable] | None, progress: bool = False) -> Any:
        """Outputs for every sample in dataset order, on the CPU, padding removed.

        Outputs stay on the device in chunks of ``PREDICT_CHUNK`` batches; a chunk
        moves to the host in one transfer once the next chunk is under way, so the
        device never waits for the host (and at most two chunks are held).
        """
        self.model.eval()
        on_host: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        previous: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        current: list[tuple[list[torch.Tensor], torch.Tensor]] = []
        spec = None
        speak = progress and self.topology.master and backend.is_master()  # one bar per job, also when each predicts alone
        bar = progress_bar(len(loader), "predict", enabled=speak)
        with torch.no_grad():
            for batch, index in self.batches(loader):
                bar.update(1)
                leaves, spec = batch_first_leaves(self._predict_batch(step, batch, tta), index.shape[0])
                current.append((leaves, index))
                if len(current) == PREDICT_CHUNK:
                    on_host += self._to_host(previous)  # computed already: the device goes on with `current`
                    previous, current = current, []
            if self.lazy:
                backend.current().devices.sync()  # the last batch's graph runs as every other batch's did (no new compile)
            on_host += self._to_host(previous + current)
        bar.close()
        return pytree.tree_unflatten(_in_order(on_host, loader.dataset.n), spec)

    def _predict_batch(self, step: Step, batch: Batch, tta: Sequence[Callable] | None) -> Any:
        if not tta:
            return self.run(step, batch)
        outputs = [self.run(step, _transformed(k, transform, batch)) for k, transform in enumerate(tta)]
        return _tta_mean(outputs)

    def _to_host(self, pending: list[tuple[list[torch.Tensor], torch.Tensor]]) -> list[tuple[list[torch.Tensor], torch.Tensor]]:
        """One device-to-host transfer for many batches (gathered over replicas first)."""
        if not pending:
            return []
        flat = [t for leaves, index in pending for t in (*leaves, index)]
        if self.topology.replicas > 1:  # one replica of several, each with its share of the samples
            flat = backend.current().processes.all_gather(flat)
        moved = iter(backend.current().devices.to_cpu(flat))
        width = len(pending[0][0])
        result = []
        for _ in pending:
            leaves = [next(moved) for _ in range(width)]
            result.append((leaves, next(moved)))
        return result


class _Called(nn.Module):
    """The model as a compiled step calls it; its attributes are the model's (a ``train_step`` may read them). One
    class per kind of step, so that torch.compile keeps training and evaluation apart (one frame each) and a
    recompile's reason is the failed guard of its own kind, not the other kind's grad mode."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.module = model

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)


class _Training(_Called):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class _Evaluation(_Called):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


def _own_compiled(model: nn.Module, compile: Compile | None) -> tuple[nn.Module, nn.Module | None]:
    """(the module to train and save, the caller's compiled form of it or None). ``torch.compile(model)`` given: the
    module inside is trained (its own state-dict keys) through the caller's compiled wrapper; on XLA, which compiles
    every step itself and where inductor does not compile, the module alone, said once."""
    inner, own = compiled_parts(model)
    if own is None:
        return model, None
    own_compiler = backend.current().compute.graph_compiler()
    if own_compiler is not None:
        warnings.warn(f"the model given is compiled by torch.compile, which does not target {own_compiler}: "
                      f"{type(inner).__name__} itself is run, and {own_compiler} compiles every step's graph", stacklevel=4)  # fmt: skip
        return inner, None
    if compile is not None and compile.enabled is False:
        raise ValueError(f"compile=False, but the model given is torch.compile'd ({type(inner).__name__} inside): "
                         f"give the module itself (model._orig_mod) to run eagerly, or leave compile as it is")  # fmt: skip
    return inner, own


def batch_first_leaves(output: Any, batch: int) -> tuple[list[torch.Tensor], Any]:
    """The output's tensors and structure, each checked to be batch-first: dim 0 is the batch.

    Raises:
        TypeError: a leaf that is not a tensor.
        ValueError: a 0-d leaf, or one whose dim 0 is not the batch size (an LSTM's
            ``(h, c)``, a transposed ``(C, N)`` output, a value reduced over the batch).
    """
    paths, spec = pytree.tree_flatten_with_path(output)
    for path, leaf in paths:
        where = f"output{pytree.keystr(path)}"
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"predict needs tensors (a tensor, or tuples, lists and dicts of them), but {where} is "
                f"{type(leaf).__name__}; return only tensors from the model or predict_step"
            )
        if leaf.dim() == 0 or leaf.shape[0] != batch:
            raise ValueError(
                f"predict needs batch-first outputs (dim 0 = the batch), but {where} has shape "
                f"{tuple(leaf.shape)} for a batch of {batch} samples; leave it out or move the batch to "
                f"dim 0 with predict_step=lambda model, batch: ... (for an LSTM: its output, not (h, c))"
            )
    return [leaf for _, leaf in paths], spec


def _transformed(k: int, transform: Callable, batch: Batch) -> Batch:
    """tta[k](batch), its error naming the transform and the batch it was given."""
    try:
        return transform(batch)
    except Exception as error:
        kind = type(error) if type(error) in (ValueError, TypeError, AttributeError, IndexError, KeyError) else RuntimeError
        raise kind(
            f"tta[{k}] failed on a batch {_structure(batch)}: {error}. A tta transform gets the whole batch "
            f"as the loader gives it; for (inputs, target) batches write lambda b: (b[0].flip(-1), *b[1:])"
        ) from error


def _tta_mean(outputs: list[Any]) -> Any:
    """The mean of the tta outputs, which must all have tta[0]'s structure and shapes, and be floats
    (the mean of class ids 2 and 3 is no class)."""
    for path, leaf in pytree.tree_flatten_with_path(outputs[0])[0]:  # dtypes: known without reading the device
        if isinstance(leaf, torch.Tensor) and not (leaf.is_floating_point() or leaf.is_complex()):
            raise TypeError(
                f"tta averages the outputs of its transforms, but output{pytree.keystr(path)} is {leaf.dtype} "
                f"(class ids or votes?), whose mean would be fractions of classes. Return logits or "
                f"probabilities (and take .argmax(-1) of predict's result), or predict without tta once per "
                f"transform and take the vote yourself (torch.mode)"
            )
    want = _structure(outputs[0])
    for k, output in enumerate(outputs[1:], 1):
        if _structure(output) != want:
            raise ValueError(
                f"tta[{k}] gives the output {_structure(output)}, but tta[0] gives {want}; tta outputs "
                f"are averaged, so every transform must keep the output's structure and shapes"
            )
    return pytree.tree_map(lambda *ts: torch.stack([t.float() for t in ts]).mean(0), *outputs)


class _Shape:
    def __init__(self, t: torch.Tensor) -> None:
        self.text = f"Tensor{tuple(t.shape)}"

    def __repr__(self) -> str:
        return self.text


def _structure(batch: Batch) -> str:
    """A batch described by its structure and shapes, for error messages: [Tensor(16, 4), Tensor(16,)]."""
    return repr(pytree.tree_map(lambda t: _Shape(t) if isinstance(t, torch.Tensor) else t, batch))


def _in_order(parts: list[tuple[list[torch.Tensor], torch.Tensor]], n: int) -> list[torch.Tensor]:
    """Each output leaf over all batches, placed by dataset index, padding dropped."""
    index = torch.cat([i for _, i in parts])
    keep = index >= 0
    where = index[keep]
    in_place = len(index) >= n and torch.equal(index[:n], torch.arange(n))  # one loader, no sampler: in order
    ordered = []
    for k in range(len(parts[0][0])):
        values = torch.cat([leaves[k] for leaves, _ in parts])
        values = values[:n] if in_place else values[keep]
        if not in_place:
            values = values.new_empty((n, *values.shape[1:])).index_copy_(0, where, values)
        ordered.append(values)
    return ordered
