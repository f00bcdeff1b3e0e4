"""export_pretrained: a fine-tuned model leaves the chips as a Hugging Face folder that loads on the CPU.

Full models and LoRA (as an adapter, or merged into the base) from one core, 4 SPMD devices and
strategy="fsdp" (in one child): reloaded with ``from_pretrained`` on the CPU, their logits equal
``predict``'s on the same inputs, and a merged LoRA's equal its adapter model's. A run's best.pt
converts to the same folder after the fact; bf16 weights stay bf16. An export is written beside its folder and
renamed into place: 12 kills -9 at random points leave the folder whole (one export's config and weights) or
absent; a file or an unwritable place is an error; peft's merge_and_unload().save_pretrained() works on XLA.
"""

import os

import pytest
import torch
from torch import nn

from conftest import child_result
from llm_models import BATCH_KEYS, adamw, causal_lm, counting, lora, prompt_tuning
from one_thread import one_torch_thread  # noqa: F401
from tpu_utility import export_pretrained, one_cycle_fit, predict

LR, BATCH = 3e-3, 8


def fit(model, data, **kwargs):
    return one_cycle_fit(model, data, epochs=1, max_lr=LR, batch_size=BATCH, schedule="constant",
                         optimizer=adamw(LR), progress=False, **kwargs)  # fmt: skip


def logits(model, data):
    batch = {k: torch.stack([s[k] for s in data]) for k in BATCH_KEYS}
    with torch.no_grad():
        return model.eval()(**batch).logits


def test_a_full_model_and_a_lora_adapter_or_merge_reload_on_the_cpu_with_predicts_logits(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    data = counting(32, seed=0)
    full = fit(causal_lm("llama", tied=True), data).model
    assert next(full.parameters()).device.type == "xla"
    reloaded = AutoModelForCausalLM.from_pretrained(export_pretrained(full, tmp_path / "full"))
    torch.testing.assert_close(logits(reloaded, data[:BATCH]), predict(full, data[:BATCH], progress=False),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert reloaded.get_input_embeddings().weight is reloaded.get_output_embeddings().weight  # the tie, kept
    assert os.path.exists(tmp_path / "full" / "model.safetensors")

    tuned = fit(lora(causal_lm("llama")), data).model
    on_xla = predict(tuned, data[:BATCH], progress=False)
    adapter = peft.PeftModel.from_pretrained(causal_lm("llama"), export_pretrained(tuned, tmp_path / "adapter"))
    torch.testing.assert_close(logits(adapter, data[:BATCH]), on_xla, atol=1e-5, rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "adapter")) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    merged = AutoModelForCausalLM.from_pretrained(export_pretrained(tuned, tmp_path / "merged", merge_lora=True))
    assert not any("lora_" in name for name in merged.state_dict())
    torch.testing.assert_close(logits(merged, data[:BATCH]), logits(adapter, data[:BATCH]), atol=1e-5, rtol=1e-5)
    # the model the run handed back is untouched: still the adapter model, on the device, its LoRA weights there
    assert isinstance(tuned, peft.PeftModel) and any("lora_B" in n for n, _ in tuned.named_parameters())
    assert next(tuned.parameters()).device.type == "xla"
    torch.testing.assert_close(predict(tuned, data[:BATCH], progress=False), on_xla)
    # peft's own idiom after a run, on XLA: the merged model is saved through the CPU as the adapter model is
    tuned.merge_and_unload().save_pretrained(tmp_path / "peft_idiom")
    idiom = AutoModelForCausalLM.from_pretrained(tmp_path / "peft_idiom")
    torch.testing.assert_close(logits(idiom, data[:BATCH]), logits(merged, data[:BATCH]), atol=1e-5, rtol=1e-5)


def test_a_runs_best_pt_converts_after_the_fact_and_bf16_stays_bf16(tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    data = counting(32, seed=0)
    history = fit(causal_lm("llama"), data, checkpoint_dir=str(tmp_path / "run"))
    fresh = causal_lm("llama", seed=1)  # the architecture alone: other weights, on the CPU, left as they are
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    folder = export_pretrained(fresh, tmp_path / "from_best", checkpoint=tmp_path / "run" / "best.pt")
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    torch.testing.assert_close(logits(reloaded, data[:BATCH]), predict(history.model, data[:BATCH], progress=False),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())

    half = causal_lm("llama").to(torch.bfloat16)
    with safe_open(os.path.join(export_pretrained(half, tmp_path / "bf16"), "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_what_it_cannot_export_is_named(tmp_path):
    with pytest.raises(TypeError, match="export_pretrained writes a transformers model.*given Linear"):
        export_pretrained(nn.Linear(2, 2), tmp_path)
    with pytest.raises(ValueError, match="merge_lora=True .* LlamaForCausalLM, which has no adapters"):
        export_pretrained(causal_lm("llama"), tmp_path, merge_lora=True)
    with pytest.raises(ValueError, match="merge_lora=True .* peft PeftModelForCausalLM, whose adapters peft cannot"):
        export_pretrained(prompt_tuning(causal_lm("llama")), tmp_path, merge_lora=True)
    with pytest.raises(TypeError, match="merge_lora must be True or False, but given 'yes'"):
        export_pretrained(causal_lm("llama"), tmp_path, merge_lora="yes")
    assert not os.listdir(tmp_path)


def test_a_file_or_an_unwritable_place_is_an_error_and_a_compiled_model_is_written_as_its_module(tmp_path):
    from transformers import AutoModelForCausalLM

    model = causal_lm("llama")
    (tmp_path / "a_file").write_text("not a folder")
    with pytest.raises(ValueError, match=r"export_pretrained writes a folder, but folder='.*a_file' is a file"):
        export_pretrained(model, tmp_path / "a_file")
    with pytest.raises(ValueError, match=r"export_pretrained cannot write folder='.*a_file/out': File exists \(.*a_file\); give a folder in a writable place"):
        export_pretrained(model, tmp_path / "a_file" / "out")
    assert sorted(os.listdir(tmp_path)) == ["a_file"]  # nothing half-written beside it
    folder = export_pretrained(torch.compile(model), tmp_path / "compiled")
    reloaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in model.state_dict().items())
    # an export over an earlier one replaces its weights and keeps what it does not write (a tokenizer's file)
    (tmp_path / "compiled" / "tokenizer.json").write_text("{}")
    export_pretrained(causal_lm("llama", seed=1), folder)
    assert sorted(os.listdir(folder)) == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json"]
    assert not torch.equal(AutoModelForCausalLM.from_pretrained(folder).lm_head.weight, model.lm_head.weight)
    assert sorted(os.listdir(tmp_path)) == ["a_file", "compiled"]


KILLS = """
import json, os, random, signal, sys, tempfile, time
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
from transformers import AutoModelForCausalLM
from transformers.utils import logging
from llm_models import causal_lm
from tpu_utility import export_pretrained
logging.set_verbosity_error()
folder, model, rng = os.path.join(tempfile.mkdtemp(), "out"), causal_lm("llama"), random.Random(0)

def tagged(tag):  # every weight and the config say which export wrote them: a mix is seen at once
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(tag)
    model.config.export_tag = tag
    return model

export_pretrained(tagged(1), folder)
seen, latest = [], 1
for kill in range(12):
    child = os.fork()
    if child == 0:  # exports again and again, a new tag each time, until killed
        tag = latest
        while True:
            tag += 1
            export_pretrained(tagged(tag), folder)
    time.sleep(rng.uniform(0.01, 0.2))
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    if not os.path.isdir(folder):
        seen.append("absent")
        continue
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    tag = loaded.config.export_tag
    values = {float(v) for p in loaded.parameters() for v in p.unique()}
    seen.append(tag if values == {float(tag)} and tag >= latest else f"mixed: config {tag}, weights {sorted(values)[:4]}")
    latest = tag
print("RESULT", json.dumps(seen))
"""


def test_a_kill_at_any_point_of_an_export_leaves_the_folder_whole_or_absent():
    seen = child_result(KILLS)
    assert len(seen) == 12 and all(isinstance(s, int) or s == "absent" for s in seen), seen
    assert len({s for s in seen if isinstance(s, int)}) > 3, seen  # the kills fell at different exports


CHILD = """
import json, sys, tempfile
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)
import peft
from transformers import AutoModelForCausalLM
from llm_models import BATCH_KEYS, adamw, causal_lm, counting, lora
from tpu_utility import export_pretrained, one_cycle_fit, predict
data, out, folder = counting(32, seed=0), {}, tempfile.mkdtemp()
def logits(model):
    batch = {k: torch.stack([s[k] for s in data[:8]]) for k in BATCH_KEYS}
    with torch.no_grad():
        return model.eval()(**batch).logits
def gap(a, b):
    return (a - b).abs().max().item()
for strategy in ("spmd", "fsdp"):
    for name, make in [("full", lambda: causal_lm("llama", tied=True)), ("lora", lambda: lora(causal_lm("llama")))]:
        h = one_cycle_fit(make(), data, epochs=1, max_lr=3e-3, batch_size=2, cores="all", strategy=strategy,
                          schedule="constant", optimizer=adamw(3e-3), progress=False)
        want = predict(h.model, data[:8], batch_size=2, cores="all", progress=False)
        where = f"{folder}/{strategy}-{name}"
        if name == "full":
            got = {"full": gap(logits(AutoModelForCausalLM.from_pretrained(export_pretrained(h.model, where))), want)}
        else:
            adapter = peft.PeftModel.from_pretrained(causal_lm("llama"), export_pretrained(h.model, where + "-adapter"))
            merged = AutoModelForCausalLM.from_pretrained(export_pretrained(h.model, where, merge_lora=True))
            got = {"adapter": gap(logits(adapter), want), "merged": gap(logits(merged), logits(adapter))}
        out[f"{strategy}-{name}"] = {**got, "summary": h.summary}
print("RESULT", json.dumps(out))
"""


@pytest.mark.multidevice
def test_on_four_devices_and_under_fsdp_each_export_reloads_with_predicts_logits():
    runs = child_result(CHILD, env={"CPU_NUM_DEVICES": "4"})
    assert "fsdp" in runs["fsdp-full"]["summary"] and "spmd on 4" in runs["spmd-full"]["summary"], runs
    gaps = {f"{run}.{k}": v for run, got in runs.items() for k, v in got.items() if k != "summary"}
    assert len(gaps) == 6 and all(v < 1e-5 for v in gaps.values()), gaps
