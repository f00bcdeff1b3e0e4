"""LoRA fine-tuning of a causal LM with a plain loop, as peft's causal-language-modeling examples write it.

Kept as written there: `device = torch.accelerator.current_accelerator().type if hasattr(torch,
"accelerator") else "cuda"`, `get_peft_model(model, peft_config)` and
`model.print_trainable_parameters()`, `torch.optim.AdamW(model.parameters(), lr=lr)` built before
`model = model.to(device)`, `get_linear_schedule_with_warmup`, `batch = {k: v.to(device) ...}`,
`total_loss += loss.detach().float()`, an eval loop, and `model.save_pretrained(peft_model_id)`.
The checkpoint (bigscience/bloomz-560m there) is a tiny GPT-2 built from a config (its
embeddings tied to the LM head, as GPT-2's are) and the twitter_complaints data generated
token sequences; dropout is 0 so a first loss can be compared across devices.
"""
import json
import os
import sys

import torch
from peft import LoraConfig, TaskType, get_peft_model
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

device = torch.accelerator.current_accelerator().type if hasattr(torch, "accelerator") else "cuda"
if device == "cpu" or (device == "cuda" and not torch.cuda.is_available()):
    device = "cpu"  # (not in peft's example: torch.accelerator gives no accelerator on a CPU-only machine)
peft_model_id = os.environ.get("OUT_DIR", ".") + "/gpt2_lora_clm"
peft_config = LoraConfig(task_type=TaskType.CAUSAL_LM, inference_mode=False, r=8, lora_alpha=32, lora_dropout=0.0,
                         target_modules=["c_attn"])
max_length = 16
lr = 3e-3
num_epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
max_steps = int(sys.argv[2]) if len(sys.argv) > 2 else None
batch_size = 8

torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=max_length, n_embd=32, n_layer=2, n_head=2,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(config)
model = get_peft_model(model, peft_config)
model.print_trainable_parameters()

g = torch.Generator().manual_seed(1)
starts = torch.randint(0, 64, (96, 1), generator=g)
input_ids = (starts + torch.arange(max_length) * torch.randint(1, 3, (96, 1), generator=g)) % 64
examples = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()} for ids in input_ids]
train_dataloader = DataLoader(examples[:80], shuffle=True, batch_size=batch_size, pin_memory=True)
eval_dataloader = DataLoader(examples[80:], batch_size=batch_size, pin_memory=True)

optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
lr_scheduler = get_linear_schedule_with_warmup(
    optimizer=optimizer, num_warmup_steps=0, num_training_steps=(len(train_dataloader) * num_epochs))

model = model.to(device)
history = []
for epoch in range(num_epochs):
    model.train()
    total_loss = 0
    for step, batch in enumerate(train_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        total_loss += loss.detach().float()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
        if not history:
            history.append(loss.item())
        if max_steps and step + 1 >= max_steps:
            break
    model.eval()
    eval_loss = 0
    for step, batch in enumerate(eval_dataloader):
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.no_grad():
            outputs = model(**batch)
        eval_loss += outputs.loss.detach().float()
    eval_epoch_loss = eval_loss / len(eval_dataloader)
    train_epoch_loss = total_loss / len(train_dataloader)
    print(f"{epoch=}: {train_epoch_loss=} {eval_epoch_loss=}")
    history.append(float(train_epoch_loss))

model.save_pretrained(peft_model_id)
print("RESULT " + json.dumps({"first_loss": history[0], "last_loss": history[-1],
                              "saved": os.path.exists(os.path.join(peft_model_id, "adapter_model.safetensors"))}))
