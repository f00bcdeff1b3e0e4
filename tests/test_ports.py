"""Real loops, written as their authors wrote them for CUDA, then ported.

Each loop below is the CUDA original with its port's edits marked `# was: ...`;
each test states how many lines the port edited and checks what a user would
notice: the loss falls, the compile count stays flat, every sample counts once.
"""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from conftest import BLOCK_TORCH_XLA, flat_digits, run_python, run_script, small_mlp
from tpu_utility import device_loader, get_device, masked_loader, step_optimizer, backend


def _per_epoch(start: int, totals: list[int]) -> list[int]:
    return [b - a for a, b in zip([start] + totals, totals)]


# ------------------------------------------------ word-language-model style LSTM
def make_text(n_tokens: int = 6000, vocab: int = 24, seed: int = 0) -> torch.Tensor:
    """Tokens from a random Markov chain with two likely successors per token: learnable."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, 2), generator=g)
    pick = (torch.rand(n_tokens, generator=g) < 0.2).long()
    tokens = [0]
    for k in range(n_tokens - 1):
        tokens.append(int(successors[tokens[-1], pick[k]]))
    return torch.tensor(tokens)


class RNNModel(nn.Module):
    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 64) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input, hidden):
        output, hidden = self.rnn(self.encoder(input), hidden)
        return self.decoder(output).view(-1, self.decoder.out_features), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, self.nhid), weight.new_zeros(1, bsz, self.nhid))


def batchify(data, bsz):
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


class BpttChunks(Dataset):
    """Chunk k is rows [k*bptt, (k+1)*bptt) of every stream: hidden state carries over."""

    def __init__(self, data, bptt):
        self.data, self.bptt = data, bptt

    def __len__(self):
        return (self.data.size(0) - 1) // self.bptt

    def __getitem__(self, k):
        i = k * self.bptt
        return self.data[i : i + self.bptt], self.data[i + 1 : i + 1 + self.bptt].reshape(-1)


def repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(repackage_hidden(v) for v in h)


def test_manual_update_lstm_language_model_port():
    # Edited lines: 2 (the device line and the for line); no optimizer, so no step line.
    torch.manual_seed(0)
    batch_size, bptt, lr, clip = 16, 20, 2.0, 0.25
    train_data = batchify(make_text(), batch_size)
    loader = DataLoader(BpttChunks(train_data, bptt), batch_size=None, shuffle=False)
    start = backend.compile_count()
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = RNNModel(24).to(device)
    criterion = nn.CrossEntropyLoss()
    losses, compiles = [], []
    for epoch in range(3):
        model.train()
        total_loss = 0.0
        hidden = model.init_hidden(batch_size)
        for data, targets in device_loader(loader):  # was: for data, targets in loader:
            data, targets = data.to(device), targets.to(device)
            hidden = repackage_hidden(hidden)
            model.zero_grad()
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            total_loss += loss.item()
        losses.append(total_loss / len(loader))
        compiles.append(backend.compile_count())
    assert device.type == "xla"
    assert losses[-1] < 0.6 * losses[0], losses
    assert compiles[0] == compiles[1] == compiles[2], f"compiles after each epoch: {compiles}"
    print(f"LSTM LM port: 2 edited lines, compiles per epoch {_per_epoch(start, compiles)}, losses {losses}")


def test_word_language_model_as_written_port():
    # pytorch/examples' word_language_model train(): batchify moves the corpus to the device and
    # get_batch slices it with Python ints, which on XLA would compile a graph per offset.
    # Edited lines: 3 (device, batchify, the for line) and 1 deleted (data, targets = get_batch(...)).
    torch.manual_seed(0)
    batch_size, bptt, lr, clip = 16, 20, 2.0, 0.25
    start = backend.compile_count()
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def batchify(data, bsz):
        nbatch = data.size(0) // bsz
        data = data.narrow(0, 0, nbatch * bsz)
        return data.view(bsz, -1).t().contiguous()  # was: ....contiguous().to(device)

    def get_batch(source, i):
        seq_len = min(bptt, len(source) - 1 - i)
        return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].view(-1)

    train_data = batchify(make_text(), batch_size)
    model = RNNModel(24).to(device)
    criterion = nn.CrossEntropyLoss()
    losses, compiles = [], []
    for epoch in range(3):
        model.train()
        total_loss, steps = 0.0, 0
        hidden = model.init_hidden(batch_size)
        # was: for batch, i in enumerate(range(0, train_data.size(0) - 1, bptt)):
        #          data, targets = get_batch(train_data, i)
        for batch, (data, targets) in enumerate(device_loader(get_batch(train_data, i) for i in range(0, train_data.size(0) - 1, bptt))):
            model.zero_grad()
            hidden = repackage_hidden(hidden)
            output, hidden = model(data, hidden)
            loss = criterion(output, targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            total_loss += loss.item()
            steps += 1
        losses.append(total_loss / steps)
        compiles.append(backend.compile_count())
    per_epoch = _per_epoch(start, compiles)
    assert losses[-1] < 0.6 * losses[0], losses
    assert per_epoch[1:] == [0, 0], f"compiles per epoch {per_epoch}"
    assert per_epoch[0] <= 6, f"a graph per offset would be {steps}: {per_epoch}"  # full batches and the short last one
    print(f"word_language_model port: 3 edited + 1 deleted line, compiles per epoch {per_epoch}")


# ------------------------------------------------------------ autocast + GradScaler
# conftest sets PJRT_DEVICE=CPU on import; a machine without torch_xla has none.
NO_XLA_PRELUDE = "import os, sys; sys.path.insert(0, 'tests'); import conftest; os.environ.pop('PJRT_DEVICE')\n"

AMP_LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from conftest import flat_digits, small_mlp
from tpu_utility import autocast, get_device, grad_scaler, backend

torch.manual_seed(0)
# Edited lines: 3 (device, scaler, autocast); scaler.scale/unscale_/step/update stay.
device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = small_mlp().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
scaler = grad_scaler(device)  # was: torch.amp.GradScaler("cuda")
loss_fn = nn.CrossEntropyLoss()
loader = DataLoader(flat_digits(), batch_size=32, shuffle=True, drop_last=True)
losses, compiles = [], []
for epoch in range(3):
    running = 0.0
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        with autocast(device, dtype=torch.float16):  # was: torch.autocast("cuda", dtype=torch.float16)
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        running += loss.item()
    losses.append(running / len(loader))
    compiles.append(backend.compile_count())
"""


def test_autocast_gradscaler_port_on_xla():
    ns: dict = {}
    start = backend.compile_count()
    exec(AMP_LOOP, ns)
    losses, compiles = ns["losses"], ns["compiles"]
    assert ns["device"].type == "xla"
    assert not ns["scaler"].is_enabled()  # bf16 (TPU) or float32 (XLA:CPU): nothing to scale
    assert losses[-1] < 0.5 * losses[0], losses
    assert compiles[0] == compiles[1] == compiles[2], f"compiles after each epoch: {compiles}"
    print(f"AMP port on XLA: 3 edited lines, compiles per epoch {_per_epoch(start, compiles)}")


def test_autocast_gradscaler_port_on_plain_cpu():
    # one thread for torch's CPU ops: an MLP gains nothing from a pool, whose threads spin on a loaded host
    r = run_python(BLOCK_TORCH_XLA + NO_XLA_PRELUDE + "import torch; torch.set_num_threads(1)\n" + AMP_LOOP
                   + "print('device', device.type, 'losses', losses[0], losses[-1])",
                   env={"PJRT_DEVICE": None})  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [ln.split() for ln in r.stdout.splitlines() if ln.startswith("device")]
    assert line[1] == "cpu"
    assert float(line[4]) < 0.5 * float(line[3]), line
    assert "no mixed precision on cpu" in r.stderr


# ---------------------------------------------------- masked evaluation, drop_last=False
class IndexTarget(Dataset):
    """Sample i has target i, so a sum of targets shows which samples were counted."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), torch.tensor(i)


def test_masked_evaluation_counts_each_sample_once_without_recompiling():
    # Edited lines: 3 (the device line, the for line, and the mask in the two sums: one line).
    n = 1001  # 15 full batches of 64 and a last one of 41
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = backend.compile_count()
    model = nn.Linear(4, 1).to(device)
    valid_loader = DataLoader(IndexTarget(n), batch_size=64, shuffle=False)  # drop_last=False
    compiles = []
    for _ in range(3):
        total = torch.zeros((), device=device)
        seen = torch.zeros((), device=device)
        with torch.no_grad():
            for (x, y), mask in device_loader(masked_loader(valid_loader)):  # was: for x, y in valid_loader:
                x, y = x.to(device), y.to(device)
                out = model(x)
                total, seen = total + (y * mask).sum(), seen + mask.sum()  # was: total + y.sum(), seen + len(y)
        compiles.append(backend.compile_count())
        assert total.item() == n * (n - 1) / 2  # each index exactly once
        assert seen.item() == n
    assert out.shape[0] == 64  # the last batch is full size too
    assert compiles[1] == compiles[2], f"compiles after each evaluation: {compiles}"
    print(f"masked evaluation port: 3 edited lines, compiles per pass {_per_epoch(start, compiles)}")


def _reference_evaluate(model, loader, device, context):
    """torchvision's classification reference, as written (its evaluate() under inference_mode)."""
    correct = torch.zeros((), device=device)
    with context():
        for image, target in loader:
            image, target = image.to(device, non_blocking=True), target.to(device, non_blocking=True)
            output = model(image)
            correct += (output.argmax(1) == target).sum()
    return correct.item() / len(loader.dataset)


def test_inference_mode_evaluation_fails_on_xla_as_written_and_runs_after_the_port():
    # Edited lines: 2 (the device line, and torch.inference_mode() -> inference_mode()).
    from tpu_utility import inference_mode

    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)).to(device).eval()
    loader = DataLoader(flat_digits(256), batch_size=64)
    with pytest.raises(RuntimeError, match="Cannot set version_counter for inference tensor"):
        _reference_evaluate(model, loader, device, torch.inference_mode)  # the cause, still there on XLA
    ported = _reference_evaluate(model, loader, device, inference_mode)
    expected = _reference_evaluate(model.cpu(), loader, torch.device("cpu"), torch.inference_mode)
    assert ported == pytest.approx(expected)  # the same figure as on plain CPU


# ------------------------------------------------------- optimizer built before the move
def _train_digits(build_optimizer_first: bool) -> list[float]:
    torch.manual_seed(0)
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = small_mlp()
    if build_optimizer_first:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model = model.to(device)
    else:
        model = model.to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(flat_digits(640), batch_size=32, shuffle=True, drop_last=True)
    losses = []
    for epoch in range(3):
        running = torch.zeros((), device=device)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            step_optimizer(optimizer)  # was: optimizer.step()
            running += loss.detach()
        losses.append(running.item() / len(loader))
    return losses


# ------------------------------------------- timm: create_model, create_optimizer_v2, its scheduler
def upscaled_digits(n: int | None = None) -> TensorDataset:
    """The first n digits at 32x32: a timm ResNet downsamples past 8x8."""
    x, y = flat_digits(n).tensors
    return TensorDataset(nn.functional.interpolate(x, size=32, mode="bilinear"), y)


def test_timm_model_optimizer_factory_and_scheduler_port():
    """timm's train.py loop as written: create_model, create_optimizer_v2 (norms and biases without weight
    decay), a cosine scheduler with warm-up stepped per epoch. Edited lines: 3 (device, loader, step)."""
    import timm
    from timm.optim import create_optimizer_v2
    from timm.scheduler import create_scheduler_v2

    torch.manual_seed(0)
    device = get_device()  # was: device = torch.device("cuda")
    model = timm.create_model("test_resnet", num_classes=10, in_chans=1).to(device)
    optimizer = create_optimizer_v2(model, opt="adamw", lr=3e-3, weight_decay=0.05)
    scheduler, num_epochs = create_scheduler_v2(optimizer, sched="cosine", num_epochs=3, warmup_epochs=1, warmup_lr=1e-4)
    # half the samples in batches of 32: as many updates as 1437 in 64s (24 an epoch), at half the compute
    loader = DataLoader(upscaled_digits(768), batch_size=32, shuffle=True, drop_last=True)
    loss_fn = nn.CrossEntropyLoss()
    start, totals, losses, lrs = backend.compile_count(), [], [], []
    for epoch in range(num_epochs):
        lrs.append(optimizer.param_groups[0]["lr"])  # the lr this epoch trains with
        model.train()
        running = torch.zeros((), device=device)
        for x, y in device_loader(loader):  # was: for x, y in loader: x, y = x.to(device), y.to(device)
            loss = loss_fn(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            step_optimizer(optimizer)  # was: optimizer.step()
            running += loss.detach()
        scheduler.step(epoch + 1)
        losses.append(running.item() / len(loader))
        totals.append(backend.compile_count())
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.05]  # timm's groups, kept
    assert lrs[0] == 1e-4 and lrs[1] > lrs[2] > lrs[0]  # warm-up, then the cosine: a new lr each epoch
    assert losses[-1] < 0.3 * losses[0], losses
    per_epoch = _per_epoch(start, totals)
    assert per_epoch[-1] == 0, per_epoch  # a new lr every epoch compiles nothing (5, 2, 0 measured)


def test_one_cycle_fit_gives_timms_optimizer_factory_the_model():
    """create_optimizer_v2's first parameter is model_or_params: one_cycle_fit passes the model, so timm
    builds its no-weight-decay groups (passed the bare parameters it would decay norms and biases too)."""
    from functools import partial

    import timm
    from timm.optim import create_optimizer_v2

    from tpu_utility import Callback, one_cycle_fit

    class Groups(Callback):
        def on_fit_start(self, loop):
            self.seen = [(len(g["params"]), g["weight_decay"]) for g in loop.optimizer.param_groups]

    torch.manual_seed(0)
    model, groups = timm.create_model("test_resnet", num_classes=10, in_chans=1), Groups()
    history = one_cycle_fit(model, upscaled_digits(768), epochs=2, max_lr=3e-3, batch_size=32, progress=False,
                            optimizer=partial(create_optimizer_v2, opt="adamw", weight_decay=0.05),
                            callbacks=[groups])  # fmt: skip
    assert [wd for _, wd in groups.seen] == [0.0, 0.05]
    assert sum(n for n, _ in groups.seen) == len(list(model.parameters()))
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss, history.records


def test_optimizer_built_before_the_move_is_refused_and_after_the_move_trains():
    # Edited lines: 2 (device line, step line), as in the README.
    with pytest.raises(RuntimeError, match=r"the optimizer was built before\s+model.to\(device\)") as err:
        _train_digits(build_optimizer_first=True)
    assert "are on the cpu" in str(err.value) and "optimizer = torch.optim.AdamW(model.parameters()" in str(err.value)
    losses = _train_digits(build_optimizer_first=False)
    assert losses[-1] < 0.5 * losses[0], losses


# ------------------------------------------------------------------ all cores
SPMD_HAND_LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from tpu_utility import device_loader, get_device, make_sampler, masked_loader, step_optimizer, use_all_cores, backend
from tpu_utility.demo import digits_datasets

train_ds, valid_ds = digits_datasets()
cores = use_all_cores()                    # added line: SPMD over every core
device = get_device()
sampler = make_sampler(train_ds)
print("cores", cores, "sampler", sampler)
torch.manual_seed(0)
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
loader = DataLoader(train_ds, batch_size=16 * cores, shuffle=True, drop_last=True)  # global batch
for epoch in range(3):
    running = torch.zeros((), device=device)
    for i, (x, y) in enumerate(device_loader(loader)):
        if epoch == 0 and i == 0:
            shards = backend.xla.local_shards(x)
            host = x.cpu()
            print("shards", len(shards), [tuple(t.shape) for _, t in shards])
            print("own", all(torch.equal(t, host[k * 16:(k + 1) * 16]) for k, (_, t) in enumerate(shards)))
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step_optimizer(optimizer)
        running += loss.detach()
    print("epoch", epoch, "loss", running.item() / len(loader), "compiles", backend.compile_count())
try:
    iter(device_loader(DataLoader(train_ds, batch_size=6)))
except ValueError as e:
    print("refused:", e)
seen = torch.zeros((), device=device)
ysum = torch.zeros((), device=device)
correct = torch.zeros((), device=device)
with torch.no_grad():
    for (x, y), mask in device_loader(masked_loader(valid_ds, 16 * cores)):
        correct += ((model(x).argmax(1) == y) & mask).sum()
        seen += mask.sum()
        ysum += (y * mask).sum()
print("valid", int(seen.item()), len(valid_ds), int(ysum.item()), int(valid_ds.tensors[1].sum()), correct.item() / len(valid_ds))
"""


def _rows(stdout: str, key: str) -> list[list[str]]:
    return [line.split() for line in stdout.splitlines() if line.startswith(key)]


@pytest.mark.multidevice
def test_hand_loop_on_four_devices_with_spmd():
    # Edited lines: 3 beyond the two-line port (use_all_cores, device_loader, batch_size x cores).
    r = run_python(SPMD_HAND_LOOP, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _rows(r.stdout, "cores") == [["cores", "4", "sampler", "None"]]  # one process: no sampler
    assert _rows(r.stdout, "shards") == [["shards", "4", "[(16,", "1,", "8,", "8),", "(16,", "1,", "8,", "8),",
                                          "(16,", "1,", "8,", "8),", "(16,", "1,", "8,", "8)]"]]  # fmt: skip
    assert _rows(r.stdout, "own") == [["own", "True"]]  # device k holds rows 16k..16k+15
    assert "refused: batch_size=6 does not split evenly over the 4 cores of the SPMD mesh" in r.stdout
    epochs = _rows(r.stdout, "epoch")
    print(r.stdout)
    losses = [float(e[3]) for e in epochs]
    assert losses[-1] < 0.5 * losses[0], losses
    assert epochs[1][5] == epochs[2][5], f"compiles grew: {epochs}"
    ((_, seen, n, ysum, ytrue, acc),) = _rows(r.stdout, "valid")
    assert seen == n and ysum == ytrue  # every validation sample once, over 4 cores
    assert float(acc) > 0.85


LAUNCH_SCRIPT = """
import torch
from torch import nn
from torch.utils.data import DataLoader
from tpu_utility import device_loader, get_device, launch, make_sampler, step_optimizer, backend
from tpu_utility.demo import digits_datasets

def train(index):
    train_ds, _ = digits_datasets()
    device = get_device()
    sampler = make_sampler(train_ds)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(train_ds, batch_size=32, sampler=sampler, shuffle=sampler is None, drop_last=True)
    for epoch in range(3):
        if sampler is not None:
            sampler.set_epoch(epoch)
        running = torch.zeros((), device=device)
        for x, y in device_loader(loader):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            step_optimizer(optimizer)
            running += loss.detach()
        print("epoch", index, device.type, backend.world_size(), running.item() / len(loader), backend.compile_count(), flush=True)

if __name__ == "__main__":
    launch(train)
    print("runtime started in the parent:", backend.runtime_started())
"""


def test_hand_loop_under_launch_with_one_device(tmp_path):
    r = run_script(tmp_path, "hand_launch.py", LAUNCH_SCRIPT, env={"CPU_NUM_DEVICES": "1"})
    assert "runtime started in the parent: False" in r.stdout
    epochs = _rows(r.stdout, "epoch")
    print(r.stdout)
    assert [e[1:4] for e in epochs] == [["0", "xla", "1"]] * 3
    assert float(epochs[-1][4]) < 0.5 * float(epochs[0][4]), epochs
    assert epochs[1][5] == epochs[2][5], f"compiles grew: {epochs}"


# ------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_get_device_and_fp16_port_with_a_real_scaler():
    code = BLOCK_TORCH_XLA + NO_XLA_PRELUDE + AMP_LOOP + """
print("device", device.type, type(scaler).__name__, scaler.is_enabled(), losses[0], losses[-1])
"""
    r = run_python(code, env={"PJRT_DEVICE": None})
    assert r.returncode == 0, r.stderr[-3000:]
    ((_, dev, kind, enabled, first, last),) = _rows(r.stdout, "device")
    assert (dev, kind, enabled) == ("cuda", "GradScaler", "True")
    assert float(last) < 0.5 * float(first)
