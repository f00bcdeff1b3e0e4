"""A tokenized text task and a tiny BERT built from its config (no download), for test_huggingface.py.

Samples are dicts, as a tokenized ``datasets`` split gives them: ``input_ids``,
``attention_mask`` and ``labels``. The label says whether token 7 occurs among a
sequence's real tokens (the rest is padding), so the model must read the mask.
Kept apart from the test file so that a subprocess can import it without conftest.
"""

import torch
from torch.utils.data import Dataset

VOCAB, LENGTH = 30, 16


class Tokens(Dataset):
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, VOCAB, (n, LENGTH), generator=g)
        lengths = torch.randint(6, LENGTH + 1, (n,), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        for i in range(n):
            if self.labels[i]:
                self.ids[i, torch.randint(1, int(lengths[i]), (1,), generator=g)] = 7
            self.ids[i, 0] = 2  # [CLS]
            self.ids[i, int(lengths[i]) :] = 0  # [PAD]
        self.mask = (torch.arange(LENGTH) < lengths[:, None]).long()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def unpadded(dataset: Tokens) -> list[dict]:
    """The same samples as a tokenizer gives them before padding: each sequence its own length."""
    lengths = dataset.mask.sum(1).tolist()
    return [{"input_ids": dataset.ids[i, :n], "attention_mask": dataset.mask[i, :n], "labels": dataset.labels[i]}
            for i, n in enumerate(lengths)]  # fmt: skip


def bert(seed: int = 0, layers: int = 2):
    """Two layers by default, for the tests with a loss bar: with one layer, 512 samples and 3 epochs, one_cycle_fit
    reaches accuracy 1.0 but its last train loss is 0.65 of a first 0.69 (two layers: 0.28), which fails the bar
    "last loss below half the first". ``layers=1`` for the tests without one: its graphs compile in about half
    the CPU time."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=LENGTH, num_labels=2)  # fmt: skip
    return BertForSequenceClassification(config)


def cpu_logits(model, dataset: Tokens) -> torch.Tensor:
    """The model's logits for every sample on the plain CPU, in one batch."""
    model = model.cpu().eval()
    with torch.no_grad():
        return model(input_ids=dataset.ids, attention_mask=dataset.mask).logits
