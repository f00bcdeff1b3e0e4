"""Condensed timm train.py: native AMP + GradScaler, AverageMeter logging, cosine LR.

Same structure as pytorch-image-models' train.py / train_one_epoch() / validate(),
cut down to a single file with the args namespace filled in by hand.
Data: sklearn's bundled digits, upsampled to 32x32 single-channel images.
"""
import json
import os
import time
from contextlib import suppress
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset

import timm
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from timm.utils import AverageMeter, accuracy

args = SimpleNamespace(
    model="resnet10t", num_classes=10, in_chans=1, img_size=32,
    batch_size=64, epochs=int(os.environ.get("EPOCHS", 2)), lr=3e-3, weight_decay=0.05, warmup_epochs=0,
    amp=True, amp_dtype="float16", prefetcher=False, log_interval=10, seed=42,
)
torch.manual_seed(args.seed)

# ---- data -----------------------------------------------------------------
digits = load_digits()
x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
x = F.interpolate(x, size=(args.img_size, args.img_size), mode="bilinear", align_corners=False)
x = (x - 0.5) / 0.5
y = torch.tensor(digits.target, dtype=torch.long)
perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
train_idx, eval_idx = perm[:1500], perm[1500:]
loader_train = DataLoader(TensorDataset(x[train_idx], y[train_idx]),
                          batch_size=args.batch_size, shuffle=True, drop_last=True)
loader_eval = DataLoader(TensorDataset(x[eval_idx], y[eval_idx]), batch_size=args.batch_size)

# ---- model / optimizer / amp ---------------------------------------------
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = timm.create_model(args.model, pretrained=False, num_classes=args.num_classes,
                          in_chans=args.in_chans)
model.to(device=device)

optimizer = create_optimizer_v2(model, "adamw", lr=args.lr, weight_decay=args.weight_decay)

# resolve AMP arguments based on PyTorch / Apex availability
amp_dtype = torch.bfloat16 if args.amp_dtype == "bfloat16" else torch.float16
amp_autocast = suppress  # do nothing
loss_scaler = None
if args.amp and device.type == "cuda":
    amp_autocast = partial(torch.autocast, device_type=device.type, dtype=amp_dtype)
    if amp_dtype == torch.float16:
        # loss scaler only used for float16 (half) dtype, bfloat16 does not need it
        loss_scaler = torch.amp.GradScaler("cuda")
    print("Using native Torch AMP. Training in mixed precision.")
else:
    print("AMP not enabled. Training in float32.")

updates_per_epoch = len(loader_train)
lr_scheduler = CosineLRScheduler(optimizer, t_initial=args.epochs * updates_per_epoch,
                                 warmup_t=args.warmup_epochs * updates_per_epoch,
                                 lr_min=1e-5, t_in_epochs=False)
train_loss_fn = nn.CrossEntropyLoss(label_smoothing=0.1).to(device=device)
validate_loss_fn = nn.CrossEntropyLoss().to(device=device)


def train_one_epoch(epoch, model, loader, optimizer, loss_fn, lr_scheduler=None, history=None):
    batch_time_m, data_time_m, losses_m = AverageMeter(), AverageMeter(), AverageMeter()
    model.train()
    num_updates = epoch * updates_per_epoch
    last_idx = len(loader) - 1
    end = time.time()
    for batch_idx, (input, target) in enumerate(loader):
        last_batch = batch_idx == last_idx
        data_time_m.update(time.time() - end)
        if args.prefetcher and device.type == "cuda":
            input, target = input.cuda(non_blocking=True), target.cuda(non_blocking=True)
        else:
            input, target = input.to(device), target.to(device)

        with amp_autocast():
            output = model(input)
            loss = loss_fn(output, target)

        losses_m.update(loss.item(), input.size(0))
        if history is not None:
            history.append(losses_m.val)

        optimizer.zero_grad()
        if loss_scaler is not None:
            loss_scaler.scale(loss).backward()
            loss_scaler.step(optimizer)
            loss_scaler.update()
        else:
            loss.backward()
            optimizer.step()

        if device.type == "cuda":
            torch.cuda.synchronize()
        num_updates += 1
        batch_time_m.update(time.time() - end)
        if last_batch or batch_idx % args.log_interval == 0:
            lrl = [param_group["lr"] for param_group in optimizer.param_groups]
            lr = sum(lrl) / len(lrl)
            print(f"Train: {epoch} [{batch_idx:>3d}/{last_idx}]  Loss: {losses_m.val:#.3g} "
                  f"({losses_m.avg:#.3g})  Time: {batch_time_m.val:.3f}s  LR: {lr:.3e}")

        if lr_scheduler is not None:
            lr_scheduler.step_update(num_updates=num_updates, metric=losses_m.avg)
        end = time.time()
    return {"loss": losses_m.avg}


def validate(model, loader, loss_fn):
    losses_m, top1_m = AverageMeter(), AverageMeter()
    model.eval()
    with torch.no_grad():
        for input, target in loader:
            input, target = input.to(device), target.to(device)
            with amp_autocast():
                output = model(input)
            loss = loss_fn(output, target)
            acc1, = accuracy(output, target, topk=(1,))
            losses_m.update(loss.item(), input.size(0))
            top1_m.update(acc1.item(), output.size(0))
            if device.type == "cuda":
                torch.cuda.synchronize()
    return {"loss": losses_m.avg, "top1": top1_m.avg}


history = []
for epoch in range(args.epochs):
    train_metrics = train_one_epoch(epoch, model, loader_train, optimizer, train_loss_fn,
                                    lr_scheduler=lr_scheduler, history=history)
    eval_metrics = validate(model, loader_eval, validate_loss_fn)
    if lr_scheduler is not None:
        # step LR for next epoch
        lr_scheduler.step(epoch + 1, eval_metrics["top1"])
    print(f"Epoch {epoch}: train_loss={train_metrics['loss']:.4f} "
          f"eval_loss={eval_metrics['loss']:.4f} top1={eval_metrics['top1']:.2f}")

print("RESULT " + json.dumps({
    "first_loss": history[0],
    "last_loss": history[-1],
    "valid_accuracy": eval_metrics["top1"] / 100.0,
}))
