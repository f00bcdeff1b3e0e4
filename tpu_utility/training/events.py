"""The events of one_cycle_fit's loop, and how callbacks hook into them.

A callback is any object with one or more of the methods below (subclassing
``Callback`` is optional). The loop calls them in a fixed order: by each
callback's ``order`` (default 0), then in the order given. Every replica calls
the same hooks with the same figures, so a decision taken from them (stopping
the run) is taken alike everywhere.

The events, in the order they fire:

* ``on_fit_start(loop)``: the model is on its device, the optimizer built; before
  a checkpoint is resumed (its callback state is loaded after this).
* ``on_train_epoch_start(loop, epoch)``: before the epoch's first batch (``epoch``
  counts from 0).
* ``on_before_step(loop)``: before every optimizer step, the gradients ready (the
  schedule sets the learning rate here). Under ``precision="fp16"`` they are still
  multiplied by the GradScaler's scale (the step unscales them).
* ``on_step_end(loop)``: after every optimizer step. The tensors a hook sees here
  live on the device: compute with them, never read them (``.item()``,
  ``float()``, ``print``). A read waits for the device every step, and
  ``EpochRecord.host_syncs`` shows it.
* ``on_train_epoch_end(loop)``: the epoch's training is done; evaluation and the
  checkpoint follow.
* ``on_epoch_end(loop, record)``: ``record`` is the epoch's ``EpochRecord``, its
  figures already all-reduced and read (Python floats). Call ``loop.stop(reason)``
  to end the run after this epoch; the epoch is saved first.
* ``on_fit_end(loop)``: after the last epoch, before ``restore_best`` loads the best weights.

To end the run at once, in the middle of an epoch, raise ``StopFit(reason)`` from
``on_fit_start`` or a hook within the epoch: the unfinished epoch is neither recorded
nor saved, and ``on_fit_end`` runs. Raised from ``on_epoch_end``, where the epoch is
whole, it acts as ``loop.stop(reason)``: the other callbacks see the epoch and it is saved.

A callback with ``state_dict()`` and ``load_state_dict(state)`` has its state saved
in ``last.pt`` and restored by ``resume=True``.

What a hook may use of ``loop`` is the ``Loop`` protocol below: ``model``, ``optimizer``,
``device``, ``master`` (True in the one process that writes files), ``epochs``, ``history``
and ``stop(reason)``; and, as the built-in callbacks do: ``step`` (optimizer steps done),
``total_steps``, ``start_epoch`` (after a resume), ``lr`` (the latest step's), ``loss`` (the
latest batch's, a device tensor), ``elapsed`` (seconds since the start, the same on every
replica), ``cores`` and ``last_path`` (``last.pt``, or None).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, Sequence

if TYPE_CHECKING:
    import torch

    from .history import EpochRecord, History

EVENTS = ("on_fit_start", "on_train_epoch_start", "on_before_step", "on_step_end", "on_train_epoch_end",
          "on_epoch_end", "on_fit_end")  # fmt: skip


class Loop(Protocol):
    """What a callback's hooks are handed as ``loop``: the run's objects and figures, the same on every replica.

    A type for your hooks' signatures (nothing to subclass): the loop that ``one_cycle_fit``,
    ``find_lr`` and the built-in callbacks run has these, and a hook may use only these.
    ``lr`` and ``model``'s weights are the hooks' to change (a learning rate written under
    a schedule is reported); the rest is read only.

    Attributes:
        model: The model being trained, on its device (the replica's module, not a DDP wrapper).
        optimizer: The optimizer ``one_cycle_fit`` built (``optimizer.param_groups`` for the lr).
        device: The device the model and batches are on.
        master: True in the one process that writes files (logs, checkpoints).
        cores: The number of cores (replicas, or SPMD devices) training together.
        epochs: The epochs asked for.
        start_epoch: The first epoch this run trains (after a resume, the one it resumed at).
        step: Optimizer steps done so far, over the whole run.
        total_steps: Optimizer steps of the whole run on each core (the schedule's length).
        lr: The learning rate of the latest step (the schedule writes it before each).
        loss: The latest batch's loss, a device tensor (compute with it; a read waits for
            the device), or None before the first step.
        elapsed: Seconds since the run started, the same figure on every replica.
        history: The ``History`` so far: ``records`` (one ``EpochRecord`` an epoch), ``best_epoch``.
        last_path: Where ``last.pt`` is written, or None without ``checkpoint_dir``.

    Example:
        >>> # was: `if step % 100 == 0: print(optimizer.param_groups[0]["lr"])` in a hand loop
        >>> class Every100(Callback):
        ...     def on_step_end(self, loop: Loop) -> None:
        ...         if loop.master and loop.step % 100 == 0:
        ...             print(f"step {loop.step}/{loop.total_steps}: lr {loop.lr:.2e}")
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    device: torch.device
    master: bool
    cores: int
    epochs: int
    start_epoch: int
    step: int
    total_steps: int
    lr: float
    loss: torch.Tensor | None
    elapsed: float
    history: History
    last_path: str | None

    def stop(self, reason: str) -> None:
        """Ends the run after this epoch (it is recorded and saved first), ``reason`` as the stop reason."""


class TrainerLoop(Loop, Protocol):
    """The loop as the built-in callbacks (``builtins.py``, ``agreement.py``) see it: ``Loop`` and the trainer's
    own parts they drive. Not for a user's callback: these change with the trainer. (Their hooks take it where
    ``Callback``'s take ``Loop``: narrower, on purpose, as only the trainer runs them.)"""

    runner: Any  # training.runner.Runner (a layer above)
    plan: Any  # training.trainer.FitPlan
    events: Events
    valid_loader: Any
    batches: int  # training batches per epoch on each core
    saved_epoch: int  # the epoch last.pt holds
    lr_ratios: list[float]  # each param group's share of max_lr
    first_bad_step: int | None  # the epoch's first step with a non-finite loss
    stop_request: str | None  # loop.stop's reason, once asked
    compile_seconds: float  # the epoch's, all-reduced


class StopFit(Exception):
    """Raised from a hook, ends the run at once with its message as the stop reason (fastai's CancelFitException).

    The epoch under way is neither recorded nor saved; ``on_fit_end`` still runs.
    From ``on_epoch_end`` (the epoch is whole) it acts as ``loop.stop(reason)``.
    ``find_lr``'s sweep ends this way when the loss diverges.

    Example:
        >>> # was: `break` out of the batch loop of a hand-written loop
        >>> class StopAfter(Callback):
        ...     def on_step_end(self, loop):
        ...         if loop.step == 100:
        ...             raise StopFit("100 steps are enough")
    """


class Callback:
    """A base class for callbacks: every event does nothing. Override the ones you need.

    Example:
        >>> # was: `if valid_acc > 0.99: break` inside a hand-written epoch loop
        >>> class StopAt(Callback):
        ...     def on_epoch_end(self, loop, record):
        ...         if record.metrics["accuracy"] > 0.99:
        ...             loop.stop("accuracy passed 0.99")
        >>> history = one_cycle_fit(model, train_ds, valid_data=valid_ds, epochs=20, max_lr=3e-3,  # doctest: +SKIP
        ...                         callbacks=[StopAt()])
    """

    order = 0

    def on_fit_start(self, loop: Loop) -> None:
        """The model is on its device and the optimizer built."""

    def on_train_epoch_start(self, loop: Loop, epoch: int) -> None:
        """Before the epoch's first batch (``epoch`` from 0)."""

    def on_before_step(self, loop: Loop) -> None:
        """Before an optimizer step, the gradients ready: device tensors only, never read them."""

    def on_step_end(self, loop: Loop) -> None:
        """After an optimizer step: device tensors only, never read them."""

    def on_train_epoch_end(self, loop: Loop) -> None:
        """After the epoch's training, before evaluation and the checkpoint."""

    def on_epoch_end(self, loop: Loop, record: EpochRecord) -> None:
        """The epoch's figures, read and all-reduced; ``loop.stop(reason)`` ends the run."""

    def on_fit_end(self, loop: Loop) -> None:
        """After the last epoch."""


def check_callbacks(callbacks: Any) -> list[Any]:
    """``callbacks`` as a list, each with at least one event method.

    Raises:
        TypeError: not a list or tuple, or an item with none of the events (named, with the events).
    """
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise TypeError(f"callbacks must be a list of callback objects, but given {callbacks!r}")
    for item in callbacks:
        if isinstance(item, type):
            raise TypeError(f"callbacks holds the class {item.__name__}, not an instance: write {item.__name__}(...)")
        if not any(callable(getattr(item, name, None)) for name in EVENTS):
            raise TypeError(f"callbacks holds {item!r}, which has none of the events {', '.join(EVENTS)}")
        order = getattr(item, "order", 0)
        if isinstance(order, bool) or not isinstance(order, (int, float)):
            raise TypeError(f"{type(item).__name__}.order must be a number, but is {order!r}")
    return list(callbacks)


class Events:
    """Calls the callbacks' hooks for an event, in a fixed order; saves and restores their state."""

    def __init__(self, callbacks: Sequence[Any]) -> None:
        self.callbacks = sorted(callbacks, key=lambda c: getattr(c, "order", 0))  # stable: ties keep the given order
        # each event's hooks, looked up once: two events fire every step, and Callback's own do nothing
        self.hooks = {event: [(c, getattr(c, event)) for c in self.callbacks if does(c, event)] for event in EVENTS}

    def fire(self, event: str, loop: Loop, *args: Any) -> None:
        if event != "on_epoch_end":
            for _, hook in self.hooks[event]:
                hook(loop, *args)
            return
        for callback, hook in self.hooks[event]:
            try:
                hook(loop, *args)
            except StopFit as stop:  # the epoch is whole: it ends the run as loop.stop does, every callback seeing it
                loop.stop(str(stop) or f"stopped by {type(callback).__name__}")

    def keys(self) -> list[str]:
        """The names their state is saved under: class names, numbered where a class repeats."""
        names = [type(c).__name__ for c in self.callbacks if _stateful(c)]
        return [name if names.count(name) == 1 else f"{name}#{names[:i].count(name) + 1}" for i, name in enumerate(names)]

    def state_dict(self) -> dict[str, Any]:
        return dict(zip(self.keys(), (c.state_dict() for c in self.callbacks if _stateful(c))))

    def load_state_dict(self, states: dict[str, Any], path: str) -> None:
        stateful = [c for c in self.callbacks if _stateful(c)]
        missing = [k for k in self.keys() if k not in states]
        if missing:
            raise ValueError(f"{path} holds no state for the callback(s) {missing}; resume with the callbacks it was "
                             f"written with ({sorted(states) or 'none with state'})")  # fmt: skip
        for key, callback in zip(self.keys(), stateful):
            callback.load_state_dict(states[key])


def does(callback: Any, event: str) -> bool:
    """Whether ``callback`` does something at ``event``: it has the hook, and not ``Callback``'s empty one."""
    hook = getattr(callback, event, None)
    return callable(hook) and getattr(hook, "__func__", None) is not getattr(Callback, event)


def _stateful(callback: Any) -> bool:
    return callable(getattr(callback, "state_dict", None)) and callable(getattr(callback, "load_state_dict", None))
