"""Language-model fine-tuning as transformers 2.x/3.x examples wrote it (run_lm_finetuning.py / run_language_modeling.py).

Kept as written there: `from transformers import AdamW, get_linear_schedule_with_warmup` (AdamW
gone in transformers 5), `args.device = torch.device("cuda" if torch.cuda.is_available() and not
args.no_cuda else "cpu")`, `args.n_gpu = torch.cuda.device_count()`, the no_decay parameter
groups, `model.to(args.device)`, `if args.n_gpu > 1: model = torch.nn.DataParallel(model)`,
`tr_loss += loss.item()` each step, `optimizer.step(); scheduler.step(); model.zero_grad()`,
and `model_to_save = model.module if hasattr(model, "module") else model;
model_to_save.save_pretrained(args.output_dir)` with `tokenizer.save_pretrained` and
`torch.save(args, ...)`. A tiny GPT-2 from a config and generated token blocks replace the
pretrained model and the text file; the tokenizer step is left out.
"""
import argparse
import json
import os

import torch
from torch.utils.data import DataLoader, RandomSampler
from transformers import AdamW, GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup


def train(args, train_dataset, model):
    args.train_batch_size = args.per_gpu_train_batch_size * max(1, args.n_gpu)
    train_sampler = RandomSampler(train_dataset)
    train_dataloader = DataLoader(train_dataset, sampler=train_sampler, batch_size=args.train_batch_size)
    t_total = len(train_dataloader) * args.num_train_epochs
    no_decay = ["bias", "LayerNorm.weight"]
    optimizer_grouped_parameters = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = AdamW(optimizer_grouped_parameters, lr=args.learning_rate, eps=args.adam_epsilon)
    scheduler = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=args.warmup_steps,
                                                num_training_steps=t_total)
    if args.n_gpu > 1:
        model = torch.nn.DataParallel(model)
    global_step, tr_loss, losses = 0, 0.0, []
    model.zero_grad()
    for _ in range(args.num_train_epochs):
        for step, batch in enumerate(train_dataloader):
            inputs, labels = (batch, batch)
            inputs = inputs.to(args.device)
            labels = labels.to(args.device)
            model.train()
            outputs = model(inputs, labels=labels)
            loss = outputs[0]
            if args.n_gpu > 1:
                loss = loss.mean()
            loss.backward()
            tr_loss += loss.item()
            losses.append(loss.item())
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            model.zero_grad()
            global_step += 1
            if args.max_steps > 0 and global_step >= args.max_steps:
                break
    return global_step, tr_loss / global_step, losses


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", default=os.environ.get("OUT_DIR", "."), type=str)
    parser.add_argument("--per_gpu_train_batch_size", default=4, type=int)
    parser.add_argument("--learning_rate", default=5e-4, type=float)
    parser.add_argument("--weight_decay", default=0.0, type=float)
    parser.add_argument("--adam_epsilon", default=1e-8, type=float)
    parser.add_argument("--max_grad_norm", default=1.0, type=float)
    parser.add_argument("--num_train_epochs", default=1, type=int)
    parser.add_argument("--max_steps", default=-1, type=int)
    parser.add_argument("--warmup_steps", default=0, type=int)
    parser.add_argument("--no_cuda", action="store_true", help="Avoid using CUDA when available")
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() and not args.no_cuda else "cpu")
    args.n_gpu = torch.cuda.device_count()
    args.device = device
    torch.manual_seed(args.seed)

    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.to(args.device)
    g = torch.Generator().manual_seed(0)
    train_dataset = (torch.randint(0, 64, (64, 1), generator=g) + torch.arange(32)) % 64

    global_step, tr_loss, losses = train(args, train_dataset, model)
    print(" global_step = %s, average loss = %s" % (global_step, tr_loss))

    os.makedirs(args.output_dir, exist_ok=True)
    model_to_save = model.module if hasattr(model, "module") else model
    model_to_save.save_pretrained(args.output_dir)
    torch.save(args, os.path.join(args.output_dir, "training_args.bin"))
    print("RESULT " + json.dumps({"first_loss": losses[0], "last_loss": losses[-1]}))


if __name__ == "__main__":
    main()
