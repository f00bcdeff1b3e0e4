"""generate(): the CPU's greedy tokens on XLA, with few compiles, on one core, four devices and natively.

The bar is what a user notices: every prompt's new tokens equal those of transformers' own
``model.generate(prompt, do_sample=False)`` run on the CPU one prompt at a time (prompts of
3 to 40 tokens, left-padded to one bucket of 40 here, to four buckets in the 64-prompt test); a second pass compiles nothing; a sampled
sample's tokens do not depend on the core count or the batch it falls in; a KV cache that
cannot fit is refused before anything compiles, with the batch size that fits.
"""

import copy
import functools
import json

import pytest
import torch

from conftest import run_python
from one_thread import one_torch_thread  # noqa: F401
from tpu_utility import backend, generate
from tpu_utility.data import choose_buckets
from tpu_utility.training.generate import GenerationPlan, Sampling, kv_cache_bytes, stop_tokens

# the models and prompts, built the same way here and in the subprocesses
BUILD = """
import torch
from transformers import GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig, Qwen2Config, Qwen2ForCausalLM

# Gemma 2 and 3: a sliding window of 6 (shorter than the 40 + 10 positions), a layer of each kind, soft-capped
# logits; larger, untied weights so that greedy rows vary and the window and the attention cap change them
SLIDING = dict(head_dim=8, sliding_window=6, final_logit_softcapping=3.0, query_pre_attn_scalar=8,
               tie_word_embeddings=False, initializer_range=0.2)

def tiny(family, **changed):
    torch.manual_seed(0)
    common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0)
    if family == "gpt2":
        config = GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=None,
                            eos_token_id=None, pad_token_id=0)
        return GPT2LMHeadModel(config).eval()
    if family == "gemma":
        return GemmaForCausalLM(GemmaConfig(**common, head_dim=8)).eval()
    if family == "gemma2":
        # eager attention, as transformers 5.24 picks for Gemma 2: 5.0-5.23 pick sdpa, which drops the soft-cap
        return Gemma2ForCausalLM(Gemma2Config(**common, **{**SLIDING, "attn_logit_softcapping": 0.5, **changed},
                                              attn_implementation="eager")).eval()
    if family == "gemma3":  # layer types: sliding, full
        return Gemma3ForCausalLM(Gemma3TextConfig(**common, **{**SLIDING, **changed}, sliding_window_pattern=2)).eval()
    kind = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[family]
    return kind[1](kind[0](**common)).eval()

def prompts(n, seed, low=3, high=40):
    g = torch.Generator().manual_seed(seed)
    lengths = [low, high] + torch.randint(low, high + 1, (n - 2,), generator=g).tolist()
    return [torch.randint(1, 96, (k,), generator=g) for k in lengths]

def on_cpu(model, prompts, new, eos=None):
    with torch.no_grad():
        return [model.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), do_sample=False,
                               max_new_tokens=new, eos_token_id=eos, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]
"""


@functools.cache
def _built() -> dict:
    """BUILD's definitions, the same as the subprocesses', made when a test first needs them: collecting this file
    then imports no model family (six: about 10 CPU-s in every pytest worker, run these tests or not)."""
    namespace: dict = {}
    exec(BUILD, namespace)  # noqa: S102
    return namespace


def tiny(family, **changed):
    return _built()["tiny"](family, **changed)


def prompts(n, seed):
    return _built()["prompts"](n, seed)


def on_cpu(model, prompts, new, eos=None):
    return _built()["on_cpu"](model, prompts, new, eos)


NEW = 10  # new tokens per prompt
FAMILIES = ("llama", "gpt2", "gemma", "qwen2", "gemma2", "gemma3")
SLIDING_FAMILIES = ("gemma2", "gemma3")


def _eos_between(rows):
    """A token some greedy rows emit (not first) and others never do: the EOS that stops some rows early."""
    counts = {}
    for row in rows:
        for t in set(row[1:-1]):
            counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: (abs(counts[t] - len(rows) / 2), t))


@pytest.fixture(scope="module")
def cases():
    """Per family: the model, 6 prompts (3..40 tokens), an EOS token, and the CPU's greedy rows without and with it."""
    made = {}
    for family in FAMILIES:
        model, few = tiny(family), prompts(6, seed=1)
        plain = on_cpu(model, few, NEW)
        eos = _eos_between(plain)
        made[family] = model, few, eos, plain, on_cpu(model, few, NEW, eos)
    return made


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_are_the_cpus_model_generate_with_and_without_eos(cases, family):
    model, few, eos, plain, stopped = cases[family]
    assert any(len(r) < NEW for r in stopped) and any(len(r) == NEW for r in stopped)  # EOS stops some rows only
    got = generate(model, few, max_new_tokens=NEW, eos_token_id=eos, batch_size=4, buckets=[40], progress=False)
    assert got == stopped
    # the graph without stop flags: the 64-prompt test compares it with the CPU's tokens
    assert next(model.parameters()).device.type == "cpu" and not model.training


@pytest.mark.parametrize("family", SLIDING_FAMILIES)
def test_a_sliding_window_shorter_than_the_cache_runs_static_without_eos_and_compiles_nothing_again(cases, family):
    model, few, eos, plain, stopped = cases[family]
    # the window (6 < 40 + 10) and Gemma 2's attention soft-cap change the CPU's greedy rows: equal rows mean they ran
    assert on_cpu(tiny(family, sliding_window=128), few, NEW) != plain
    if family == "gemma2":
        assert on_cpu(tiny(family, attn_logit_softcapping=None), few, NEW) != plain
    model = copy.deepcopy(model).to(backend.device())  # restoring it moves nothing: the counts are generate's own
    backend.clear_counters()
    again = generate(model, few, max_new_tokens=NEW, eos_token_id=eos, batch_size=4, buckets=[40], progress=False)
    assert again == stopped and backend.counters().compiles <= 4  # 1 prefill + 1 decode graph, a few small ones
    backend.clear_counters()
    assert generate(model, few, max_new_tokens=NEW, eos_token_id=eos, batch_size=4, buckets=[40], progress=False) == stopped
    assert backend.counters().compiles == 0  # the window is a mask over the one cache: no shape changes by length
    assert generate(model, few, max_new_tokens=NEW, eos_token_id=[], batch_size=4, buckets=[40], progress=False) == plain


def test_64_prompts_compile_buckets_plus_few_graphs_then_nothing_and_read_every_k_steps(cases):
    model = copy.deepcopy(cases["llama"][0])
    many, new_ones = prompts(64, seed=2), prompts(64, seed=3)
    want = on_cpu(model, many, 8)
    buckets = choose_buckets([len(p) for p in many], num_buckets=4, multiple_of=8)
    model.to(backend.device())  # already on the device: restoring it moves nothing, so transfers are generate's own

    def run(data, **kw):
        backend.clear_counters()
        got = generate(model, data, max_new_tokens=8, batch_size=16, read_every=4, progress=False, **kw)
        return got, backend.counters()

    got, first = run(many)
    assert got == want
    assert first.compiles <= len(buckets) + 4, (first, buckets)
    batches = len(GenerationPlan.of([len(p) for p in many], buckets, 16, 8).batches)
    assert first.transfers <= batches * (8 // 4 + 2), (first, batches)
    again, second = run(many)
    assert again == want and second.compiles == 0, second
    _, fresh = run(new_ones, buckets=buckets)
    assert fresh.compiles == 0, fresh
    assert first.host_syncs == 0 and backend.fallback_ops() == []


def test_a_peft_model_generates_with_its_adapters(cases):
    peft = pytest.importorskip("peft")
    base = copy.deepcopy(cases["llama"][0])
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = peft.get_peft_model(base, lora).eval()
    few = cases["llama"][1][:3]
    want = on_cpu(model, few, NEW)
    assert want != cases["llama"][3][:3]  # the adapters change the tokens, so equal tokens mean they ran
    assert generate(model, few, max_new_tokens=NEW, batch_size=4, buckets=[40], progress=False) == want


def test_sampling_depends_on_seed_index_and_position_only():
    logits = torch.randn(3, 50)
    index, position = torch.tensor([7, 8, 9]), torch.tensor([[4], [4], [30]])
    draw = Sampling(temperature=0.8, top_k=5, seed=1)
    one = draw.draw(logits, index, position)
    alone = draw.draw(logits[1:2], index[1:2], position[1:2])  # another batch, the same sample
    assert one[1] == alone[0]
    assert all(t in logits[r].topk(5).indices for r, t in enumerate(one.tolist()))  # top_k holds
    seeds = {tuple(Sampling(seed=s).draw(torch.zeros(3, 50), index, position).tolist()) for s in range(6)}
    assert len(seeds) > 1  # the seed changes the draw
    many = torch.stack([Sampling(seed=s).draw(torch.zeros(1, 8), index[:1], position[:1]) for s in range(400)])
    assert set(many.flatten().tolist()) == set(range(8))  # flat logits: every token drawn


def test_a_kv_cache_that_cannot_fit_is_refused_before_compiling_with_the_batch_that_fits(cases, monkeypatch):
    model, few = cases["llama"][0], cases["llama"][1]
    per_row = kv_cache_bytes(model.config, 1, 40 + 100, torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    monkeypatch.setenv("TPU_UTILITY_DEVICE_MEMORY_GB", str((weights + 5.5 * per_row / 0.9) / 2**30))
    before = backend.compile_count()
    with pytest.raises(ValueError, match=r"batch_size=64 needs a KV cache .* batch_size=5 fits"):
        generate(model, few, max_new_tokens=100, batch_size=64, buckets=[16, 40], progress=False)
    assert backend.compile_count() == before
    monkeypatch.setenv("TPU_UTILITY_DEVICE_MEMORY_GB", "lots")
    with pytest.raises(ValueError, match="TPU_UTILITY_DEVICE_MEMORY_GB must be a positive number.*'lots'"):
        backend.memory_override()


def test_models_it_cannot_run_and_bad_arguments_are_named(cases):
    model, few = cases["llama"][0], cases["llama"][1]

    class Eager(type(model)):
        _can_compile_fullgraph = False

    with pytest.raises(ValueError, match="Eager cannot run with a static KV cache.*_can_compile_fullgraph=False"):
        generate(Eager(model.config), few, max_new_tokens=2)
    with pytest.raises(TypeError, match="transformers causal language model.*Linear"):
        generate(torch.nn.Linear(2, 2), few, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"temperature=0.7 given with do_sample=False"):
        generate(model, few, max_new_tokens=2, temperature=0.7)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1, but given 0"):
        generate(model, few, max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 has 40 tokens, more than the largest bucket 16"):
        generate(model, few[:2], max_new_tokens=2, buckets=[16])
    with pytest.raises(TypeError, match="prompt 0 must be token ids.*torch.float32"):
        generate(model, [torch.randn(4)], max_new_tokens=2)
    gpt2 = cases["gpt2"][0]
    with pytest.raises(ValueError, match="learned 128 \\(config.n_positions\\)"):
        generate(gpt2, few, max_new_tokens=100, buckets=[40], progress=False)
    from transformers import Lfm2Config, Lfm2ForCausalLM  # a convolution layer: its state is no per-position cache

    conv = Lfm2ForCausalLM(Lfm2Config(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, layer_types=["full_attention", "conv"]))
    before = backend.compile_count()
    with pytest.raises(ValueError, match="Lfm2ForCausalLM cannot run .* its layer 1 is 'conv', which keeps a convolution "
                                         "state.*left padding would flow into it"):  # fmt: skip
        generate(conv, few, max_new_tokens=2, progress=False)
    assert backend.compile_count() == before and next(conv.parameters()).device.type == "cpu"


def test_token_ids_outside_the_vocabulary_and_weights_never_loaded_are_named_before_compiling():
    model = tiny("llama")  # vocabulary 96: on XLA an id past it read another row, and tokens came back unseen
    before = backend.compile_count()
    for ids, bad in (([5, 999, 7], 999), ([5, -5, 7], -5)):
        with pytest.raises(ValueError, match=rf"^prompt 1 holds token id {bad} at position 1, outside the model's "
                                             rf"vocabulary \[0, 96\); tokenize with the model's own tokenizer"):  # fmt: skip
            generate(model, [[5, 6], ids], max_new_tokens=4, progress=False)
    with torch.device("meta"):
        empty = type(model)(model.config)
    with pytest.raises(ValueError, match=r"LlamaForCausalLM's weights are still on the meta device \(\d+ tensors, "
                                         r"model.embed_tokens.weight the first\).*Load the weights \(from_pretrained, "
                                         r"load_state_dict"):  # fmt: skip
        generate(empty, [[5, 6, 7]], max_new_tokens=4, progress=False)
    assert backend.compile_count() == before


def test_prompts_as_a_tokenizer_gives_them_and_the_models_own_eos():
    model = tiny("llama")
    padded = {"input_ids": torch.tensor([[0, 0, 5, 6, 7]]), "attention_mask": torch.tensor([[0, 0, 1, 1, 1]])}
    from tpu_utility.training.generate import prompt_ids

    assert prompt_ids([padded, [5, 6, 7], torch.tensor([5, 6, 7])]) == [[5, 6, 7]] * 3
    model.generation_config.eos_token_id = [3, 4]
    assert stop_tokens(model, None) == [3, 4] and stop_tokens(model, 9) == [9] and stop_tokens(model, []) == []


FOUR_DEVICES = BUILD + """
import json, sys
from tpu_utility import backend, generate
want = json.loads(sys.argv[1])
out = {}
for family in want:
    model, few = tiny(family), prompts(6, seed=1)
    got = generate(model, few, max_new_tokens=10, eos_token_id=want[family]["eos"], cores="all", batch_size=2,
                   buckets=[40], progress=False)
    out[family] = got == want[family]["tokens"]
    if family == "gemma2":  # a sliding window shorter than the cache: the second pass compiles nothing
        backend.clear_counters()
        again = generate(model, few, max_new_tokens=10, eos_token_id=want[family]["eos"], cores="all", batch_size=2,
                         buckets=[40], progress=False)
        out["sliding_again"] = [again == got, backend.counters().compiles]
model = tiny("llama")
out["sampled"] = generate(model, prompts(6, seed=1), max_new_tokens=10, cores="all", batch_size=2, do_sample=True,
                          temperature=0.9, top_p=0.9, seed=7, buckets=[40], progress=False)
out["devices"], out["spmd"] = backend.global_device_count(), backend.is_spmd()
out["backend"] = backend.current().name
print("RESULT", json.dumps(out))
"""


def _run_elsewhere(want, env):
    r = run_python(FOUR_DEVICES.replace("json.loads(sys.argv[1])", repr(json.dumps(want)).join(["json.loads(", ")"])),
                   env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def sampled_on_one_core(cases):
    model, few = cases["llama"][0], cases["llama"][1]
    return generate(model, few, max_new_tokens=10, do_sample=True, temperature=0.9, top_p=0.9, seed=7, batch_size=3,
                    buckets=[40], progress=False)


def _wanted(cases):
    return {f: {"eos": cases[f][2], "tokens": cases[f][4]} for f in FAMILIES}


@pytest.mark.multidevice
def test_on_four_devices_greedy_is_the_cpus_and_sampling_is_one_cores(cases, sampled_on_one_core):
    got = _run_elsewhere(_wanted(cases), {"CPU_NUM_DEVICES": "4"})
    assert (got["devices"], got["spmd"]) == (4, True), got
    assert all(got[f] for f in FAMILIES), got
    assert got["sliding_again"] == [True, 0], got
    assert got["sampled"] == sampled_on_one_core  # 8 rows a batch over 4 devices against 3 on one core


def test_natively_greedy_is_the_cpus_and_sampling_is_xlas(cases, sampled_on_one_core):
    # PJRT_DEVICE stays as conftest set it (the warm interpreter): in a fresh one without it, the script's
    # transformers import imports torch_xla, which sets PJRT_DEVICE=CPU before generate runs there too
    got = _run_elsewhere(_wanted(cases), {"TPU_UTILITY_BACKEND": "native"})
    assert got["backend"] == "cpu", got
    assert all(got[f] for f in FAMILIES), got
    assert got["sampled"] == sampled_on_one_core
