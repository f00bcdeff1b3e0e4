"""precision="fp16": float16 autocast and torch's GradScaler in one_cycle_fit, evaluate and predict.

fp16 runs where the backend has a float16 path: CUDA, and the native CPU backend (slow, for
checking). The suite's own process runs XLA:CPU (PJRT_DEVICE=CPU), where fp16 is refused, so
the training runs are made in one child interpreter on the native CPU backend and read back
as JSON (as tests/test_doctor_native.py does); the refusals are tested in this process.
"""

import json

import pytest
import torch

from conftest import flat_digits, run_python, small_mlp
from tpu_utility import backend, evaluate, one_cycle_fit
from tpu_utility.backend.tpu import TorchTpuBackend
from tpu_utility.training.precision import check_precision

NATIVE = {"PJRT_DEVICE": None, "CPU_NUM_DEVICES": None}
# The native CPU backend asked for by name, PJRT_DEVICE left as conftest set it: the runs start from the warm
# interpreter (torch_xla imported, no XLA runtime started: ~10 CPU-s less than a fresh one), as a user's process
# that imported torch_xla and chose backend="native" does. CUDA_VISIBLE_DEVICES="" only where a GPU is (it makes
# a fresh interpreter): the CPU even there.
NATIVE_CPU = {"TPU_UTILITY_BACKEND": "native", **({"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() else {})}

# Shared by the CPU and the CUDA runs: a tiny MLP on 512 digits, and callbacks that watch the scaler.
PRELUDE = """
import json, warnings
import torch
from torch import nn
from tpu_utility import backend, evaluate, one_cycle_fit, predict
from tpu_utility.demo import digits_datasets

warnings.filterwarnings("ignore", "dropping the last")
TRAIN, VALID = digits_datasets()
DATA = torch.utils.data.TensorDataset(*(t[:512] for t in TRAIN.tensors))  # 16 batches of 32
OUT = {}


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


class Step:
    \"\"\"The default train step; records the forward's dtype, and crashes after `limit` calls.\"\"\"

    def __init__(self, limit=10**9):
        self.calls, self.limit, self.dtypes = 0, limit, set()

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls > self.limit:
            raise KeyboardInterrupt("simulated crash")
        x, y = batch
        out = model(x)
        self.dtypes.add(str(out.dtype))
        return nn.functional.cross_entropy(out.float(), y)


def scale(loop):
    scaler = loop.runner.precision.scaler
    return None if scaler is None else scaler.get_scale()


def fit(precision, step=None, **kwargs):
    args = dict(epochs=3, max_lr=1e-2, batch_size=32, progress=False, seed=1, precision=precision)
    return one_cycle_fit(mlp(), DATA, train_step=step or Step(), **{**args, **kwargs})


def weights(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
"""

# On the native CPU backend: training, an inf gradient, checkpoint and resume, precision changes.
CPU_RUNS = PRELUDE + """
import math
from tpu_utility.checkpoint import load_checkpoint


class InfGradientAt:
    \"\"\"Puts an inf into one gradient before optimizer step `at` (counted from 0) and watches that step.\"\"\"

    def __init__(self, at=3):
        self.at, self.seen = at, {}

    def on_before_step(self, loop):
        if loop.step == self.at:
            next(loop.model.parameters()).grad[0, 0] = float("inf")
            self.before, self.seen["scale_before"] = weights(loop.model), scale(loop)

    def on_step_end(self, loop):
        if loop.step == self.at + 1:
            after = weights(loop.model)
            self.seen["unchanged"] = all(torch.equal(self.before[k], after[k]) for k in after)
            self.seen["scale_after"] = scale(loop)


class FirstScale:
    \"\"\"The scaler's scale when the first epoch this process trains starts (after a resume).\"\"\"

    def on_train_epoch_start(self, loop, epoch):
        self.__dict__.setdefault("first", (epoch, scale(loop)))


def said(call):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [str(w.message) for w in caught if "precision=" in str(w.message)]


# 1. trains; an inf gradient is a skipped step, not a poisoned model; the scale is checkpointed
step, inf = Step(), InfGradientAt()
straight = fit("fp16", step, callbacks=[inf], checkpoint_dir="straight")
state = load_checkpoint("straight")
OUT["straight"] = {
    "losses": [r.train_loss for r in straight.records], "summary": straight.summary, "dtypes": sorted(step.dtypes),
    "finite": all(bool(torch.isfinite(v).all()) for v in straight.model.state_dict().values()),
    "param_dtypes": sorted({str(p.dtype) for p in straight.model.parameters()}),
    "precision": state["precision"], "scaler": state["scaler"], **inf.seen,
}
try:  # the same inf gradient without a scaler: the weights turn NaN and the run stops
    fit("fp32", callbacks=[InfGradientAt()])
    OUT["fp32_inf"] = "trained on"
except FloatingPointError as error:
    OUT["fp32_inf"] = str(error)

# 2. a crash in epoch 2, then resume=True: the same weights and the checkpoint's scale
try:
    fit("fp16", Step(16 + 5), callbacks=[InfGradientAt()], checkpoint_dir="crashed")
except KeyboardInterrupt:
    pass
first = FirstScale()
resumed = fit("fp16", callbacks=[InfGradientAt(), first], checkpoint_dir="crashed", resume=True)
after = weights(resumed.model)
OUT["resume"] = {
    "equal": all(torch.equal(weights(straight.model)[k], after[k]) for k in after),
    "first": first.first, "scaler": load_checkpoint("crashed")["scaler"],
    "losses": [r.train_loss for r in resumed.records],
}

# 3. clipping and accumulation through the scaler: fp16 learns as fp32 does (SGD: Adam would hide a wrong scale)
clipped = {p: fit(p, optimizer="sgd", max_lr=0.3, max_grad_norm=0.5, accumulate_steps=2, checkpoint_dir=f"clip_{p}")
           for p in ("fp32", "fp16")}  # fmt: skip
OUT["clipped"] = {p: [r.train_loss for r in h.records] for p, h in clipped.items()}
OUT["clipped_tracker"] = load_checkpoint("clip_fp16")["scaler"]["_growth_tracker"]

# 4. a checkpoint resumed in another precision, both ways: said, never silent
for was, now in (("fp32", "fp16"), ("fp16", "fp32")):
    try:
        fit(was, Step(16 + 5), checkpoint_dir=f"{was}_to_{now}")
    except KeyboardInterrupt:
        pass
    first = FirstScale()
    words = said(lambda: fit(now, callbacks=[first], checkpoint_dir=f"{was}_to_{now}", resume=True))
    OUT[f"{was}_to_{now}"] = {"said": words, "first": first.first,
                              "scaler": load_checkpoint(f"{was}_to_{now}")["scaler"]}  # fmt: skip

# 5. evaluate under fp16: autocast only, the model left as it was
model = straight.model
before = weights(model)
OUT["evaluate"] = {p: evaluate(model, VALID, precision=p) for p in ("fp32", "fp16")}
rows = {p: predict(model, VALID, precision=p, progress=False) for p in ("fp32", "fp16")}
OUT["predict"] = {
    "dtype": str(rows["fp16"].dtype),
    "same_class": (rows["fp16"].argmax(1) == rows["fp32"].argmax(1)).float().mean().item(),
    "max_difference": (rows["fp16"].float() - rows["fp32"]).abs().max().item(),
}
OUT["evaluate_left_model"] = all(torch.equal(before[k], v) for k, v in weights(model).items())
print("RESULT", json.dumps(OUT))
"""


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, stdout[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


@pytest.fixture(scope="module")
def cpu(tmp_path_factory):
    """The native CPU backend's runs, made once (one interpreter start) in a folder of their own."""
    r = run_python(CPU_RUNS, env=NATIVE_CPU, cwd=str(tmp_path_factory.mktemp("fp16")))
    assert r.returncode == 0, r.stderr[-3000:]
    return _result(r.stdout)


# ------------------------------------------------------------- native CPU
def test_fp16_trains_with_autocast_and_a_grad_scaler(cpu):
    run = cpu["straight"]
    assert "fp16 (autocast + GradScaler)" in run["summary"]
    assert "on 1 cpu core(s)" in run["summary"]  # the native backend, not XLA
    assert run["dtypes"] == ["torch.float16"]  # the forward ran in float16
    assert run["param_dtypes"] == ["torch.float32"]  # the weights stayed float32
    assert run["losses"][-1] < 0.5 * run["losses"][0], run["losses"]
    assert run["finite"]


def test_an_inf_gradient_skips_the_step_and_halves_the_scale(cpu):
    run = cpu["straight"]
    assert run["unchanged"] is True  # the optimizer step with the inf gradient was skipped
    assert run["scale_after"] == run["scale_before"] / 2 == 32768.0
    assert run["finite"]  # training went on, and the model is whole
    # the same gradient without a scaler poisons the model: the loss turns NaN and the run stops
    assert "became NaN or inf" in cpu["fp32_inf"]


def test_the_scale_is_checkpointed_and_a_resume_goes_on_with_it(cpu):
    run, resume = cpu["straight"], cpu["resume"]
    assert run["precision"] == "fp16"
    # 48 steps; the skipped step (index 3) reset the growth counter: 44 good steps since
    assert run["scaler"]["scale"] == 32768.0 and run["scaler"]["_growth_tracker"] == 44
    # the crashed run saved epoch 1 (after the skipped step); the resumed one started epoch 2 with that scale,
    # where a fresh scaler would start at 65536 and end there
    assert resume["first"] == [1, 32768.0]
    assert resume["scaler"] == run["scaler"]
    assert resume["equal"], "the resumed run's weights differ from the uninterrupted run's"
    assert resume["losses"] == run["losses"]


def test_clipping_and_accumulation_unscale_before_they_act(cpu):
    fp32, fp16 = cpu["clipped"]["fp32"], cpu["clipped"]["fp16"]
    # clipped while still scaled by 65536, fp16's gradients would be 65536 times too small: SGD would not learn
    assert fp16[-1] < 0.5 * fp16[0], fp16
    assert fp16[-1] == pytest.approx(fp32[-1], rel=0.02), (fp16, fp32)
    assert cpu["clipped_tracker"] == 3 * 16 // 2  # one scaler step per optimizer step, not per batch


FRESH = {"scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000, "_growth_tracker": 32}


@pytest.mark.parametrize("was, now, then, first, scaler", [
    ("fp32", "fp16", "a fresh GradScaler starts at scale 65536 (halved at each step whose gradients overflow)",
     [1, 65536.0], FRESH),  # the resumed epochs' 32 steps, none skipped
    ("fp16", "fp32", "the checkpoint's GradScaler state (scale 65536) is left unused, as fp32 scales no loss",
     [1, None], {}),
])  # fmt: skip
def test_a_checkpoint_resumed_in_another_precision_says_what_becomes_of_the_scaler(cpu, was, now, then, first, scaler):
    run = cpu[f"{was}_to_{now}"]
    assert len(run["said"]) == 1, run["said"]  # one warning, on the one process
    change = f"last.pt was written with precision={was!r} and this run uses precision={now!r}"
    assert run["said"][0].endswith(f"{change}: {then}"), run["said"]
    assert run["first"] == first and run["scaler"] == scaler


def test_evaluate_and_predict_in_fp16_agree_with_fp32_and_leave_the_model(cpu):
    fp32, fp16 = cpu["evaluate"]["fp32"], cpu["evaluate"]["fp16"]
    assert fp16["accuracy"] == pytest.approx(fp32["accuracy"], abs=0.01)
    assert fp16["loss"] == pytest.approx(fp32["loss"], rel=0.02)
    assert fp16["loss"] != fp32["loss"]  # float16 did run
    rows = cpu["predict"]
    assert rows["dtype"] == "torch.float16" and 0 < rows["max_difference"] < 0.05
    assert rows["same_class"] >= 0.99
    assert cpu["evaluate_left_model"]


# ---------------------------------------------------------------- refusals
class _Seen:
    def __init__(self):
        self.events = []

    def on_fit_start(self, loop):
        self.events.append("fit_start")

    def on_train_epoch_start(self, loop, epoch):
        self.events.append(epoch)


def test_fp16_is_refused_on_xla_before_any_epoch():
    model, seen = small_mlp(), _Seen()
    with pytest.raises(ValueError) as caught:
        one_cycle_fit(model, flat_digits(64), epochs=1, max_lr=1e-3, batch_size=32, precision="fp16",
                      progress=False, callbacks=[seen])  # fmt: skip
    message = str(caught.value)
    assert "precision='fp16'" in message and "XLA:CPU" in message
    assert "use precision='bf16'" in message and "precision='fp32'" in message
    assert seen.events == [] and next(model.parameters()).device.type == "cpu"  # nothing ran, nothing moved
    with pytest.raises(ValueError, match=r"precision='fp16' .* on XLA:CPU .* use precision='bf16'"):
        evaluate(model, flat_digits(64), precision="fp16")


def test_fp16_is_refused_on_torchtpu(monkeypatch):
    monkeypatch.setattr(backend, "current", TorchTpuBackend)
    with pytest.raises(ValueError, match=r"precision='fp16' .* on tpu \(the tpu backend\): use precision='bf16'"):
        check_precision("fp16")
    check_precision("bf16")  # what it offers instead


def test_an_unknown_precision_names_the_three():
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16', 'fp16'\), but given 'fp8'"):
        check_precision("fp8")


# ------------------------------------------------------------------- CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fp16_trains_on_cuda_with_a_grad_scaler(tmp_path):
    code = PRELUDE + """
from tpu_utility.checkpoint import load_checkpoint
step = Step()
history = fit("fp16", step, checkpoint_dir="run")
OUT = {"losses": [r.train_loss for r in history.records], "summary": history.summary, "dtypes": sorted(step.dtypes),
       "device": next(history.model.parameters()).device.type, "scaler": load_checkpoint("run")["scaler"]}
print("RESULT", json.dumps(OUT))
"""
    r = run_python(code, env=NATIVE, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    run = _result(r.stdout)
    assert run["device"] == "cuda" and "fp16 (autocast + GradScaler)" in run["summary"]
    assert run["dtypes"] == ["torch.float16"]
    assert run["losses"][-1] < 0.5 * run["losses"][0], run["losses"]
    scaler = run["scaler"]  # the scaler stepped: every good step counted, or a skipped one lowered the scale
    assert scaler and (scaler["_growth_tracker"] > 0 or scaler["scale"] < 65536.0), scaler
