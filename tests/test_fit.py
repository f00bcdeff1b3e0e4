"""one_cycle_fit on one XLA:CPU device: learning, no recompiles or syncs, bf16,
checkpoints and resume, tied weights, non-finite loss, custom steps, find_lr."""

import importlib.metadata
import math
import os

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from conftest import BLOCK_TORCH_XLA, flat_digits, run_python, small_mlp, tiny_cnn
from tpu_utility import find_lr, one_cycle_fit
from tpu_utility.training.schedule import one_cycle

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 3, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


def test_learns_digits_without_recompiles_or_host_syncs(digits):
    train, valid = digits
    torch.manual_seed(0)
    history = fit(tiny_cnn(), train, valid_data=valid, epochs=4, max_lr=1e-2)  # 0.983 when written
    first, last = history.records[0], history.records[-1]
    assert last.train_loss < 0.3 * first.train_loss
    assert last.metrics["accuracy"] >= 0.95
    assert [r.compiles for r in history.records] == [first.compiles] * 4  # flat after epoch 1
    assert all(r.host_syncs == 0 for r in history.records)  # no .item() in the loop
    assert all(r.transfers == 1 for r in history.records)  # one read per epoch, not per step
    steps = history.records[-1].epoch * (len(train) // 32)
    assert last.lr == pytest.approx(one_cycle(steps - 1, steps, 1e-2)[0])
    assert history.model is not None and next(history.model.parameters()).device.type == "xla"


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_schedule_meeting_the_models_round_scalars_compiles_nothing_new(optimizer):
    # issue 29: torch_xla shares a scalar upload with every equal scalar of a step's graph. One-cycle's momentum
    # passes exactly 0.9 (the middle of 0.85 -> 0.95), dropout's keep probability; its peak lr here, 1e-2, is
    # AdamW's weight decay. Each time the two merged into one input and the step compiled anew: [6, 6, 7, 7]
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.1), nn.Linear(16, 2))
    history = one_cycle_fit(model, TensorDataset(x, (x[:, 0] > 0).long()), epochs=4, max_lr=1e-2, batch_size=32,
                            optimizer=optimizer, progress=False)  # fmt: skip
    assert 0.9 in [round(m, 12) for m in history.step_momenta] and max(history.step_lrs) == 1e-2  # they meet
    compiles = [r.compiles for r in history.records]
    assert compiles == [compiles[0]] * 4, compiles
    assert history.records[-1].train_loss < history.records[0].train_loss


def test_sgd_follows_the_schedule_too(digits):
    history = fit(small_mlp(), digits[0], valid_data=digits[1], optimizer="sgd", max_lr=0.05)
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    assert history.records[0].compiles == history.records[-1].compiles


def test_bf16_trains_on_xla_cpu(digits):
    history = fit(small_mlp(), digits[0], valid_data=digits[1], precision="bf16", max_lr=1e-2)
    assert "bf16 (model and inputs cast)" in history.summary
    assert next(history.model.parameters()).dtype == torch.float32  # trained by casting, given back as found
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    assert history.records[-1].metrics["accuracy"] > 0.8


def test_checkpoint_loads_on_cpu_without_torch_xla(tmp_path):
    fit(small_mlp(), flat_digits(), epochs=2, checkpoint_dir=str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "history.csv", "last.pt"]  # no temporary files left
    r = run_python(BLOCK_TORCH_XLA + f"""
import torch
state = torch.load({str(tmp_path / "last.pt")!r}, weights_only=True)
devices = {{t.device.type for t in state["model"].values()}}
print("epoch", state["epoch"], "step", state["step"], "devices", sorted(devices))
print("keys", sorted(state))
print("history", len(state["history"]), "torch_xla", state["versions"]["torch_xla"])
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model.load_state_dict(state["model"])
print("loaded")
""")
    assert r.returncode == 0, r.stderr
    assert "epoch 2 step 88 devices ['cpu']" in r.stdout
    assert "keys ['callbacks', 'config', 'epoch', 'format', 'history', 'model', 'monitor', 'optimizer', 'optimizer_class', 'precision', 'rng', 'run', 'scaler', 'step', 'total_steps', 'versions']" in r.stdout
    assert f"history 2 torch_xla {importlib.metadata.version('torch_xla')}" in r.stdout
    assert "loaded" in r.stdout


class _StopAfter:
    """A train_step equal to the default that raises after `limit` calls (a crash)."""

    def __init__(self, limit):
        self.calls, self.limit = 0, limit

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls > self.limit:
            raise KeyboardInterrupt("simulated crash")
        x, y = batch
        return nn.functional.cross_entropy(model(x).float(), y)


def _dropout_mlp():
    torch.manual_seed(1)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 10))


def test_resume_after_a_crash_matches_an_uninterrupted_run(tmp_path):
    data = flat_digits()
    straight = fit(_dropout_mlp(), data, epochs=4, train_step=_StopAfter(10**9), seed=3)
    per_epoch = len(data) // 32
    with pytest.raises(KeyboardInterrupt):
        fit(_dropout_mlp(), data, epochs=4, train_step=_StopAfter(2 * per_epoch + 5), seed=3,
            checkpoint_dir=str(tmp_path))  # fmt: skip
    resumed = fit(_dropout_mlp(), data, epochs=4, train_step=_StopAfter(10**9), seed=3,
                  checkpoint_dir=str(tmp_path), resume=True)  # fmt: skip
    assert [r.epoch for r in resumed.records] == [1, 2, 3, 4]
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.equal(a.cpu(), b.cpu())  # bitwise
    assert resumed.records[-1].train_loss == straight.records[-1].train_loss


def test_a_crash_while_writing_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import tpu_utility.checkpoint as ckpt

    real_save, saves = torch.save, []

    def failing_save(obj, f, *a, **k):
        saves.append(obj["epoch"])
        if obj["epoch"] == 2:
            f.write(b"half a checkpoint")
            raise OSError("disk full")
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        fit(small_mlp(), flat_digits(), epochs=3, checkpoint_dir=str(tmp_path))
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert saves == [1, 1, 2]  # last.pt and best.pt after epoch 1, then last.pt fails
    assert sorted(os.listdir(tmp_path)) == ["best.pt", "history.csv", "last.pt"]
    assert ckpt.load_checkpoint(str(tmp_path))["epoch"] == 1


class TiedLM(nn.Module):
    def __init__(self, vocab=10, dim=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(dim=1))


class _TokenTask(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, 10, (5,), generator=g)
        return tokens, tokens[0]


def test_tied_weights_stay_tied_on_device_and_through_a_checkpoint(tmp_path):
    from tpu_utility import load_checkpoint

    history = fit(TiedLM(), _TokenTask(), epochs=2, max_lr=1e-2, checkpoint_dir=str(tmp_path))
    model = history.model
    assert model.out.weight is model.emb.weight
    assert model.out.weight.device.type == "xla"
    state = load_checkpoint(str(tmp_path))
    fresh = TiedLM()
    fresh.load_state_dict(state["model"])
    assert fresh.out.weight is fresh.emb.weight
    assert torch.equal(fresh.emb.weight, model.emb.weight.cpu())


def test_nan_loss_stops_with_epoch_and_step_and_keeps_the_good_checkpoint(tmp_path):
    class NanAt(_StopAfter):
        def __call__(self, model, batch):
            loss = super().__call__(model, batch)
            return loss * float("nan") if self.calls == 44 + 3 else loss

    with pytest.raises(FloatingPointError, match=r"NaN or inf in epoch 2 at step 3 of 44"):
        fit(small_mlp(), flat_digits(), epochs=3, train_step=NanAt(10**9), checkpoint_dir=str(tmp_path))
    from tpu_utility import load_checkpoint

    state = load_checkpoint(str(tmp_path))
    assert state["epoch"] == 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())


class _TwoInputs(Dataset):
    def __init__(self):
        self.base = flat_digits()

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y = self.base[i]
        return {"left": x[:, :4], "right": x[:, 4:], "label": y}


class TwoTower(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(32, 32), nn.Linear(32, 32)
        self.head = nn.Linear(64, 10)

    def forward(self, left, right):
        return self.head(torch.relu(torch.cat([self.left(left.flatten(1)), self.right(right.flatten(1))], 1)))


def test_custom_steps_train_a_multi_input_model():
    def train_step(model, batch):
        return nn.functional.cross_entropy(model(batch["left"], batch["right"]), batch["label"])

    def eval_step(model, batch):
        return model(batch["left"], batch["right"]), batch["label"]

    history = fit(TwoTower(), _TwoInputs(), valid_data=_TwoInputs(), train_step=train_step,
                  eval_step=eval_step, metrics="accuracy", max_lr=1e-2)  # fmt: skip
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    assert history.records[-1].metrics["accuracy"] > 0.9


def test_default_step_explains_an_unexpected_batch():
    with pytest.raises(TypeError, match=r"a dict batch must hold them under 'labels'.*has \['label', 'left', 'right'\].*train_step"):
        fit(TwoTower(), _TwoInputs(), epochs=1)
    with pytest.raises(TypeError, match=r"expects batches of \(inputs, targets\), \(\*inputs, targets\) or a dict .* batch is list of length 1"):
        fit(TwoTower(), TensorDataset(torch.ones(64, 4)), epochs=1)


def test_a_dataloader_is_accepted_and_its_batch_size_kept(digits):
    loader = DataLoader(digits[0], batch_size=16, shuffle=True)
    history = one_cycle_fit(small_mlp(), loader, epochs=1, max_lr=3e-3, progress=False)
    assert "batch 16 per core" in history.summary
    with pytest.raises(ValueError, match=r"batch_size=32 differs from train_data.batch_size=16"):
        one_cycle_fit(small_mlp(), loader, epochs=1, max_lr=3e-3, batch_size=32, progress=False)


def test_progress_prints_summary_and_epoch_lines_and_false_is_silent(digits, capsys):
    fit(small_mlp(), digits[0], valid_data=digits[1], epochs=2, progress=True)
    out = capsys.readouterr()
    assert "one_cycle_fit: single on 1 CPU core(s) | batch 32 per core, 32 global" in out.out
    assert "max_lr 3.00e-03 (not scaled by cores)" in out.out
    assert "epoch 2/2  train_loss" in out.out and "accuracy" in out.out
    fit(small_mlp(), digits[0], valid_data=digits[1], epochs=1, progress=False)
    out = capsys.readouterr()
    assert out.out == "" and "epoch 1/1" not in out.err


def test_history_plot_writes_a_png(digits, tmp_path):
    history = fit(small_mlp(), digits[0], valid_data=digits[1], epochs=2)
    path = tmp_path / "history.png"
    history.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_find_lr_sweeps_stops_on_divergence_and_restores_weights(tmp_path):
    model = small_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = find_lr(model, flat_digits(), batch_size=32, num_steps=200, end_lr=100.0)
    assert result.diverged and len(result.lrs) < 200
    assert result.lrs == sorted(result.lrs) and result.lrs[0] == pytest.approx(1e-7)
    assert 1e-5 < result.suggested_lr < 1.0
    for name, value in model.state_dict().items():
        assert torch.equal(value.cpu(), before[name]), name
    result.plot(str(tmp_path / "lr.png"))
    assert (tmp_path / "lr.png").exists()


def test_find_lr_compiles_do_not_grow_with_the_number_of_parameters():
    # The sweep stops inside a step; its last update was left pending, and moving the model back then
    # compiled one graph per parameter (48 compiles, 122 s for a 30-step sweep of a 2-layer BERT).
    from tpu_utility import backend

    torch.manual_seed(0)
    deep = nn.Sequential(nn.Flatten(), nn.Linear(64, 13), *[nn.Sequential(nn.Linear(13, 13), nn.Tanh()) for _ in range(20)],
                         nn.Linear(13, 10))  # fmt: skip
    parameters = len(list(deep.parameters()))
    before = backend.compile_count()
    find_lr(deep, flat_digits(512), batch_size=32, num_steps=5)
    assert backend.compile_count() - before < parameters // 4, (backend.compile_count() - before, parameters)
    assert all(p.device.type == "cpu" for p in deep.parameters())


def test_accumulate_steps_shortens_the_schedule_and_still_learns(digits):
    history = fit(small_mlp(), digits[0], valid_data=digits[1], accumulate_steps=2, max_lr=1e-2)
    per_core = len(digits[0]) // 32
    assert f"{per_core} batches/epoch per core x 3 epochs = {per_core // 2 * 3} optimizer steps" in history.summary
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    assert history.records[0].compiles == history.records[-1].compiles


def test_step_optimizer_clips_on_xla():
    from tpu_utility import get_device, step_optimizer

    device = get_device()
    model = small_mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    (model(torch.randn(8, 1, 8, 8, device=device)).pow(2).sum() * 1000).backward()
    step_optimizer(opt, max_grad_norm=0.5)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()])).item()
    assert norm == pytest.approx(0.5, rel=1e-4)


def test_a_users_own_torch_adamw_also_trains_without_recompiles(digits):
    # the default "adamw" is torch_xla's fused sync-free AdamW; a user's own torch AdamW gets its
    # schedule through device tensors instead, so a changing lr never changes the graph either
    history = fit(small_mlp(), digits[0], valid_data=digits[1], epochs=4,
                  optimizer=lambda params: torch.optim.AdamW(params, weight_decay=0.05))  # fmt: skip
    assert "(torch_xla sync-free, fused)" not in history.summary
    assert [r.compiles for r in history.records] == [history.records[0].compiles] * 4
    assert all(r.host_syncs == 0 for r in history.records)
    assert history.records[-1].train_loss < 0.5 * history.records[0].train_loss
    default = fit(small_mlp(), digits[0], epochs=1)
    assert "| adamw (torch_xla sync-free, fused)" in default.summary


# ------------------------------------------------------------- the loop's own per-step work (issue 29, item 9)
@pytest.mark.parametrize("bad_at", [None, 0, 3, 4, 5, 10])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_epoch_loss_and_its_first_bad_batch_are_exact_across_the_additions(bad_at, bad):
    from tpu_utility.training.trainer import LossTally

    torch.manual_seed(0)
    losses = [torch.rand(()) for _ in range(11)]
    if bad_at is not None:
        losses[bad_at] = torch.tensor(bad)
    tally = LossTally(torch.device("cpu"), lazy=False)
    tally.every = 4  # 11 losses: added up after 4 and 8, the last 3 by sums()
    for loss in losses:
        tally.make_room()
        tally.keep(loss)
    loss_sum, finite = (float(t) for t in tally.sums())
    if bad_at is None:
        assert loss_sum == pytest.approx(float(sum(losses)), rel=1e-6) and finite == 11
    else:  # the count of batches before the first bad one, whatever came after it
        assert not math.isfinite(loss_sum) and finite == bad_at


def test_a_step_traces_what_the_fused_hand_loop_traces_and_a_late_nan_is_named():
    """The step graph one_cycle_fit runs has the IR nodes of torch_xla's recommended loop (MpDeviceLoader,
    the fused AdamW, xm.optimizer_step) and one more, the loss kept as an output for the epoch's figure:
    the loop's bookkeeping traces nothing else per step (it traced 12 more, the running loss sum and its
    finite count). 70 steps an epoch: the losses are added up after 64 in a graph of their own,
    compiled in epoch 1 like the rest."""
    import statistics

    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met
    import torch_xla.distributed.parallel_loader as pl
    from torch_xla.amp import syncfree

    def step_nodes() -> int:  # the commonest graph size: the steps' (the epoch's read and additions are rare)
        return int(statistics.mode(size for _, size in met.metric_data("TensorsGraphSize")[2]))

    data = flat_digits(70 * 16)
    device = torch_xla.device()
    torch.manual_seed(0)
    model = small_mlp().to(device)
    opt = syncfree.AdamW(model.parameters(), lr=1e-3)
    found_inf = torch.zeros((), device=device)
    met.clear_all()
    for x, y in pl.MpDeviceLoader(DataLoader(data, batch_size=16, drop_last=True), device):
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        xm.optimizer_step(opt, optimizer_args={"found_inf": found_inf})
    xm.wait_device_ops()
    hand = step_nodes()
    met.clear_all()
    torch.manual_seed(0)
    history = fit(small_mlp(), data, batch_size=16, epochs=2, schedule="constant")
    assert step_nodes() == hand + 1, (step_nodes(), hand)
    assert history.records[0].compiles == history.records[1].compiles  # the addition compiled in epoch 1
    assert all(r.host_syncs == 0 and r.transfers == 1 for r in history.records)

    class NanAt(_StopAfter):  # batch 66 of epoch 2: after the first addition
        def __call__(self, model, batch):
            loss = super().__call__(model, batch)
            return loss * float("nan") if self.calls == 70 + 66 else loss

    with pytest.raises(FloatingPointError, match=r"NaN or inf in epoch 2 at step 66 of 70"):
        fit(small_mlp(), data, batch_size=16, epochs=2, train_step=NanAt(10**9))
