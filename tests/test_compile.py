"""compile=: the step compiled with torch.compile on the native backend, the same run as eager.

The suite's process runs XLA:CPU, where XLA compiles every step itself: what compile= says there, and the
option's checks, are tested here. The compiled runs are made in child interpreters on the native CPU backend,
through torch.compile's ``aot_eager`` backend: dynamo and AOTAutograd, where a compiled step's semantics are
decided (its frames, guards, recompiles, the model's keys, the optimizer's state), without inductor's C++ build.
Inductor itself (``compile=True``) runs in one lane, the Kaggle one (``TPU_UTILITY_TEST_INDUCTOR=1``, set by
``make test-kaggle``: torch 2.8, what Kaggle's TPU image has): from a cold cache its C++ build took about 200
CPU-s of a 2-core host, a third of ``make test``'s budget, for what aot_eager already checks here.
"""

import os

import pytest
import torch
from torch import nn

from conftest import child_result, record_figure
from tpu_utility import Compile, backend, compile_model, one_cycle_fit
from tpu_utility.compiler import compiled_parts

NATIVE_CPU = {"TPU_UTILITY_BACKEND": "native", **({"CUDA_VISIBLE_DEVICES": ""} if torch.cuda.is_available() else {})}
INDUCTOR = bool(os.environ.get("TPU_UTILITY_TEST_INDUCTOR"))  # the Kaggle lane: compile=True, inductor's C++
COMPILER = "inductor" if INDUCTOR else "aot_eager"
# what a child script compiles with: compile=True (inductor) in the inductor lane, else aot_eager
COMPILED = """
import os as _os
from tpu_utility import Compile as _Compile
COMPILED = True if _os.environ.get("TPU_UTILITY_TEST_INDUCTOR") else _Compile(backend="aot_eager")
"""


def test_compile_is_checked_at_the_boundary_naming_the_value():
    with pytest.raises(TypeError, match=r"compile must be True, False, 'auto' or Compile.*given 'yes'"):
        one_cycle_fit(nn.Linear(2, 2), torch.utils.data.TensorDataset(torch.ones(8, 2), torch.zeros(8).long()),
                      epochs=1, max_lr=1e-3, compile="yes")  # fmt: skip
    with pytest.raises(ValueError, match=r"Compile\(mode=...\) must be None or one of .*'max-autotune'.*given 'fast'"):
        Compile(mode="fast")
    with pytest.raises(TypeError, match=r"Compile\(fullgraph=...\) must be True or False, but given 1"):
        Compile(fullgraph=1)
    assert Compile(mode="max-autotune", dynamic=False).options == {"mode": "max-autotune", "dynamic": False}
    assert Compile.of("auto").enabled == "auto" and Compile.of(True) == Compile()


def test_on_xla_the_step_is_xlas_own_graph_whatever_compile_says():
    assert backend.current().lazy  # the suite's process: XLA:CPU
    model = nn.Linear(2, 2)
    assert compile_model(model) is model  # inductor does not target XLA: the model itself
    assert Compile.of("auto").decide(10_000) == (False, "")  # nothing to say: XLA compiles as always
    on, words = Compile.of(False).decide(10_000)
    assert not on and "XLA compiles every step's graph itself" in words
    assert compiled_parts(model) == (model, None)


CNN = COMPILED + """
import contextlib, json, os, tempfile, warnings
import torch
from torch import nn
from torch.utils.data import TensorDataset
from tpu_utility import Compile, evaluate, load_checkpoint, one_cycle_fit, predict

g = torch.Generator().manual_seed(0)
y = torch.arange(256) % 4
x = torch.randn(256, 3, 8, 8, generator=g) + y.view(-1, 1, 1, 1).float()
train, valid = TensorDataset(x[:192], y[:192]), TensorDataset(x[192:], y[192:])


def cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 4))


class Step:  # the default loss, a crash after `limit` steps, or smaller images after `shrink_after`
    def __init__(self, limit=10**9, shrink_after=None):
        self.calls, self.limit, self.shrink_after = 0, limit, shrink_after

    def __call__(self, model, batch):
        self.calls += 1
        if self.calls > self.limit:
            raise KeyboardInterrupt("simulated crash")
        x, y = batch
        if self.shrink_after is not None and self.calls > self.shrink_after:
            x = x[:, :, :6, :6]
        return nn.functional.cross_entropy(model(x), y)


root = tempfile.mkdtemp()


def fit(model, compile, folder=None, step=None, **kw):
    return one_cycle_fit(model, train, valid_data=valid, epochs=3, max_lr=3e-2, batch_size=32, compile=compile,
                         checkpoint_dir=folder and os.path.join(root, folder), progress=False,
                         train_step=step or Step(), **kw)


def figures(h):
    return [r.train_loss for r in h.records] + [r.valid_loss for r in h.records]


out = {}
eager, given = fit(cnn(), False, "eager"), cnn()
compiled = fit(given, COMPILED, "compiled")
out.update(eager=figures(eager), compiled=figures(compiled), compiles=[r.compiles for r in compiled.records],
           summary=compiled.summary, same_object=compiled.model is given and type(given) is nn.Sequential)
best = load_checkpoint(os.path.join(root, "compiled", "best.pt"))["model"]
fresh = cnn()
fresh.load_state_dict(best)  # an uncompiled model, on the CPU
out["keys"] = sorted(best) == sorted(cnn().state_dict())
out["best_loads"] = all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), best.values()))
with contextlib.suppress(KeyboardInterrupt):
    fit(cnn(), COMPILED, "resumed", step=Step(limit=6 + 3))  # in epoch 2: last.pt holds epoch 1
resumed = fit(cnn(), COMPILED, "resumed", resume=True)
out["resumed_bitwise"] = all(torch.equal(a, b) for a, b in zip(compiled.model.state_dict().values(),
                                                               resumed.model.state_dict().values()))
own = fit(torch.compile(cnn(), backend="aot_eager"), "auto", "own")  # aot_eager: dynamo's frames without a C++ build
out.update(own_summary=own.summary, own_losses=figures(own),
           own_keys=sorted(load_checkpoint(os.path.join(root, "own", "last.pt"))["model"]) == sorted(cnn().state_dict()))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    shrunk = fit(cnn(), Compile(backend="aot_eager"), step=Step(shrink_after=6))
out["recompiles"] = [str(w.message) for w in caught if "recompiled" in str(w.message)]
out["shrunk_compiles"] = [r.compiles for r in shrunk.records]
out["evaluate"] = [evaluate(eager.model, valid, compile=c) for c in (False, COMPILED)]
rows = [predict(eager.model, valid, compile=c, progress=False) for c in (False, COMPILED)]
out["predict_close"] = torch.allclose(rows[0], rows[1], atol=1e-5) and rows[0].shape == (64, 4)
print("RESULT " + json.dumps(out))
"""


def test_a_compiled_cnn_run_is_the_eager_run_and_keeps_the_models_own_keys_resume_and_flat_compiles():
    out = child_result(CNN, env=NATIVE_CPU)
    assert out["eager"] == pytest.approx(out["compiled"], rel=1e-4)  # losses and validation losses, fp32
    assert out["compiles"][0] > 0 and len(set(out["compiles"])) == 1, out["compiles"]  # none after epoch 1
    assert f"| compiled (torch.compile, {COMPILER}) |" in out["summary"], out["summary"]
    assert out["same_object"] and out["keys"] and out["best_loads"]  # history.model is the user's; no _orig_mod.
    assert out["resumed_bitwise"]  # a compiled run resumed from last.pt ends where the uninterrupted one did
    assert "compiled by the caller (torch.compile(model)): trained as it is" in out["own_summary"]
    assert out["own_keys"] and out["own_losses"] == pytest.approx(out["eager"], rel=1e-4)
    # a shape that changes in epoch 2 recompiles, said with torch.compile's own reason
    assert out["shrunk_compiles"][1] == out["shrunk_compiles"][0] + 1 == out["shrunk_compiles"][2]
    assert len(out["recompiles"]) == 1 and "epoch 2" in out["recompiles"][0], out["recompiles"]
    assert "size mismatch at index 2. expected 8, actual 6" in out["recompiles"][0], out["recompiles"]
    assert out["evaluate"][0] == pytest.approx(out["evaluate"][1], rel=1e-5) and out["predict_close"]


LLM = COMPILED + """
import json, sys
sys.path.insert(0, "tests")
from llm_models import causal_lm, counting, lora
from tpu_utility import EMA, Compile, GradientCheckpointing, evaluate, one_cycle_fit

train, valid = counting(64, 0), counting(16, 1)
out = {}


def fit(model, compile, **kw):
    h = one_cycle_fit(model, train, valid_data=valid, epochs=2, max_lr=3e-3, batch_size=8, compile=compile,
                      progress=False, **kw)
    return h, {"figures": [r.train_loss for r in h.records] + [r.valid_loss for r in h.records],
               "compiles": [r.compiles for r in h.records]}


_, out["eager"] = fit(causal_lm("llama"), False)
h, out["compiled"] = fit(causal_lm("llama"), COMPILED)
out["evaluate"] = [evaluate(h.model, valid, compile=c)["loss"] for c in (False, COMPILED)]
cheap = Compile(backend="aot_eager")
cases = {"checkpointing": (causal_lm, dict(callbacks=[GradientCheckpointing()])),
         "ema": (causal_lm, dict(callbacks=[EMA(decay=0.9)])), "fp16": (causal_lm, dict(precision="fp16")),
         "lora": (lambda kind: lora(causal_lm(kind)), {})}
for name, (build, kw) in cases.items():
    _, out[name + " eager"] = fit(build("llama"), False, **kw)
    h, out[name] = fit(build("llama"), cheap, **kw)
    out[name + " keys"] = [k for k in h.model.state_dict() if "_orig_mod" in k or "module.module" in k]
from tpu_utility import PackedDataset
samples = [{k: s[k] for k in ("input_ids", "labels")} for n in range(6, 16) for s in counting(4, seed=n, length=n)]
packed = PackedDataset(samples, length=32)  # 40 samples of 6-15 tokens in 14 rows: 3 batches of 4
for name, compile in (("packed eager", False), ("packed", cheap)):
    h = one_cycle_fit(lora(causal_lm("llama")), packed, epochs=2, max_lr=3e-3, batch_size=4, compile=compile,
                      progress=False)
    out[name] = {"figures": [r.train_loss for r in h.records], "compiles": [r.compiles for r in h.records]}
print("RESULT " + json.dumps(out))
"""


def test_a_compiled_llama_trains_as_eager_also_with_checkpointing_ema_fp16_and_lora():
    """And a LoRA Llama on packed rows (PackedDataset): their block-diagonal masks built inside the compiled step."""
    out = child_result(LLM, env=NATIVE_CPU)
    assert out["compiled"]["figures"] == pytest.approx(out["eager"]["figures"], rel=1e-4)
    assert out["compiled"]["figures"][1] < out["compiled"]["figures"][0]  # the loss falls
    assert out["compiled"]["compiles"][0] > 0 and len(set(out["compiled"]["compiles"])) == 1
    assert out["evaluate"][0] == pytest.approx(out["evaluate"][1], rel=1e-5)
    for name in ("checkpointing", "ema", "fp16", "lora", "packed"):
        assert out[name]["figures"] == pytest.approx(out[name + " eager"]["figures"], rel=1e-4), name
        assert out[name]["compiles"][0] > 0 and not out.get(name + " keys"), name
    for name in ("ema", "fp16", "lora", "packed"):  # flat after epoch 1 (checkpointing's: see docs/training.md)
        assert len(set(out[name]["compiles"])) == 1, (name, out[name]["compiles"])


CUDA_RUN = """
import json, sys
import torch
sys.path.insert(0, "tests")
from llm_models import causal_lm, counting
from tpu_utility import one_cycle_fit

train = counting(256, 0)
out = {}
for compile in (False, True):
    h = one_cycle_fit(causal_lm("llama"), train, epochs=3, max_lr=3e-3, batch_size=16, compile=compile, progress=False,
                      precision="bf16")
    out[str(compile)] = {"losses": [r.train_loss for r in h.records], "compiles": [r.compiles for r in h.records],
                         "summary": h.summary, "device": str(next(h.model.parameters()).device)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_a_compiled_run_trains_as_eager_with_flat_compiles():
    out = child_result(CUDA_RUN, env={"TPU_UTILITY_BACKEND": "native"})
    eager, compiled = out["False"], out["True"]
    worst = max(abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"]))
    record_figure("compiled Llama on CUDA: losses vs eager (bf16)", f"worst rel. difference {worst:.2e}", "<= 2e-2",
                  worst <= 2e-2)  # fmt: skip
    assert "compiled (torch.compile, inductor)" in compiled["summary"] and "cuda" in compiled["summary"]
    assert "adamw (fused)" in compiled["summary"] and "(fused)" not in eager["summary"]
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=2e-2)  # bf16 kernels differ
    assert compiled["losses"][-1] < compiled["losses"][0]
    assert compiled["compiles"][0] > 0 and len(set(compiled["compiles"])) == 1


PROCESSES = """
import json, sys
sys.path.insert(0, "tests")
from llm_models import causal_lm, counting
from tpu_utility import Compile, one_cycle_fit

if __name__ == "__main__":
    out = {}
    for strategy in ("auto", "fsdp"):  # DDP over 2 gloo processes; FSDP2 over them
        for compile in (False, Compile(backend="aot_eager")):
            h = one_cycle_fit(causal_lm("llama"), counting(64, 0), epochs=2, max_lr=3e-3, batch_size=8, cores=2,
                              strategy=strategy, compile=compile, progress=False)
            out[f"{strategy} {bool(compile)}"] = {"losses": [r.train_loss for r in h.records], "summary": h.summary}
    print("RESULT " + json.dumps(out))
"""


@pytest.mark.multidevice
def test_compiled_ddp_and_fsdp2_replicas_train_as_eager_ones():
    out = child_result(PROCESSES, env=NATIVE_CPU)
    for strategy in ("auto", "fsdp"):
        eager, compiled = out[f"{strategy} False"], out[f"{strategy} True"]
        assert "compiled (torch.compile, aot_eager)" in compiled["summary"], compiled["summary"]
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-4), strategy
        assert compiled["losses"][1] < compiled["losses"][0]


GENERATE = """
import json, sys
sys.path.insert(0, "tests")
from llm_models import causal_lm, counting
from tpu_utility import Compile, generate

model = causal_lm("llama")
prompts = [s["input_ids"][: 5 + i % 7] for i, s in enumerate(counting(12, 3))]  # two buckets
runs = [generate(model, prompts, max_new_tokens=10, batch_size=4, compile=c, progress=False)
        for c in (False, Compile(backend="aot_eager"))]
import torch._dynamo.utils
print("RESULT " + json.dumps({"eager": runs[0], "compiled": runs[1],
                              "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]}))
"""


def test_generate_compiled_gives_the_eager_tokens():
    out = child_result(GENERATE, env=NATIVE_CPU)
    assert out["compiled"] == out["eager"] and len(out["eager"]) == 12 and all(1 <= len(t) <= 10 for t in out["eager"])
    assert out["graphs"] > 0  # the prefills and the decode step did compile


def test_a_compiled_cuda_run_steps_one_cycle_fits_adam_fused_and_the_cpu_keeps_torchs_default():
    from tpu_utility.backend.native import NativeBackend

    assert NativeBackend("cuda", "nccl").compute.compiled_optimizer_options("adamw") == {"fused": True}
    assert NativeBackend("cuda", "nccl").compute.compiled_optimizer_options("sgd") == {}
    assert NativeBackend("cpu", "gloo").compute.compiled_optimizer_options("adamw") == {}
    assert not NativeBackend("cpu", "gloo").compute.compile_pays(10**6)  # "auto" never compiles on the CPU
    assert NativeBackend("cuda", "nccl").compute.compile_pays(300) and not NativeBackend("cuda", "nccl").compute.compile_pays(299)


BUCKETS = """
import json
import torch
from torch.utils.data import DataLoader
from tpu_utility import BucketCollate, Compile, one_cycle_fit
from tpu_utility.demo import MarkerClassifier, marker_sequences

train, valid = marker_sequences(512, 0), marker_sequences(128, 1)
out = {}
for compile in (False, Compile(backend="aot_eager")):
    torch.manual_seed(0)
    h = one_cycle_fit(MarkerClassifier(), DataLoader(train, batch_size=32, shuffle=True, drop_last=True,
                                                     collate_fn=BucketCollate([16, 40, 120])),
                      valid_data=DataLoader(valid, batch_size=32, collate_fn=BucketCollate([16, 40, 120])),
                      epochs=3, max_lr=1e-2, compile=compile, progress=False)
    out[str(bool(compile))] = {"losses": [r.train_loss for r in h.records], "compiles": [r.compiles for r in h.records]}
print("RESULT " + json.dumps(out))
"""


def test_variable_lengths_through_buckets_compile_in_epoch_1_only():
    out = child_result(BUCKETS, env=NATIVE_CPU)
    assert out["True"]["losses"] == pytest.approx(out["False"]["losses"], rel=1e-4)
    assert out["True"]["compiles"][0] > 0 and len(set(out["True"]["compiles"])) == 1, out["True"]["compiles"]


def test_on_xla_a_torch_compiled_model_trains_its_module_and_says_so(tmp_path):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.arange(64) % 2)
    with pytest.warns(UserWarning, match="compiled by torch.compile, which does not target XLA: Sequential itself is run"):
        h = one_cycle_fit(torch.compile(net), data, epochs=2, max_lr=1e-2, batch_size=16, progress=False,
                          checkpoint_dir=str(tmp_path))  # fmt: skip
    from tpu_utility import load_checkpoint

    assert sorted(load_checkpoint(str(tmp_path / "last.pt"))["model"]) == sorted(net.state_dict())  # no _orig_mod.
    assert h.records[-1].train_loss < h.records[0].train_loss
