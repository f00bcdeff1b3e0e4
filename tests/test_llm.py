"""Decoder LLMs fine-tuned as people write them: causal LMs, token labels, LoRA and prompt tuning.

Tiny GPT-2, Llama (tied and not), Gemma and BERT models built from their configs train
through ``one_cycle_fit`` with no step function (the model computes its own loss from
``labels``), and their per-epoch losses equal the plain CPU loop's (``llm_models``).
Validation leaves -100 targets out, as the model's own loss does; a ``datasets`` split
goes in without ``set_format``; a collator that pads each batch to its longest is named
before training; gradient checkpointing runs on XLA; ``save_pretrained`` works on what
``one_cycle_fit`` hands back. The same on 4 SPMD devices and natively, in one child each.
"""

import copy
import re
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import child_result, run_python
from llm_models import (VOCAB, Tagger, adamw, causal_lm, counting, lora, own_loss_mean, padded, plain_cpu_losses,
                        prompt_tuning, tags)
from one_thread import one_torch_thread  # noqa: F401
from tpu_utility import GradientCheckpointing, backend, doctor, evaluate, get_device, move_model, one_cycle_fit, predict

LR, BATCH = 3e-3, 8


def fit(model, data, epochs=2, **kwargs):
    return one_cycle_fit(model, data, epochs=epochs, max_lr=LR, batch_size=BATCH, schedule="constant",
                         optimizer=adamw(LR), progress=False, **kwargs)  # fmt: skip


def same(a, b, rel=1e-4):
    return a == pytest.approx(b, rel=rel), (a, b)


@pytest.mark.parametrize("kind, tied", [("gpt2", True), ("llama", True), ("gemma", True)])  # untied: every other test
def test_a_causal_lm_trains_with_no_step_function_as_the_plain_cpu_loop(kind, tied, tmp_path):
    data = counting(32, seed=0)
    history = fit(causal_lm(kind, tied), data)
    losses = [r.train_loss for r in history.records]
    assert losses[-1] < losses[0]
    assert same(losses, plain_cpu_losses(causal_lm(kind, tied), data, 2, BATCH, LR))
    assert [r.host_syncs for r in history.records] == [0, 0]
    assert history.records[-1].compiles == history.records[0].compiles  # flat after epoch 1
    model = history.model
    tie = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert tie == tied, "the tie of the embeddings and the LM head is the model's own, kept on XLA"
    if kind == "gpt2":  # save_pretrained of the model one_cycle_fit hands back, on XLA
        model.save_pretrained(tmp_path)
        reloaded = type(model).from_pretrained(tmp_path).eval()
        batch = {k: torch.stack([s[k] for s in data[:BATCH]]) for k in ("input_ids", "attention_mask")}
        with torch.no_grad():
            torch.testing.assert_close(reloaded(**batch).logits, predict(model, data[:BATCH], progress=False),
                                       atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("wrap", [lora, prompt_tuning], ids=["lora", "prompt_tuning"])
def test_peft_models_train_as_the_plain_cpu_loop_and_a_lora_adapter_reloads(wrap, tmp_path):
    import peft

    data = counting(32, seed=0)
    model = wrap(causal_lm("llama"))
    base = {k: v.clone() for k, v in model.get_base_model().state_dict().items() if "lora_" not in k}
    history = fit(model, data)
    losses = [r.train_loss for r in history.records]
    assert losses[-1] < losses[0]
    assert same(losses, plain_cpu_losses(wrap(causal_lm("llama")), data, 2, BATCH, LR))
    if wrap is prompt_tuning:  # its logits are longer than its labels (the virtual tokens): no loss_fn needed
        return
    after = {k: v.cpu() for k, v in history.model.get_base_model().state_dict().items() if "lora_" not in k}
    assert all(torch.equal(base[k], after[k]) for k in base), "the base weights stay as they were"
    history.model.save_pretrained(tmp_path)  # the adapter, from the model on XLA
    reloaded = peft.PeftModel.from_pretrained(causal_lm("llama"), tmp_path)
    lora_b = [p for name, p in reloaded.named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # trained: lora_B starts at zero otherwise
    trained = {k: v.cpu() for k, v in history.model.state_dict().items() if "lora_B" in k}
    assert all(torch.equal(v, reloaded.state_dict()[k]) for k, v in trained.items())


def test_the_validation_loss_of_a_causal_lm_is_its_own_loss_with_ignored_targets_left_out():
    train, valid = counting(32, seed=0), counting(20, seed=1, ignored=5)  # 20: the last batch is padded
    history = fit(causal_lm("llama"), train, epochs=1, valid_data=valid)
    own = own_loss_mean(copy.deepcopy(history.model), valid, BATCH)
    assert same(history.records[-1].valid_loss, own, rel=1e-5)
    figures = evaluate(history.model, valid, batch_size=BATCH)
    assert same(figures["loss"], own, rel=1e-5)
    assert 0 < figures["accuracy"] < 1  # the next token, over the targets that count


def test_a_token_classifier_trains_on_the_default_loss_and_its_figures_leave_ignored_targets_out():
    train, valid = tags(64, 0), tags(20, 1)
    torch.manual_seed(0)
    history = one_cycle_fit(Tagger(), train, valid_data=valid, epochs=3, max_lr=3e-2, batch_size=BATCH, progress=False)
    assert history.records[-1].train_loss < 0.6 * history.records[0].train_loss
    assert history.records[-1].metrics["accuracy"] > 0.7
    model = copy.deepcopy(history.model).cpu()
    tokens, labels = valid.tensors
    with torch.no_grad():
        logits = model(tokens)
    counted = labels != -100
    expected = nn.functional.cross_entropy(logits.transpose(1, 2), labels)  # torch leaves the -100s out
    assert same(history.records[-1].valid_loss, expected.item(), rel=1e-5)
    accuracy = (logits.argmax(-1) == labels)[counted].float().mean().item()
    assert history.records[-1].metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)
    figures = evaluate(history.model, valid, batch_size=BATCH)
    assert same(figures["loss"], expected.item(), rel=1e-5)


def test_a_token_label_out_of_the_class_range_is_named_before_training():
    with pytest.raises(ValueError, match=r"class indices in \[0, 5\).*holds \[7\]"):
        one_cycle_fit(Tagger(), tags(32, 0, bad=7), epochs=1, max_lr=1e-2, batch_size=BATCH, progress=False)


# labels that would give NaN figures or a loss error named in transformers' words (issue 53); the same
# inputs natively: test_natively_bad_llm_inputs_are_named_as_on_xla
def _short_labels(data, keep=15):
    return [{**s, "labels": s["labels"][:keep]} for s in data]


def _labels_per_token_pair(data):
    return [{"input_ids": s["input_ids"], "labels": s["labels"][:, None].repeat(1, 2)} for s in data]


def test_data_in_which_no_target_counts_is_refused_before_training_or_evaluating():
    train, prompt_only = counting(32, seed=0), counting(16, seed=1, ignored=16)
    model = causal_lm("llama")
    before = backend.compile_count()
    with pytest.raises(ValueError, match=r"^valid_data has no target that counts: every label is -100 \(ignore_index\), "
                                         r"so its loss and metrics would be NaN"):  # fmt: skip
        fit(model, train, epochs=1, valid_data=prompt_only)
    with pytest.raises(ValueError, match=r"^data has no target that counts: every label is -100"):
        evaluate(model, prompt_only, batch_size=BATCH)
    with pytest.raises(ValueError, match=r"^batch 1 of an epoch of train_data has no target that counts: all its 128 "
                                         r"labels are -100 \(ignore_index\), so its loss is 0/0"):  # fmt: skip
        fit(model, prompt_only, epochs=1)
    tokens, labels = tags(16, 0).tensors  # a TensorDataset's labels, checked whole
    with pytest.raises(ValueError, match=r"^valid_data has no target that counts: all its 192 labels are -100"):
        one_cycle_fit(Tagger(), tags(32, 0), valid_data=torch.utils.data.TensorDataset(tokens, torch.full_like(labels, -100)),
                      epochs=1, max_lr=1e-2, batch_size=BATCH, progress=False)  # fmt: skip
    assert backend.compile_count() - before <= 1, "refused before any step or evaluation compiled (set-up's graph at most)"
    mixed = counting(8, seed=2, ignored=16) + counting(8, seed=3)  # a first batch without targets, a second with
    assert evaluate(model, mixed, batch_size=BATCH)["loss"] > 0


@pytest.mark.parametrize("labels", [_short_labels, _labels_per_token_pair])
def test_causal_lm_labels_not_shaped_as_input_ids_are_named_at_the_first_batch(labels):
    bad = labels(counting(32, seed=0))
    shapes = r"labels have shape \(8, 15\) and input_ids \(8, 16\)" if labels is _short_labels else \
        r"labels have shape \(8, 16, 2\) and input_ids \(8, 16\)"
    with pytest.raises(ValueError, match=r"^batch 1 of train_data: a causal LM takes one label per token, .*" + shapes):
        fit(causal_lm("llama"), bad, epochs=1)
    if labels is not _short_labels:
        return  # validation and evaluate read the batch as training does: one layout is enough there
    with pytest.raises(ValueError, match=r"^batch 1 of valid_data: .*" + shapes):
        fit(causal_lm("llama"), counting(32, seed=0), epochs=1, valid_data=bad[:16])
    with pytest.raises(ValueError, match=r"^batch 1 of data: .*" + shapes):
        evaluate(causal_lm("llama"), bad[:16], batch_size=BATCH)


def test_a_datasets_split_without_set_format_trains_as_with_it():
    import datasets

    data = counting(32, seed=0)
    columns = {k: [s[k].tolist() for s in data] for k in data[0]}
    split = datasets.Dataset.from_dict(columns)
    assert isinstance(split[0]["input_ids"], list)  # what a tokenized split gives
    as_lists = fit(causal_lm("llama"), split, epochs=1)
    as_tensors = fit(causal_lm("llama"), split.with_format("torch"), epochs=1)
    assert as_lists.records[0].train_loss == as_tensors.records[0].train_loss
    rows = predict(as_lists.model, split, batch_size=BATCH, progress=False)
    assert rows.shape == (32, 16, VOCAB)


def test_a_collator_that_pads_each_batch_to_its_longest_is_named_before_training():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="[UNK]")),
                                        pad_token="[PAD]", unk_token="[UNK]")  # fmt: skip
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": counting(1, seed=k, length=int(torch.randint(6, 20, (1,), generator=g)))[0]["input_ids"]
                .tolist()} for k in range(16)]  # fmt: skip
    with pytest.warns(UserWarning, match=r"DataCollatorForLanguageModeling pads each batch to its own longest.*"
                                         r"pad_to_multiple_of=64.*BucketCollate"):  # fmt: skip
        one_cycle_fit(causal_lm("llama"), DataLoader(samples, batch_size=BATCH,
                      collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False)),
                      epochs=1, max_lr=LR, progress=False)  # fmt: skip
    fixed = DataLoader(samples, batch_size=BATCH, collate_fn=DataCollatorForLanguageModeling(tokenizer, mlm=False,
                                                                                           pad_to_multiple_of=32))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*pads each batch.*")
        history = one_cycle_fit(causal_lm("llama"), fixed, epochs=2, max_lr=LR, progress=False)
    assert history.records[1].compiles == history.records[0].compiles


def test_gradient_checkpointing_trains_on_xla_with_the_losses_of_a_run_without():
    data = counting(32, seed=0)
    plain = fit(causal_lm("llama"), data, epochs=1).records[0].train_loss
    model = causal_lm("llama")
    model.gradient_checkpointing_enable()  # as every LLM notebook does: torch's checkpoint fails on XLA
    assert same(fit(model, data, epochs=1).records[0].train_loss, plain, rel=1e-5)
    model = causal_lm("llama")
    assert same(fit(model, data, epochs=1, callbacks=[GradientCheckpointing()]).records[0].train_loss, plain, rel=1e-5)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()), "switched off after"
    with pytest.raises(TypeError, match="GradientCheckpointing needs a Hugging Face model.*Tagger"):
        one_cycle_fit(Tagger(), tags(32, 0), epochs=1, max_lr=1e-2, batch_size=BATCH, progress=False,
                      callbacks=[GradientCheckpointing()])  # fmt: skip


# LoRA on each family the corpus fine-tunes, in each attention its config may pick, with and without checkpointing
PEFT_CASES = [("llama", "sdpa", False), ("llama", "sdpa", True), ("gemma", "eager", False), ("gemma", "eager", True),
              ("qwen2", "sdpa", True), ("qwen2", "eager", False)]  # fmt: skip


@pytest.mark.parametrize("kind, attention, checkpointing", PEFT_CASES)
def test_a_lora_model_with_padded_masks_reads_nothing_on_the_host(kind, attention, checkpointing):
    model = causal_lm(kind)
    model.set_attn_implementation(attention)
    model = lora(model)
    callbacks = [GradientCheckpointing()] if checkpointing else []
    history = fit(model, padded(32, seed=0), epochs=1, callbacks=callbacks)
    assert history.records[0].host_syncs == 0  # transformers' padding_mask.all() would read twice a step
    assert history.model.get_base_model().config._attn_implementation == attention  # its own, given back
    plain = padded(32, seed=0)
    assert same([history.records[0].train_loss], plain_cpu_losses(lora(causal_lm(kind)), plain, 1, BATCH, LR),
                rel=1e-4 if attention == "sdpa" else 2e-3)  # the CPU loop's sdpa against the eager kernel: close


def test_doctor_names_the_tie_that_model_to_split_and_move_model_keeps_it():
    batches = [{k: torch.stack([s[k] for s in counting(BATCH, seed=j)]) for k in ("input_ids", "labels")} for j in range(3)]
    split = causal_lm("gpt2").to(get_device())  # the README's two-line port, as it was
    report = doctor(split, batches=batches, optimizer=torch.optim.AdamW(split.parameters()), steps=1, warmup=1)
    assert "tied_weights" in report.kinds() and "move_model(model, device)" in str(report), str(report)
    kept = move_model(causal_lm("gpt2"), get_device())
    assert kept.get_input_embeddings().weight is kept.get_output_embeddings().weight


CHILD = """
import copy, json, sys
sys.path.insert(0, "tests")
import torch
torch.set_num_threads(1)  # the plain CPU loops (tests/one_thread.py says why)
from llm_models import (Tagger, adamw, causal_lm, counting, lora, own_loss_mean, plain_cpu_losses,
                        prompt_tuning, tagger_loss, tags)
from tpu_utility import evaluate, one_cycle_fit
CORES, PER_CORE, LR = {cores!r}, {per_core}, 3e-3
train, valid = counting(32, seed=0), counting(20, seed=1, ignored=5)  # 4 steps an epoch, as the one-device tests
out = {{}}
for name, make in [("llama", lambda: causal_lm("llama", tied=True)), ("lora", lambda: lora(causal_lm("llama"))),
                   ("prompt_tuning", lambda: prompt_tuning(causal_lm("llama")))]:
    h = one_cycle_fit(make(), train, valid_data=valid, epochs=2, max_lr=LR, batch_size=PER_CORE, cores=CORES,
                      schedule="constant", optimizer=adamw(LR), progress=False)
    out[name] = {{"losses": [r.train_loss for r in h.records], "summary": h.summary,
                 "plain": plain_cpu_losses(make(), train, 2, {global_batch}, LR),
                 "valid": h.records[-1].valid_loss, "own": own_loss_mean(copy.deepcopy(h.model), valid, 8),
                 "evaluate": evaluate(h.model, valid, batch_size=PER_CORE, cores=CORES)["loss"]}}
from tpu_utility import PackedDataset, packed_attention
samples = [{{k: s[k] for k in ("input_ids", "labels")}} for n in range(6, 16) for s in counting(8, seed=n, length=n)]
packed = PackedDataset(samples, length=32)  # 80 samples of 6-15 tokens in 27 rows: 3 global batches of 8
h = one_cycle_fit(lora(causal_lm("llama")), packed, epochs=2, max_lr=LR, batch_size=PER_CORE, cores=CORES,
                  schedule="constant", optimizer=adamw(LR), progress=False)
cpu = lora(causal_lm("llama"))
packed_attention(cpu)  # the hand loop's one line
out["packed_lora"] = {{"losses": [r.train_loss for r in h.records], "summary": h.summary,
                      "syncs": [r.host_syncs for r in h.records],
                      "plain": plain_cpu_losses(cpu, [packed[i] for i in range(len(packed))], 2, {global_batch}, LR)}}
torch.manual_seed(0)
h = one_cycle_fit(Tagger(), tags(64, 0), epochs=2, max_lr=LR, batch_size=PER_CORE, cores=CORES, schedule="constant",
                  optimizer=adamw(LR), progress=False)
torch.manual_seed(0)
out["tagger"] = {{"losses": [r.train_loss for r in h.records], "summary": h.summary,
                 "plain": plain_cpu_losses(Tagger(), tags(64, 0), 2, {global_batch}, LR, tagger_loss)}}
print("RESULT", json.dumps(out))
"""


def _child(env, cores, per_core, global_batch):
    return child_result(CHILD.format(cores=cores, per_core=per_core, global_batch=global_batch), env=env)


def _check(runs, where):
    for name, run in runs.items():
        assert where in run["summary"], run["summary"]
        assert run["losses"][-1] < run["losses"][0], (name, run["losses"])
        assert same(run["losses"], run["plain"]), name
        if name == "packed_lora":  # packed rows (test_packing.py): their attention built on the device
            assert run["syncs"] == [0, 0] and "real tokens" in run["summary"], run
            continue
        if name != "tagger":  # its figures with -100 targets: test_a_token_classifier_trains_on_the_default_loss...
            assert same(run["valid"], run["own"], rel=1e-5), name
            assert same(run["evaluate"], run["own"], rel=1e-5), name


PEFT_CHILD = """
import json, sys
sys.path.insert(0, "tests")
from llm_models import adamw, causal_lm, lora, padded
from tpu_utility import GradientCheckpointing, one_cycle_fit
out = {}
for kind in ("llama", "gemma", "qwen2"):
    for strategy, callbacks in (("spmd", [GradientCheckpointing()]), ("fsdp", [])):  # fsdp checkpoints every block
        h = one_cycle_fit(lora(causal_lm(kind)), padded(32, seed=0), epochs=1, max_lr=3e-3, batch_size=2, cores="all",
                          strategy=strategy, callbacks=callbacks, schedule="constant", optimizer=adamw(3e-3),
                          progress=False)
        out[f"{kind}-{strategy}"] = [h.records[0].host_syncs, h.summary]
from llm_models import counting, plain_cpu_losses
from tpu_utility import PackedDataset, packed_attention
samples = [{k: s[k] for k in ("input_ids", "labels")} for n in range(6, 16) for s in counting(8, seed=n, length=n)]
packed = PackedDataset(samples, length=32)  # 80 samples of 6-15 tokens in 27 rows: 3 global batches of 8
h = one_cycle_fit(lora(causal_lm("llama")), packed, epochs=2, max_lr=3e-3, batch_size=2, cores="all", strategy="fsdp",
                  callbacks=[GradientCheckpointing()], schedule="constant", optimizer=adamw(3e-3), progress=False)
cpu = lora(causal_lm("llama"))
packed_attention(cpu)
out["packed-fsdp"] = [h.records[1].host_syncs, h.summary, [r.train_loss for r in h.records],
                      plain_cpu_losses(cpu, [packed[i] for i in range(len(packed))], 2, 8, 3e-3)]
print("RESULT", json.dumps(out))
"""


@pytest.mark.multidevice
def test_on_four_devices_and_under_fsdp_lora_models_with_padded_masks_read_nothing_on_the_host():
    runs = child_result(PEFT_CHILD, env={"CPU_NUM_DEVICES": "4"})
    syncs, summary, losses, plain = runs.pop("packed-fsdp")  # packed rows, fsdp and checkpointing: the plain CPU loop
    assert syncs == 0 and "fsdp" in summary and "real tokens" in summary and same(losses, plain), (losses, plain)
    assert len(runs) == 6 and all(syncs == 0 for syncs, _ in runs.values()), runs
    assert all(("fsdp" in summary) == name.endswith("fsdp") for name, (_, summary) in runs.items()), runs


@pytest.mark.multidevice
def test_on_four_spmd_devices_causal_lms_and_peft_models_train_as_the_plain_cpu_loop():
    _check(_child({"CPU_NUM_DEVICES": "4"}, "all", 2, 8), "spmd on 4 CPU core(s) | batch 2 per core, 8 global")


def test_natively_causal_lms_and_peft_models_train_as_the_plain_cpu_loop():
    # PJRT_DEVICE stays as conftest set it, so the child starts from the warm interpreter: a fresh one without
    # it has torch_xla imported by transformers (the models' import) before training, which sets PJRT_DEVICE=CPU,
    # so the training ran with it set there too; TPU_UTILITY_BACKEND=native chooses the backend either way
    native = {"TPU_UTILITY_BACKEND": "native"}
    _check(_child(native, 1, 8, 8), "single on 1 cpu core(s)")


BAD_INPUTS = """
import json, sys
sys.path.insert(0, "tests")
import torch
from torch import nn
from llm_models import causal_lm, counting
from tpu_utility import backend, evaluate, generate, memory_plan, one_cycle_fit
model, train, prompt_only = causal_lm("llama"), counting(32, seed=0), counting(16, seed=1, ignored=16)
short = [{**s, "labels": s["labels"][:15]} for s in train]
with torch.device("meta"):
    empty = causal_lm("llama")
fit = lambda data, **kw: one_cycle_fit(model, data, epochs=1, max_lr=1e-3, batch_size=8, progress=False, **kw)
cases = {
    "id": lambda: generate(model, [[5, 999, 7]], max_new_tokens=4, progress=False),
    "negative id": lambda: generate(model, [[5, -5, 7]], max_new_tokens=4, progress=False),
    "valid": lambda: fit(train, valid_data=prompt_only),
    "evaluate": lambda: evaluate(model, prompt_only, batch_size=8),
    "train": lambda: fit(prompt_only),
    "shape": lambda: fit(short),
    "meta": lambda: generate(empty, [[5, 6, 7]], max_new_tokens=4, progress=False),
    "memory": lambda: memory_plan(model, device_memory=16),
}
out = {"backend": backend.current().name}
for name, case in cases.items():
    try:
        case()
        out[name] = "no error"
    except Exception as error:
        out[name] = f"{type(error).__name__}: {error}"
print("RESULT", json.dumps(out))
"""


def test_natively_bad_llm_inputs_are_named_as_on_xla():
    # each case's one-core test above: test_data_in_which_no_target_counts..., test_causal_lm_labels_not_shaped...,
    # test_generate's test_token_ids_outside_the_vocabulary..., test_memory's test_a_device_memory_under_a_gb...
    r = run_python(BAD_INPUTS, env={"TPU_UTILITY_BACKEND": "native"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    import json

    got = json.loads(r.stdout.split("RESULT ")[1])
    assert got.pop("backend") == "cpu"
    wanted = {
        "id": r"ValueError: prompt 0 holds token id 999 at position 1, outside the model's vocabulary \[0, 48\)",
        "negative id": r"ValueError: prompt 0 holds token id -5 at position 1, outside the model's vocabulary \[0, 48\)",
        "valid": r"ValueError: valid_data has no target that counts: every label is -100 \(ignore_index\)",
        "evaluate": r"ValueError: data has no target that counts: every label is -100 \(ignore_index\)",
        "train": r"ValueError: batch 1 of an epoch of train_data has no target that counts: all its 128 labels are -100",
        "shape": r"ValueError: batch 1 of train_data: .* labels have shape \(8, 15\) and input_ids \(8, 16\)",
        "meta": r"ValueError: LlamaForCausalLM's weights are still on the meta device .* Load the weights \(from_pretrained",
        "memory": r"ValueError: device_memory=16 is 16 bytes, less than a GB: a unit slip\? .* give 16e9 or '16GB'",
    }
    for name, pattern in wanted.items():
        assert re.match(pattern, got[name]), (name, got[name])
