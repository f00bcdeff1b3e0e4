"""Compiling the step: ``torch.compile`` on the native backend (CUDA GPUs, TorchTPU, the CPU), XLA's own compiler
under torch_xla.

On torch_xla every step is already one compiled graph. Elsewhere a step runs op by op unless it is compiled,
and on a GPU a compiled step is about twice as fast. A hand loop keeps its compile line::

    model = compile_model(model)          # was: model = torch.compile(model)

and ``one_cycle_fit``, ``find_lr``, ``evaluate`` and ``predict`` take ``compile=``: ``"auto"`` (the default:
compiled on an accelerator for a run long enough to pay for the compile, eager on the CPU), ``True``, ``False``,
or ``Compile(mode="max-autotune", ...)`` with torch.compile's options. The model itself is never changed: the run
calls a compiled wrapper of it, so its class, its state-dict keys and its checkpoints stay its own. A model the
user compiled already (``torch.compile(model)`` or ``model.compile()``) is trained as it is, not compiled twice.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, NamedTuple

from torch import nn

from . import backend as backends

CompileSetting = Literal["auto"]
# torch.compile's modes (torch/_inductor/list_mode_options)
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class Compile:
    """A run's ``compile=``: whether its step is compiled (``enabled``: True, False or "auto") and
    ``torch.compile``'s options for it.

    Args:
        enabled: True compiles, False runs eagerly, "auto" compiles on an accelerator for a run of enough steps
            (the backend decides: ``compute.compile_pays``) and never on the CPU.
        mode: torch.compile's ``mode`` ("default", "reduce-overhead", "max-autotune", ...); None: its default.
        fullgraph: torch.compile's ``fullgraph``: a graph break is an error instead of a split graph.
        dynamic: torch.compile's ``dynamic``: None lets it mark a dimension dynamic after it changed once;
            TorchTPU compiles static shapes (False) unless this says otherwise.
        backend: torch.compile's ``backend``; None: the device's (inductor; "tpu" under TorchTPU).
        scan: Whether a Hugging Face decoder's layers are compiled once and looped (``scan.scan_layers``: torch_xla's
            scan): "auto" for a decoder of 8 layers or more, True for any that can be, False never.

    Raises:
        ValueError, TypeError: a value outside those, named with what is allowed.

    Example:
        >>> # was: model = torch.compile(model, mode="max-autotune"); train(model)
        >>> Compile(mode="max-autotune").options
        {'mode': 'max-autotune'}
        >>> Compile.of("auto").enabled, Compile.of(False).enabled
        ('auto', False)
    """

    enabled: bool | CompileSetting = True
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    backend: str | None = None
    scan: bool | CompileSetting = "auto"

    def __post_init__(self) -> None:
        if not (isinstance(self.scan, bool) or self.scan == "auto"):
            raise ValueError(f"scan must be True, False or 'auto', but given {self.scan!r}")
        if not (isinstance(self.enabled, bool) or self.enabled == "auto"):
            raise ValueError(f"Compile(enabled=...) must be True, False or 'auto', but given {self.enabled!r}")
        if self.mode is not None and self.mode not in MODES:
            raise ValueError(f"Compile(mode=...) must be None or one of {MODES}, but given {self.mode!r}")
        if not isinstance(self.fullgraph, bool):
            raise TypeError(f"Compile(fullgraph=...) must be True or False, but given {self.fullgraph!r}")
        if self.dynamic is not None and not isinstance(self.dynamic, bool):
            raise TypeError(f"Compile(dynamic=...) must be None, True or False, but given {self.dynamic!r}")
        if self.backend is not None and not (isinstance(self.backend, str) and self.backend):
            raise TypeError(f"Compile(backend=...) must be None or a torch.compile backend's name such as "
                            f"'inductor' or 'aot_eager', but given {self.backend!r}")  # fmt: skip

    @classmethod
    def of(cls, value: Any) -> Compile:
        """``compile=`` as given (True, False, "auto" or a ``Compile``) as a Compile, checked once at the boundary.

        Raises:
            TypeError: any other value, named with the allowed ones.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
            return cls(enabled=value)
        raise TypeError(f"compile must be True, False, 'auto' or Compile(mode=..., fullgraph=..., dynamic=...), "
                        f"but given {value!r}")  # fmt: skip

    @property
    def options(self) -> dict[str, Any]:
        """torch.compile's keyword arguments that differ from its defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("enabled", "scan") and getattr(self, f.name) != f.default}  # fmt: skip

    def settled(self, steps: int) -> Compile:
        """This setting with ``"auto"`` settled, True or False, for a run of ``steps`` steps: the one place that asks
        whether compiling pays (``compute.compile_pays``). ``decide`` settles it so; a caller that knows its run's
        length better than the loop that decides settles it first (``find_lr``: its sweep stops after ``num_steps``).

        Example:
            >>> Compile.of(True).settled(10).enabled, Compile.of("auto").settled(10).enabled  # the CPU: never
            (True, False)
        """
        if self.enabled != "auto":
            return self
        return replace(self, enabled=backends.current().compute.compile_pays(steps))

    def decide(self, steps: int) -> CompileDecision:
        """Whether this process's run of ``steps`` steps compiles its step with torch.compile, and the words the
        summary line says for it ("" where there is nothing to say: XLA compiles every step itself).

        Example:
            >>> Compile.of(False).decide(1000)
            CompileDecision(on=False, words='eager (compile=False)')
        """
        compute = backends.current().compute
        own = compute.graph_compiler()
        if own is not None:
            return CompileDecision(False, "" if self.enabled == "auto" else f"compile={self.enabled!r}: {own} compiles "
                             f"every step's graph itself, whatever is asked")  # fmt: skip
        if self.enabled is False:
            return CompileDecision(False, "eager (compile=False)")
        name = self.backend or compute.compile_backend
        options = ", ".join(f"{k}={v!r}" for k, v in self.options.items() if k != "backend")
        compiled = f"compiled (torch.compile, {name}{', ' + options if options else ''}"
        if self.enabled is True:
            return CompileDecision(True, compiled + ")")
        device = backends.current().device_type
        if self.settled(steps).enabled:
            return CompileDecision(True, f"{compiled}; compile='auto': {steps} steps on {device}, compile=False runs eagerly)")
        why = "the CPU" if device == "cpu" else f"{steps} steps, too few to pay for compiling"
        return CompileDecision(False, f"eager (compile='auto': {why}; compile=True compiles)")


EAGER = Compile(enabled=False)


class CompileDecision(NamedTuple):
    """What ``Compile.decide`` chose: ``on`` (torch.compile the step) and the summary line's ``words``."""

    on: bool
    words: str


def compiled_parts(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """(the module itself, the user's compiled form of it or None).

    ``torch.compile(model)`` returns a wrapper whose state-dict keys carry ``_orig_mod.``: the module inside is
    the one whose weights are saved and returned; ``model.compile()`` compiles the module in place.

    Example:
        >>> net = nn.Linear(2, 2)
        >>> compiled_parts(net) == (net, None)
        True
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # a model compiled by torch.compile imported it
    if eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        return model._orig_mod, model
    if getattr(model, "_compiled_call_impl", None) is not None:
        return model, model
    return model, None


def compile_model(model: nn.Module, *, mode: str | None = None, fullgraph: bool = False, dynamic: bool | None = None,
                  backend: str | None = None) -> nn.Module:  # fmt: skip
    """The model compiled for this device: ``torch.compile`` on the native backend (inductor on CUDA and the CPU,
    TorchTPU's ``tpu`` backend with static shapes), the model itself under torch_xla, which compiles every step's
    graph on its own (inductor does not target XLA). A model compiled already is returned as it is.

    Args:
        model: The module (on its device, or not yet moved: torch.compile compiles at the first call).
        mode, fullgraph, dynamic, backend: torch.compile's options, as ``Compile`` checks them.

    Returns:
        A module to call in place of ``model``; its parameters are the model's own, and ``model`` is unchanged
        (save ``model.state_dict()``: its keys have no ``_orig_mod.``).

    Raises:
        ValueError, TypeError: an option outside torch.compile's, named.

    Example:
        >>> # was: model = torch.compile(model)
        >>> model = compile_model(model)   # doctest: +SKIP
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"compile_model takes an nn.Module, but given {type(model).__name__}")
    options = Compile(mode=mode, fullgraph=fullgraph, dynamic=dynamic, backend=backend).options
    _, own = compiled_parts(model)
    if own is not None:
        return own
    return backends.current().compute.torch_compile(model, options)


__all__ = ["Compile", "CompileDecision", "EAGER", "compile_model", "compiled_parts", "MODES"]
