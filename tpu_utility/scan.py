"""A decoder's layers compiled once: a Hugging Face decoder's identical layers looped by the backend's scan.

Traced layer by layer, a 32-layer decoder is a graph 32 layers long, forward and backward, and
XLA compiles all of it before the first step. ``scan_layers(model)`` stores the layers' weights
stacked (one parameter of shape ``(layers, ...)`` for each of a layer's parameters) and runs
them through the backend's loop primitive (torch_xla's ``scan``): one layer is traced and
compiled, and looped over the stack. The optimizer updates the stacked parameters, so its graph
does not grow with depth either.

What stays as it was:

* **The model's keys.** ``state_dict()`` gives each layer's own keys (``model.layers.7.mlp.up_proj.weight``)
  and ``load_state_dict`` takes them: checkpoints load into the plain model and back.
* **The first ``period`` layers run as they are** (unrolled): their calls say what every layer is
  given (the masks of each attention kind, the rotary embeddings), and the groups that follow run
  ``period`` layers an iteration, so alternating layers (Gemma 2's sliding and full attention,
  Gemma 3's 5 + 1) scan as one group of each pattern. Layers left over after the last whole group
  run unrolled too.
* **A call scan cannot take** (a KV cache in ``generate``, attention weights asked for) runs every
  layer one after the other on its slice of the stacked weights: the same numbers.
* **``undo()``** writes the trained weights back into the layers' own parameters (the same objects)
  and puts the layers back: ``one_cycle_fit`` returns the plain model.

A model whose layers differ in structure, hold buffers (an int8 base's weights) or are too few is
left unrolled, and ``scan_plan(model).why`` says why.

Example:
    >>> # was: nothing; XLA compiled all 32 layers, forward and backward, before the first step
    >>> scanned = scan_layers(model)            # doctest: +SKIP
    >>> train(model); scanned.undo()            # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import backend

# the fewest layers one_cycle_fit scans by default ("auto"): below it the unrolled graph compiles about as fast and
# its step runs faster on XLA:CPU (bench/scan_bench.py, docs/benchmarks.md)
SCAN_MIN_LAYERS = 8
_CACHES = ("cache", "past_key_values", "past_key_value", "layer_past")


@dataclass(frozen=True)
class ScanPlan:
    """Whether and how a model's decoder layers can be scanned: the layer list, its period (the layers of one
    iteration: 1, or the length of the repeating pattern of attention kinds), or why not."""

    layers: nn.ModuleList | None
    period: int = 1
    why: str = ""

    @property
    def groups(self) -> int:
        """Iterations of the scan: the whole groups after the first ``period`` layers (run unrolled)."""
        return 0 if self.layers is None else (len(self.layers) - self.period) // self.period


def _signature(layer: nn.Module) -> tuple:
    """What must match between two layers for one to stand for the other: module types and parameter shapes."""
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters())
    return (tuple(type(m) for m in layer.modules()), params)


def _period(config: Any, count: int) -> int:
    """The repeating pattern's length of ``config.layer_types`` (Gemma 2: 2, Gemma 3: 6), 1 without one."""
    kinds = getattr(config, "layer_types", None)
    if not isinstance(kinds, (list, tuple)) or len(kinds) != count:
        return 1
    return next(p for p in range(1, count + 1) if all(kinds[i] == kinds[i - p] for i in range(p, count)))


def scan_plan(model: nn.Module) -> ScanPlan:
    """Which layer list of ``model`` scans, with what period; or why none does.

    Example:
        >>> scan_plan(llama).period, scan_plan(gemma2).period      # doctest: +SKIP
        (1, 2)
    """
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    config = getattr(inner, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count < 1:
        return ScanPlan(None, why="not a Hugging Face decoder (no config.num_hidden_layers)")
    layers = next((m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)
    if isinstance(layers, ScannedLayers):
        return ScanPlan(None, why="its layers are scanned already")
    if layers is None:
        return ScanPlan(None, why=f"no list of its {count} layers found")
    period = _period(config, count)
    if (count - period) // period < 2:
        return ScanPlan(None, period, why=f"{count} layers: too few to loop")
    for i in range(period, count):
        if _signature(layers[i]) != _signature(layers[i % period]):
            return ScanPlan(None, period, why=f"layer {i} differs in structure from layer {i % period}")
    held = _own_buffers(layers[period])
    if held:  # an int8 base's weights: per layer, where scan stacks parameters only
        return ScanPlan(None, period, why=f"its layers hold buffers ({', '.join(held[:3])}), which scan does not stack")
    return ScanPlan(layers, period)


def _own_buffers(layer: nn.Module) -> list[str]:
    """The layer's persistent buffers (its state: an int8 base's weights); non-persistent ones (GPT-2's causal
    mask in transformers 5.0) are made from the config, the same in every layer, and stay the template's."""
    return [f"{prefix}.{name}".lstrip(".") for prefix, module in layer.named_modules()
            for name in module._buffers if name not in module._non_persistent_buffers_set]


def scan_layers(model: nn.Module, layer_scan: Callable[..., Any] | None = None) -> ScannedLayers:
    """Stores ``model``'s decoder layers stacked and runs them through ``layer_scan`` (default: the backend's,
    torch_xla's ``scan``); returns the handle whose ``undo()`` puts the plain layers back.

    Args:
        model: A Hugging Face decoder (or a peft model of one) on its device.
        layer_scan: ``(fn, init, xs, checkpoint) -> (carry, ys)``; None: ``backend.current().compute.layer_scan()``.

    Raises:
        ValueError: the model cannot be scanned (the message says why), or the backend has no scan.

    Example:
        >>> # was: the loop over model.model.layers, traced layer by layer
        >>> scanned = scan_layers(model); print(scanned.note)      # doctest: +SKIP
        scan: 31 of 32 layers compiled once and looped
    """
    plan = scan_plan(model)
    if plan.layers is None:
        raise ValueError(f"scan_layers: {type(model).__name__} cannot be scanned: {plan.why}")
    if layer_scan is None:
        layer_scan, why = backend.current().compute.layer_scan()
        if layer_scan is None:
            raise ValueError(f"scan_layers: no scan here: {why}")
    return ScannedLayers(model, plan, layer_scan)


def _owner(model: nn.Module, target: nn.Module) -> tuple[nn.Module, str]:
    for module in model.modules():
        for name, child in module.named_children():
            if child is target:
                return module, name
    raise ValueError("the layer list is not a child of the model")


class _Proxy(nn.Module):
    """Stands in the layer list for a scanned layer; attributes not its own are the layer's (``attention_type``)."""

    def __init__(self, owner: ScannedLayers, index: int, layer: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "_owner", owner)  # not children: the stacked weights are the owner's
        object.__setattr__(self, "_layer", layer)
        self.index = index

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_layer"), name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._owner._call(self.index, args, kwargs)


class _Stack(nn.Module):
    """One position's parameters of every group, stacked: ``(groups, *shape)`` each, named with ``-`` for ``.``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.names = [name for name, _ in layers[0].named_parameters()]
        for name in self.names:
            found = [layer.get_parameter(name) for layer in layers]
            stacked = torch.stack([p.detach() for p in found])
            self.register_parameter(name.replace(".", "-"), nn.Parameter(stacked, requires_grad=found[0].requires_grad))

    def weights(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name.replace(".", "-")) for name in self.names}


@dataclass
class _Call:
    """How a layer was called: its arguments flattened, the hidden states' place, and the output's shape."""

    spec: Any
    leaves: list[Any]
    tuple_output: bool = False  # the layer returns (hidden_states,) (GPT-2 in transformers 5.0), not the tensor
    plain: bool = False  # its output is the hidden states alone (no attention weights asked for)


class ScannedLayers(nn.Module):
    """The layer list, scanned: ``len``, indexing and iteration give the layers' places (a stand-in for each
    scanned one), ``stacks`` holds their weights; see the module's docstring."""

    def __init__(self, model: nn.Module, plan: ScanPlan, layer_scan: Callable[..., Any]) -> None:
        super().__init__()
        layers, period, groups = plan.layers, plan.period, plan.groups
        assert layers is not None
        self.period, self.groups, self.count = period, groups, len(layers)
        self.scanned = range(period, period + groups * period)
        object.__setattr__(self, "_layers", layers)
        object.__setattr__(self, "_scan", layer_scan)
        self.stacks = nn.ModuleList([_Stack([layers[period + g * period + j] for g in range(groups)])
                                     for j in range(period)])  # fmt: skip
        self._templates = [layers[period + j] for j in range(period)]  # run on each group's weights
        self._checkpointing = [getattr(t, "gradient_checkpointing", None) for t in self._templates]
        self._entries: list[nn.Module] = []
        for i, layer in enumerate(layers):
            entry = _Proxy(self, i, layer) if i in self.scanned else layer
            self._entries.append(entry)
            self.add_module(str(i), entry)
        self._parked: dict[int, list[nn.Parameter]] = {}
        for i in self.scanned:  # the layers' own tensors freed (the stacks hold the weights); undo() gives them back
            self._parked[i] = list(layers[i].parameters())
            for p in self._parked[i]:
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for template in self._templates:  # a layer's own checkpointing cannot run inside the scan's trace
            if getattr(template, "gradient_checkpointing", None) is True:
                template.gradient_checkpointing = False
        self._calls: dict[int, _Call] = {}
        self._state: tuple[str, Any] = ("", None)
        self._bodies: dict[Any, Callable] = {}
        self._hooks = [layers[j].register_forward_pre_hook(self._record, with_kwargs=True) for j in range(period)]
        self._hooks += [layers[j].register_forward_hook(self._record_output) for j in range(period)]
        self._hooks.append(self.register_state_dict_post_hook(_own_keys))
        self._hooks.append(self.register_load_state_dict_pre_hook(_stacked_keys))
        inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        self._config = inner.config
        self._use_cache = getattr(self._config, "use_cache", None)
        if self._use_cache:  # a training or evaluation forward keeps no KV cache (transformers would, and discard it)
            self._config.use_cache = False
        owner, name = _owner(model, layers)
        object.__setattr__(self, "_place", (owner, name))
        setattr(owner, name, self)
        self.note = (f"scan: {groups * period} of {self.count} layers compiled once and looped"
                     + (f" ({period} a step)" if period > 1 else ""))  # fmt: skip

    # -- a list's face
    def __len__(self) -> int:
        return self.count

    def __iter__(self):
        return iter(self._entries)

    def __getitem__(self, index: Any) -> Any:
        return self._entries[index]

    # -- what a forward sees
    def _record(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        j = next(i for i in range(self.period) if self._layers[i] is layer)
        if j == 0:
            self._calls, self._state = {}, ("", None)
        leaves, spec = pytree.tree_flatten((args, kwargs))
        self._calls[j] = _Call(spec, leaves)

    def _record_output(self, layer: nn.Module, args: tuple, output: Any) -> None:
        j = next(i for i in range(self.period) if self._layers[i] is layer)
        if j in self._calls:
            self._calls[j].tuple_output = isinstance(output, tuple)
            self._calls[j].plain = isinstance(output, torch.Tensor) or (isinstance(output, tuple) and len(output) == 1)

    def _call(self, index: int, args: tuple, kwargs: dict) -> Any:
        j, g = (index - self.period) % self.period, (index - self.period) // self.period
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if index == self.scanned.start:
            self._state = ("scanned", None) if self._scannable(leaves, spec) else ("unrolled", None)
            if self._state[0] == "scanned":
                hidden = self._run_scan(args[0])
                return (hidden,) if self._calls[0].tuple_output else hidden
        if self._state[0] == "scanned":
            call = self._calls[j]
            same = spec == call.spec and all(a is b for a, b in zip(leaves[1:], call.leaves[1:]) if isinstance(a, torch.Tensor))
            if not same:
                raise RuntimeError(f"scanned layer {index} was called with other tensors than layer {j} "
                                   f"(its attention kind's masks); run this model with scan=False")  # fmt: skip
            return (args[0],) if call.tuple_output else args[0]
        weights = {name: w[g] for name, w in self.stacks[j].weights().items()}
        layer = self._layers[index]  # its own layer_idx: where a KV cache keeps its keys
        layer.train(self.training)
        return torch.func.functional_call(layer, weights, args, kwargs)

    def _scannable(self, leaves: list[Any], spec: Any) -> bool:
        """Whether this forward can run the scan: every leading layer recorded, called as this one is, no cache."""
        if len(self._calls) != self.period or not all(getattr(c, "plain", False) for c in self._calls.values()):
            return False
        first = self._calls[0]
        if spec != first.spec or not all(a is b for a, b in zip(leaves[1:], first.leaves[1:]) if isinstance(a, torch.Tensor)):
            return False
        for call in self._calls.values():
            for leaf in call.leaves[1:]:
                if isinstance(leaf, torch.Tensor) or leaf is None or isinstance(leaf, (bool, int, float, str)):
                    continue
                return False  # a cache object, or anything scan cannot carry
        _, kwargs = pytree.tree_unflatten(first.leaves, first.spec)
        return not any(kwargs.get(name) is not None for name in _CACHES) and not kwargs.get("output_attentions")

    def _run_scan(self, hidden: torch.Tensor) -> torch.Tensor:
        """The groups' layers looped: the carry holds the hidden states and every tensor the layers are given
        (masks as floats, positions as float32: a scan's carry must be floating), the stacked weights are scanned."""
        slots: dict[int, int] = {}
        extras: list[torch.Tensor] = []
        plans = []
        for j in range(self.period):
            plan = []
            for k, leaf in enumerate(self._calls[j].leaves):
                if k == 0:
                    plan.append(("hidden", None))
                elif isinstance(leaf, torch.Tensor):
                    if id(leaf) not in slots:
                        slots[id(leaf)] = len(extras)
                        extras.append(_as_float(leaf, hidden.dtype))
                    plan.append((_kind(leaf), (slots[id(leaf)], leaf.dtype)))
                else:
                    plan.append(("static", leaf))
            plans.append(plan)
        checkpoint = bool(getattr(self._layers[0], "gradient_checkpointing", False)) and self.training
        key = (self.training, checkpoint, tuple(str(self._calls[j].spec) for j in range(self.period)),
               tuple(tuple((kind, value if kind in ("static", "hidden") else value[1]) for kind, value in plan) for plan in plans))  # fmt: skip
        for template in self._templates:  # not in the model's tree: train() and eval() reach them here
            template.train(self.training)
        body = self._bodies.get(key)
        if body is None:  # one function per kind of call: scan caches its trace per function object
            body = self._bodies[key] = self._body(plans)
        xs = tuple(stack.weights() for stack in self.stacks)
        carry, _ = self._scan(body, (hidden, *extras), xs, checkpoint)
        return carry[0]

    def _body(self, plans: list[list[tuple[str, Any]]]) -> Callable:
        templates, specs = self._templates, [self._calls[j].spec for j in range(self.period)]

        def body(carry: tuple, xs: tuple) -> tuple:
            hidden, extras = carry[0], carry[1:]
            for j, plan in enumerate(plans):
                leaves = [hidden if kind == "hidden" else value if kind == "static" else
                          _from_float(extras[value[0]], kind, value[1]) for kind, value in plan]  # fmt: skip
                args, kwargs = pytree.tree_unflatten(leaves, specs[j])
                out = torch.func.functional_call(templates[j], xs[j], args, kwargs)
                hidden = out[0] if isinstance(out, tuple) else out
            return (hidden, *extras), None

        return body

    # -- back to the plain model
    def undo(self) -> None:
        """The trained weights written into the layers' own parameters, the plain layer list back in its place."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for i in self.scanned:
            j, g = (i - self.period) % self.period, (i - self.period) // self.period
            weights = self.stacks[j].weights()
            for param, name in zip(self._parked[i], self.stacks[j].names):
                param.data = weights[name].detach()[g].clone()
        for template, flag in zip(self._templates, self._checkpointing):
            if flag is not None:
                template.gradient_checkpointing = flag
        if self._use_cache:
            self._config.use_cache = self._use_cache
        owner, name = self._place
        setattr(owner, name, self._layers)
        self._parked = {}


def _kind(tensor: torch.Tensor) -> str:
    return "float" if tensor.is_floating_point() else "bool" if tensor.dtype == torch.bool else "int"


def _as_float(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if tensor.is_floating_point():
        return tensor
    return tensor.to(dtype if tensor.dtype == torch.bool else torch.float32)  # positions: exact below 2**24


def _from_float(value: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    if kind == "float":
        return value
    return value != 0 if kind == "bool" else value.to(dtype)


def _own_keys(module: ScannedLayers, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``state_dict`` hook: the stacked weights given back as each layer's own keys. On a lazy device (XLA) the
    stacked tensors come to the host in one transfer and are cut there: a checkpoint compiles no graph of slices."""
    keys = [(j, name, f"{prefix}stacks.{j}.{name.replace('.', '-')}") for j, stack in enumerate(module.stacks)
            for name in stack.names]  # fmt: skip
    stacked = [state.pop(key) for _, _, key in keys]
    devices = backend.current().devices
    if stacked and not isinstance(stacked[0], nn.Parameter) and devices.is_lazy(stacked[0].device):  # not keep_vars
        stacked = devices.state_to_cpu(stacked)
    for (j, name, _), tensor in zip(keys, stacked):
        for g in range(module.groups):
            state[f"{prefix}{module.period + g * module.period + j}.{name}"] = tensor[g]


def _stacked_keys(module: ScannedLayers, state: dict[str, Any], prefix: str, *rest: Any) -> None:
    """``load_state_dict`` pre-hook: each layer's own keys stacked into the scanned weights' keys."""
    for j, stack in enumerate(module.stacks):
        for name in stack.names:
            keys = [f"{prefix}{module.period + g * module.period + j}.{name}" for g in range(module.groups)]
            if all(key in state for key in keys):
                state[f"{prefix}stacks.{j}.{name.replace('.', '-')}"] = torch.stack([state.pop(key) for key in keys])


def scan_for_run(model: nn.Module, setting: bool | str) -> tuple[ScannedLayers | None, str]:
    """A run's decoder layers scanned where ``setting`` (``Compile.scan``: True, False or "auto") and the model allow,
    on a backend with a scan; returns the handle (None: unrolled) and the summary line's words ("": nothing to say,
    not a decoder).

    "auto" scans a decoder of ``SCAN_MIN_LAYERS`` layers or more; True scans any decoder that can be (one that
    cannot is refused, naming why); False leaves the layers as they are.

    Raises:
        ValueError: ``setting`` is True and the model cannot be scanned.
    """
    plan = scan_plan(model)
    decoder = plan.layers is not None or not plan.why.startswith("not a Hugging Face decoder")
    if not decoder or setting is False:
        return None, "layers unrolled (scan=False)" if decoder and setting is False else ""
    layer_scan, why = backend.current().compute.layer_scan()
    if layer_scan is None:
        return None, f"layers unrolled ({why})" if setting is True or plan.layers is not None else ""
    if plan.layers is None:
        if setting is True:
            raise ValueError(f"scan=True, but {type(model).__name__} cannot be scanned: {plan.why}; give scan='auto' "
                             f"or False to run its layers unrolled")  # fmt: skip
        return None, f"layers unrolled ({plan.why})"
    if setting == "auto" and len(plan.layers) < SCAN_MIN_LAYERS:
        return None, (f"layers unrolled ({len(plan.layers)} layers: scan pays from {SCAN_MIN_LAYERS}; "
                      f"scan=True scans them)")  # fmt: skip
    scanned = ScannedLayers(model, plan, layer_scan)
    return scanned, scanned.note + ("" if setting is True else " (scan='auto'; scan=False unrolls them)")
