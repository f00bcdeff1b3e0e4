"""strategy="fsdp" on 4 XLA:CPU devices, in one subprocess: every parameter sharded 4 ways while training, the
losses of the replicated run, flat compiles, no host syncs, and checkpoints with the plain model's own keys."""

import json

import pytest

from conftest import run_python

FSDP_SCRIPT = r"""
import copy, json, os, sys, tempfile
import torch, torch_xla
from transformers import LlamaConfig, LlamaForCausalLM
from tpu_utility import Callback, load_checkpoint, memory_plan, one_cycle_fit

torch.manual_seed(0)
config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
base = LlamaForCausalLM(config)
ids = torch.randint(0, 64, (32, 16))
data = [{"input_ids": row, "labels": row} for row in ids]
out = {}

class Specs(Callback):
    def on_epoch_end(self, loop, record):
        self.specs = {n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in loop.model.named_parameters()}

for strategy in ("spmd", "fsdp"):
    model, specs, folder = copy.deepcopy(base), Specs(), tempfile.mkdtemp()
    history = one_cycle_fit(model, data, epochs=3, max_lr=1e-2, batch_size=2, cores="all", strategy=strategy,
                            progress=False, callbacks=[specs], checkpoint_dir=folder, seed=1)
    out[strategy] = {"losses": [r.train_loss for r in history.records], "compiles": [r.compiles for r in history.records],
                     "syncs": [r.host_syncs for r in history.records], "summary": history.summary,
                     "specs": specs.specs, "keys": sorted(history.model.state_dict())}
    plain = LlamaForCausalLM(config)
    load_checkpoint(os.path.join(folder, "best.pt"), model=plain)  # strict, on the CPU, the plain model's keys
    out[strategy]["best_loaded"] = True
    out[strategy]["same_as_history"] = all(torch.equal(v, history.model.state_dict()[k].cpu())
                                           for k, v in plain.state_dict().items())
out["base_keys"] = sorted(base.state_dict())
os.environ["TPU_UTILITY_DEVICE_MEMORY_GB"] = str(2e-4)  # ~215 kB: one replica's AdamW state cannot fit, a shard can
try:
    one_cycle_fit(copy.deepcopy(base), data, epochs=1, max_lr=1e-2, batch_size=2, cores="all", strategy="spmd")
except ValueError as error:
    out["refusal"] = str(error)
print("RESULT" + json.dumps(out))
"""


@pytest.mark.multidevice
def test_fsdp_on_four_devices_shards_every_parameter_and_trains_as_the_replicated_run():
    r = run_python(FSDP_SCRIPT, env={"CPU_NUM_DEVICES": "4"}, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(r.stdout.split("RESULT", 1)[1])
    spmd, fsdp = out["spmd"], out["fsdp"]
    assert "fsdp on 4" in fsdp["summary"], fsdp["summary"]
    unsharded = {n: s for n, s in fsdp["specs"].items() if "devices=[" not in s or "replicate" in s}
    assert not unsharded, unsharded  # every parameter split over the 4 devices
    assert all(s.count("4") >= 1 for s in fsdp["specs"].values())
    assert all(s == "" or "replicated" in s for s in spmd["specs"].values())  # the control: replicated
    assert fsdp["losses"] == pytest.approx(spmd["losses"], rel=1e-4)
    assert fsdp["losses"][-1] < fsdp["losses"][0]
    assert fsdp["compiles"][1] == fsdp["compiles"][2], fsdp["compiles"]  # flat after epoch 2's first save
    assert fsdp["syncs"] == [0, 0, 0], fsdp["syncs"]
    assert fsdp["keys"] == spmd["keys"] == out["base_keys"]  # no _orig_module. or FSDP prefixes
    assert fsdp["best_loaded"] and fsdp["same_as_history"]
    assert "strategy='fsdp'" in out["refusal"] and "per chip" in out["refusal"], out.get("refusal")
