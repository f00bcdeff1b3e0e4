"""Which graphs a run compiled on XLA: each one's compile seconds, size and cause, kept in ``History.graphs``.

torch_xla cuts the graph of batch ``i`` when the loader fetches batch ``i + 1`` (and after the last batch, when
the loader ends), so a compile seen after a step's trace belongs to the step before it: ``GraphLog`` keeps the
previous batch's shapes to name it. The seconds and sizes are torch_xla's own (``diagnosis.last_compiles``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from .. import backend


@dataclass
class CompiledGraph:
    """One graph compiled during a run, as ``History.graphs`` lists them.

    ``graph`` is what it computes: "train step", "eval step", "epoch figures" (the epoch's one read of its
    sums) or "setup" (before the first step: the model's and optimizer's tensors placed). ``shapes`` are the
    shapes of the batch's tensors (a new set of shapes is a new graph: a bucket, a short last batch);
    ``seconds`` the compile's own time and ``nodes`` the graph's size in IR nodes, both as torch_xla measured
    them (None where it kept no sample); ``cause`` why it compiled.

    Example:
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=2, max_lr=1e-3)  # doctest: +SKIP
        >>> for graph in history.graphs:                                                        # doctest: +SKIP
        ...     print(graph)
        epoch 1 train step [(32, 128), (32,)]: 3.2s, 1,840 IR nodes (the first train step)
    """

    epoch: int
    graph: str
    shapes: list[tuple[int, ...]]
    seconds: float | None
    nodes: int | None
    cause: str

    def __str__(self) -> str:
        took = f"{self.seconds:.2f}s" if self.seconds is not None else "time not measured"
        size = f", {self.nodes:,} IR nodes" if self.nodes is not None else ""
        return f"epoch {self.epoch} {self.graph} {self.shapes}: {took}{size} ({self.cause})"


def batch_shapes(batch: Any) -> list[tuple[int, ...]]:
    """The shapes of a batch's tensors, in its order (a dict's values, a tuple's items)."""
    return [tuple(t.shape) for t in pytree.tree_leaves(batch) if isinstance(t, torch.Tensor)]


def _cause(graph: str, shapes: list[tuple[int, ...]], before: list[CompiledGraph]) -> str:
    same = [g for g in before if g.graph == graph]
    if graph == "setup":
        return "before the first step: the model's and optimizer's tensors placed on the device"
    if graph.startswith("after the "):
        return f"what the {graph[len('after the '):]} pass left pending (its sums), cut by the next pass's first batch"
    if not same:
        return f"the first {graph}"
    if all(g.shapes != shapes for g in same):
        known = sorted({str(g.shapes) for g in same})
        return (f"new input shapes: {graph} compiled before for {', '.join(known)} (another length bucket, or a "
                f"short last batch; drop_last or BucketCollate keep the set of shapes small)")  # fmt: skip
    if graph == "train step" and len(same) == 1 and same[0].epoch == before[-1].epoch:
        return ("the same input shapes as the first train step, whose graph also created the optimizer's state: "
                "expected once, in the first epoch")
    return (f"the same input shapes as an earlier {graph}, so the traced graph itself changed: a Python value "
            f"baked into it (a float or int that changes, a slice offset) or another code path; doctor() names it")


class GraphLog:
    """Records the graphs compiled while the loop runs, into ``graphs`` (``History.graphs``).

    Call ``begin(graph, epoch)`` before a pass, ``step(batch)`` after each batch's trace, ``end()`` after
    the pass. Each call reads one counter (the compile count); the compile times are read only when it rose.

    Example:
        >>> log = GraphLog([])                                   # doctest: +SKIP
        >>> log.begin("train step", epoch=1)                     # doctest: +SKIP
        >>> for batch in loader: step(batch); log.step(batch)    # doctest: +SKIP
        >>> log.end()                                            # doctest: +SKIP
    """

    def __init__(self, graphs: list[CompiledGraph], count: Callable[[], int] | None = None) -> None:
        self.graphs = graphs
        self.diagnosis = backend.current().diagnosis
        self.count = count or self.diagnosis.compile_count
        self.seen = self.count()
        self.graph, self.epoch, self.previous = "setup", 0, []
        self.last = "setup"  # the pass before this one

    def begin(self, graph: str, epoch: int) -> None:
        self.end()
        self.last = self.graph
        self.graph, self.epoch, self.previous = graph, epoch, None

    def step(self, batch: Any) -> None:
        """After a batch's trace: a compile seen now is the previous batch's graph (the first batch's fetch cut
        what came before the pass: the setup, in the run's first pass)."""
        if self.previous is None:
            self._take([], "setup" if all(g.graph == "setup" for g in self.graphs) else f"after the {self.last}")
        else:
            self._take(self.previous, self.graph)
        self.previous = batch  # its shapes are read only if its graph compiled: no work per step on the hot path

    def end(self) -> None:
        self._take(self.previous if self.previous is not None else [], self.graph)

    def _take(self, batch: Any, graph: str) -> None:
        now = self.count()
        new, self.seen = now - self.seen, now
        if new <= 0:
            return
        shapes = batch_shapes(batch)
        timed = self.diagnosis.last_compiles(new)
        timed = [None] * (new - len(timed)) + list(timed)
        for compiled in timed:
            self.graphs.append(CompiledGraph(
                self.epoch, graph, shapes, compiled.seconds if compiled else None,
                compiled.nodes if compiled else None, _cause(graph, shapes, self.graphs)))  # fmt: skip
