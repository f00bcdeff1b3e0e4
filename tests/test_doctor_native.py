"""doctor on the eager backends: native PyTorch (CPU here, CUDA where a GPU is) and TorchTPU.

There nothing compiles and torch_xla's counters do not exist, so doctor watches the
step's aten ops through the backend (``watch_host_syncs``, a TorchDispatchMode) and
compares the input shapes of the steps. Each planted defect must be named with the fix
doctor gives on XLA, a clean step must say what it could not measure, and the optimizer's
own host-side step counter must not count as a sync.

doctor chooses its backend per process, and the suite's own process runs XLA
(PJRT_DEVICE=CPU), so the reports are made in one child interpreter that takes PJRT_DEVICE
out before it imports tpu_utility (the native CPU backend; tests/native_jobs.py's WARM) and read
back as JSON; the backend's watch itself is tested in this process.
"""

import json

import pytest
import torch
from torch import nn

from conftest import BLOCK_TORCH_XLA, run_python, run_script
from native_jobs import WARM
from test_torchtpu import FAKE_TORCHTPU, _torchtpu_installed
from tpu_utility import get_device
from tpu_utility.backend import XLA_INSTALLED, NativeBackend

NATIVE = {"PJRT_DEVICE": None, "CPU_NUM_DEVICES": None}

# The steps of tests/test_doctor.py (the two-line port of a CUDA step), each run by doctor;
# every report goes to stdout as one JSON line.
STEPS = """
import json
import torch
from torch import nn
from tpu_utility import DoctorError, backend, doctor, get_device, step_optimizer
from tpu_utility.demo import digits_datasets

X, Y = digits_datasets()[0].tensors
DEVICE = get_device()


def batches(sizes=(32,) * 6):
    out, start = [], 0
    for size in sizes:
        out.append((X[start : start + size], Y[start : start + size]))
        start += size
    return out


def setup(optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(DEVICE)
    return model, optimizer(model.parameters(), lr=1e-3)


def port_step(model, optimizer, extra=None):
    def step(batch):
        x, y = batch[0].to(DEVICE), batch[1].to(DEVICE)
        optimizer.zero_grad()
        logits = model(x)
        loss = nn.functional.cross_entropy(logits, y)
        if extra is not None:
            loss = extra(loss, logits)
        loss.backward()
        step_optimizer(optimizer)

    return step


def show(name, report):
    print(json.dumps({"name": name, "kinds": sorted(report.kinds()), "clean": report.clean,
                      "syncs": report.host_syncs_per_step, "compiles": report.compiles_per_step,
                      "unmeasured": report.unmeasured, "notes": report.notes, "measured_on": report.measured_on,
                      "findings": [vars(f) for f in report.findings], "text": str(report)}))
"""

SCENARIOS = STEPS + """
print(json.dumps({"backend": repr(backend.current())}))
model, optimizer = setup()
show("clean", doctor(port_step(model, optimizer), batches=batches(), model=model, optimizer=optimizer))
show("model_form_eval", doctor(model, batches=batches(), optimizer=optimizer, mode="eval"))

seen = []


def log_loss(loss, logits):
    seen.append(loss.item())  # the planted host sync
    return loss


show("item", doctor(port_step(*setup(), log_loss), batches=batches()))

preds = []


def keep_preds(loss, logits):
    preds.append(logits.argmax(1).cpu().numpy())  # planted: a copy to the host per step
    return loss


show("preds", doctor(port_step(*setup(), keep_preds), batches=batches()))


def confident_only(loss, logits):
    confident = logits[logits.softmax(1).amax(1) > 0.05]  # planted: a boolean mask, a data-dependent shape
    return loss + 0 * confident.sum()


show("mask", doctor(port_step(*setup(), confident_only), batches=batches()))
show("shapes", doctor(port_step(*setup()), batches=batches((32, 32, 17, 32, 17, 32))))

torch.manual_seed(0)
emb, out = nn.Embedding(64, 16), nn.Linear(16, 4)
bag = nn.Sequential()
bag.forward = lambda tokens: out(emb(tokens).mean(1))
bag.emb, bag.out = emb, out
g = torch.Generator().manual_seed(0)
lengths = [10, 10, 13, 21, 30, 38]  # each batch padded to its longest sequence
data = [(torch.randint(0, 64, (16, n), generator=g), torch.randint(0, 4, (16,), generator=g)) for n in lengths]
show("lengths", doctor(bag, batches=data, optimizer=torch.optim.AdamW(bag.parameters(), lr=1e-3)))


ran = []


def raising(batch):
    ran.append(batch[0].sum().item())
    if len(ran) == 5:  # the third step after warm-up
        raise ZeroDivisionError("planted")


try:
    doctor(raising, batches=batches())
except DoctorError as error:
    show("raised", error.report)
"""


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every scenario's report on the native CPU backend, by name (one interpreter for all)."""
    r = run_script(tmp_path_factory.mktemp("doctor"), "steps.py", WARM + SCENARIOS)  # warm, PJRT_DEVICE taken out
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"backend": "NativeBackend('cpu', 'gloo')"}, r.stdout
    return {line["name"]: line for line in lines[1:]}


def test_a_clean_step_is_clean_of_host_syncs_and_says_what_it_could_not_measure(reports):
    clean = reports["clean"]  # AdamW reads its host-side step counter every step: not a sync
    assert clean["clean"] and clean["kinds"] == [] and clean["syncs"] == 0, clean["text"]
    assert clean["compiles"] is None and clean["measured_on"] == "cpu"
    text = clean["text"]
    assert "clean of what doctor sees on this backend: no host syncs, no input shape changes" in text
    assert "clean: no recompiles" not in text  # compiles and fallbacks were not measured: not called clean
    assert "compiles and CPU fallbacks not measured" in text
    assert "not measured: graph compilations while doctor watches: a step under torch.compile runs uncompiled" in text
    assert "not measured: CPU fallbacks: the CPU runs every op itself" in text
    assert "note: on the CPU nothing waits for a host sync: doctor counts the ops that would make a GPU" in text
    assert reports["model_form_eval"]["clean"], reports["model_form_eval"]["text"]


def test_item_every_step_is_a_host_sync_with_its_line_and_the_xla_fix(reports):
    item = reports["item"]
    assert item["kinds"] == ["host_sync"] and item["syncs"] == 1, item["text"]
    (finding,) = item["findings"]
    assert finding["where"] == [f"4x aten::_local_scalar_dense {finding['where'][0].split(' ', 2)[2]}"]
    assert "steps.py:" in finding["where"][0] and "seen.append(loss.item())" in finding["where"][0]
    assert finding["fix"] == "keep values on the device (running_loss += loss.detach()) and read them once per epoch"
    assert "each read of a device value waits for the device" in finding["message"]


def test_predictions_copied_to_the_host_get_the_collect_on_device_fix(reports):
    preds = reports["preds"]
    assert preds["kinds"] == ["host_sync"] and preds["syncs"] == 1, preds["text"]  # .cpu() counted, .numpy() not
    (finding,) = preds["findings"]
    assert "torch.cat(preds).cpu()" in finding["fix"]
    assert any(".cpu()" in w and "preds.append(logits.argmax(1).cpu().numpy())" in w for w in finding["where"])


def test_a_boolean_mask_is_a_data_dependent_shape_with_the_fixed_shape_fix(reports):
    mask = reports["mask"]
    assert mask["kinds"] == ["host_sync"], mask["text"]
    (finding,) = mask["findings"]
    assert any("aten::index (a boolean mask)" in w and "confident = logits[" in w for w in finding["where"])
    assert "torch.where(mask, x, 0)" in finding["fix"]


def test_changing_batch_shapes_are_named_as_recompiles_elsewhere(reports):
    shapes = reports["shapes"]
    assert shapes["kinds"] == ["recompile"], shapes["text"]
    (finding,) = shapes["findings"]
    assert finding["message"].startswith("1 new input shape(s) in 4 steps after warm-up")
    assert "torch.compile(dynamic=False)" in finding["message"] and "on XLA" in finding["message"]
    assert any("(32, 1, 8, 8) -> (17, 1, 8, 8)" in w for w in finding["where"])
    assert "drop_last=True" in finding["fix"]


def test_changing_sequence_lengths_get_the_bucket_collate_fix(reports):
    lengths = reports["lengths"]
    assert lengths["kinds"] == ["recompile"], lengths["text"]
    (finding,) = lengths["findings"]
    assert finding["message"].startswith("4 new input shape(s) in 4 steps after warm-up")
    assert "sequence lengths: dim 1 of input 0 took 5 values, 10..38" in finding["message"]
    assert "BucketCollate(buckets=[16, 32, 40])" in finding["fix"]


def test_a_step_that_raises_keeps_the_host_syncs_seen_before(reports):
    raised = reports["raised"]
    assert raised["kinds"] == ["host_sync"] and not raised["clean"], raised["text"]
    assert "error: your step raised ZeroDivisionError: planted (at step 5" in raised["text"]


def test_without_torch_xla_doctor_measures_on_the_native_backend_and_says_which():
    r = run_python(BLOCK_TORCH_XLA + """
import os
import torch
from tpu_utility import doctor
model = torch.nn.Linear(4, 2)
batch = (torch.ones(8, 4), torch.zeros(8, dtype=torch.long))
report = doctor(model, batch=batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
print("plain:", report.kinds(), report.clean, report.notes)
os.environ["PJRT_DEVICE"] = "TPU"
print("asked:", *doctor(model, batch=batch, optimizer=torch.optim.SGD(model.parameters(), lr=0.1)).notes)
""", env=NATIVE)
    assert r.returncode == 0, r.stderr
    plain = r.stdout.split("plain:")[1].split("asked:")[0]
    assert "set() True" in plain and "torch_xla" not in plain  # was: not_on_xla, nothing measured
    assert "PJRT_DEVICE='TPU' is set but torch_xla is not installed: doctor measured the step on the cpu" in r.stdout


@pytest.mark.skipif(not XLA_INSTALLED, reason="torch_xla is not installed here")
def test_with_torch_xla_installed_but_unused_the_report_says_how_to_measure_on_xla(reports):
    assert any("torch_xla is installed but not in use" in n and "setup_tpu()" in n for n in reports["clean"]["notes"])


def test_torchtpu_gets_the_same_findings_through_the_native_machinery(tmp_path):
    # No tensor can live on a fake 'tpu' device, so the TorchTPU backend is told to own the
    # CPU's tensors; SGD keeps no host-side step counter for it to take for a device read.
    r = run_python(FAKE_TORCHTPU + STEPS.replace("DEVICE = get_device()", "DEVICE = torch.device('cpu')") + """
from tpu_utility.backend import TorchTpuBackend
torch.accelerator.synchronize = lambda device=None: None
TorchTpuBackend.Devices.owns = lambda self, device: True
print(json.dumps({"backend": repr(backend.current())}))
model, optimizer = setup(torch.optim.SGD)
show("clean", doctor(port_step(model, optimizer), batches=batches(), model=model, optimizer=optimizer))
show("item", doctor(port_step(*setup(torch.optim.SGD), lambda loss, logits: loss + 0 * loss.item()),
                    batches=batches((32, 32, 17, 32, 17, 32))))
print(json.dumps({"strict": [c for c in CALLS if c in STRICT]}))
""", env=_torchtpu_installed(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert lines[0] == {"backend": "TorchTpuBackend()"} and lines[-1] == {"strict": []}, r.stdout
    clean, item = lines[1], lines[2]
    assert clean["clean"] and clean["measured_on"] == "tpu", clean["text"]
    assert any("TorchTPU runs eagerly unless the step is compiled (one_cycle_fit's compile=, compile_model)" in u for u in clean["unmeasured"])
    assert any("TorchTPU does not count them" in u for u in clean["unmeasured"])
    assert "nothing waits" not in clean["text"]  # a TPU does wait: no CPU caveat
    assert item["kinds"] == ["host_sync", "recompile"] and item["syncs"] == 1, item["text"]


# ------------------------------------------------------- the backend's watch itself
def _watched(backend, work):
    seen = []
    with backend.diagnosis.watch_host_syncs(lambda kind, op: seen.append((kind, op))) as watching:
        work()
    assert watching is True
    return seen


@pytest.fixture(autouse=True, scope="module")
def _xla_registered_before_the_first_backward():
    # torch's autograd engine sizes its device queues at the process's first backward: a CPU backward
    # run here before the XLA runtime knew its devices would make every later XLA backward in this
    # pytest process fail an internal assert. A user's notebook starts XLA first (setup_tpu, get_device).
    if XLA_INSTALLED:
        get_device()

    yield


def test_the_cpu_watch_counts_what_would_wait_on_an_accelerator_and_nothing_else():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randn(8, 4)
    cpu = NativeBackend("cpu", "gloo")

    def quiet():  # no host sync on any device
        model(x).sum().backward()
        optimizer.step()  # AdamW reads its step counter on the host: not a device read
        torch.where(x > 0, x, 0).sum()
        x.masked_fill(x > 0, 0).to(torch.float64)
        x.repeat_interleave(torch.full((8,), 2), dim=0, output_size=16)

    assert _watched(cpu, quiet) == []

    loss = model(x).sum()

    def loud():
        loss.item()
        if loss > 0:
            pass
        x[x > 0]
        torch.unique(x)
        x.nonzero()
        x.cpu().tolist()  # one copy on an accelerator: the tolist reads the host copy
        x.tolist()

    assert _watched(cpu, loud) == [
        ("read", "aten::_local_scalar_dense"), ("read", "aten::_local_scalar_dense"),
        ("shape", "aten::index (a boolean mask)"), ("shape", "aten::_unique2"), ("shape", "aten::nonzero"),
        ("copy", ".cpu()"), ("copy", ".tolist()"),
    ]  # fmt: skip
    originals = (torch.Tensor.cpu, torch.Tensor.tolist)
    _watched(cpu, lambda: None)
    assert (torch.Tensor.cpu, torch.Tensor.tolist) == originals  # nothing of the watch stays after it


def test_the_watch_of_an_accelerator_ignores_host_tensors():
    # a CUDA backend in a process without CUDA: every tensor here is on the host, none is its own
    seen = _watched(NativeBackend("cuda", "nccl"), lambda: (torch.ones(3).sum().item(), torch.ones(3).nonzero()))
    assert seen == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_watch_counts_real_syncs_and_not_the_optimizer_or_host_to_device_copies():
    model = nn.Linear(4, 2).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randn(8, 4)

    def step():
        xd = x.to("cuda")  # host to device: no wait
        loss = model(xd).sum()
        loss.backward()
        optimizer.step()
        loss.item()
        xd[xd > 0]
        xd.cpu()

    seen = _watched(NativeBackend("cuda", "nccl"), step)
    assert seen == [("read", "aten::_local_scalar_dense"), ("shape", "aten::index (a boolean mask)"),
                    ("copy", "aten::_to_copy")], seen  # fmt: skip
