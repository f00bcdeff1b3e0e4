"""strategy="fsdp" on 4 XLA:CPU devices, in one subprocess: every parameter sharded 4 ways while training, the
losses of the replicated run (with accumulation, clipping, and with and without per-block checkpointing),
strategy="auto" choosing it from the memory plan, flat compiles, no host syncs, the bytes each device holds,
predict/evaluate/find_lr sharded, the hand loop's shard_model, checkpoints with the plain model's own keys, a run
killed after epoch 1 and resumed bitwise (its restored state sharded again), and peft LoRA sharded (adapters alone
optimized, the base bit-equal, the adapter reloaded). A resume with another core count (from the killed run's
folder) and the bad inputs that need no devices are checked in this process."""

import json

import pytest
import torch
from torch import nn

from conftest import run_python
from tpu_utility import FSDP, one_cycle_fit
from tpu_utility.training.strategies import choose_strategy, resolve_strategy
from tpu_utility.sharding import block_classes, check_batch, output_scores, refuse_replaced

FSDP_SCRIPT = r"""
import copy, json, math, os, tempfile
import torch, torch_xla
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM
from tpu_utility import (FSDP, Callback, device_bytes, device_loader, evaluate, find_lr, load_checkpoint, memory_plan,
                         one_cycle_fit, predict, shard_model, step_optimizer)
from tpu_utility.backend import compile_count, to_cpu

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
base = LlamaForCausalLM(config)
ids = torch.randint(0, 64, (32, 16))
data = [{"input_ids": row, "labels": row} for row in ids]
out = {}

def device_bytes_by_hand(tensors):
    # (bytes device 0 holds, bytes of the whole tensors, a quarter of them plus the padding of an uneven split),
    # from the live shards' indices: the runtime reports no memory under SPMD
    held = whole = bound = 0
    tensors = [t for t in tensors if t.numel()]
    spec = torch_xla._XLAC._get_xla_sharding_spec
    places = iter(torch_xla._XLAC._get_local_shard_replica_and_indices([t for t in tensors if spec(t)]))
    for t in tensors:
        _, index = next(places)[0] if spec(t) else (None, Ellipsis)  # no sharding at all: whole on every device
        size = t.element_size()
        if index is Ellipsis or not isinstance(index, (tuple, list)):
            held += t.numel() * size
        else:
            held += math.prod(len(range(*s.indices(n))) for s, n in zip(index, t.shape)) * size
        whole += t.numel() * size
        if t.dim():
            k = max(range(t.dim()), key=lambda d: t.shape[d])
            bound += math.ceil(t.shape[k] / 4) * (t.numel() // t.shape[k]) * size
        else:
            bound += size
    return held, whole, bound

class Watch(Callback):
    after_save, order, restored = (), 100, None  # after every built-in: Checkpoints has written or restored
    def on_fit_start(self, loop):  # a resume's optimizer state, as loaded from last.pt and before any step
        state = [t for s in loop.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        self.restored = device_bytes_by_hand(state) if state else None
    def on_epoch_end(self, loop, record):
        self.after_save = [*self.after_save, compile_count()]
        self.specs = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in loop.model.named_parameters()}
    def on_fit_end(self, loop):  # after the last step's sync: parameters and optimizer state are device data
        state = [t for s in loop.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
        self.bytes = device_bytes_by_hand([*loop.model.parameters(), *state])
        held = device_bytes(loop.model, loop.optimizer)  # the public figure, from the same shards
        self.public = [held.parameters, held.gradients, held.optimizer_state]

class Killed(Callback):
    order = 200  # after every built-in and Watch: epoch 1's last.pt and best.pt are written, then the process "dies"
    def on_epoch_end(self, loop, record):
        raise SystemExit(f"killed after epoch {record.epoch}")

def fit(strategy, folder=None, also=(), **kw):
    model, watch, folder = copy.deepcopy(base), Watch(), folder or tempfile.mkdtemp()
    history = one_cycle_fit(model, data, epochs=3, max_lr=1e-2, batch_size=2, cores="all", strategy=strategy,
                            accumulate_steps=2, max_grad_norm=0.5, progress=False, callbacks=[watch, *also],
                            checkpoint_dir=folder, seed=1, **kw)
    plain = LlamaForCausalLM(config)
    load_checkpoint(os.path.join(folder, "best.pt"), model=plain)  # strict, on the CPU, the plain model's keys
    trained = history.model.state_dict()  # to the host in one graph (a .cpu() per sharded tensor compiles one each)
    trained = dict(zip(trained, to_cpu(list(trained.values()))))
    same = all(torch.equal(v, trained[k]) for k, v in plain.state_dict().items())
    fit.trained = trained
    return plain, {"losses": [r.train_loss for r in history.records], "compiles": [r.compiles for r in history.records],
                   "syncs": [r.host_syncs for r in history.records], "summary": history.summary, "specs": watch.specs,
                   "keys": sorted(history.model.state_dict()), "same_as_history": same, "bytes": watch.bytes, "public": watch.public, "after_save": watch.after_save, "restored": watch.restored,
                   "use_cache": history.model.config.use_cache,
                   "forward_restored": all("forward" not in m.__dict__ for m in history.model.modules())}

_, out["spmd"] = fit("spmd")
# the runs' plans, as one_cycle_fit makes them: 16-token rows, activations traced; fsdp checkpointed and not
plan = memory_plan(base, cores=4, batch_size=2, seq_len=16)
unchecked = memory_plan(base, cores=4, batch_size=2, seq_len=16, fsdp=FSDP(checkpoint=False))
limit = (plan.replicated + unchecked.sharded) / 2 / 0.9  # one replica cannot fit the usable 90%, a shard can
os.environ["TPU_UTILITY_DEVICE_MEMORY_GB"] = str(limit / 1e9)
out["plan"] = [plan.replicated, plan.sharded, limit * 0.9, plan.method]
plain, out["auto"] = fit("auto")  # the plan chooses fsdp, with per-block checkpointing (FSDP()'s default)
_, out["no_checkpoint"] = fit(FSDP(checkpoint=False))
straight = fit.trained
# killed right after epoch 1's checkpoints (nothing after them runs: no fit end, no restore), then resumed
kept = os.environ["KEEP"]  # the test resumes from it in its own process with another core count
try:
    fit(FSDP(checkpoint=False), folder=kept, also=[Killed()])
except SystemExit as stop:
    out["killed"] = str(stop)
_, out["resumed"] = fit(FSDP(checkpoint=False), folder=kept, resume=True)
out["resumed"]["bitwise"] = sorted(k for k, v in straight.items() if not torch.equal(v, fit.trained[k]))
try:
    one_cycle_fit(copy.deepcopy(base), data, epochs=1, max_lr=1e-2, batch_size=2, cores="all", strategy="spmd")
except ValueError as error:
    out["refusal"] = str(error)
del os.environ["TPU_UTILITY_DEVICE_MEMORY_GB"]
out["base_keys"] = sorted(base.state_dict())

# predict and evaluate: the trained plain CPU model, sharded and replicated; 12 rows (a padded last batch)
rows = data[:12]
sharded = predict(plain, rows, cores="all", batch_size=2, strategy="fsdp", progress=False)
replicated = predict(plain, rows, cores="all", batch_size=2, progress=False)
out["predict"] = {"shape": list(sharded.shape), "max_diff": float((sharded - replicated).abs().max()),
                  "scale": float(replicated.abs().max()), "on_cpu": all(p.device.type == "cpu" for p in plain.parameters())}
out["evaluate"] = [evaluate(plain, rows, cores="all", batch_size=2, strategy=FSDP())["loss"],
                   evaluate(plain, rows, cores="all", batch_size=2)["loss"]]
before = {k: v.clone() for k, v in plain.state_dict().items()}
sweep = find_lr(plain, data, batch_size=2, num_steps=4, read_every=2, strategy="fsdp")
out["find_lr"] = {"losses": sweep.losses, "unchanged": all(torch.equal(v, plain.state_dict()[k]) for k, v in before.items())}

# peft LoRA sharded: the optimizer holds the adapters alone, the base stays bit-equal, the adapter reloads
import peft
lora_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
lora = peft.get_peft_model(copy.deepcopy(base), lora_config)
frozen = {k: v.clone() for k, v in lora.state_dict().items() if "lora_" not in k}
class Held(Callback):
    def on_fit_start(self, loop):
        held = {id(p) for g in loop.optimizer.param_groups for p in g["params"]}
        self.held = [n for n, p in loop.model.named_parameters() if id(p) in held]
held = Held()
tuned = one_cycle_fit(lora, data, epochs=1, max_lr=1e-2, batch_size=2, cores="all", strategy="fsdp", progress=False,
                      callbacks=[held], seed=1)
state = tuned.model.state_dict()
state = dict(zip(state, to_cpu(list(state.values()))))
on_cpu = peft.get_peft_model(copy.deepcopy(base), lora_config)  # history.model's weights, on the CPU
on_cpu.load_state_dict(state)
adapter = tempfile.mkdtemp()
tuned.model.save_pretrained(adapter)
reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter)
with torch.no_grad():
    gap = float((reloaded(input_ids=ids[:4]).logits - on_cpu(input_ids=ids[:4]).logits).abs().max())
out["lora"] = {"held": held.held, "trainable": [n for n, p in lora.named_parameters() if p.requires_grad],
               "base_changed": sorted(k for k, v in frozen.items() if not torch.equal(v, state[k])),
               "lora_B": [float(v.abs().max()) for k, v in reloaded.state_dict().items() if "lora_B" in k],
               "gap": gap, "summary": tuned.summary}

# the hand loop: shard_model before the optimizer; one built before is refused by name
model = copy.deepcopy(base)
stale = torch.optim.AdamW(model.parameters(), lr=1e-2)
shard_model(model)
try:
    step_optimizer(stale)
except RuntimeError as error:
    out["stale_step"] = str(error)
other = copy.deepcopy(base)
try:
    shard_model(other, optimizer=torch.optim.AdamW(other.parameters(), lr=1e-2))
except RuntimeError as error:
    out["stale_given"] = str(error)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
losses = []
for epoch in range(3):
    for batch in device_loader(DataLoader(data, batch_size=8, shuffle=False)):
        optimizer.zero_grad(set_to_none=True)  # before the backward: the last step's gradients stay to be measured
        loss = model(**batch).loss
        loss.backward()
        step_optimizer(optimizer)
        losses.append(loss.detach())
state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
grads = [p.grad for p in model.parameters()]
out["hand"] = {"losses": torch.stack(losses).cpu().tolist(), "bytes": device_bytes_by_hand([*model.parameters(), *grads, *state]),
               "specs": [torch_xla._XLAC._get_xla_sharding_spec(p) for p in model.parameters()]}
print("RESULT" + json.dumps(out))
"""


@pytest.mark.multidevice
def test_fsdp_on_four_devices_shards_every_parameter_and_trains_as_the_replicated_run(tmp_path):
    kept = tmp_path / "killed"
    r = run_python(FSDP_SCRIPT, env={"CPU_NUM_DEVICES": "4", "KEEP": str(kept)}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    # the console shows the package's own lines: XLA's GSPMD notice (one per compiled graph, dozens here) said once,
    # and no backward-hook warning for a root barrier that a ModelOutput never lets torch call
    assert r.stderr.count("GSPMD sharding propagation is going to be deprecated") <= 1, r.stderr[-3000:]
    assert "For backward hooks to be called" not in r.stderr, r.stderr[-3000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    spmd, auto, plain_fsdp = out["spmd"], out["auto"], out["no_checkpoint"]
    replicated, sharded, usable, method = out["plan"]
    assert sharded < usable < replicated and method.startswith("traced one step (2 x 16 tokens"), out["plan"]
    # the summary line says the plan the run was checked against (traced, as the run is: 16-token rows)
    assert f"memory plan (traced): " in auto["summary"] and "sharded over 4 of" in auto["summary"], auto["summary"]
    # strategy="auto" under a chip between the two figures: fsdp, said with the figures, checkpointed per block
    assert "fsdp on 4" in auto["summary"] and "strategy='auto' chose fsdp" in auto["summary"], auto["summary"]
    assert "2 LlamaDecoderLayer blocks gathered one at a time, each checkpointed" in auto["summary"], auto["summary"]
    assert "each checkpointed" not in plain_fsdp["summary"] and "fsdp on 4" in plain_fsdp["summary"]
    for run in (auto, plain_fsdp):
        unsharded = {n: s for n, s in run["specs"].items() if "devices=[" not in s or "replicate" in s}
        assert not unsharded, unsharded  # every parameter split over the 4 devices
        # losses of the replicated run with accumulate_steps=2 and max_grad_norm, with and without checkpointing
        assert run["losses"] == pytest.approx(spmd["losses"], rel=1e-4)
        assert run["syncs"] == [0, 0, 0], run["syncs"]
        # flat from epoch 1, its checkpoint saves included: the sharded tensors reach the host from their shards,
        # never whole on a device, so a save compiles nothing (it once compiled a gather graph at epoch 1's end)
        assert run["compiles"] == [run["compiles"][0]] * 3 and run["after_save"] == run["compiles"], (
            run["compiles"], run["after_save"])
        assert run["keys"] == out["base_keys"] and run["same_as_history"]  # no _orig_module. or FSDP prefixes
        assert run["use_cache"] is True and run["forward_restored"]  # given back after training
        held, whole, bound = run["bytes"]  # parameters + AdamW state per device, from the live shards
        assert held <= bound < 0.3 * whole, run["bytes"]
        params, grads, state = run["public"]  # device_bytes: the same shards, and AdamW's step counts (a few bytes)
        assert held <= params + state <= held + 8 * len(run["specs"]) and grads < 0.3 * whole, (run["public"], held)
    assert all(s == "" or "replicated" in s for s in spmd["specs"].values())  # the control: replicated
    assert spmd["bytes"][0] == spmd["bytes"][1]
    assert auto["losses"][-1] < auto["losses"][0]
    assert spmd["compiles"][0] == spmd["compiles"][1] == spmd["compiles"][2], spmd["compiles"]  # nothing to gather
    assert "strategy='fsdp'" in out["refusal"] and "per chip" in out["refusal"], out.get("refusal")
    # predict and evaluate sharded: every row, in dataset order, equal to the replicated model's
    assert out["predict"]["shape"] == [12, 16, 64] and out["predict"]["on_cpu"]
    assert out["predict"]["max_diff"] <= 1e-5 * max(1.0, out["predict"]["scale"]), out["predict"]
    assert out["evaluate"][0] == pytest.approx(out["evaluate"][1], rel=1e-5)
    assert len(out["find_lr"]["losses"]) == 4 and out["find_lr"]["unchanged"]
    # killed after epoch 1's checkpoint and resumed: bitwise the uninterrupted run, its state sharded again
    resumed = out["resumed"]
    assert out["killed"] == "killed after epoch 1"
    assert resumed["bitwise"] == [] and resumed["losses"] == plain_fsdp["losses"], (resumed, plain_fsdp["losses"])
    assert not {n: s for n, s in resumed["specs"].items() if "devices=[" not in s or "replicate" in s}
    for held, whole, bound in (resumed["restored"], resumed["bytes"]):  # the loaded AdamW state sliced like its
        assert held <= bound < 0.3 * whole, resumed  # parameters at once, never whole on every device
    assert plain_fsdp["restored"] is None  # a fresh run: nothing restored
    # another core count: last.pt holds whole tensors (any count could read them), but the global batch and the
    # schedule's steps follow the cores, so resume=True refuses it by name; here, in this process's one device
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    data = [{"input_ids": row, "labels": row} for row in torch.randint(0, 64, (32, 16))]
    with pytest.raises(ValueError) as error:
        one_cycle_fit(model, data, epochs=3, max_lr=1e-2, batch_size=2, cores=1, accumulate_steps=2, max_grad_norm=0.5,
                      progress=False, checkpoint_dir=str(kept), seed=1, resume=True)
    message = str(error.value)
    assert "was written by a different run, so resume=True refuses it" in message, message
    assert "cores: checkpoint 4, this run 1" in message and "optimizer steps: checkpoint 6, this run 24" in message
    # peft LoRA sharded
    lora = out["lora"]
    assert lora["held"] == lora["trainable"] and all("lora_" in n for n in lora["held"]), lora["held"]
    assert len(lora["held"]) == 8 and "fsdp on 4" in lora["summary"]  # A and B of q_proj and v_proj, 2 layers
    assert lora["base_changed"] == [], lora["base_changed"]
    assert min(lora["lora_B"]) > 0 and lora["gap"] <= 1e-5, lora
    # the hand loop
    assert "shard_model" in out["stale_step"] and "train nothing" in out["stale_step"]
    assert "shard_model" in out["stale_given"]
    hand = out["hand"]
    assert all("devices=[" in s and "replicate" not in s and "4" in s for s in hand["specs"]), hand["specs"]
    first, last = hand["losses"][:4], hand["losses"][-4:]  # epoch 1's and epoch 3's four steps
    assert sum(last) < 0.95 * sum(first), hand["losses"]  # 3.75 against 4.17 when written
    held, whole, bound = hand["bytes"]  # parameters + gradients + AdamW state on device 0
    assert held <= bound < 0.3 * whole, hand["bytes"]


# ------------------------------------------------------------------ in this process: the bad inputs
class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        return self.linear(x)


def test_fsdp_options_validate_themselves_and_fsdp_means_fsdp_defaults():
    assert resolve_strategy("fsdp") == ("fsdp", FSDP())
    assert resolve_strategy(FSDP(wrap=_Block)) == ("fsdp", FSDP(wrap=(_Block,)))
    assert FSDP().checkpoint is True
    with pytest.raises(TypeError, match=r"wrap=.*given 3"):
        FSDP(wrap=3)
    with pytest.raises(TypeError, match="checkpoint=.*given 'yes'"):
        FSDP(checkpoint="yes")
    with pytest.raises(TypeError, match="strategy must be .*given 2"):
        resolve_strategy(2)


def test_bad_fsdp_inputs_are_refused_by_name_before_training():
    model = nn.Sequential(_Block(), _Block(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"cores=1.*cores='all'"):  # fsdp on one core
        one_cycle_fit(model, [(torch.zeros(4), 0)] * 8, epochs=1, max_lr=1e-2, batch_size=2, cores=1, strategy="fsdp")
    with pytest.raises(ValueError, match="one replica of a multi-process launch"):  # inside multiprocess
        choose_strategy("fsdp", 4, in_launch=True)
    with pytest.raises(ValueError, match=r"wrap=\['Missing'\].*'_Block'"):  # a wrap class not found
        block_classes(model, ("Missing",))
    with pytest.raises(ValueError, match="batch has 6 rows; give a global batch that is a multiple of 4"):
        check_batch(6, 4)
    with pytest.raises(ValueError, match=r"Tensor\(2, 6\).*batch's 6 rows.*FSDP\(shard_output=False\)"):
        output_scores((torch.zeros(2, 6), torch.zeros(6)), 6, "Lstm")  # (h, c)-like: no batch-first scores
    with pytest.raises(ValueError, match="no tensor with the batch's 6 rows.*FSDP"):
        output_scores(torch.tensor(1.0), 6, "Net")


def test_an_optimizer_holding_the_parameters_shard_model_replaced_is_refused(monkeypatch):
    from tpu_utility import sharding

    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    refuse_replaced(list(model.parameters()))  # not replaced: fine
    monkeypatch.setattr(sharding, "_REPLACED", __import__("weakref").WeakValueDictionary())
    sharding._REPLACED.update({id(p): p for p in model.parameters()})  # as shard_model's move leaves them
    with pytest.raises(RuntimeError, match="holds 2 of its 2 parameters as they were before shard_model"):
        refuse_replaced([p for g in optimizer.param_groups for p in g["params"]])
