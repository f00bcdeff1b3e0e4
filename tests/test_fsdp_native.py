"""strategy="fsdp" on the native backend: FSDP2 (``fully_shard``) over several gloo processes on the CPU.

One launch script checks, with 2 and 4 processes started by ``one_cycle_fit(cores=N)``: per-epoch losses
equal to one unsharded process with the same global batch (SGD: a gradient summed over the ranks instead of
averaged would double every step, pytorch/pytorch#162338), each rank holding about 1/N of the parameter
bytes while it trains, the blocks checkpointed, ``best.pt`` loading strictly into the plain model with
logits equal to ``predict(history.model)``, and (2 processes) a run whose rank 0 is killed by SIGKILL after epoch 1
(the parent names it) and resumed in new processes ending bitwise equal to an uninterrupted one; ``predict`` and ``evaluate`` with ``cores=2, strategy="fsdp"`` (processes
launched, the model sharded while they run) give every row in dataset order and the figures of the replicated
model; a rank that raises mid-training ends the run at once with its error, not the collective timeout. A
``torchrun`` job of 2 processes checks the same losses, bytes, checkpoint, ``predict`` and ``evaluate`` from
inside a job, and a hand loop calling ``shard_model`` (losses those of one unsharded process; an optimizer
built before the call refused by name).
"""

import json
import os

import pytest

from conftest import run_python
from test_native import WARM, _ranks, _torchrun
from tpu_utility.sharding import FSDP
from tpu_utility.backend.native import NativeBackend
from tpu_utility.backend.xla import XlaBackend
from tpu_utility.training.strategies import Fsdp, FsdpProcess, choose_strategy

MODEL = """
import json, os, sys
import torch
from torch import nn
from torch.utils.data import TensorDataset


CALLS = [0]   # blocks' forwards run in this process: a checkpointed block runs again in the backward


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        CALLS[0] += torch.is_grad_enabled()
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    # three repeated blocks in a ModuleList: the blocks strategy='fsdp' finds by itself
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def blobs(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    return TensorDataset(torch.randn(n, 8, generator=g) + 2.0 * nn.functional.one_hot(y, 8).float(), y)


class Probe:
    # at the first step each rank writes what it holds
    def __init__(self, folder):
        self.folder = folder

    def on_fit_start(self, loop):
        self.calls = CALLS[0]   # a forked process starts with its parent's count

    def on_step_end(self, loop):
        if loop.step != 1:
            return
        from torch.distributed.tensor import DTensor
        from tpu_utility import backend

        params = list(loop.model.parameters())
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in params)
        total = sum(p.numel() * p.element_size() for p in params)
        checkpointed = CALLS[0] - self.calls   # after one step: 3 forwards, 3 recomputed
        from tpu_utility import device_bytes

        with open(os.path.join(self.folder, f"held{backend.rank()}.json"), "w") as f:
            json.dump({"held": held, "total": total, "checkpointed": checkpointed,
                       "public": device_bytes(loop.model).parameters,  # the same local shards
                       "sharded": all(isinstance(p, DTensor) for p in params)}, f)


class Killed:
    # rank 0 (the writer) dies by SIGKILL right after epoch 1's last.pt and best.pt, as a preempted or OOM-killed
    # process does: nothing after them runs (no fit end, no restore); rank 1 is left waiting in epoch 2
    order = 200

    def on_epoch_end(self, loop, record):
        import signal
        from tpu_utility import backend

        if record.epoch == 1 and backend.rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)


FIT = dict(epochs=2, max_lr=0.05, optimizer="sgd", progress=False, seed=0)


def best_logits_equal(history, folder):
    # best.pt strictly into the plain CPU model; its logits against predict(history.model)
    from tpu_utility import load_checkpoint, predict

    plain = Net()
    load_checkpoint(os.path.join(folder, "best.pt"), model=plain)
    x = blobs()[:][0]
    return bool(torch.equal(plain.eval()(x), predict(history.model, x, batch_size=16, progress=False)))


def sharded_step(model, batch):
    # predict_step that notes, per rank, whether every parameter is sharded while it predicts
    from torch.distributed.tensor import DTensor
    from tpu_utility import backend

    if all(isinstance(p, DTensor) for p in model.parameters()):
        open(os.path.join(os.environ["SHARDED_DIR"], f"predicted{backend.rank()}"), "w").close()
    return model(batch[0])


def inference_figures(**where):
    # predict and evaluate with strategy='fsdp' against the replicated model in this one process: 61 rows, batches
    # of 8 per process (the last padded), so a row out of order or a padding row kept would show
    from tpu_utility import evaluate, predict

    data = blobs(61, seed=3)
    with torch.no_grad():
        ref = Net().eval()(data.tensors[0])
    rows = predict(Net(), data, batch_size=8, strategy="fsdp", predict_step=sharded_step, progress=False, **where)
    figures = evaluate(Net(), data, batch_size=8, strategy="fsdp", **where)
    return {"rows": list(rows.shape), "max_diff": (rows - ref).abs().max().item(),
            "loss": figures["loss"], "ref_loss": nn.functional.cross_entropy(ref, data.tensors[1]).item(),
            "accuracy": figures["accuracy"], "ref_accuracy": (ref.argmax(1) == data.tensors[1]).float().mean().item()}


def plain_model(model):
    # handed back unwrapped: its own class, plain tensors, no FSDP hooks left
    from torch.distributed.tensor import DTensor

    return type(model) is Net and not any(isinstance(p, DTensor) for p in model.parameters())
"""


def check_inference(seen):
    # every row in dataset order, equal to the replicated model's; evaluate's figures equal
    assert seen["rows"] == [61, 3] and seen["max_diff"] <= 1e-5, seen
    assert seen["loss"] == pytest.approx(seen["ref_loss"], rel=1e-5), seen
    assert seen["accuracy"] == pytest.approx(seen["ref_accuracy"], abs=1e-6), seen


def test_fsdp_is_launched_natively_joined_in_a_job_and_refused_on_one_core():
    native = {"on": NativeBackend("cpu", "gloo")}  # the backend's capability (one process per device) decides, not a flag
    launched = choose_strategy("fsdp", 2, in_launch=False, **native)  # one_cycle_fit launches processes that shard
    assert (launched.name, launched.launches, launched.shards) == ("multiprocess-fsdp", True, True)
    assert launched.replica() == FsdpProcess(2, FSDP())  # each of them holds a shard
    joined = choose_strategy("fsdp", 1, in_launch=True, **native)  # a torchrun process shards with the job
    assert (type(joined), joined.name, joined.launches, joined.in_job) == (FsdpProcess, "fsdp", False, True)
    on_xla = choose_strategy("fsdp", 4, in_launch=False, on=XlaBackend())  # XLA: one process over the mesh
    assert (type(on_xla), on_xla.launches, on_xla.shards, on_xla.in_job) == (Fsdp, False, True, False)
    with pytest.raises(ValueError, match="this process is one replica of a multi-process launch"):
        choose_strategy("fsdp", 4, in_launch=True, on=XlaBackend())  # XLA's one-process SPMD cannot run inside a launch
    with pytest.raises(ValueError, match=r"given cores=1; give cores=N with N >= 2"):
        choose_strategy("fsdp", 1, in_launch=False, **native)


@pytest.mark.multidevice
def test_one_cycle_fit_predict_and_evaluate_launch_fsdp_processes_that_run_as_one_unsharded_process(tmp_path):
    # run as a notebook cell (the warm interpreter's __main__ has no file): one_cycle_fit, predict and evaluate
    # fork their processes, which then need not import torch afresh (about 3 CPU-s each, 14 of them); the
    # spawned launch of a script is test_native.py's test_one_cycle_fit_launches_its_own_replicas_and_learns
    r = run_python(WARM + MODEL + f"""
from tpu_utility import backend, load_checkpoint, one_cycle_fit
from tpu_utility.environment import is_interactive


class Boom:
    # rank 1 fails at its third step, in the middle of FSDP2's collectives
    def on_step_end(self, loop):
        if loop.step == 3 and backend.rank() == 1:
            raise ValueError("boom on rank 1")


out, seen = {str(tmp_path)!r}, {{"notebook": is_interactive()}}
os.environ["SHARDED_DIR"] = out   # the launched processes inherit it
seen["inference"] = inference_figures(cores=2)   # 2 processes launched for predict, 2 for evaluate
try:   # the collective timeout is an hour: had a rank waited for it, this script would be killed first
    one_cycle_fit(Net, blobs(), batch_size=8, cores=2, strategy="fsdp", callbacks=[Boom()], **FIT)
    seen["failed"] = "ran"
except RuntimeError as error:
    seen["failed"] = str(error)
for n in (2, 4):
    folder = os.path.join(out, f"n{{n}}")
    os.makedirs(folder)
    ref = one_cycle_fit(Net(), blobs(), batch_size=8 * n, **FIT)   # one process, the same global batch
    fsdp = one_cycle_fit(Net, blobs(), batch_size=8, cores=n, strategy="fsdp", callbacks=[Probe(folder)],
                         checkpoint_dir=os.path.join(folder, "ckpt"), **FIT)
    seen[n] = {{"ref": [r.train_loss for r in ref.records], "fsdp": [r.train_loss for r in fsdp.records],
               "summary": fsdp.summary, "held": [json.load(open(os.path.join(folder, f"held{{k}}.json")))
                                                 for k in range(n)],
               "best": best_logits_equal(fsdp, os.path.join(folder, "ckpt")), "plain": plain_model(fsdp.model)}}
    if n == 2:   # killed after epoch 1, then resumed in new processes: bitwise the uninterrupted run
        ckpt = os.path.join(folder, "killed")
        try:
            one_cycle_fit(Net, blobs(), batch_size=8, cores=n, strategy="fsdp", callbacks=[Killed()],
                          checkpoint_dir=ckpt, **FIT)
            killed = "ran"
        except RuntimeError as error:
            killed = str(error)
        resumed = one_cycle_fit(Net, blobs(), batch_size=8, cores=n, strategy="fsdp", checkpoint_dir=ckpt,
                                resume=True, **FIT)
        straight = fsdp.model.state_dict()
        seen[n]["resume"] = {{"killed": killed, "epochs": len(resumed.records),
                             "bitwise": all(torch.equal(v, straight[k]) for k, v in resumed.model.state_dict().items())}}
        # last.pt: the optimizer's state whole, in torch's own format, loads into a plain model's SGD too
        plain = Net()
        sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        load_checkpoint(os.path.join(folder, "ckpt", "last.pt"), model=plain, optimizer=sgd)
        seen[n]["last"] = all(sgd.state[p]["momentum_buffer"].shape == p.shape for p in plain.parameters())
print("SEEN", json.dumps(seen))
""", env={"TPU_UTILITY_COLLECTIVE_TIMEOUT": "3600"})
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.split("SEEN", 1)[1])
    assert seen["notebook"]  # the processes were forked, as from a notebook
    check_inference(seen["inference"])
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("predicted")) == ["predicted0", "predicted1"]
    # the launcher reports the first replica to end: rank 1 with its own error, or rank 0 naming it
    failed = seen["failed"]
    assert "boom on rank 1" in failed and ("Process 1 terminated" in failed or "rank 1 failed (ValueError" in failed), failed
    assert "timed out" not in failed and "SIGABRT" not in failed, failed  # not the timeout, not gloo's abort
    for n in ("2", "4"):
        run = seen[n]
        assert run["summary"].startswith(f"one_cycle_fit: fsdp on {n} cpu core(s) | batch 8 per core, {8 * int(n)} global")
        # a sum over the ranks in place of the mean would double each step: the losses would part at epoch 2
        assert run["fsdp"] == pytest.approx(run["ref"], rel=1e-4), run
        assert run["fsdp"][1] < run["fsdp"][0]
        held = [h["held"] for h in run["held"]]
        assert all(h["sharded"] and h["checkpointed"] == 2 * 3 for h in run["held"]), run["held"]
        assert [h["public"] for h in run["held"]] == held, run["held"]  # device_bytes reads the same shards
        assert sum(held) == run["held"][0]["total"] and max(held) <= 1.1 * sum(held) / int(n), held  # 1/N each
        assert run["best"] and run["plain"], run
    # the parent names the dead replica and its signal: rank 1 fails only after rank 0 is gone (gloo's "Connection
    # closed by peer"), and where both have ended the launcher's poll reports them in rank order
    resume, killed = seen["2"]["resume"], seen["2"]["resume"]["killed"]
    assert "replica 0 of 2 died" in killed and "SIGKILL" in killed, resume
    assert resume["epochs"] == 2 and resume["bitwise"], resume
    assert seen["2"]["last"]


@pytest.mark.multidevice
def test_inside_a_torchrun_job_fsdp_and_shard_model_shard_and_run_as_one_process(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    reference = run_python(WARM + MODEL + """
from tpu_utility import one_cycle_fit

print("REF", json.dumps([r.train_loss for r in one_cycle_fit(Net(), blobs(), batch_size=16, **FIT).records]))
""")
    assert reference.returncode == 0, reference.stderr[-3000:]
    script = tmp_path / "job.py"
    script.write_text(MODEL + f"""
from tpu_utility import backend, one_cycle_fit, predict, shard_model, step_optimizer

folder = {str(out)!r}
os.environ["SHARDED_DIR"] = folder
os.makedirs(os.path.join(folder, "held"), exist_ok=True)
history = one_cycle_fit(Net(), blobs(), batch_size=8, strategy="fsdp", callbacks=[Probe(os.path.join(folder, "held"))],
                        checkpoint_dir=os.path.join(folder, "ckpt"), **FIT)
figures = dict(losses=[r.train_loss for r in history.records], summary=history.summary, plain=plain_model(history.model),
               best=best_logits_equal(history, os.path.join(folder, "ckpt")),
               held=json.load(open(os.path.join(folder, "held", f"held{{backend.rank()}}.json"))))
figures["inference"] = inference_figures()   # the job's 2 processes hold the shards
try:   # each process its own data: no row could run through both shards
    predict(Net(), blobs(61, seed=backend.rank()), batch_size=8, strategy="fsdp", progress=False)
    figures["own_data"] = "ran"
except ValueError as error:
    figures["own_data"] = f"{{type(error).__name__}}: {{error}}"


def hand_loop(model, optimizer):
    # the porting guide's loop with shard_model: each process its 8 rows of a global batch of 16
    rank, data, losses = backend.rank(), blobs(), []
    for k in range(0, 64, 16):
        x, y = data[k + 8 * rank: k + 8 * rank + 8]
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        step_optimizer(optimizer)
        losses.append(backend.current().processes.all_reduce([loss.detach()])[0].item() / 2)   # the global batch's mean loss
    return losses


model = shard_model(Net())
figures["shard_model"] = hand_loop(model, torch.optim.SGD(model.parameters(), lr=0.1))
from torch.distributed.tensor import DTensor
figures["hand_sharded"] = all(isinstance(p, DTensor) for p in model.parameters())
reference = Net()
figures["hand_ref"] = []
optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
for k in range(0, 64, 16):   # one unsharded process, the whole global batch
    x, y = blobs()[k: k + 16]
    optimizer.zero_grad()
    loss = nn.functional.cross_entropy(reference(x), y)
    loss.backward()
    optimizer.step()
    figures["hand_ref"].append(loss.item())
early = Net()
stale = torch.optim.SGD(early.parameters(), lr=0.1)   # built before the call: it holds the unsharded parameters
shard_model(early)
try:
    hand_loop(early, stale)
    figures["stale"] = "trained"
except RuntimeError as error:
    figures["stale"] = str(error)
with open(os.path.join(folder, f"rank{{backend.rank()}}.json"), "w") as f:
    json.dump(figures, f)
""")
    _torchrun(script, 2)
    ref = json.loads(reference.stdout.split("REF", 1)[1])
    ranks = _ranks(out, 2)
    assert ranks[0]["losses"] == ranks[1]["losses"] == pytest.approx(ref, rel=1e-4), (ranks, ref)
    assert ranks[0]["summary"].startswith("one_cycle_fit: fsdp on 2 cpu core(s)")
    held = [rank["held"]["held"] for rank in ranks]
    assert sum(held) == ranks[0]["held"]["total"] and max(held) <= 0.55 * sum(held), held
    for rank in ranks:
        assert rank["held"]["sharded"] and rank["held"]["checkpointed"] == 2 * 3 and rank["best"] and rank["plain"], rank
    assert os.path.exists(os.path.join(out, "ckpt", "best.pt"))
    for rank in ranks:  # predict and evaluate sharded over the job's processes
        check_inference(rank["inference"])
    assert sorted(f for f in os.listdir(out) if f.startswith("predicted")) == ["predicted0", "predicted1"]
    for rank in ranks:  # refused alike on both, before any batch
        assert rank["own_data"].startswith("ReplicaMismatch: predict with strategy='fsdp' runs one model sharded"), rank
    # shard_model in a hand loop: FSDP2 over the job, the global batch's losses those of one unsharded process (SGD)
    assert ranks[0]["hand_sharded"] and ranks[0]["shard_model"] == pytest.approx(ranks[0]["hand_ref"], rel=1e-5), ranks[0]
    assert ranks[0]["shard_model"][-1] < ranks[0]["shard_model"][0]
    for rank in ranks:  # an optimizer built before shard_model: refused at its first step_optimizer, by name
        assert "the optimizer holds 10 of its 10 parameters as they were before shard_model(model)" in rank["stale"]
