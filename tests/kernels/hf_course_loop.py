"""Fine-tuning a (tiny) BERT with a plain PyTorch training loop.

Follows the Hugging Face course, chapter 3, "A full training": no Trainer,
just AdamW + a linear schedule + tqdm.  The checkpoint is replaced by a small
BertConfig so the script runs offline, and the GLUE data by a synthetic
"sentiment" task: a review is positive when it uses more positive words.
"""
import json
import os
import random

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from transformers import BertConfig, BertForSequenceClassification

random.seed(0)
np.random.seed(0)
torch.manual_seed(0)

SEQ_LEN = 32
VOCAB_SIZE = 128
PAD, CLS, SEP = 0, 1, 2
POSITIVE = list(range(10, 20))   # "great", "love", ...
NEGATIVE = list(range(20, 30))   # "awful", "boring", ...
NEUTRAL = list(range(30, VOCAB_SIZE))


class ReviewDataset(Dataset):
    """Already-tokenized reviews, padded to SEQ_LEN (what tokenizer(..., padding="max_length") gives)."""

    def __init__(self, n, seed):
        rng = np.random.RandomState(seed)
        self.examples = []
        for _ in range(n):
            label = int(rng.randint(2))
            length = int(rng.randint(12, SEQ_LEN - 1))
            words = list(rng.choice(NEUTRAL, size=length))
            n_sent = int(rng.randint(3, 6))
            pool = POSITIVE if label == 1 else NEGATIVE
            for pos in rng.choice(length, size=n_sent, replace=False):
                words[pos] = int(rng.choice(pool))
            ids = [CLS] + [int(w) for w in words][: SEQ_LEN - 2] + [SEP]
            mask = [1] * len(ids) + [0] * (SEQ_LEN - len(ids))
            ids = ids + [PAD] * (SEQ_LEN - len(ids))
            self.examples.append((ids, mask, label))

    def __len__(self):
        return len(self.examples)

    def __getitem__(self, i):
        ids, mask, label = self.examples[i]
        return {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(label),
        }


train_dataset = ReviewDataset(512, seed=1)
eval_dataset = ReviewDataset(128, seed=2)

# Every example has the same length, so the default collate works (no DataCollatorWithPadding).
train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=16)
eval_dataloader = DataLoader(eval_dataset, batch_size=32)

config = BertConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=64,
    num_labels=2,
)
model = BertForSequenceClassification(config)

from torch.optim import AdamW

# The course uses lr=5e-5 to fine-tune a pretrained checkpoint; from scratch we need more.
optimizer = AdamW(model.parameters(), lr=2e-3)

from transformers import get_scheduler

num_epochs = int(os.environ.get("EPOCHS", 3))
num_training_steps = num_epochs * len(train_dataloader)
lr_scheduler = get_scheduler(
    "linear",
    optimizer=optimizer,
    num_warmup_steps=0,
    num_training_steps=num_training_steps,
)
print(num_training_steps)

device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
model.to(device)

from tqdm.auto import tqdm

progress_bar = tqdm(range(num_training_steps))
first_loss = None

model.train()
for epoch in range(num_epochs):
    for batch in train_dataloader:
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        loss.backward()

        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        progress_bar.update(1)

        # keep an eye on the loss in the progress bar
        last_loss = loss.item()
        if first_loss is None:
            first_loss = last_loss
        progress_bar.set_postfix(loss=f"{last_loss:.4f}")
progress_bar.close()

# Evaluation: the course uses evaluate.load("glue", "mrpc"); metric.add_batch just
# collects predictions and references, so we do the same by hand.
all_predictions, all_references = [], []
model.eval()
for batch in eval_dataloader:
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():
        outputs = model(**batch)

    logits = outputs.logits
    predictions = torch.argmax(logits, dim=-1)
    all_predictions.append(predictions.cpu())
    all_references.append(batch["labels"].cpu())

predictions = torch.cat(all_predictions)
references = torch.cat(all_references)
accuracy = (predictions == references).float().mean().item()
print({"accuracy": accuracy})

print("RESULT " + json.dumps({
    "first_loss": first_loss,
    "last_loss": last_loss,
    "valid_accuracy": accuracy,
}))
