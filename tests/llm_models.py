"""Tiny decoder LLMs built from their configs (no download), learnable token data, and the loop a user had.

The data is counting: each sequence steps through the vocabulary by a stride of its own
(``start, start + stride, ...`` modulo the vocabulary), so a model that trains learns it
quickly and its loss falls. ``plain_cpu_losses`` is the fine-tuning loop of peft's and
transformers' examples on the CPU (``model(**batch).loss``), drawing batches in the order
``one_cycle_fit`` draws them, so per-epoch losses can be compared number for number.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler

VOCAB, LENGTH = 48, 16
BATCH_KEYS = ("input_ids", "attention_mask")  # what a model is called with to compare logits


def counting(n: int, seed: int, length: int = LENGTH, ignored: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` dict samples of ``input_ids`` and ``labels``; the first ``ignored`` labels are -100 (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        start, stride = torch.randint(0, VOCAB, (1,), generator=g).item(), torch.randint(1, 4, (1,), generator=g).item()
        ids = (start + stride * torch.arange(length)) % VOCAB
        labels = ids.clone()
        labels[:ignored] = -100
        samples.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": labels})
    return samples


def padded(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """``counting`` with 0-3 padding tokens at the start of each sample (attention mask 0, label -100): the
    batches whose mask transformers' SDPA mask code would test on the host (``padding_mask.all()``)."""
    samples = counting(n, seed)
    for i, sample in enumerate(samples):
        sample["attention_mask"][: i % 4] = 0
        sample["labels"][: i % 4] = -100
    return samples


def causal_lm(kind: str, tied: bool | None = None, seed: int = 0) -> torch.nn.Module:
    """A 2-layer causal LM of ``kind`` ("gpt2", "llama", "gemma", "gemma2", "qwen2"), weights drawn under ``seed``."""
    import transformers as t

    torch.manual_seed(seed)
    small = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip
    if kind == "gpt2":
        config = t.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                              embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)  # fmt: skip
        return t.GPT2LMHeadModel(config)
    if kind == "llama":
        return t.LlamaForCausalLM(t.LlamaConfig(**small, tie_word_embeddings=bool(tied)))
    if kind == "gemma":
        return t.GemmaForCausalLM(t.GemmaConfig(**small, head_dim=8))
    if kind == "gemma2":  # its final logits soft-capped (tanh(x / c) * c): c small enough to matter here
        return t.Gemma2ForCausalLM(t.Gemma2Config(**small, head_dim=8, final_logit_softcapping=2.0))
    if kind == "qwen2":
        return t.Qwen2ForCausalLM(t.Qwen2Config(**small, tie_word_embeddings=bool(tied)))
    raise ValueError(kind)


def lora(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      task_type="CAUSAL_LM", init_lora_weights="gaussian"))  # fmt: skip


def prompt_tuning(model: torch.nn.Module) -> torch.nn.Module:
    import peft

    return peft.get_peft_model(model, peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))


def adamw(lr: float):
    """The optimizer both loops build over the trainable parameters (a factory for ``one_cycle_fit``)."""
    return lambda params: torch.optim.AdamW(params, lr=lr)


def plain_cpu_losses(model: torch.nn.Module, data: list, epochs: int, batch_size: int, lr: float,
                     loss_of=lambda model, batch: model(**batch).loss) -> list[float]:  # fmt: skip
    """The loop before the port, on the CPU, at a constant lr: each epoch's mean training loss."""
    optimizer = adamw(lr)([p for p in model.parameters() if p.requires_grad])
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)  # one_cycle_fit's order
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=True)
    model.train()
    means = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        losses = []
        for batch in loader:
            loss = loss_of(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        means.append(sum(losses) / len(losses))
    return means


def own_loss_mean(model: torch.nn.Module, data: list, batch_size: int) -> float:
    """The model's own loss over ``data`` on the CPU, each batch weighted by the targets that count in it
    (a causal LM's: every label but the first of each row, less the -100s)."""
    model = model.cpu().eval()
    total = count = 0.0
    with torch.no_grad():
        for k in range(0, len(data), batch_size):
            batch = {key: torch.stack([s[key] for s in data[k : k + batch_size]]) for key in data[0]}
            counted = int((batch["labels"][:, 1:] != -100).sum())
            total += model(**batch).loss.item() * counted
            count += counted
    return total / count


class Tagger(torch.nn.Module):
    """A token classifier of one's own: (N, T) tokens to (N, T, C) scores, trained on (N, T) labels."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(tokens))


def tags(n: int, seed: int, bad: int | None = None) -> torch.utils.data.TensorDataset:
    """Tokens and their classes (the token modulo 5); the first 3 positions -100, a ``bad`` label at one."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (n, 12), generator=g)
    labels = tokens % 5
    labels[:, :3] = -100  # positions that count in no loss: padding, a prompt
    if bad is not None:
        labels[n - 1, 5] = bad
    return torch.utils.data.TensorDataset(tokens, labels)


def tagger_loss(model: torch.nn.Module, batch: list) -> torch.Tensor:
    """The tagger's loss as its loop computes it: cross-entropy over the class dimension, -100 left out."""
    tokens, labels = batch
    return torch.nn.functional.cross_entropy(model(tokens).transpose(1, 2), labels)
