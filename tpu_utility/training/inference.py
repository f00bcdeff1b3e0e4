"""predict() and evaluate(): inference on one core or all cores, in dataset order.

Both leave the model as they found it: weights untouched, and back on its
device, dtype and train/eval mode afterwards.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
from torch import nn

from .. import backend
from ..compiler import Compile
from . import agreement
from ..data.loaders import LabelCheck, LoaderSpec, refuse_uncounted, unpack_loader
from ..huggingface import is_causal_lm
from .metrics import CrossEntropy, MetricSet, check_loss_fn, resolve_metrics
from .precision import PrecisionName
from .runner import Runner
from .steps import EvalStep, default_eval_step, default_predict_step
from .strategies import FSDP, Strategy, StrategyName, choose


def _strategy(model: nn.Module, cores: int | str, strategy: Any) -> Strategy:
    """The strategy ``predict`` or ``evaluate`` runs (``strategies.choose``), the model checked first."""
    if isinstance(model, type):
        raise TypeError(f"model is the class {model.__qualname__}, not a model; give an instance, "
                        f"{model.__qualname__}(...), with its trained weights")  # fmt: skip
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, but given {model!r}")
    return choose(cores, strategy)


def _runner(model: nn.Module, precision: str, spec: LoaderSpec, what: str, chosen: Strategy, compiling: Compile) -> Runner:
    """The Runner for ``predict`` or ``evaluate`` under ``chosen``; the replicas of a job given different data each run
    alone (``predict``: each gets its own rows) or are refused (``evaluate``: no one figure is asked for; and a
    sharded model, whose every batch runs through all the processes' shards)."""
    # several processes of a job only (on XLA, "fsdp" is one process, whose runtime must not start before SPMD is on)
    several = chosen.job_size() > 1
    differ = agreement.data_differences(spec.dataset, backend.current().devices.device()) if several else []
    alone = chosen.alone() if differ else chosen
    if alone is None:
        raise agreement.ReplicaMismatch(
            f"{what} with strategy='{chosen.name}' runs one model sharded over the {len(differ)} processes, each batch "
            f"through all of them, but the processes were given different data ({agreement.by_rank(differ)}). "
            f"Give every process the same dataset, or {what} without sharding for each process's own data"
        )
    if differ and what == "evaluate":
        raise agreement.ReplicaMismatch(
            f"evaluate splits one dataset over the {len(differ)} replicas and sums their figures, but the "
            f"replicas were given different data ({agreement.by_rank(differ)}), so its figures would be of "
            f"no replica's data. Give every replica the same dataset; for each replica's own figures, "
            f"predict(model, its_data) gives every replica its own rows to score"
        )
    return Runner(model, precision, alone, compiling)  # each replica given data of its own predicts every row, alone


def predict(
    model: nn.Module,
    data: Any,
    *,
    cores: int | str = 1,
    batch_size: int | None = None,
    precision: PrecisionName = "fp32",
    strategy: StrategyName | FSDP = "auto",
    compile: bool | Literal["auto"] | Compile = "auto",
    predict_step: Callable[[nn.Module, Any], Any] | None = None,
    tta: Sequence[Callable[[Any], Any]] | None = None,
    progress: bool = True,
) -> Any:
    """The model's outputs for every sample, in dataset order, on the CPU.

    Row ``i`` of every output is ``model(dataset[i])``. Works on one core, on all
    cores (SPMD; inside a ``torch_xla.launch`` each process gets every
    prediction), and without torch_xla (CUDA or CPU). Batches are padded to one
    shape (one compile); outputs stay on the device and move to the host every
    16 batches in one transfer. In a job of several processes, the same dataset
    on every process is split over them and each gets every row; a process given
    data of its own (another length, or other samples) predicts it alone and gets
    its own rows.

    Outputs must be batch-first: a tensor whose dim 0 is the batch, or tuples,
    lists and dicts of them (nested), which come back in the same structure.
    Anything else is refused by name, since joining it along dim 0 would give
    wrong rows: a 0-d value, an output reduced over the batch, a transposed
    ``(C, N)`` output, an LSTM's ``(h, c)`` (``(layers, N, H)``). A Hugging Face
    ``ModelOutput`` (or a dict) holding ``logits`` gives its logits.

    Args:
        model: The model (left on its device and in its mode afterwards).
        data: A Dataset or DataLoader of inputs, of ``(*inputs, target)`` (the
            target is ignored), or of dicts of model arguments (``labels`` ignored). A DataLoader's sampler may order the samples
            any way (rows still come back in dataset order), but it must draw
            each sample once: one that draws a subset or draws with replacement
            (``SubsetRandomSampler``, ``WeightedRandomSampler``,
            ``RandomSampler(replacement=True)``) is refused, since no row order
            would then be ``model(dataset[i])``. Predict on
            ``torch.utils.data.Subset(dataset, indices)`` instead: its row ``k``
            is ``model(dataset[indices[k]])``.
        cores: 1, "all", or the number of all cores.
        batch_size: Per core (default 64, or the DataLoader's own).
        precision: "fp32", "bf16" or "fp16" (float16 autocast only: no backward, so no
            GradScaler; CUDA and the CPU, refused on TPUs as in ``one_cycle_fit``).
        strategy: As ``one_cycle_fit`` takes it: "fsdp" or ``FSDP(...)`` (with ``cores="all"``) predicts with
            the parameters sharded over the cores, for a model that one chip cannot hold; the rows are the same.
            Natively (CUDA, the CPU) ``cores=N`` launches N processes that hold the shards (FSDP2), as
            ``one_cycle_fit`` does, and inside a ``torchrun`` job the job's processes shard together.
        compile: As ``one_cycle_fit`` takes it ("auto": torch.compile on CUDA and TorchTPU for 300 batches or more,
            never on the CPU; True; False; ``Compile(...)``); XLA compiles every batch's graph itself.
        predict_step: ``(model, batch) -> output`` replacing ``model(x)``.
        tta: Batch transforms whose outputs are averaged on the device (include
            ``lambda b: b`` to keep the plain prediction among them). Each gets
            the whole batch as the loader gives it (for ``(x, y)`` batches:
            ``lambda b: (b[0].flip(-1), *b[1:])``) and must keep the output's shape.
        progress: A progress bar counting batches (master only; no host syncs).

    Returns:
        A tensor (or the tuple or dict of tensors the model returns), first
        dimension ``len(dataset)``.

    Raises:
        ValueError: an output that is not batch-first (the message names its
            path in the output, its shape and the batch size); a sampler that
            does not draw every sample once; a tta transform that changes the
            output's shape.
        TypeError: an output that is not made of tensors; a tta that is not a
            list of callables; with tta, an integer or bool output (class ids), whose
            average would be fractions; a class given as the model.

    Example:
        >>> # was: model.eval(); torch.cat([model(x.cuda()).cpu() for x, _ in loader])
        >>> probs = predict(model, test_ds, cores="all").softmax(-1)   # doctest: +SKIP
        >>> pd.DataFrame({"id": ids, "label": probs.argmax(1)}).to_csv("submission.csv")  # doctest: +SKIP
        >>> logits = predict(llm, test_ds, cores="all", strategy="fsdp")   # doctest: +SKIP
    """
    if tta is not None and (isinstance(tta, (str, bytes)) or not all(callable(t) for t in tta)):
        raise TypeError(f"tta must be a list of batch transforms (callables), but given {tta!r}")
    spec = _every_sample_once(unpack_loader(data, batch_size, "data"))
    compiling = Compile.of(compile)
    chosen = _strategy(model, cores, strategy)  # it runs the work here, or in the processes holding the shards
    call = _Call(precision, compiling, predict_step, tta=tta, progress=progress)
    return chosen.infer(_predict, (model, spec, call), what="predict")


@dataclass(frozen=True)
class _Call:
    """``predict``'s or ``evaluate``'s checked settings, as the strategy hands them to the work (here, or launched)."""

    precision: str
    compiling: Compile
    step: Callable | None  # predict_step, or eval_step
    tta: Sequence[Callable] | None = None
    progress: bool = False
    table: dict[str, Any] | None = None  # evaluate's metrics
    loss_fn: Callable | None = None


def _predict(chosen: Strategy, model: nn.Module, spec: LoaderSpec, call: _Call) -> torch.Tensor:
    """``predict``'s work under ``chosen`` (this process's strategy, or a launched process's)."""
    runner = _runner(model, call.precision, spec, "predict", chosen, call.compiling)
    try:
        loader = runner.eval_loader(spec)
        runner.compile_for(len(loader))
        return runner.predict(loader, call.step or default_predict_step, call.tta, call.progress)
    finally:
        runner.restore_model()


def _every_sample_once(spec: LoaderSpec) -> LoaderSpec:
    """The spec without its sampler when that only orders the dataset; refused when it draws otherwise."""
    if spec.sampler is None:
        return spec
    drawn, n = list(spec.sampler), len(spec.dataset)
    if sorted(drawn) == list(range(n)):
        return dataclasses.replace(spec, sampler=None)  # rows come back in dataset order whatever the draw
    repeats = len(drawn) - len(set(drawn))
    how = f"{len(drawn)} indices with {repeats} repeated" if repeats else f"{len(drawn)} of the {n} samples"
    raise ValueError(
        f"predict returns row i = model(dataset[i]) for every sample, but data's sampler "
        f"{type(spec.sampler).__name__} draws {how}; give the samples to predict as "
        f"torch.utils.data.Subset(dataset, indices) (its row k is model(dataset[indices[k]]))"
    )


def evaluate(
    model: nn.Module,
    data: Any,
    *,
    metrics: Any = None,
    loss_fn: Callable | None = None,
    cores: int | str = 1,
    batch_size: int | None = None,
    precision: PrecisionName = "fp32",
    strategy: StrategyName | FSDP = "auto",
    compile: bool | Literal["auto"] | Compile = "auto",
    eval_step: Callable[[nn.Module, Any], Any] | None = None,
) -> dict[str, float]:
    """Exact loss and metrics over every sample (each counted once on any number of cores).

    The same figures ``one_cycle_fit`` reports per epoch for ``valid_data``. In a job
    of several processes every process must be given the same dataset, which is split
    over them (``ReplicaMismatch`` otherwise, before any batch).

    Args:
        model: The model (left on its device and in its mode afterwards).
        data: A Dataset or DataLoader of ``(*inputs, target)``.
        metrics: Names ("accuracy"), functions ``(output, target) -> values`` (per
            sample or a per-batch mean), torchmetrics ``Metric`` objects, or a dict
            naming them. Default "accuracy" with the default loss.
        loss_fn: Default ``nn.CrossEntropyLoss()`` over the class dimension (the last for ``(N, T, C)``
            scores against ``(N, T)`` targets); targets of -100 count in no figure.
        cores, batch_size, precision, strategy, compile: As for ``predict``.
        eval_step: ``(model, batch) -> (output, target)``.

    Returns:
        ``{"loss": ..., name: value, ...}``.

    Example:
        >>> # was: a loop summing correct predictions and dividing by len(dataset)
        >>> evaluate(model, valid_ds, cores="all")       # doctest: +SKIP
        {'loss': 0.1032, 'accuracy': 0.9722}
    """
    check_loss_fn(loss_fn)
    spec = unpack_loader(data, batch_size, "data")
    table = resolve_metrics(metrics, loss_fn is None)
    compiling = Compile.of(compile)
    chosen = _strategy(model, cores, strategy)  # it runs the work here, or in the processes holding the shards
    call = _Call(precision, compiling, eval_step, table=table, loss_fn=loss_fn)
    return chosen.infer(_evaluate, (model, spec, call), what="evaluate")


def _evaluate(chosen: Strategy, model: nn.Module, spec: LoaderSpec, call: _Call) -> dict[str, float]:
    """``evaluate``'s work under ``chosen`` (this process's strategy, or a launched process's)."""
    runner = _runner(model, call.precision, spec, "evaluate", chosen, call.compiling)
    table, loss_fn, eval_step = call.table, call.loss_fn, call.step
    try:
        metric_set = MetricSet(table, loss_fn or CrossEntropy(), runner.device)
        loader, step = runner.eval_loader(spec), eval_step or default_eval_step
        runner.compile_for(len(loader))
        if loss_fn is None and eval_step is None:  # on XLA an out-of-range label would not raise: check on the host
            causal = is_causal_lm(model)  # and a causal LM's scores and labels paired as its own loss pairs them
            labels = LabelCheck(causal=causal)
            loader, step = labels.loader(loader, masked=True, what="data"), EvalStep(labels, causal=causal)
        runner.check_eval(loader, metric_set, step)
        refuse_uncounted(loader)  # figures of 0/0: refused before the pass
        sums, computed = runner.eval_sums(loader, metric_set, step)
        sums = backend.current().processes.all_reduce([torch.stack(sums)], "sum")[0]
        sum_values, computed_values = backend.current().devices.to_cpu([sums, torch.stack(computed) if computed else sums[:0]])
        loss, values = metric_set.values(sum_values.tolist(), computed_values.tolist())
    finally:
        runner.restore_model()
    return {"loss": loss, **values}
