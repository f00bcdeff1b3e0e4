"""Replicas that must agree are checked to agree, and one that stops answering is named.

The native backend with gloo on the CPU: our launcher (2 processes) and two ``torchrun``
agents on localhost as two "nodes", each with its own checkpoint folder for a disk.
"""

import json
import os
import socket

import pytest

from conftest import run_python, run_script
from native_jobs import WARM, torchrun
from test_native import COMMON, _ranks, replicas
from tpu_utility.backend.native import _PEER_LEFT

pytestmark = pytest.mark.multidevice


# Run by the replica jobs of tests/test_native.py (``replicas``: 2 and 4 processes), after other scenarios.
DIFFER = """
from tpu_utility import evaluate, one_cycle_fit, predict


def attempt(fn):
    try:
        fn()
        return "ran"
    except Exception as error:
        return f"{type(error).__name__}: {error}"


def differ_work(rank, out):
    steps = []
    class Count:
        def on_step_end(self, loop):
            steps.append(rank)

    def fit(model=None, train=None, **kwargs):
        return one_cycle_fit(model or mlp(), train or blobs(96), epochs=1, max_lr=1e-2, batch_size=8,
                             progress=False, callbacks=[Count()], **kwargs)

    seen = {
        "sizes": attempt(lambda: fit(train=blobs(96 if rank == 0 else 64))),
        "shards": attempt(lambda: fit(train=blobs(96, seed=rank))),
        "valid": attempt(lambda: fit(valid_data=blobs(40 if rank == 0 else 56, seed=5))),
        "model": attempt(lambda: fit(model=nn.Sequential(nn.Linear(8, 16 + rank), nn.ReLU(), nn.Linear(16 + rank, 3)))),
        "argument": attempt(lambda: fit(max_grad_norm=1.0 + rank)),
        "evaluate": attempt(lambda: evaluate(mlp(), blobs(50, seed=rank), batch_size=8)),
    }
    seen["steps before the same run"] = len(steps)
    seen["same"] = attempt(lambda: fit(valid_data=blobs(40, seed=5)))
    seen["steps"] = len(steps)
    mine = blobs(101 if rank == 0 else 57, seed=rank)   # each replica its own data, of its own length
    preds = predict(mlp(), mine, batch_size=8, progress=False)
    seen["own rows"] = [list(preds.shape), torch.allclose(preds, mlp().eval()(mine.tensors[0]), atol=1e-5)]
    write(out, rank, **seen)
"""


@pytest.mark.parametrize("nprocs", [2, 4])
def test_replicas_given_different_things_are_refused_alike_before_any_step(tmp_path_factory, nprocs):
    ranks = _ranks(os.path.join(replicas(tmp_path_factory, nprocs)["out"], "differ"), nprocs)
    assert ranks[0].pop("own rows") == [[101, 3], True]  # rank 0's own 101 rows: model(its data), row for row
    assert all(seen.pop("own rows") == [[57, 3], True] for seen in ranks[1:])
    assert all(seen == ranks[0] for seen in ranks)  # the same error, word for word, on every replica
    seen, others = ranks[0], "rank 1" if nprocs == 2 else "ranks 1, 2, 3"
    fixes = {
        "sizes": [f"train_data samples: rank 0: 96; {others}: 64",
                  f"train_data batches per epoch: rank 0: {12 // nprocs}; {others}: {8 // nprocs}",
                  "Fix: give every replica the same train_data"],
        "shards": ["train_data sampled digest: rank 0: ", "one_cycle_fit splits it over the replicas itself"],
        "valid": [f"valid_data samples: rank 0: 40; {others}: 56", "Fix: give every replica the same valid_data"],
        "model": ["parameters (trainable): rank 0: 195 in 4 tensors", "rank 1: 207 in 4 tensors",
                  "Fix: build the same model on every replica"],
        "argument": ["argument max_grad_norm: rank 0: 1.0; rank 1: 2.0", "with the same arguments on every replica"],
        "evaluate": [f"evaluate splits one dataset over the {nprocs} replicas", "rank 0: 50 samples, sampled digest",
                     "predict(model, its_data) gives every replica its own rows"],
    }  # fmt: skip
    for case, parts in fixes.items():
        assert seen[case].startswith("ReplicaMismatch: "), (case, seen[case])
        for part in parts:
            assert part in seen[case], (case, part, seen[case])
    assert "nothing has run yet" in seen["sizes"] and "train_data samples" not in seen["shards"]
    assert seen["steps before the same run"] == 0  # refused before any optimizer step
    assert seen["same"] == "ran" and seen["steps"] == 96 // 8 // nprocs  # then the same run trains, split over all


def _gloo_peer_left(said: str) -> bool:
    """gloo's error for a collective whose peer left is quoted: "Connection closed by peer" or "... reset by
    peer" (which one depends on whether the peer's socket closed before or during the read)."""
    return any(words in said.lower() for words in _PEER_LEFT)


def test_a_replica_that_stops_answering_is_named_by_the_one_that_waited(tmp_path):
    r = run_python(WARM + f"""
import os, runpy, signal
open({str(tmp_path / "stall.py")!r}, "w").write('''
import os, signal
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import Callback, launch, one_cycle_fit


class Stall(Callback):
    def on_step_end(self, loop):
        if loop.step == 3 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)   # alive, sockets open, never answering


def work(rank):
    data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), torch.arange(256) % 3)
    one_cycle_fit(nn.Linear(8, 3), data, epochs=2, max_lr=1e-2, batch_size=8, progress=False, callbacks=[Stall()])


if __name__ == "__main__":
    launch(work, nprocs=2, start_method="fork")
''')
runpy.run_path({str(tmp_path / "stall.py")!r}, run_name="__main__")
""", env={"TPU_UTILITY_COLLECTIVE_TIMEOUT": "5"}, timeout=300)
    assert r.returncode != 0
    said = r.stderr.splitlines()
    named = [line for line in said if line.startswith("tpu_utility.backend.api.CollectiveTimeout")]
    assert named, r.stderr[-3000:]
    assert "rank 1 of 2 did not arrive" in named[-1] and "rank 0 waited" in named[-1], named
    assert "one_cycle_fit, waiting in backward (the gradient all-reduce of DDP)" in named[-1]
    assert "a collective timed out after 5 s on rank 0" in named[-1]


def test_a_launched_hand_loops_stall_is_named_after_its_replica(monkeypatch):
    # backend.launch hands the backend each replica's fn inside naming_stalls (the backends never import api back)
    import pickle
    import types

    from tpu_utility.backend import api

    class Stalls:
        def launch(self, fn, args, nprocs, start_method):
            self.fn, self.args = pickle.loads(pickle.dumps(fn)), args  # spawn pickles it

        def stalled(self, error):
            return f"rank 1 of 2 did not arrive ({error})"

    chosen = types.SimpleNamespace(processes=Stalls())  # a backend whose processes group is the double
    monkeypatch.setattr(api, "current", lambda: chosen)
    api.launch(_stall_in_a_collective, ("my loop",), 2, "spawn")
    processes = chosen.processes
    with pytest.raises(api.CollectiveTimeout, match=r"^replica 1: rank 1 of 2 did not arrive \(Timed out in my loop"):
        processes.fn(1, *processes.args)  # what the backend's replica runs
    with pytest.raises(ValueError, match="not a collective"):
        processes.fn(0, *processes.args)  # anything else passes through as it was


def _stall_in_a_collective(index, where):
    if index == 0:
        raise ValueError("not a collective")
    raise RuntimeError(f"Timed out in {where} at step {index}")


def test_a_ddp_hand_loop_whose_replicas_take_different_step_counts_says_so(tmp_path):
    # issue 40: rank 1 returns after 3 steps; rank 0's 4th backward met gloo's "Connection closed by peer", no word why
    r = run_script(tmp_path, "steps.py", WARM + """
import torch
from torch import nn
from tpu_utility import launch


def work(rank):
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5 if rank == 0 else 3):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()


if __name__ == "__main__":
    try:
        launch(work, nprocs=2, start_method="fork")
    except RuntimeError as error:
        print("RAISED", str(error).splitlines()[-1])
""", timeout=300)
    said = r.stdout.split("RAISED", 1)[1]
    assert "the replicas took different step counts: rank 1 finished after 3 optimizer step(s) and left" in said, said
    # gloo's own words for the peer that left, quoted: "closed" or "reset", as the socket's end raced the read
    assert "while rank 0 had taken 3 and went on" in said and _gloo_peer_left(said), said


def test_inside_a_torchrun_job_a_replica_that_stops_answering_is_named_too(tmp_path):
    # torchrun's ranks share the agent's TCP store (our launcher: a file store); rank 1 hangs in its own code
    script = tmp_path / "stall.py"
    script.write_text('''
import os, time
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import Callback, one_cycle_fit


class Stall(Callback):
    def on_step_end(self, loop):
        if loop.step == 3 and os.environ["RANK"] == "1":
            time.sleep(600)   # stuck in its own code (torchrun ends it at once when rank 0 fails)


data = TensorDataset(torch.randn(256, 8, generator=torch.Generator().manual_seed(0)), torch.arange(256) % 3)
one_cycle_fit(nn.Linear(8, 3), data, epochs=2, max_lr=1e-2, batch_size=8, progress=False, callbacks=[Stall()])
''')
    r = torchrun(script, 2, expect_ok=False, env={"TPU_UTILITY_COLLECTIVE_TIMEOUT": "5"}, timeout=300)
    assert r.returncode != 0
    named = [line for line in r.stderr.splitlines() if "CollectiveTimeout: one_cycle_fit" in line]
    assert named and "rank 1 of 2 did not arrive" in named[-1] and "rank 0 waited" in named[-1], r.stderr[-3000:]


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


NODE = COMMON + """
from tpu_utility import backend, one_cycle_fit
from tpu_utility.training.agreement import ReplicaMismatch

disk = sys.argv[1]   # this node's own disk
rank = backend.rank()   # joins the job on the first call; 0 before it
history = one_cycle_fit(mlp(), blobs(), valid_data=blobs(300, seed=1), epochs=2, max_lr=3e-2, batch_size=16,
                        metrics=whole_set_metrics(), checkpoint_dir=os.path.join(disk, "ckpt"), progress=False)
rank = backend.rank()
x, y = blobs(300, seed=1).tensors
with torch.no_grad():   # the validation figures, by hand, in this one process
    out = history.model.eval()(x)
plain = {"valid_loss": nn.functional.cross_entropy(out, y).item(), "accuracy": (out.argmax(1) == y).float().mean().item()}
try:   # each node resumes from its own disk: node 0's has last.pt, node 1's none
    one_cycle_fit(mlp(), blobs(), valid_data=blobs(300, seed=1), epochs=2, max_lr=3e-2, batch_size=16,
                  metrics=whole_set_metrics(), checkpoint_dir=os.path.join(disk, "ckpt"), resume=True, progress=False)
    resumed = "ran"
except ReplicaMismatch as error:
    resumed = str(error)
write(disk, rank, world=backend.world_size(), record=history.records[-1].metrics, valid_loss=history.records[-1].valid_loss,
      plain=plain, files=sorted(os.listdir(os.path.join(disk, "ckpt"))), resumed=resumed)
"""


def test_two_torchrun_nodes_train_as_one_job_and_refuse_a_resume_from_their_own_disks(tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE)
    disks = [tmp_path / f"node{n}" for n in range(2)]
    for disk in disks:
        disk.mkdir()
    # both nodes' torchrun agents from one warm interpreter: it forks the second; each waits for its own
    r = run_python(WARM + f"""
import os, runpy, sys, traceback
child = os.fork()
node = 1 if child == 0 else 0
sys.argv = ["torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "localhost:{_free_port()}", "--rdzv-id", "two-nodes", "--max-restarts", "0",
            {str(script)!r}, {[str(d) for d in disks]!r}[node]]
try:
    runpy.run_module("torch.distributed.run", run_name="__main__")
    status = 0
except SystemExit as end:
    status = end.code if isinstance(end.code, int) else 1
except BaseException:
    traceback.print_exc()
    status = 1
if child == 0:
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(status)
print("agents exited:", status, os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
""", timeout=300)  # fmt: skip
    assert "agents exited: 0 0" in r.stdout, r.stdout[-1000:] + r.stderr[-3000:]
    found = {}
    for disk in disks:
        for name in os.listdir(disk):
            if name.endswith(".json"):
                found[name] = json.load(open(disk / name))
    assert sorted(found) == ["rank0.json", "rank1.json"]
    ranks = [found["rank0.json"], found["rank1.json"]]
    for seen in ranks:
        assert seen["world"] == 2
        assert seen["record"]["n"] == 300  # every validation sample counted once over both nodes
        assert seen["valid_loss"] == pytest.approx(seen["plain"]["valid_loss"], abs=1e-5)  # exact, not per node
        assert seen["record"]["accuracy"] == pytest.approx(seen["plain"]["accuracy"], abs=1e-6)
        assert "resume point: rank 0: after epoch 2 (step " in seen["resumed"], seen["resumed"]
        assert "rank 1: epoch 1, afresh" in seen["resumed"] and "gs://bucket/run" in seen["resumed"]
    assert ranks[0]["record"] == ranks[1]["record"]
    assert "last.pt" in ranks[0]["files"] and ranks[1]["files"] == []  # one writer: rank 0, on its node's disk


def test_inside_a_torchrun_job_a_ddp_hand_loop_whose_replicas_take_different_step_counts_says_so(tmp_path):
    # issue 40: under torchrun nothing of ours wraps the loop; rank 1 destroys its group and leaves after 3 steps,
    # and rank 0's 4th backward met gloo's "Connection closed by peer" with no word why
    script = tmp_path / "steps.py"
    script.write_text("""
import torch
import torch.distributed as dist
from torch import nn
from tpu_utility import backend, get_device

dist.init_process_group("gloo")   # a torchrun script's own first lines
device = get_device()
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5 if backend.rank() == 0 else 3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
dist.destroy_process_group()
""")
    from test_native import _torchrun

    r = _torchrun(script, 2, expect_ok=False)
    assert r.returncode != 0
    said = [line for line in r.stderr.splitlines() if "the replicas took different step counts" in line]
    assert said, r.stderr[-3000:]
    # the same words as under launch (the test above), as the last line of rank 0's traceback
    assert "rank 0: the replicas took different step counts: rank 1 finished after 3 optimizer step(s) and left" in said[-1]
    assert "while rank 0 had taken 3 and went on" in said[-1] and _gloo_peer_left(said[-1]), said
