"""strategy="fsdp-tp" (a 2-D mesh: FSDP x tensor parallel) on 4 XLA:CPU devices as 2x2, in one subprocess: a tiny
Llama and a tiny Qwen2 with LoRA adapters train to the replicated run's losses (1e-5, fp32); each device holds a
quarter of every projection and half of the rest (read from the live shards); the memory plan's column for it is
what the devices hold, within [1.00, 1.15]; checkpoints load into the plain model, export_pretrained writes from
it. The second sharding is the proof that a strategy is one module: the package files it touches are counted."""

import json
import os
import subprocess

import pytest

from conftest import ROOT, run_python
from native_jobs import WARM
from tpu_utility import FSDP
from tpu_utility.training.strategies import Mesh2D, choose_strategy, resolve_strategy

# the models and data both scripts train: ROWS rows of 16 tokens
MODELS = r"""
sizes = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
torch.manual_seed(0)
ids = torch.randint(0, 128, (ROWS, 16))
data = [{"input_ids": row, "labels": row} for row in ids]
options = Mesh2D(tensor=2, checkpoint=False)

def qwen_lora():
    torch.manual_seed(2)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0)
    return get_peft_model(Qwen2ForCausalLM(Qwen2Config(**sizes)), lora)
"""

SCRIPT = r"""
import copy, json, os, tempfile
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from tpu_utility import Callback, device_bytes, export_pretrained, load_checkpoint, memory_plan, one_cycle_fit
from tpu_utility.backend import current
from tpu_utility.training.strategies import Mesh2D
from tpu_utility.training.strategies.mesh2d import projections

MODELS
out = {}

class Held(Callback):
    def on_fit_end(self, loop):  # after the last step's sync: parameters and optimizer state are device data
        split = projections(loop.model)
        params = [p for p in loop.model.parameters()]
        held = current().sharding.held_bytes(params)
        whole = [p.numel() * p.element_size() for p in params]
        self.projections = sum(h for h, p in zip(held, params) if id(p) in split) / sum(
            w for w, p in zip(whole, params) if id(p) in split)
        self.rest = sum(h for h, p in zip(held, params) if id(p) not in split) / sum(
            w for w, p in zip(whole, params) if id(p) not in split)
        figures = device_bytes(loop.model, loop.optimizer)  # the public figure, from the same shards
        moments = [t for s in loop.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        self.state = figures.parameters + sum(current().sharding.held_bytes(moments))  # the step counters aside

def run(name, build, strategy):
    torch.manual_seed(1)
    model, held, folder = build(), Held(), tempfile.mkdtemp()
    history = one_cycle_fit(model, data, epochs=1, max_lr=1e-2, batch_size=2, cores="all", strategy=strategy,
                            progress=False, callbacks=[held], checkpoint_dir=folder, seed=1)
    record = {"losses": [r.train_loss for r in history.records], "summary": history.summary}
    if strategy != "spmd":
        plain = build()
        load_checkpoint(os.path.join(folder, "last.pt"), model=plain)  # strict, on the CPU: the plain model's keys
        trained = {k: v.cpu() for k, v in history.model.state_dict().items()}
        record["loaded"] = all(torch.equal(v, trained[k]) for k, v in plain.state_dict().items())
        exported = export_pretrained(history.model, os.path.join(folder, "export"))
        record["exported"] = sorted(os.listdir(exported))
        plan = memory_plan(build(), cores=4, batch_size=2, seq_len=16, fsdp=options)
        planned = plan.term("parameters").sharded + next(t for t in plan.terms if t.name.startswith("optimizer")).sharded
        record.update(projections=held.projections, rest=held.rest, plan_ratio=planned / held.state)
    out[f"{name} {strategy if isinstance(strategy, str) else 'fsdp-tp'}"] = record

llama = lambda: LlamaForCausalLM(LlamaConfig(**sizes))  # noqa: E731
for name, build in (("llama", llama), ("qwen2-lora", qwen_lora)):
    run(name, build, "spmd")
    run(name, build, options)
print("RESULT" + json.dumps(out))
""".replace("MODELS", MODELS.replace("ROWS", "16"))

# natively: 4 gloo processes as 2x2, launched (forked, the script runs as a notebook cell) by one_cycle_fit;
# the replicated run is one process with the job's global batch (2 rows x 2 FSDP ranks)
NATIVE_SCRIPT = WARM + r"""
os.environ["TPU_UTILITY_BACKEND"] = "native"
import json, os, tempfile
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from tpu_utility import Callback, export_pretrained, load_checkpoint, memory_plan, one_cycle_fit
from tpu_utility.backend import current
from tpu_utility.training.strategies import Mesh2D
from tpu_utility.training.strategies.mesh2d import projections

MODELS
out, folder = {}, tempfile.mkdtemp()
os.environ["HELD_DIR"] = folder

class Held(Callback):
    def __init__(self, name):
        self.name = name
    def on_fit_end(self, loop):
        split = projections(loop.model)
        params = list(loop.model.parameters())
        held = current().sharding.held_bytes(params)
        whole = [p.numel() * p.element_size() for p in params]
        ratio = lambda pick: sum(h for h, p in zip(held, params) if pick(p)) / sum(w for w, p in zip(whole, params) if pick(p))
        moments = [t for s in loop.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        figures = {"projections": ratio(lambda p: id(p) in split), "rest": ratio(lambda p: id(p) not in split),
                   "state": sum(held) + sum(current().sharding.held_bytes(moments))}
        with open(os.path.join(os.environ["HELD_DIR"], f"{self.name}.{current().processes.rank()}.json"), "w") as f:
            json.dump(figures, f)

def llama():
    torch.manual_seed(1)
    return LlamaForCausalLM(LlamaConfig(**sizes))

runs = (("llama", llama), ("qwen2-lora", qwen_lora))
for name, build in runs:  # the launched runs first: a fork after this process computed (OpenMP's pool) would hang
    ckpt = os.path.join(folder, name)
    two = one_cycle_fit(build(), data, epochs=1, max_lr=1e-2, batch_size=2, cores=4, strategy=options, progress=False,
                        seed=1, callbacks=[Held(name)], checkpoint_dir=ckpt)
    plain = build()
    load_checkpoint(os.path.join(ckpt, "last.pt"), model=plain)
    same = all(torch.equal(v, two.model.state_dict()[k]) for k, v in plain.state_dict().items())
    held = [json.load(open(os.path.join(folder, f"{name}.{r}.json"))) for r in range(4)]
    out[name] = {"two": [r.train_loss for r in two.records], "summary": two.summary, "loaded": same, "held": held,
                 "exported": sorted(os.listdir(export_pretrained(two.model, os.path.join(folder, name + "-export"))))}
for name, build in runs:
    one = one_cycle_fit(build(), data, epochs=1, max_lr=1e-2, batch_size=4, cores=1, progress=False, seed=1)
    plan = memory_plan(build(), cores=4, batch_size=2, seq_len=16, fsdp=options)
    planned = plan.term("parameters").sharded + next(t for t in plan.terms if t.name.startswith("optimizer")).sharded
    out[name].update(one=[r.train_loss for r in one.records], plan_ratio=planned / max(h["state"] for h in out[name]["held"]))
print("RESULT" + json.dumps(out))
""".replace("MODELS", MODELS.replace("ROWS", "8"))


def _check(out, name, replicated, sharded):
    assert sharded["losses"] == pytest.approx(replicated["losses"], rel=1e-5, abs=1e-5), (name, out)
    assert "fsdp-tp: a 2x2 mesh" in sharded["summary"], sharded["summary"]
    # a projection's weights split over both axes (Qwen2's q/k/v biases over the tensor axis alone on XLA)
    assert sharded["projections"] == pytest.approx(0.25, abs=0.002), (name, sharded)
    assert sharded["rest"] == pytest.approx(0.5), (name, sharded)  # over the fsdp axis alone
    assert 1.0 <= sharded["plan_ratio"] <= 1.15, (name, sharded)  # the plan's column: what a device holds
    assert sharded["loaded"], (name, sharded)  # the checkpoint loads strictly into the plain model
    assert any(f.endswith(".safetensors") for f in sharded["exported"]), sharded["exported"]


@pytest.mark.multidevice
def test_fsdp_tp_on_a_2x2_mesh_trains_as_the_replicated_run_and_holds_a_quarter_of_each_projection():
    r = run_python(SCRIPT, env={"CPU_NUM_DEVICES": "4"}, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    for name in ("llama", "qwen2-lora"):
        _check(out, name, out[f"{name} spmd"], out[f"{name} fsdp-tp"])


@pytest.mark.multidevice
def test_fsdp_tp_natively_is_dtensor_tensor_parallel_under_fsdp2_over_4_gloo_processes():
    r = run_python(NATIVE_SCRIPT, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    for name in ("llama", "qwen2-lora"):
        run = out[name]
        held = run["held"]
        assert all(h == held[0] for h in held), held  # every rank its quarter and half
        sharded = {"losses": run["two"], **held[0], **{k: run[k] for k in ("summary", "plan_ratio", "loaded", "exported")}}
        _check(out, name, {"losses": run["one"]}, sharded)


def test_fsdp_tp_takes_its_options_and_refuses_what_it_cannot_run():
    assert resolve_strategy("fsdp-tp") == ("fsdp-tp", Mesh2D())
    assert resolve_strategy(Mesh2D(tensor=4)) == ("fsdp-tp", Mesh2D(tensor=4))
    assert resolve_strategy(FSDP()) == ("fsdp", FSDP())  # FSDP's own options stay FSDP's
    assert choose_strategy("fsdp-tp", 8, in_launch=False, options=Mesh2D(tensor=4)).cores == 8
    with pytest.raises(ValueError, match=r"cores a multiple of Mesh2D\(tensor=2\) and at least 4, but given cores=2"):
        choose_strategy("fsdp-tp", 2, in_launch=False)
    with pytest.raises(TypeError, match=r"Mesh2D\(tensor=...\) is the devices along the tensor axis.*given 1"):
        Mesh2D(tensor=1)
    from tpu_utility.backend.native import NativeBackend

    launched = choose_strategy("fsdp-tp", 4, in_launch=False, on=NativeBackend("cpu", "gloo"))  # natively: processes
    assert launched.name == "multiprocess-fsdp-tp" and launched.replica().name == "fsdp-tp"
    with pytest.raises(ValueError, match=r"predict with strategy='fsdp-tp' is built on XLA's mesh.*use strategy='fsdp'"):
        launched.infer(print, (), what="predict")  # refused before any launch: not built natively


def test_the_second_sharding_is_one_module_one_table_row_and_the_backends_sharding_group():
    """The package files the 2-D strategy's commit touches, outside tests and docs: its module, the table, and the
    backends' sharding groups (base.py's default refusal, xla.py's placement) - at most 3 rooms of the package."""
    touched = subprocess.run(["git", "log", "--format=", "--name-only", "--grep=fsdp-tp: the second sharding"],
                             capture_output=True, text=True, cwd=ROOT).stdout.split()  # fmt: skip
    if not touched:
        pytest.skip("not a git checkout with the strategy's commit")
    package = sorted({f for f in touched if f.startswith("tpu_utility/")})
    rooms = {os.path.dirname(f) if f.startswith("tpu_utility/backend/") else f for f in package}
    assert rooms <= {"tpu_utility/training/strategies/mesh2d.py", "tpu_utility/training/strategies/__init__.py",
                     "tpu_utility/backend"}, package  # fmt: skip
