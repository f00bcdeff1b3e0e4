"""generate() against transformers' model.generate() on XLA:CPU: compiles per call, tokens per second.

Same model (a 2-layer Llama from LlamaConfig, no download), the same three sets of 16
prompts (3 to 40 tokens: a test set's prompts come in batches of different padded lengths),
16 new tokens each, greedy, no EOS. Each row makes one call per set:

- ``model.generate()`` on XLA:CPU: the batch left-padded by the caller, as a tokenizer with
  ``padding_side="left"`` gives it; transformers' default dynamic cache;
- the same with ``cache_implementation="static"``;
- ``generate()`` (this package): buckets chosen from the first set and given to the others;
- ``model.generate()`` on the plain CPU (eager, no compiles): the reference speed.

Then the same for a 2-layer Gemma 2 whose sliding window (16 tokens) is shorter than
prompt + new tokens, with soft-capped attention and final logits: ``generate()`` against
``model.generate()`` on the plain CPU (the tokens to match).

The figures: graphs compiled at each call, and new tokens per second in the last call
(after the warm-up of the first two). On XLA:CPU the "device" shares the host's cores,
so the speeds are the CPU's, not a TPU's; the compile counts are what carries over.

    PJRT_DEVICE=CPU python bench/generate_bench.py
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tpu_utility import backend, generate  # noqa: E402
from tpu_utility.data import choose_buckets  # noqa: E402

PROMPTS, NEW, CALLS = 16, 16, 3


def model_and_sets() -> tuple[LlamaForCausalLM, list[list[torch.Tensor]]]:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         bos_token_id=None, eos_token_id=None, pad_token_id=0)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    sets = []
    for _ in range(CALLS):
        lengths = torch.randint(3, 41, (PROMPTS,), generator=g).tolist()
        sets.append([torch.randint(1, 256, (n,), generator=g) for n in lengths])
    return LlamaForCausalLM(config).eval(), sets


def gemma2_like() -> Gemma2ForCausalLM:
    """A Gemma 2 of the Llama's size: layers of a 16-token sliding window and of full attention, soft-capped."""
    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                          sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                          bos_token_id=None, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return Gemma2ForCausalLM(config).eval()


def left_padded(prompts: list[torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def hf_call(model: LlamaForCausalLM, device: torch.device, static: bool):
    def call(prompts: list[torch.Tensor]) -> list[list[int]]:
        batch = left_padded(prompts, device)
        extra = {"cache_implementation": "static"} if static else {}
        with torch.no_grad():
            out = model.generate(**batch, do_sample=False, max_new_tokens=NEW, pad_token_id=0, **extra)
        return out[:, batch["input_ids"].shape[1]:].cpu().tolist()

    return call


def measure(call, sets: list[list[torch.Tensor]]) -> tuple[list[int], float, list[list[int]]]:
    compiles, tokens = [], []
    for prompts in sets:
        backend.clear_counters()
        start = time.perf_counter()
        tokens = call(prompts)
        seconds = time.perf_counter() - start
        compiles.append(backend.counters().compiles)
    return compiles, PROMPTS * NEW / seconds, tokens


def main() -> None:
    model, sets = model_and_sets()
    buckets = choose_buckets([len(p) for p in sets[0]], num_buckets=4, multiple_of=8)
    ours = lambda prompts: generate(model, prompts, max_new_tokens=NEW, batch_size=PROMPTS, buckets=buckets,  # noqa: E731
                                    progress=False)  # fmt: skip
    rows = [("generate() (this package)", *measure(ours, sets))]
    cpu = measure(hf_call(model, torch.device("cpu"), False), sets)
    xla_model = LlamaForCausalLM(model.config).eval()
    xla_model.load_state_dict(model.state_dict())
    xla_model.to(backend.device())
    rows.append(("model.generate() on XLA:CPU", *measure(hf_call(xla_model, backend.device(), False), sets)))
    rows.append(('model.generate(cache_implementation="static") on XLA:CPU',
                 *measure(hf_call(xla_model, backend.device(), True), sets)))  # fmt: skip
    rows.append(("model.generate() on the CPU, eager (reference)", [0] * CALLS, cpu[1], cpu[2]))
    gemma = gemma2_like()
    ours_gemma = lambda prompts: generate(gemma, prompts, max_new_tokens=NEW, batch_size=PROMPTS,  # noqa: E731
                                          buckets=buckets, progress=False)  # fmt: skip
    gemma_cpu = measure(hf_call(gemma, torch.device("cpu"), False), sets)
    gemma_rows = [("Gemma 2, window 16: generate() (this package)", *measure(ours_gemma, sets)),
                  ("Gemma 2, window 16: model.generate() on the CPU, eager (reference)", [0] * CALLS, *gemma_cpu[1:])]
    print(f"{PROMPTS} prompts of 3-40 tokens x {NEW} new tokens, greedy, {CALLS} calls with other prompts; "
          f"torch {torch.__version__}, buckets {buckets}")  # fmt: skip
    print("| call | compiles per call | new tokens/s, last call | tokens = CPU's |")
    print("|---|---|---|---|")
    table = [(row, cpu[2]) for row in rows] + [(row, gemma_cpu[2]) for row in gemma_rows]  # each against its CPU
    for (name, compiles, rate, tokens), want in table:
        print(f"| {name} | {', '.join(map(str, compiles))} | {rate:.0f} | {tokens == want} |")


if __name__ == "__main__":
    main()
