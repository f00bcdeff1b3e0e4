"""A decoder's layers compiled once and looped (torch_xla's scan over their stacked weights): the same training.

Each family (Llama, Mistral, Qwen2, Gemma, Gemma 2 and 3 with alternating sliding-window layers, GPT-2) gives the
unrolled model's loss, gradients and evaluation loss through ``scan_layers``; ``one_cycle_fit`` with
``scan="auto"`` scans an 8-layer Llama and trains to the unrolled run's losses with its checkpoints in the model's
own keys; LoRA with gradient checkpointing, packed rows and ``generate`` (a KV cache: each layer on its slice)
give the unrolled numbers; a model scan cannot take is named with why. On 4 devices: ``strategy="fsdp"`` and
SPMD data parallel, in one child.
"""

import json
import os

import pytest
import torch

from conftest import run_python
from llm_models import VOCAB, adamw, counting, lora
from tpu_utility import Compile, GradientCheckpointing, backend, get_device, one_cycle_fit
from tpu_utility.huggingface import static_masks
from tpu_utility.scan import SCAN_MIN_LAYERS, scan_for_run, scan_layers, scan_plan

LR, BATCH = 3e-3, 8


def decoder(kind: str, layers: int = 6, seed: int = 0) -> torch.nn.Module:
    """A tiny causal LM of ``kind`` with ``layers`` layers; Gemma 2 and 3 alternate sliding and full attention."""
    import transformers as t

    torch.manual_seed(seed)
    small = dict(num_hidden_layers=layers, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)  # fmt: skip
    if kind == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                              eos_token_id=0))  # fmt: skip
    if kind == "gemma2":
        return t.Gemma2ForCausalLM(t.Gemma2Config(**small, head_dim=8, sliding_window=8, attn_logit_softcapping=5.0,
                                                  final_logit_softcapping=2.0))  # fmt: skip
    if kind == "gemma3":
        kinds = ["sliding_attention", "full_attention"] * (layers // 2)
        return t.Gemma3ForCausalLM(t.Gemma3TextConfig(**small, head_dim=8, sliding_window=8, layer_types=kinds))
    config = {"llama": t.LlamaConfig, "mistral": t.MistralConfig, "qwen2": t.Qwen2Config, "gemma": t.GemmaConfig}[kind]
    extra = {"head_dim": 8} if kind == "gemma" else {"sliding_window": 8} if kind == "mistral" else {}
    model_class = {"llama": t.LlamaForCausalLM, "mistral": t.MistralForCausalLM, "qwen2": t.Qwen2ForCausalLM,
                   "gemma": t.GemmaForCausalLM}[kind]  # fmt: skip
    return model_class(config(**small, **extra))


def _grads_by_layer(scanned) -> dict:
    """The stacked weights' gradients, as each layer's own (layer index, parameter name)."""
    found = {}
    for j, stack in enumerate(scanned.stacks):
        for name, weight in stack.weights().items():
            grad = weight.grad.cpu()
            for g in range(scanned.groups):
                found[scanned.period + g * scanned.period + j, name] = grad[g]
    return found


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gemma", "gemma2", "gemma3", "gpt2"])
def test_each_family_scanned_gives_the_unrolled_loss_gradients_and_evaluation(kind):
    device = get_device()
    plain, model = decoder(kind).to(device), decoder(kind).to(device)
    static_masks(plain), static_masks(model)
    ids = torch.randint(0, VOCAB, (4, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[1, 11:] = 0  # a padded row: the padding mask reaches every scanned layer
    batch = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": ids.to(device)}
    expected = plain(**batch).loss
    expected.backward()
    scanned = scan_layers(model)
    assert scanned.period == (2 if kind in ("gemma2", "gemma3") else 1)  # one sliding and one full layer a step
    assert set(model.state_dict()) == set(plain.state_dict())  # each layer's own keys
    loss = model(**batch).loss
    loss.backward()
    backend.current().devices.sync()  # both backward passes run in one graph: each gradient read after is device data
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    layers = scan_plan(plain).layers
    grads = _grads_by_layer(scanned)
    assert len(grads) == sum(1 for i in scanned.scanned for _ in layers[i].parameters())
    for (i, name), grad in grads.items():
        torch.testing.assert_close(grad, layers[i].get_parameter(name).grad.cpu(), atol=1e-5, rtol=1e-5)
    plain.eval(), model.eval()
    with torch.no_grad():
        assert model(**batch).loss.item() == pytest.approx(plain(**batch).loss.item(), abs=1e-5)
    scanned.undo()
    assert type(scan_plan(model).layers).__name__ == "ModuleList"
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key].cpu(), value.cpu()), key


def fit(model, data, **kwargs):
    return one_cycle_fit(model, data, epochs=2, max_lr=LR, batch_size=BATCH, schedule="constant",
                         optimizer=adamw(LR), progress=False, **kwargs)  # fmt: skip


def test_one_cycle_fit_scans_a_deep_decoder_by_default_and_trains_as_the_unrolled_run(tmp_path):
    data, valid = counting(32, seed=0), counting(16, seed=1)
    layers = SCAN_MIN_LAYERS
    unrolled = fit(decoder("llama", layers), data, valid_data=valid, scan=False)
    scanned = fit(decoder("llama", layers), data, valid_data=valid, checkpoint_dir=tmp_path)  # scan="auto"
    assert f"scan: {layers - 1} of {layers} layers compiled once and looped (scan='auto'" in scanned.summary
    assert "layers unrolled (scan=False)" in unrolled.summary
    for a, b in zip(scanned.records, unrolled.records):
        assert a.train_loss == pytest.approx(b.train_loss, rel=1e-5) and a.valid_loss == pytest.approx(b.valid_loss, rel=1e-5)
    assert [r.host_syncs for r in scanned.records] == [0, 0]
    assert scanned.records[-1].compiles == scanned.records[0].compiles, "flat after epoch 1, its checkpoint's save included"
    step = [g.nodes for g in scanned.graphs if g.graph == "train step"][0]
    assert step < [g.nodes for g in unrolled.graphs if g.graph == "train step"][0] / 2  # one layer traced, not 8
    # the model comes back plain, trained as the unrolled one; last.pt holds its own keys and loads into a plain model
    assert type(scanned.model.model.layers).__name__ == "ModuleList"
    for key, value in unrolled.model.state_dict().items():
        torch.testing.assert_close(scanned.model.state_dict()[key].cpu(), value.cpu(), atol=1e-5, rtol=1e-5)
    scanned.model.save_pretrained(tmp_path / "hf")  # what export_pretrained writes: the plain model's own files
    type(scanned.model).from_pretrained(tmp_path / "hf")
    saved = torch.load(tmp_path / "last.pt", map_location="cpu", weights_only=True)["model"]
    decoder("llama", layers).load_state_dict(saved)  # strict
    torch.testing.assert_close(saved["model.layers.5.mlp.up_proj.weight"],
                               unrolled.model.state_dict()["model.layers.5.mlp.up_proj.weight"].cpu(), atol=1e-5, rtol=1e-5)


def test_lora_with_gradient_checkpointing_packed_rows_bf16_and_buckets_scan_as_unrolled():
    pytest.importorskip("peft")
    from torch.utils.data import DataLoader

    from tpu_utility import BucketCollate, PackedDataset

    data = counting(32, seed=0)
    runs = {scan: fit(lora(decoder("llama", 4)), data, scan=scan, callbacks=[GradientCheckpointing()]) for scan in (False, True)}
    assert "scan: 3 of 4 layers compiled once and looped" in runs[True].summary
    assert [r.train_loss for r in runs[True].records] == pytest.approx([r.train_loss for r in runs[False].records], rel=1e-5)
    trained = {k: v.cpu() for k, v in runs[True].model.state_dict().items()}
    base = lora(decoder("llama", 4)).state_dict()
    assert all(torch.equal(trained[k], v) for k, v in base.items() if "lora_" not in k), "the base stays frozen"
    # packed rows: positions restart in each row (an int tensor each scanned layer is given, carried as floats)
    rows = [{"input_ids": s["input_ids"][: 5 + i % 9]} for i, s in enumerate(counting(48, seed=2))]
    packed = {scan: fit(decoder("qwen2", 4), PackedDataset(rows, 32), scan=scan) for scan in (False, True)}
    assert [r.train_loss for r in packed[True].records] == pytest.approx([r.train_loss for r in packed[False].records], rel=1e-5)
    assert [r.host_syncs for r in packed[True].records] == [0, 0]
    # bf16 (cast on XLA:CPU): the stacked weights are the cast ones, the model comes back in float32
    cast = {scan: fit(decoder("llama", 4), data, scan=scan, precision="bf16") for scan in (False, True)}
    assert [r.train_loss for r in cast[True].records] == pytest.approx([r.train_loss for r in cast[False].records], rel=1e-3)
    assert {p.dtype for p in cast[True].model.parameters()} == {torch.float32}
    # buckets: a graph for each row length, scan's trace kept for each
    loader = DataLoader([{k: v[: 5 + i % 12] for k, v in s.items()} for i, s in enumerate(counting(32, seed=4))],
                        batch_size=BATCH, collate_fn=BucketCollate([8, 16]))  # fmt: skip
    bucketed = {scan: fit(decoder("llama", 4), loader, scan=scan) for scan in (False, True)}
    assert [r.train_loss for r in bucketed[True].records] == pytest.approx([r.train_loss for r in bucketed[False].records], rel=1e-5)
    assert bucketed[True].records[1].compiles == bucketed[True].records[0].compiles


def test_generate_through_scanned_layers_runs_each_on_its_slice_and_gives_the_plain_tokens():
    device = get_device()
    plain, model = decoder("llama", 4).to(device).eval(), decoder("llama", 4).to(device).eval()
    prompt = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(3)).to(device)
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    expected = plain.generate(prompt, **options).cpu()
    scanned = scan_layers(model)
    assert torch.equal(model.generate(prompt, **options).cpu(), expected)  # a KV cache: layer by layer
    scanned.undo()


def test_what_cannot_be_scanned_is_said_and_a_bad_setting_is_named():
    from tpu_utility import quantize_base

    assert scan_for_run(decoder("llama", 4), "auto")[1] == (
        f"layers unrolled (4 layers: scan pays from {SCAN_MIN_LAYERS}; scan=True scans them)")
    assert "2 layers: too few to loop" in scan_for_run(decoder("llama", 2), "auto")[1]
    assert scan_for_run(torch.nn.Linear(2, 2), "auto") == (None, "")  # not a decoder: nothing to say
    int8 = quantize_base(decoder("llama", 4))
    words = scan_for_run(int8, "auto")[1]
    assert words.startswith("layers unrolled (its layers hold buffers (") and "which scan does not stack" in words
    with pytest.raises(ValueError, match="scan=True, but LlamaForCausalLM cannot be scanned: its layers hold buffers"):
        scan_for_run(int8, True)
    with pytest.raises(ValueError, match="scan must be True, False or 'auto', but given 'yes'"):
        fit(decoder("llama", 4), counting(16, seed=0), scan="yes")
    with pytest.raises(ValueError, match=r"scan=False and compile=Compile\(scan=True\) disagree"):
        fit(decoder("llama", 4), counting(16, seed=0), scan=False, compile=Compile(scan=True))


FOUR_DEVICES = r"""
import json, sys
import torch
import torch_xla
from transformers import LlamaConfig, LlamaForCausalLM
sys.path.insert(0, "tests")
from llm_models import counting  # not test_scan: its conftest import would take CPU_NUM_DEVICES away
from tpu_utility import one_cycle_fit
from tpu_utility.backend import xla

data, out = counting(64, seed=0), {}  # 2 global batches of 32 an epoch: the second step (its optimizer state made) in epoch 1


def run(strategy, scan):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                         num_key_value_heads=2, vocab_size=48, max_position_embeddings=64))
    specs = {}

    class Specs:  # the stacked weights' shardings, while the run holds them
        def on_train_epoch_end(self, loop):
            specs.update({n: torch_xla._XLAC._get_xla_sharding_spec(p) for n, p in loop.model.named_parameters()
                          if "stacks" in n})

    h = one_cycle_fit(model, data, epochs=2, max_lr=3e-3, batch_size=8, cores="all", strategy=strategy, scan=scan,
                      progress=False, callbacks=[Specs()])
    return dict(losses=[r.train_loss for r in h.records], syncs=[r.host_syncs for r in h.records],
                compiles=[r.compiles for r in h.records], summary=h.summary, specs=specs,
                layers=type(h.model.model.layers).__name__)


out["refused"] = run("fsdp", True)  # XLA:CPU has no JAX TPU client: unrolled, said
# what a TPU with JAX runs: scan's backward sharding hint (JAX's shard_alike) stood in by the identity, which changes
# no number; the stacking, its FSDP sharding and the loop are the package's
import torch_xla.experimental.scan as torch_xla_scan
torch_xla_scan.shard_as = lambda a, b: (a, b)
xla.scan_shards_backward = lambda: True
for strategy in ("spmd", "fsdp"):
    out[strategy] = {scan: run(strategy, scan) for scan in (False, True)}
print("RESULT " + json.dumps(out))
"""


@pytest.mark.multidevice
def test_on_four_devices_data_parallel_and_fsdp_scan_as_unrolled():
    r = run_python(FOUR_DEVICES, env={"CPU_NUM_DEVICES": "4"}, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    out = json.loads(r.stdout.split("RESULT ", 1)[1].splitlines()[0])
    refused = out.pop("refused")  # torch_xla's scan under SPMD needs JAX on a TPU: said, and trained unrolled
    assert "layers unrolled (under SPMD torch_xla's scan shards its backward through JAX" in refused["summary"]
    assert refused["losses"][-1] < refused["losses"][0] and refused["layers"] == "ModuleList"
    for strategy, runs in out.items():
        scanned, unrolled = runs["true"], runs["false"]
        assert "scan: 3 of 4 layers compiled once and looped" in scanned["summary"], scanned["summary"]
        assert scanned["losses"] == pytest.approx(unrolled["losses"], rel=1e-5), strategy
        assert scanned["syncs"] == [0, 0] and scanned["compiles"][1] == scanned["compiles"][0], scanned
        assert scanned["layers"] == "ModuleList"
    sharded = out["fsdp"]["true"]["specs"]
    assert sharded and all("devices=[" in s for s in sharded.values()), sharded  # each stack split over the 4 devices
