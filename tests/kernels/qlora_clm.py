"""QLoRA fine-tuning of a causal LM with a plain loop: a 4-bit NF4 base from bitsandbytes, LoRA adapters on top.

Written in the shape of the QLoRA recipe that peft's examples and Hugging Face's 4-bit blog post spread (a
`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_use_double_quant=True, bnb_4bit_quant_type="nf4",
bnb_4bit_compute_dtype=torch.bfloat16)` given to `from_pretrained(..., quantization_config=..., device_map={"": 0})`,
`model.gradient_checkpointing_enable()`, `prepare_model_for_kbit_training(model)`, `LoraConfig` on q_proj/v_proj,
`get_peft_model`, `print_trainable_parameters`) with the plain loop of peft's causal-language-modeling examples.
The checkpoint (a Llama 2 7B there) is MODEL_ID, a folder the tests save a tiny Llama into; the data are generated
token sequences (no tokenizer, no download).
"""
import json
import os
import sys

import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, get_linear_schedule_with_warmup

model_id = os.environ.get("MODEL_ID", "meta-llama/Llama-2-7b-hf")
num_epochs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
batch_size = 8
lr = 3e-3
max_length = 16

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_use_double_quant=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_compute_dtype=torch.bfloat16,
)
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=bnb_config, device_map={"": 0})

model.gradient_checkpointing_enable()
model = prepare_model_for_kbit_training(model)

config = LoraConfig(
    r=8,
    lora_alpha=32,
    target_modules=["q_proj", "v_proj"],
    lora_dropout=0.0,
    bias="none",
    task_type="CAUSAL_LM",
)
model = get_peft_model(model, config)
model.print_trainable_parameters()

vocab = model.config.vocab_size
g = torch.Generator().manual_seed(1)
starts = torch.randint(0, vocab, (64, 1), generator=g)
input_ids = (starts + torch.arange(max_length) * torch.randint(1, 3, (64, 1), generator=g)) % vocab
examples = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()} for ids in input_ids]
train_dataloader = DataLoader(examples, shuffle=True, batch_size=batch_size)

optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
lr_scheduler = get_linear_schedule_with_warmup(
    optimizer=optimizer, num_warmup_steps=0, num_training_steps=(len(train_dataloader) * num_epochs))

history = []
for epoch in range(num_epochs):
    model.train()
    total_loss = 0
    for step, batch in enumerate(train_dataloader):
        batch = {k: v.to(model.device) for k, v in batch.items()}
        outputs = model(**batch)
        loss = outputs.loss
        total_loss += loss.detach().float()
        loss.backward()
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()
    train_epoch_loss = total_loss / len(train_dataloader)
    print(f"{epoch=}: {train_epoch_loss=}")
    history.append(float(train_epoch_loss))

print("RESULT " + json.dumps({"first_loss": history[0], "last_loss": history[-1], "losses": history,
                              "device": str(model.device)}))
