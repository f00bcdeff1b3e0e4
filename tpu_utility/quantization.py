"""A frozen base stored in int8 under LoRA adapters: QLoRA's memory saving on XLA.

On a GPU, QLoRA loads the base with bitsandbytes (``BitsAndBytesConfig(load_in_8bit=True)``);
bitsandbytes has no XLA kernels. Here the base's linear layers keep their weights as int8 with
one scale per output channel (symmetric, ``max |w| / 127`` per row), and each forward computes
``F.linear(x, w_int8.to(x.dtype)) * scale``: plain torch ops, one graph on XLA, no host read.
Only one layer's weight exists in the compute dtype at a time, as a temporary of its matmul (the
backward keeps the int8 weight and dequantizes it again, see ``_Int8Matmul``).
Norms, embeddings and the LM head stay in their dtype; peft's LoRA wraps the quantized layers as
it wraps any ``nn.Linear`` (``Int8Linear`` is one), so ``get_peft_model`` works unchanged.

Why not torchao: its int8 weight-only tensor (``Int8WeightOnlyConfig``), in the first release peft
0.21 accepts (torchao 0.16, built for torch 2.10), under peft's LoRA on torch_xla 2.9 read the host
once per training step (``aten::_local_scalar_dense``, measured on XLA:CPU) and skipped its C++
extensions on torch 2.9; a quantized layer of 40 lines has neither problem.

Example:
    >>> # was: AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    >>> model = load_quantized(path)                       # int8 base, read layer by layer  # doctest: +SKIP
    >>> model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"]))  # doctest: +SKIP
    >>> history = one_cycle_fit(model, train_ds, epochs=2, max_lr=2e-4)                  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

__all__ = ["Int8Linear", "dequantize_base", "load_quantized", "quantize_base"]

KEEP = ("lm_head",)  # the LM head stays in its dtype (its logits feed the loss directly)


CHUNK = 1 << 20  # elements quantized at a time: the float temporaries stay a few MB whatever the layer


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(int8 weight, scale per output row)`` with ``weight ~= q * scale[:, None]`` (symmetric, per row).

    Quantized a block of rows at a time from copies, so ``weight`` is only read: a tensor that safetensors
    maps from its file stays file-backed (writing into it would copy its pages into the process), and the
    float temporaries are ``CHUNK`` elements, not a second copy of the layer.
    """
    rows = weight.shape[0]
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, dtype=torch.float32, device=weight.device)
    step = max(1, CHUNK // max(1, weight[0].numel()))
    for i in range(0, rows, step):
        w = weight[i : i + step].detach().to(torch.float32, copy=True)
        s = torch.maximum(w.amax(dim=1), -w.amin(dim=1)).clamp_(min=1e-12).div_(127.0)
        q[i : i + step] = w.div_(s[:, None]).round_().clamp_(-127, 127)
        scale[i : i + step] = s
    return q, scale.to(weight.dtype)


class _Int8Matmul(torch.autograd.Function):
    """``x @ (q * scale).T`` saving the int8 weight for the backward, not its dequantized copy: autograd would
    otherwise keep every layer's ``q.to(x.dtype)`` from the forward to the backward, a full float base."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(q, scale)
        ctx.dtype = x.dtype
        return nn.functional.linear(x, q.to(x.dtype)) * scale.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        q, scale = ctx.saved_tensors
        return ((grad * scale.to(grad.dtype)) @ q.to(grad.dtype)).to(ctx.dtype), None, None


class Int8Linear(nn.Linear):
    """A frozen ``nn.Linear`` whose weight is int8 with one scale per output channel.

    ``weight`` is an int8 ``nn.Parameter`` that never trains (peft, ``state_dict`` and the memory plan see it
    as the layer's weight, at one byte an element); ``weight_scale`` a buffer in the layer's dtype.

    Example:
        >>> layer = Int8Linear.from_linear(nn.Linear(64, 32))
        >>> layer.weight.dtype, layer(torch.randn(2, 64)).shape
        (torch.int8, torch.Size([2, 32]))
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device: Any = None,
                 dtype: torch.dtype | None = None) -> None:  # fmt: skip
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8, device=device),
                                   requires_grad=False)  # fmt: skip
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=dtype, device=device))
        self.bias = None if not bias else nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device),
                                                        requires_grad=False)  # fmt: skip

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """The int8 copy of ``linear`` (on its device; a ``meta`` layer gives an empty one to load into)."""
        w = linear.weight
        layer = cls(linear.in_features, linear.out_features, linear.bias is not None, device=w.device, dtype=w.dtype)
        if w.device.type != "meta":
            q, scale = quantize_int8(w)
            layer.weight.data, layer.weight_scale = q, scale
            if linear.bias is not None:
                layer.bias.data = linear.bias.detach().clone()
        return layer

    def dequantized(self) -> torch.Tensor:
        """The weight in the scale's dtype, ``q * scale`` (what the merged export holds)."""
        return self.weight.to(self.weight_scale.dtype) * self.weight_scale[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Int8Matmul.apply(x, self.weight, self.weight_scale)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def reset_parameters(self) -> None:  # nn.Linear's initialisation does not apply to int8 weights
        pass

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _check_bits(bits: Any) -> None:
    if isinstance(bits, bool) or bits != 8:
        raise ValueError(f"bits must be 8 (int8 weights, a scale per output channel), but given {bits!r}")


def _targets(model: nn.Module, keep: Iterable[str]) -> list[tuple[str, nn.Linear]]:
    keep = tuple(keep)
    found = []
    for name, module in model.named_modules():
        if type(module) is nn.Linear and not any(name == k or name.endswith("." + k) for k in keep):
            found.append((name, module))
    return found


def quantize_base(model: nn.Module, bits: int = 8, *, keep: Iterable[str] = KEEP) -> nn.Module:
    """Stores ``model``'s linear layers as int8 (a scale per output channel), in place, frozen; returns it.

    Call it before ``peft.get_peft_model``: LoRA then trains in the model's dtype on a base a quarter
    (fp32) or half (bf16) its size. Embeddings, norms and the modules named in ``keep`` (the LM head)
    stay as they are. A model on the ``meta`` device gets empty int8 layers to load into
    (``load_quantized`` does that from a checkpoint).

    Args:
        model: A transformers decoder (or any module); its ``nn.Linear`` layers are replaced.
        bits: 8 (the one width built).
        keep: Names (or name suffixes) of linear layers left unquantized; default ``("lm_head",)``.

    Returns:
        The same model, its linear layers ``Int8Linear``.

    Raises:
        ValueError: ``bits`` other than 8, or a model with no linear layer to quantize.

    Example:
        >>> # was: from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
        >>> model = quantize_base(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))  # doctest: +SKIP
        >>> model = peft.get_peft_model(model, peft.LoraConfig(target_modules=["q_proj", "v_proj"]))  # doctest: +SKIP
    """
    _check_bits(bits)
    targets = _targets(model, keep)
    if not targets:
        raise ValueError(f"quantize_base found no nn.Linear to quantize in {type(model).__name__} "
                         f"(keep={tuple(keep)!r}); is it quantized already?")  # fmt: skip
    for name, linear in targets:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, Int8Linear.from_linear(linear))
    return model


def dequantize_base(model: nn.Module) -> nn.Module:
    """Replaces every ``Int8Linear`` in ``model`` by an ``nn.Linear`` of ``q * scale``, in place; returns it.

    What a merged export needs (peft merges adapters into float weights): ``export_pretrained(...,
    merge_lora=True)`` calls it on its CPU copy. The logits then equal the quantized model's up to rounding.

    Example:
        >>> model = dequantize_base(quantize_base(nn.Sequential(nn.Linear(4, 4))))
        >>> type(model[0]).__name__, model[0].weight.dtype
        ('Linear', torch.float32)
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear):
            linear = nn.Linear(module.in_features, module.out_features, module.bias is not None,
                               device=module.weight.device, dtype=module.weight_scale.dtype)  # fmt: skip
            linear.weight.data = module.dequantized()
            if module.bias is not None:
                linear.bias.data = module.bias.detach().clone()
            linear.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, linear)
    return model


def _shards(folder: str) -> list[str]:
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            return sorted({os.path.join(folder, name) for name in json.load(f)["weight_map"].values()})
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"load_quantized reads a Hugging Face folder of safetensors, but {folder!r} has neither "
                                f"model.safetensors nor model.safetensors.index.json")  # fmt: skip
    return [single]


def load_quantized(folder: str | os.PathLike[str], bits: int = 8, *, dtype: torch.dtype = torch.bfloat16,
                   keep: Iterable[str] = KEEP) -> nn.Module:  # fmt: skip
    """A causal LM read from a saved folder with its linear layers quantized one tensor at a time, on the host.

    The model is built on the ``meta`` device (no weights), its linear layers made ``Int8Linear``, then
    each tensor of each safetensors shard is read, quantized (or cast to ``dtype``) and placed: host RAM
    holds the quantized model plus one layer being quantized, never the bf16 model. For Llama 3 8B that
    is ~9.1 GB (7.0 GB of int8 linear weights, 1.05 GB of bf16 embedding and 1.05 GB LM head) plus its
    largest layer (117 MB in bf16), against 16 GB for ``from_pretrained`` in bf16.

    Args:
        folder: A folder ``save_pretrained`` wrote (``config.json`` and ``model.safetensors`` or shards).
        bits: 8 (the one width built).
        dtype: The dtype of what is not quantized (norms, embeddings, LM head, scales) and of the compute.
        keep: Linear layers left unquantized, as ``quantize_base`` takes them.

    Returns:
        The model on the CPU, in eval mode as ``from_pretrained`` leaves it, ready for ``peft.get_peft_model``.

    Raises:
        ValueError: ``bits`` other than 8; a model weight the checkpoint lacks, named.
        FileNotFoundError: a folder without safetensors weights.

    Example:
        >>> # was: AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_8bit=True))
        >>> model = load_quantized("/kaggle/input/llama-3/transformers/8b/1")   # doctest: +SKIP
    """
    from accelerate import init_empty_weights  # parameters on meta, buffers (rotary frequencies) real
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    _check_bits(bits)
    folder = os.fspath(folder)
    shards = _shards(folder)
    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    quantize_base(model, bits, keep=keep)
    params = dict(model.named_parameters(remove_duplicate=False))
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if key not in params:
                    continue  # a checkpoint's extra tensor (transformers ignores them too)
                module_name, _, leaf = key.rpartition(".")
                module = model.get_submodule(module_name)
                tensor = f.get_tensor(key)  # mapped from the file: read, never written
                if isinstance(module, Int8Linear) and leaf == "weight":
                    q, scale = quantize_int8(tensor.to(dtype))
                    module.weight = nn.Parameter(q, requires_grad=False)
                    module.weight_scale = scale
                else:
                    param = params[key]
                    setattr(module, leaf, nn.Parameter(tensor.to(dtype), requires_grad=param.requires_grad))
                del tensor
    model.tie_weights()
    missing = [name for name, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"load_quantized: {folder!r} holds no weight for {missing[:5]}"
                         f"{' and more' if len(missing) > 5 else ''}; is it the checkpoint of this model?")  # fmt: skip
    for module in model.modules():
        if isinstance(module, Int8Linear):
            module.weight.requires_grad_(False)
    return model.eval()
