"""generate(): a causal LM's new tokens for every prompt, in dataset order, with static shapes.

Hugging Face's ``model.generate()`` is not made for XLA: its cache grows a token at a
time and its stop check does not cut the graph, so every call compiles anew and, with an
EOS token, each step runs a graph holding every earlier step. ``generate`` runs the same
greedy (or sampled) decoding with shapes fixed in advance:

- prompts are left-padded to a few length buckets (chosen from the data as
  ``choose_buckets`` does, or given);
- one KV-cache length for every bucket: the longest bucket + ``max_new_tokens``
  (transformers' ``StaticCache``), and one attention mask of that length per batch,
  zero on the left padding;
- one prefill graph per bucket and one decode graph; the next token and the stop flags
  stay on the device and are read every ``read_every`` steps (one transfer), which is
  also when a batch whose rows have all stopped ends.

A second pass, or new prompts in the same buckets, compiles nothing.

Example:
    >>> # was: [model.generate(**tok(p, return_tensors="pt").to("cuda"), max_new_tokens=32) for p in prompts]
    >>> new = generate(model, [tok(p)["input_ids"] for p in prompts], max_new_tokens=32)   # doctest: +SKIP
    >>> answers = tok.batch_decode(new, skip_special_tokens=True)                           # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader

from .. import backend
from ..compiler import Compile
from . import agreement
from ..data.buckets import _check_buckets, choose_buckets, group_batches
from ..huggingface import base_model, is_transformers_model
from ..progress import progress_bar
from .runner import Runner
from .strategies import choose

_MASK32 = 0xFFFFFFFF
MEMORY_HEADROOM = 0.9  # of a device's memory left over by the weights, the share a KV cache may take


# ------------------------------------------------------------------ prompts
def _prompt(sample: Any, i: int) -> list[int]:
    """One prompt's token ids: a tensor or list of ints, or a dict with ``input_ids`` (its
    ``attention_mask``, when there, drops a tokenizer's padding)."""
    mask = None
    if isinstance(sample, Mapping):
        if "input_ids" not in sample:
            raise TypeError(f"prompt {i} is a dict without 'input_ids' (it has {sorted(sample)}); give token ids")
        sample, mask = sample["input_ids"], sample.get("attention_mask")
    ids = sample.tolist() if isinstance(sample, torch.Tensor) and not sample.is_floating_point() else sample
    if isinstance(ids, (list, tuple)) and len(ids) == 1 and isinstance(ids[0], (list, tuple)):
        ids = ids[0]  # a tokenizer's batch of one: [[...]]
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        kind = f"a {sample.dtype} tensor of shape {tuple(sample.shape)}" if isinstance(sample, torch.Tensor) else repr(sample)[:80]
        raise TypeError(f"prompt {i} must be token ids (a 1-D integer tensor, a list of ints, or a dict with "
                        f"'input_ids'), but is {kind}")  # fmt: skip
    if mask is not None:
        keep = mask.flatten().tolist() if isinstance(mask, torch.Tensor) else list(mask)
        keep = keep[0] if len(keep) == 1 and isinstance(keep[0], (list, tuple)) else keep
        ids = [t for t, m in zip(ids, keep) if m]
    if not ids:
        raise ValueError(f"prompt {i} has no tokens; every prompt needs at least one (a BOS token will do)")
    return list(ids)


def prompt_ids(data: Any) -> list[list[int]]:
    """Every prompt of ``data`` (a Dataset, a DataLoader's dataset, a list) as a list of token ids."""
    if isinstance(data, DataLoader):
        data = data.dataset
    if isinstance(data, (str, bytes, torch.Tensor)) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise TypeError(f"data must be a Dataset or list of prompts (token ids), but given {type(data).__name__}"
                        + (": a 2-D tensor of prompts? give list(tensor)" if isinstance(data, torch.Tensor) else ""))  # fmt: skip
    if len(data) == 0:
        raise ValueError("data holds no prompts")
    return [_prompt(data[i], i) for i in range(len(data))]


def vocabulary(model: nn.Module) -> int:
    """The token ids a model reads: its input embedding's rows (``config.vocab_size`` where it has none)."""
    embedding = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    rows = getattr(embedding, "num_embeddings", None)
    return rows if isinstance(rows, int) else model.config.vocab_size


def check_token_ids(prompts: list[list[int]], vocab: int) -> None:
    """Refuses, on the host before any prefill, a token id outside ``[0, vocab)``: on XLA the embedding
    lookup would read another row and generate garbage without a word (the CPU raises IndexError).

    Example:
        >>> check_token_ids([[5, 6], [5, 99, 7]], vocab=64)
        Traceback (most recent call last):
        ...
        ValueError: prompt 1 holds token id 99 at position 1, outside the model's vocabulary [0, 64); tokenize with the model's own tokenizer (after adding tokens: model.resize_token_embeddings(len(tokenizer)))
    """
    for i, ids in enumerate(prompts):
        if min(ids) >= 0 and max(ids) < vocab:
            continue
        k, bad = next((k, t) for k, t in enumerate(ids) if not 0 <= t < vocab)
        raise ValueError(f"prompt {i} holds token id {bad} at position {k}, outside the model's vocabulary [0, {vocab}); "
                         f"tokenize with the model's own tokenizer (after adding tokens: "
                         f"model.resize_token_embeddings(len(tokenizer)))")  # fmt: skip


# --------------------------------------------------------------------- plan
@dataclass(frozen=True)
class GenerationPlan:
    """The fixed shapes of a generation: prompt buckets, the cache length, rows per batch, and which prompts go where."""

    buckets: list[int]
    cache_length: int
    rows: int
    batches: list[list[int]]

    @classmethod
    def of(cls, lengths: list[int], buckets: Sequence[int] | None, rows: int, max_new_tokens: int) -> GenerationPlan:
        if buckets is None:
            buckets = choose_buckets(lengths, num_buckets=4, multiple_of=8)
        else:
            buckets = _check_buckets(buckets)
            if max(lengths) > buckets[-1]:
                raise ValueError(f"prompt {lengths.index(max(lengths))} has {max(lengths)} tokens, more than the largest "
                                 f"bucket {buckets[-1]} (buckets={buckets}); add a bucket of at least {max(lengths)}")  # fmt: skip
        batches = group_batches(lengths, buckets, rows, drop_last=False)
        return cls(list(buckets), buckets[-1] + max_new_tokens, rows, batches)

    def bucket(self, lengths: list[int], batch: list[int]) -> int:
        """The length a batch's prompts are left-padded to: the smallest bucket holding its longest."""
        longest = max(lengths[i] for i in batch)
        return next(b for b in self.buckets if b >= longest)

    def host_batch(self, prompts: list[list[int]], batch: list[int]) -> dict[str, torch.Tensor]:
        """A batch's tensors, left-padded: ids ``(rows, bucket)``; a mask over the whole cache ``(rows,
        cache_length)``, 0 on the padding; positions counting real tokens only; the dataset index (-1: a filler row)."""
        bucket = self.bucket([len(p) for p in prompts], batch)
        ids = torch.zeros(self.rows, bucket, dtype=torch.long)
        mask = torch.ones(self.rows, self.cache_length, dtype=torch.long)
        index = torch.full((self.rows,), -1, dtype=torch.long)
        mask[:, :bucket] = 0
        mask[:, bucket - 1] = 1  # a filler row holds one token, so that no row attends to nothing
        for row, i in enumerate(batch):
            ids[row, bucket - len(prompts[i]) :] = torch.tensor(prompts[i])
            mask[row, bucket - len(prompts[i]) : bucket] = 1
            index[row] = i
        positions = (mask[:, :bucket].cumsum(1) - 1).clamp(min=0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "index": index}


def kv_cache_bytes(config: Any, rows: int, length: int, dtype: torch.dtype) -> int:
    """Bytes of generate's KV cache: keys and values of every layer, ``rows`` × ``length`` positions
    (a sliding-window layer's too: generate keeps the whole length in each layer).

    Example:
        >>> from types import SimpleNamespace as C
        >>> kv_cache_bytes(C(num_hidden_layers=2, num_attention_heads=4, hidden_size=32), 8, 64, torch.float32)
        131072
    """
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * rows * heads * length * head_dim * dtype.itemsize


def check_memory(model: nn.Module, rows: int, length: int, device: torch.device) -> None:
    """Refuses, before anything compiles, a KV cache of ``rows`` rows per device that the device cannot hold
    beside the weights, naming the batch size that fits."""
    memory = backend.current().devices.device_memory(device)
    if memory is None:  # the CPU: no figure to compare with
        return
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    per_row = kv_cache_bytes(model.config, 1, length, dtype)
    room = MEMORY_HEADROOM * (memory - weights)
    if per_row * rows <= room:
        return
    gib = lambda n: f"{n / 2**30:.3g} GiB"  # noqa: E731
    fits = int(room // per_row) if room > 0 else 0
    fix = f"batch_size={fits} fits" if fits else "no batch fits; give fewer max_new_tokens or shorter prompts"
    raise ValueError(
        f"batch_size={rows} needs a KV cache of {gib(per_row * rows)} per device ({rows} rows x {length} positions, "
        f"{dtype}), but a device has {gib(memory)}, {gib(weights)} of it the weights, so {gib(room)} for the cache "
        f"({MEMORY_HEADROOM:.0%} of the rest): {fix}. {backend.MEMORY_ENV} sets a device's memory"
    )


# ------------------------------------------------------------------- models
def causal_lm(model: Any) -> nn.Module:
    """The transformers causal LM that ``generate`` runs (a peft model's base, its adapters in it), checked
    to run with a static KV cache; refused by name otherwise."""
    if isinstance(model, type):
        raise TypeError(f"model is the class {model.__qualname__}, not a model; give an instance with its weights")
    inner = base_model(model)
    if not is_transformers_model(inner):
        raise TypeError(f"generate runs a transformers causal language model (AutoModelForCausalLM, or a peft model "
                        f"of one), but given {type(model).__name__}; call predict for other models")  # fmt: skip
    name = type(inner).__name__
    if getattr(inner.config, "is_encoder_decoder", False) or not inner.can_generate():
        raise ValueError(f"{name} is not a decoder-only language model with a generation head; generate runs "
                         f"causal LMs (AutoModelForCausalLM)")  # fmt: skip
    cache_argument(inner)
    cache_layer_kinds(inner)  # the most specific refusal first: a layer kind says why by name
    if not getattr(inner, "_can_compile_fullgraph", False):
        raise ValueError(
            f"{name} cannot run with a static KV cache in one graph: transformers marks it _can_compile_fullgraph="
            f"False (its forward has data-dependent steps), which on XLA would recompile or read the host at every "
            f"token. Use model.generate() for it, or a model family transformers compiles (Llama, Gemma, Qwen2, GPT-2)"
        )
    return inner


# the layer kinds (transformers' ``config.layer_types``) a static cache cannot hold, and why
_UNCACHEABLE = {
    "chunked_attention": "attends within fixed chunks, a mask generate does not build over its one cache length",
    "conv": "keeps a convolution state, not keys and values per position, so left padding would flow into it",
    "linear_attention": "keeps a recurrent state, not keys and values per position, so left padding would flow into it",
    "dummy": "reads another layer's keys and values (a shared KV cache), which generate's cache does not lay out",
}


def cache_argument(model: nn.Module) -> str:
    """The name under which ``model.forward`` takes its KV cache: ``cache`` from transformers 5.24 on,
    ``past_key_values`` before; refused by name when it takes neither."""
    parameters = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    raise ValueError(f"{type(model).__name__}.forward takes no KV cache (neither 'cache' nor 'past_key_values' "
                     f"among its arguments), so generate cannot decode with it; use model.generate()")  # fmt: skip


def _layer_types(config: Any) -> list[str]:
    """Each layer's attention kind as transformers' ``StaticCache`` reads them from ``config``: its own
    ``get_layer_types_and_kwargs`` where the installed version has it, else the same rule
    written out as 5.0's ``StaticCache.__init__`` applies it."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        kinds = getattr(config, "layer_types", None)
        if kinds is None:
            kind = ("sliding_attention" if getattr(config, "sliding_window", None) is not None
                    else "chunked_attention" if getattr(config, "attention_chunk_size", None) is not None
                    else "full_attention")  # fmt: skip
            kinds = [kind] * config.num_hidden_layers
        shared = getattr(config, "num_kv_shared_layers", None)
        return list(kinds[:-shared] if shared else kinds)
    return get_layer_types_and_kwargs(config)[0]


def cache_layer_kinds(model: nn.Module) -> list[str]:
    """Each layer's attention kind, checked to be full or sliding-window attention, which a cache of
    fixed buffers holds; any other kind is refused by name, before anything compiles."""
    try:
        kinds = _layer_types(model.config.get_text_config(decoder=True))
    except Exception as error:  # noqa: BLE001 - transformers says why in its own words
        raise ValueError(f"{type(model).__name__} cannot run with a static KV cache: {error}") from error
    for k, kind in enumerate(kinds):
        if kind not in ("full_attention", "sliding_attention"):
            why = _UNCACHEABLE.get(kind, "is a layer kind generate does not know")
            raise ValueError(
                f"{type(model).__name__} cannot run with generate's static KV cache: its layer {k} is {kind!r}, which "
                f"{why}. generate runs models whose layers are 'full_attention' or 'sliding_attention' "
                f"(config.layer_types); use model.generate() for this one"
            )
    return kinds


def _static_cache(model: nn.Module, length: int) -> Any:
    """A KV cache of ``length`` positions in every layer, each one fixed buffer written in place.

    A sliding-window layer gets the full length too, and its window comes from the model's own
    sliding mask over that cache: two cache slots of a row lie as far apart as their positions,
    left padding included, so the mask is right and keeps one shape however far generation goes.
    (transformers' ``StaticSlidingWindowLayer`` instead rolls a window-long buffer once it is
    full, which changes the mask's shape and counts on the host: a compile per token on XLA.)
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    kinds = cache_layer_kinds(model)
    cache = StaticCache(config=model.config, max_cache_len=length)
    cache.layers = [StaticLayer(max_cache_len=length) for _ in kinds]
    return cache


# ----------------------------------------------------------------- sampling
def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (in int64, every product below 2**63): the same bits on every device."""
    x = ((x // 65536) ^ x) * 0x45D9F3B & _MASK32
    x = ((x // 65536) ^ x) * 0x45D9F3B & _MASK32
    return (x // 65536) ^ x


@dataclass(frozen=True)
class Sampling:
    """Sampling settings; a token is drawn from noise keyed on (seed, dataset index, position), so a sample's
    tokens never depend on the batch, bucket or device it falls in."""

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0

    def noise(self, index: torch.Tensor, position: torch.Tensor, vocab: int) -> torch.Tensor:
        """Gumbel noise ``(rows, vocab)``, a pure function of seed, each row's index and position, and the token id."""
        key = (index[:, None] * 0x27D4EB2F + position.view(-1, 1) * 0x165667B1 + (self.seed & 0x7FFFFFFF)) & _MASK32
        bits = _hash32(_hash32(key) * 0x2C1B3C6D + torch.arange(vocab, device=index.device) & _MASK32)
        uniform = ((bits // 256).float() + 0.5) / 2**24  # 24 bits: exact in float32, never 0 or 1
        return -torch.log(-torch.log(uniform))

    def draw(self, logits: torch.Tensor, index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        """Tokens drawn from softmax(logits / temperature), cut to top_k and top_p as transformers does (Gumbel-max)."""
        scores = logits / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, order = scores.sort(dim=-1, descending=True)
            probs = ordered.softmax(-1)
            drop = (probs.cumsum(-1) - probs) >= self.top_p  # the mass above it already reaches top_p
            scores = scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
        return (scores + self.noise(index, position, scores.shape[-1])).argmax(-1)


def check_sampling(do_sample: bool, temperature: float | None, top_k: int | None, top_p: float | None, seed: int) -> Sampling | None:
    """The sampling settings, or None for greedy decoding; settings given without ``do_sample=True`` are refused."""
    given = {name: v for name, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
    if not isinstance(do_sample, bool):
        raise TypeError(f"do_sample must be True or False, but given {do_sample!r}")
    if not do_sample:
        if given:
            raise ValueError(f"{', '.join(f'{k}={v!r}' for k, v in given.items())} given with do_sample=False (greedy "
                             f"decoding ignores it); pass do_sample=True to sample")  # fmt: skip
        return None
    if temperature is not None and not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature must be a number > 0, but given {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 or None, but given {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be a number in (0, 1] or None, but given {top_p!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, but given {seed!r}")
    return Sampling(float(temperature or 1.0), top_k, top_p, seed)


def stop_tokens(model: nn.Module, eos_token_id: int | Sequence[int] | None) -> list[int]:
    """The tokens that end a sample: ``eos_token_id``, else the model's generation config's (or config's), else none."""
    if eos_token_id is None:
        for source in (getattr(model, "generation_config", None), model.config):
            eos_token_id = getattr(source, "eos_token_id", None)
            if eos_token_id is not None:
                break
    if eos_token_id is None:
        return []
    ids = [eos_token_id] if isinstance(eos_token_id, int) and not isinstance(eos_token_id, bool) else eos_token_id
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise ValueError(f"eos_token_id must be a token id, a list of them, or None (the model's), but given {eos_token_id!r}")
    return list(ids)


# ------------------------------------------------------------------ decoding
class Decoder:
    """Runs one batch: the prefill of its bucket, then one decode graph per token, read every ``read_every``."""

    def __init__(self, runner: Runner, plan: GenerationPlan, stops: list[int], sampling: Sampling | None,
                 read_every: int) -> None:  # fmt: skip
        self.runner, self.model, self.plan, self.sampling, self.read_every = runner, runner.model, plan, sampling, read_every
        self.stops = torch.tensor(stops, dtype=torch.long, device=runner.device) if stops else None
        self.stop_list = stops
        self.keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(self.model.forward).parameters else {}
        self.cache_argument = cache_argument(self.model)
        # before transformers 5.24 the caller says which cache slots a step writes (cache_position); from
        # 5.24 on, the cache counts them itself
        self.give_slots = "cache_position" in inspect.signature(self.model.forward).parameters

    def forward(self, ids: torch.Tensor, batch: dict[str, torch.Tensor], positions: torch.Tensor, cache: Any,
                slots: torch.Tensor) -> torch.Tensor:  # fmt: skip
        where = {self.cache_argument: cache, **({"cache_position": slots} if self.give_slots else {})}
        out = self.runner.step_model(input_ids=ids, attention_mask=batch["attention_mask"], position_ids=positions,
                                     use_cache=True, **where, **self.keep_last)  # fmt: skip
        return out.logits[:, -1].float()

    def choose(self, logits: torch.Tensor, index: torch.Tensor, position: torch.Tensor,
               done: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The next token of every row and the rows stopped after it, on the device."""
        token = logits.argmax(-1) if self.sampling is None else self.sampling.draw(logits, index, position)
        if self.stops is None:
            return token, done
        token = torch.where(done, self.stops[0], token)  # a stopped row repeats its stop token
        return token, done | (token[:, None] == self.stops[None, :]).any(-1)

    def run(self, batch: dict[str, torch.Tensor], rows: list[int], max_new_tokens: int, on_read: Any) -> dict[int, list[int]]:
        """Each real row's new tokens (up to and including its first stop token), by dataset index (``rows``: the
        batch's indices, as the host made it)."""
        cache = _static_cache(self.model, self.plan.cache_length)
        index, position = batch["index"], batch["position_ids"][:, -1:] + 1
        slots = torch.arange(batch["input_ids"].shape[1], device=index.device)
        logits = self.forward(batch["input_ids"], batch, batch["position_ids"], cache, slots)
        slot = slots[-1:] + 1
        backend.current().sharding.shard_batch([t for layer in cache.layers for t in (layer.keys, layer.values)])
        token, done = self.choose(logits, index, position, index < 0)
        pending, read = [token], []
        for _ in range(1, max_new_tokens):
            backend.current().devices.sync()
            if len(pending) == self.read_every:
                if self._read(pending, done, read, on_read):
                    break
                pending = []
            logits = self.forward(token[:, None], batch, position, cache, slot)
            position, slot = position + 1, slot + 1
            token, done = self.choose(logits, index, position, done)
            pending.append(token)
        backend.current().devices.sync()
        if pending:
            self._read(pending, done, read, on_read)
        return self._rows(torch.cat(read, 1), rows)

    def _read(self, pending: list[torch.Tensor], done: torch.Tensor, read: list[torch.Tensor], on_read: Any) -> bool:
        """One transfer of the pending tokens and the stop flags; True when every row has stopped."""
        *tokens, stopped = backend.current().devices.to_cpu([*pending, done])
        read.append(torch.stack(tokens, 1))
        on_read(len(tokens))
        return self.stops is not None and bool(stopped.all())

    def _rows(self, tokens: torch.Tensor, rows: list[int]) -> dict[int, list[int]]:
        found = {}
        for i, row in zip(rows, tokens.tolist()):  # filler rows come after the real ones
            end = next((k + 1 for k, t in enumerate(row) if t in self.stop_list), len(row))
            found[i] = row[:end]
        return found


def _check_count(name: str, value: Any, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, but given {value!r}")
    return value


def generate(
    model: nn.Module,
    data: Any,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    cores: int | str = 1,
    batch_size: int = 16,
    buckets: Sequence[int] | None = None,
    read_every: int = 8,
    progress: bool = True,
    compile: bool | Literal["auto"] | Compile = "auto",
) -> list[list[int]]:
    """Each prompt's new tokens, in dataset order: a causal LM's batched generation with static shapes.

    Prompts are left-padded to a few length buckets; the KV cache (transformers'
    ``StaticCache``) has one length, the longest bucket + ``max_new_tokens``; each
    bucket compiles one prefill graph and all share one decode graph. The next token
    and the stop flags stay on the device, read every ``read_every`` tokens in one
    transfer; a batch ends at the first read after all its rows stopped. Greedy
    decoding gives the tokens of ``model.generate(prompt, do_sample=False)`` for each
    prompt alone. Runs on one core, on all cores (SPMD: each batch and its cache split
    over the devices) and without torch_xla (CUDA or CPU). Before anything compiles,
    a KV cache that the device cannot hold is refused with the batch size that fits.
    In a job of several processes (``torchrun``, ``launch``) given the same prompts,
    the batches are split over the processes and every process gets every row, in
    dataset order; a process given prompts of its own generates them alone.

    Args:
        model: A transformers causal LM (Llama, Gemma, Qwen2, GPT-2, ...) or a peft model
            of one; left on its device and in its mode afterwards.
        data: A Dataset, DataLoader or list of prompts: token ids as a 1-D integer
            tensor, a list of ints, or a dict with ``input_ids`` (its ``attention_mask``
            drops a tokenizer's padding), each of any length.
        max_new_tokens: Tokens to generate per prompt (fewer when it stops first).
        do_sample: Sample instead of taking the most likely token.
        temperature, top_k, top_p: Sampling settings (with ``do_sample=True`` only),
            applied in that order as transformers does.
        seed: The sampling seed; a sample's tokens depend on the seed, its dataset
            index and its position only: not on its batch, bucket or the core count.
        eos_token_id: Token id(s) that end a sample; None takes the model's generation
            config's (or config's); ``[]`` never stops early.
        cores: 1, "all", or the number of all cores.
        batch_size: Prompts per batch, per core.
        buckets: Prompt lengths to pad to (increasing); None chooses up to 4 from the data.
        read_every: Tokens generated between two reads of the tokens and stop flags.
        progress: A progress bar counting new tokens (its rate: tokens per second).
        compile: As ``one_cycle_fit`` takes it: the prefill and decode steps compiled with torch.compile on the
            native backend ("auto": on CUDA and TorchTPU for 300 decode steps or more, never on the CPU); XLA
            compiles them itself.

    Returns:
        One list of token ids per prompt, in dataset order: its new tokens, up to and
        including its first stop token.

    Raises:
        TypeError: a model that is not a transformers causal LM; a prompt that is not token ids.
        ValueError: a bad argument (named with its value); a token id outside the model's
            vocabulary (named with its prompt and position); weights still on the meta
            device; a model that cannot run with
            a static cache (named with why); a KV cache larger than the device's memory
            (with the batch size that fits).

    Example:
        >>> # was: [model.generate(ids[None].cuda(), max_new_tokens=64)[0, len(ids):] for ids in prompts]
        >>> new = generate(model, test_ds, max_new_tokens=64, cores="all")            # doctest: +SKIP
        >>> pd.DataFrame({"id": ids, "answer": tok.batch_decode(new, skip_special_tokens=True)}
        ...              ).to_csv("submission.csv", index=False)                     # doctest: +SKIP
    """
    _check_count("max_new_tokens", max_new_tokens)
    _check_count("batch_size", batch_size)
    _check_count("read_every", read_every)
    sampling = check_sampling(do_sample, temperature, top_k, top_p, seed)
    compile_setting = Compile.of(compile)
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be True or False, but given {progress!r}")
    inner = causal_lm(model)
    stops = stop_tokens(inner, eos_token_id)
    prompts = prompt_ids(data)
    check_token_ids(prompts, vocabulary(inner))
    lengths = [len(p) for p in prompts]
    chosen = choose(cores).one_program(f"generate (cores={cores!r})")
    if chosen.job_size() > 1 and not _same_prompts_everywhere(prompts):
        chosen = chosen.alone()  # each replica given prompts of its own generates them all, alone
    runner = Runner(inner, "fp32", chosen, compile_setting)
    try:
        # the rows of a batch: the global batch of one program over the mesh, else this process's own
        rows = runner.topology.global_batch(batch_size) if runner.topology.spmd else batch_size
        plan = GenerationPlan.of(lengths, buckets, rows, max_new_tokens)
        runner.compile_for(len(plan.batches) * max_new_tokens)
        _check_positions(inner, plan)
        check_memory(inner, batch_size, plan.cache_length, runner.device)
        return _generate(runner, plan, prompts, Decoder(runner, plan, stops, sampling, read_every), (max_new_tokens, progress))
    finally:
        runner.restore_model()


def _check_positions(model: nn.Module, plan: GenerationPlan) -> None:
    """Learned positions (GPT-2's ``n_positions``) end somewhere: on XLA an index past them would not raise."""
    limit = getattr(model.config, "n_positions", None)
    if limit is not None and plan.cache_length > limit:
        raise ValueError(f"the longest bucket {plan.buckets[-1]} + max_new_tokens = {plan.cache_length} positions, more "
                         f"than {type(model).__name__}'s learned {limit} (config.n_positions); give fewer max_new_tokens "
                         f"or shorter prompts")  # fmt: skip


def _same_prompts_everywhere(prompts: list[list[int]]) -> bool:
    """Whether every replica of the job was given these prompts (a digest of all of them, one all-gather)."""
    digest = hashlib.blake2b(json.dumps(prompts).encode(), digest_size=8).hexdigest()
    return not agreement.differences(agreement.gather({"prompts": f"{len(prompts)}:{digest}"}, backend.current().devices.device()))


def replica_share(batches: list[list[int]], replicas: int, rank: int) -> list[list[int]]:
    """The batches one replica of ``replicas`` generates: every ``replicas``-th, from its rank (the plan
    groups batches by bucket, so each replica gets its share of every bucket).

    Example:
        >>> replica_share([[0, 1], [2, 3], [4, 5], [6]], replicas=2, rank=1)
        [[2, 3], [6]]
    """
    return batches[rank::replicas]


def _generate(runner: Runner, plan: GenerationPlan, prompts: list[list[int]], decoder: Decoder,
              settings: tuple[int, bool]) -> list[list[int]]:  # fmt: skip
    max_new_tokens, progress = settings
    topology = runner.topology
    mine = replica_share(plan.batches, topology.replicas, topology.rank)
    speak = progress and topology.master and backend.is_master()
    bar = progress_bar(len(mine) * max_new_tokens, "generate", enabled=speak, unit="step")
    found: dict[int, list[int]] = {}
    runner.model.eval()
    start = time.perf_counter()
    host = [plan.host_batch(prompts, batch) for batch in mine]
    with torch.no_grad():
        for batch, rows in zip(runner.batches(host), mine):
            found.update(decoder.run(batch, rows, max_new_tokens, bar.update))
            bar.set_postfix(tokens_per_s=f"{sum(map(len, found.values())) / (time.perf_counter() - start):.0f}")
    bar.close()
    if topology.replicas > 1:
        found = _gathered(found, len(prompts), max_new_tokens, runner.device)
    return [found[i] for i in range(len(prompts))]


def _gathered(found: dict[int, list[int]], n: int, max_new_tokens: int, device: torch.device) -> dict[int, list[int]]:
    """Every replica's rows, on every replica: one ``(n, max_new_tokens)`` table, -1 where this replica has
    no token, reduced by max over the replicas (each row is one replica's) and read in one transfer."""
    table = torch.full((n, max_new_tokens), -1, dtype=torch.int32)
    for i, tokens in found.items():
        table[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
    chosen = backend.current()
    (table,) = chosen.devices.to_cpu(chosen.processes.all_reduce([table.to(device)], "max"))
    return {i: [t for t in row if t >= 0] for i, row in enumerate(table.tolist())}
