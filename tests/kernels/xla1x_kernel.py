# Super fast PyTorch on TPU: 8 cores, xmp.spawn, ParallelLoader.
# Written for torch_xla 1.7 (XRT) on Kaggle TPU v3-8, in the style of the
# "Training on 8 TPU cores" kernels: MpModelWrapper + MpSerialExecutor so the
# model weights and the dataset live in host memory only once.
import gc
import json
import os
import time
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import torch_xla.core.xla_model as xm
import torch_xla.distributed.parallel_loader as pl
import torch_xla.distributed.xla_multiprocessing as xmp

warnings.filterwarnings("ignore")

OUT_DIR = os.environ.get("OUT_DIR", ".")

FLAGS = {
    "learning_rate": 2e-3,
    "batch_size": 16,      # per core
    "num_epochs": int(os.environ.get("EPOCHS", 3)),
    "num_workers": 0,
    "log_steps": 20,
    "seed": 1234,
}


def seed_everything(seed):
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)


seed_everything(FLAGS["seed"])


class Net(nn.Module):
    def __init__(self, n_classes=10):
        super().__init__()
        self.fc1 = nn.Linear(64, 128)
        self.fc2 = nn.Linear(128, 64)
        self.drop = nn.Dropout(0.1)
        self.out = nn.Linear(64, n_classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = self.drop(F.relu(self.fc2(x)))
        return self.out(x)


# Only instantiate the model weights once in memory (shared by the 8 forked processes).
MX = xmp.MpModelWrapper(Net())
# Serializes the dataset loading so the host RAM does not blow up.
SERIAL_EXEC = xmp.MpSerialExecutor()


def get_dataset():
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=0.2, random_state=42, stratify=y)
    train_ds = TensorDataset(torch.from_numpy(x_tr), torch.from_numpy(y_tr))
    valid_ds = TensorDataset(torch.from_numpy(x_va), torch.from_numpy(y_va))
    return train_ds, valid_ds


def _run(flags):
    torch.manual_seed(flags["seed"])
    train_ds, valid_ds = SERIAL_EXEC.run(get_dataset)

    train_sampler = DistributedSampler(
        train_ds, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=True)
    valid_sampler = DistributedSampler(
        valid_ds, num_replicas=xm.xrt_world_size(), rank=xm.get_ordinal(), shuffle=False)
    train_loader = DataLoader(train_ds, batch_size=flags["batch_size"], sampler=train_sampler,
                              num_workers=flags["num_workers"], drop_last=True)
    valid_loader = DataLoader(valid_ds, batch_size=flags["batch_size"], sampler=valid_sampler,
                              num_workers=flags["num_workers"], drop_last=True)

    device = xm.xla_device()
    model = MX.to(device)
    # scale the learning rate with the number of cores
    lr = flags["learning_rate"] * xm.xrt_world_size()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()

    first_loss = last_loss = None
    acc = 0.0
    for epoch in range(flags["num_epochs"]):
        gc.collect()
        t0 = time.time()
        # ---- train ----
        model.train()
        para_loader = pl.ParallelLoader(train_loader, [device])
        for step, (data, target) in enumerate(para_loader.per_device_loader(device)):
            optimizer.zero_grad()
            output = model(data)
            loss = criterion(output, target)
            loss.backward()
            xm.optimizer_step(optimizer)
            if first_loss is None:
                first_loss = loss.item()
            if step % flags["log_steps"] == 0:
                xm.master_print(f"epoch {epoch} step {step} loss={loss.item():.4f}")
        last_loss = loss.item()
        del para_loader
        gc.collect()

        # ---- eval ----
        model.eval()
        correct, total = 0, 0
        para_loader = pl.ParallelLoader(valid_loader, [device])
        with torch.no_grad():
            for data, target in para_loader.per_device_loader(device):
                output = model(data)
                pred = output.argmax(dim=1)
                correct += pred.eq(target).sum().item()
                total += target.size(0)
        acc = xm.mesh_reduce("acc", correct / max(total, 1), np.mean)
        xm.master_print(f"epoch {epoch} valid_acc={acc:.4f} time={time.time() - t0:.1f}s")
        xm.rendezvous("epoch_end")

    if xm.is_master_ordinal():
        print("Saving model to", OUT_DIR)
    xm.save(model.state_dict(), os.path.join(OUT_DIR, "model.bin"))

    if xm.is_master_ordinal():
        print("RESULT " + json.dumps({
            "first_loss": first_loss,
            "last_loss": last_loss,
            "valid_accuracy": float(acc),
        }))


# Start training processes
def _mp_fn(rank, flags):
    torch.set_default_tensor_type("torch.FloatTensor")
    _run(flags)


if __name__ == "__main__":
    xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=8, start_method="fork")
