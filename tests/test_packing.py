"""Packed rows (PackedDataset, packed_attention): nearly every token computed is data, and training is the same.

First-fit decreasing fills rows of 1,024 tokens to >= 0.95 on the issue's Alpaca-like lengths; a row
carries positions restarting at each sample and -100 at each sample's first label. Through
``packed_attention`` (which the trainer switches on) a sample never attends to the one packed
before it: per-sample losses of packed rows equal each sample run alone (fp32, 1e-5) for tiny
Llama, Gemma 2 (sliding window and soft-caps, eager), Gemma 3 (sliding window, sdpa), Qwen2, GPT-2 and a LoRA model, on the plain CPU
and on one XLA core with 0 host syncs; a packed run trains as the plain CPU loop over the same
rows, with flat compiles and 0 host syncs, and its packed validation loss is the unpacked one.
"""

import copy

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from llm_models import VOCAB, adamw, causal_lm, counting, lora, plain_cpu_losses
from one_thread import one_torch_thread  # noqa: F401
from tpu_utility import PackedDataset, backend, evaluate, get_device, move_model, one_cycle_fit, packed_attention
from tpu_utility.backend.hardware import peak_flops
from tpu_utility.data.packing import first_fit_decreasing
from tpu_utility.training.throughput import training_flops_per_token


def alpaca_lengths(n, seed=0):
    """The issue's instruction-data lengths: log-normal, median 150, sigma 0.8, clipped to 16..1024."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(150), 0.8, n)), 16, 1024).astype(int).tolist()



def _on_xla_with_no_host_read(model, losses, packed, samples, what):
    """``losses`` of a copy of ``model`` on XLA, with no host read while they are computed (``what`` is not read)."""
    device = get_device()
    moved = move_model(copy.deepcopy(model), device)
    backend.current().devices.sync()
    syncs = backend.host_sync_count()
    found = losses(moved, packed, samples, device)
    assert backend.host_sync_count() == syncs, f"no read of {what} on the host"
    return found

def test_first_fit_decreasing_fills_rows_of_alpaca_like_lengths_and_refuses_a_sample_longer_than_a_row():
    lengths = alpaca_lengths(3000)
    bins = first_fit_decreasing(lengths, 1024, seed=0)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))  # every sample once
    assert max(sum(lengths[i] for i in b) for b in bins) <= 1024
    fill = sum(lengths) / (1024 * len(bins))
    assert fill >= 0.95, fill
    assert first_fit_decreasing(lengths, 1024, seed=0) == bins  # the same rows in every process
    with pytest.raises(ValueError, match=r"^sample 2 has 1025 tokens, longer than the row length 1024"):
        first_fit_decreasing([5, 7, 1025], 1024)


class Samples(Dataset):
    def __init__(self, samples):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def test_a_packed_row_restarts_positions_and_ignores_each_samples_first_label_and_its_prompt():
    import datasets

    samples = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}, {"input_ids": [9, 10, 11], "labels": [9, 10, 11]},
               {"input_ids": [12, 13], "labels": [12, 13]}]  # fmt: skip
    split = datasets.Dataset.from_list(samples)
    for data in (samples, split, Samples(samples)):
        packed = PackedDataset(data, length=5, pad_token_id=1)
        rows = {tuple(packed[r]["input_ids"].tolist()): packed[r] for r in range(len(packed))}
        assert sorted(rows) == [(5, 6, 7, 8, 1), (9, 10, 11, 12, 13)]
        first, second = rows[(5, 6, 7, 8, 1)], rows[(9, 10, 11, 12, 13)]
        assert first["labels"].tolist() == [-100, -100, 7, 8, -100] and first["position_ids"].tolist() == [0, 1, 2, 3, 0]
        assert second["labels"].tolist() == [-100, 10, 11, -100, 13] and second["position_ids"].tolist() == [0, 1, 2, 0, 1]
        assert packed.fill == 9 / 10 and "90.0% real tokens" in packed.summary()
    with pytest.raises(ValueError, match=r"^sample 1 has 3 tokens, longer than the row length 2"):
        PackedDataset([{"input_ids": [1, 2]}, {"input_ids": [1, 2, 3]}], length=2)
    with pytest.raises(ValueError, match=r"also hold \['text'\].*split.remove_columns\(\['text'\]\)"):
        PackedDataset(split.add_column("text", ["a", "b", "c"]), length=8)
    with pytest.raises(ValueError, match=r"^sample 0's attention_mask is not all ones"):
        PackedDataset([{"input_ids": [1, 2, 0], "attention_mask": [1, 1, 0]}], length=8)
    with pytest.raises(ValueError, match=r"^sample 0 has 2 labels for 3 input_ids"):
        PackedDataset([{"input_ids": [1, 2, 3], "labels": [2, 3]}], length=8)


def gemma2():
    import transformers as t

    torch.manual_seed(0)
    config = t.Gemma2Config(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=64,
                            sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # fmt: skip
    config._attn_implementation = "eager"  # Gemma 2's soft-cap needs it
    return t.Gemma2ForCausalLM(config)


def gemma3():
    import transformers as t

    torch.manual_seed(0)
    return t.Gemma3ForCausalLM(t.Gemma3TextConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"]))  # fmt: skip


MODELS = {"llama": lambda: causal_lm("llama"), "gemma2": gemma2, "gemma3": gemma3, "qwen2": lambda: causal_lm("qwen2"),
          "gpt2": lambda: causal_lm("gpt2"), "lora": lambda: lora(causal_lm("llama"))}  # fmt: skip


def instructions(n, seed):
    """``n`` samples of 3 to 19 tokens, the first 0-2 labels -100 (a prompt)."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i in range(n):
        ids = torch.randint(0, VOCAB, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g)
        labels = ids.clone()
        labels[: i % 3] = -100
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return samples


def per_sample_losses(model, packed, samples, device):
    """Each sample's mean loss over its targets, read from the logits of every packed row at once."""
    batch = {k: torch.stack([packed[r][k] for r in range(len(packed))]).to(device) for k in ("input_ids", "position_ids")}
    logits = model(**batch).logits
    labels = torch.stack([packed[r]["labels"] for r in range(len(packed))])
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].cpu().float().transpose(1, 2), labels[:, 1:], reduction="none")
    losses = {}
    for r, row in enumerate(packed.rows):
        at = 0
        for i in row:
            n = len(samples[i]["input_ids"])
            counted = labels[r, at + 1 : at + n] != -100
            losses[i] = (ce[r, at : at + n - 1][counted].sum() / counted.sum()).item()
            at += n
    return [losses[i] for i in range(len(samples))]


@pytest.mark.parametrize("kind", list(MODELS))
def test_per_sample_losses_of_packed_rows_equal_each_sample_run_alone_on_the_cpu_and_on_xla(kind):
    samples = instructions(10, seed=0)
    packed = PackedDataset(samples, length=24)
    model = MODELS[kind]().eval()
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]])).loss.item()
                 for s in samples]  # fmt: skip
        handle = packed_attention(model)
        assert packed_attention(model) is None, "once"
        on_cpu = per_sample_losses(model, packed, samples, "cpu")
        on_xla = _on_xla_with_no_host_read(model, per_sample_losses, packed, samples, "the positions")
        handle.remove()
        crossing = per_sample_losses(model, packed, samples, "cpu")
    assert on_cpu == pytest.approx(alone, abs=1e-5)
    assert on_xla == pytest.approx(alone, abs=1e-5)
    assert crossing != pytest.approx(alone, abs=1e-3), "without packed_attention the samples attend to each other"


def test_a_packed_run_trains_as_the_plain_cpu_loop_with_flat_compiles_no_host_syncs_and_the_unpacked_valid_loss(
        monkeypatch, tmp_path):  # fmt: skip
    monkeypatch.setenv("TPU_UTILITY_DEVICE_NAME", "v5e")  # the chip's name, as a TPU VM's PCI scan gives it
    train = PackedDataset(instructions(64, seed=1), length=32)
    # equal-length samples, so the unpacked ones batch as they are: 3 to a packed row of 48
    valid = counting(24, seed=2, ignored=3)
    valid_packed = PackedDataset([{k: s[k] for k in ("input_ids", "labels")} for s in valid], length=48)
    assert valid_packed.fill == 1.0 and len(valid_packed) == 8
    history = one_cycle_fit(lora(causal_lm("llama")), train, valid_data=valid_packed, epochs=2, max_lr=3e-3,
                            batch_size=4, schedule="constant", optimizer=adamw(3e-3), progress=False)  # fmt: skip
    assert [r.host_syncs for r in history.records] == [0, 0]
    assert history.records[1].compiles == history.records[0].compiles  # flat after epoch 1
    cpu = lora(causal_lm("llama"))
    packed_attention(cpu)
    rows = [train[i] for i in range(len(train))]
    assert [r.train_loss for r in history.records] == pytest.approx(plain_cpu_losses(cpu, rows, 2, 4, 3e-3), rel=1e-4)
    unpacked = evaluate(history.model, valid, batch_size=8)["loss"]
    assert history.records[-1].valid_loss == pytest.approx(unpacked, rel=1e-5)
    assert not hasattr(history.model.get_base_model().model, "_tpu_utility_packed_attention"), "given back after"
    # real tokens/s and MFU on the epoch line, in the records and the CSV; the summary says the real-token share
    flops = training_flops_per_token(history.model, 32)
    for record in history.records:
        assert record.tokens_per_s == pytest.approx(record.samples_per_s * train.real_tokens / len(train))
        assert record.mfu == pytest.approx(record.tokens_per_s * flops / 197e12)
        assert f"{record.tokens_per_s:,.0f} tokens/s" in record.line(2) and f"MFU {record.mfu:.1%}" in record.line(2)
    assert f"{train.fill:.1%} real tokens" in history.summary and "MFU against v5e's bf16 peak" in history.summary
    assert "real tokens; packed rows attend through sdpa with block-diagonal masks" in history.summary
    history.to_csv(tmp_path / "h.csv")
    header = (tmp_path / "h.csv").read_text().splitlines()[0].split(",")
    assert "tokens_per_s" in header and "mfu" in header


def test_the_flops_of_a_token_count_full_training_as_6n_and_lora_as_what_it_computes():
    full, rows = causal_lm("llama"), 64
    config = full.config
    embedding = config.vocab_size * config.hidden_size
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * rows
    n = sum(p.numel() for p in full.parameters()) - embedding  # the lookup computes nothing
    assert training_flops_per_token(full, rows) == 6 * n + attention
    adapted = lora(causal_lm("llama"))
    adapters = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert 0 < adapters < n / 10
    n = sum(p.numel() for p in adapted.parameters()) - embedding
    assert training_flops_per_token(adapted, rows) == 4 * n + 2 * adapters + attention  # no frozen weight's gradient
    tied = causal_lm("llama", tied=True)  # the head is the embedding's matrix: counted once, as a matmul
    assert training_flops_per_token(tied, rows) == 6 * sum(p.numel() for p in tied.parameters()) + attention
    assert peak_flops("v5e") == 197e12 and peak_flops("v6e") == 918e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops("NVIDIA L4") == 121e12 and peak_flops("NVIDIA L40S") is None and peak_flops(None) is None


def test_a_segment_id_kernel_through_attention_interface_gives_each_sample_its_unpacked_loss_and_is_chosen_where_it_fits(
        monkeypatch):  # fmt: skip
    """The kernel cannot run here (torch_xla's flash attention needs a TPU): the reference stands in at its seam."""
    from tpu_utility.huggingface import SEGMENT_ATTENTION, reference_segment_attention

    calls = []

    def reference_kernel(q, k, v, segment_ids, scale):
        calls.append((tuple(q.shape), tuple(k.shape), tuple(segment_ids.shape)))
        return reference_segment_attention(q, k, v, segment_ids, scale)

    samples = instructions(10, seed=0)
    packed = PackedDataset(samples, length=24)
    model = causal_lm("llama").eval()
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]])).loss.item()
                 for s in samples]  # fmt: skip
        compute = backend.current().compute
        monkeypatch.setattr(compute, "segment_attention", lambda device: reference_kernel)  # a TPU whose torch_xla has the kernel
        handle = packed_attention(model)
        assert model.config._attn_implementation == SEGMENT_ATTENTION and "segment-id kernel reference_kernel" in handle.attention
        on_cpu = per_sample_losses(model, packed, samples, "cpu")
        # 4 query heads, the 2 key heads repeated for the kernel; one call per layer
        assert calls == [((len(packed), 4, 24, 8), (len(packed), 4, 24, 8), (len(packed), 24))] * 2
        padded = model(input_ids=torch.tensor([[3, 4, 5]]), attention_mask=torch.tensor([[1, 1, 1]])).logits
        assert len(calls) == 2, "an unpacked forward runs transformers' SDPA"
        handle.remove()
        assert model.config._attn_implementation == "sdpa", "given back"
        assert torch.allclose(padded, model(input_ids=torch.tensor([[3, 4, 5]])).logits, atol=1e-6)
        monkeypatch.setattr(compute, "segment_attention", lambda device: None)  # no kernel: the dense masks
        handle = packed_attention(model)
        assert model.config._attn_implementation == "sdpa" and "sdpa with block-diagonal masks" in handle.attention
        handle.remove()
        monkeypatch.setattr(compute, "segment_attention", lambda device: reference_kernel)
        soft = gemma2()  # soft-capped scores and sliding windows: not plain causal attention, so the masks
        handle = packed_attention(soft)
        assert soft.config._attn_implementation == "eager" and "block-diagonal" in handle.attention
        handle.remove()
        with pytest.raises(ValueError, match="segment-id attention kernel runs plain causal attention, but the model "
                                             "has attention implementation 'eager'"):  # fmt: skip
            packed_attention(soft, kernel=reference_kernel)
    assert on_cpu == pytest.approx(alone, abs=1e-5)


def test_the_xla_backend_offers_torch_xlas_segment_id_flash_attention_only_on_a_tpu_with_jax(monkeypatch):
    from tpu_utility.backend import xla

    current = backend.current()
    device = get_device()
    assert current.compute.segment_attention(device) is None  # XLA:CPU
    monkeypatch.setattr(current.devices, "hardware", lambda device: "TPU")
    monkeypatch.setattr(xla, "module_installed", lambda name: name != "jax")
    assert current.compute.segment_attention(device) is None, "its Pallas kernels are JAX's"
    monkeypatch.setattr(xla, "module_installed", lambda name: True)
    kernel = current.compute.segment_attention(device)  # the installed torch_xla's flash_attention takes segment ids
    assert callable(kernel) and kernel.__name__ == "torch_xla_flash_attention"


class StopBefore:
    """Interrupts a run as the ``epoch``-th epoch starts (after the one before was saved)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, loop, epoch):
        if epoch + 1 == self.epoch:
            raise KeyboardInterrupt


def test_a_packed_run_with_checkpointing_and_accumulation_resumed_from_its_checkpoint_equals_the_uninterrupted_run(
        tmp_path):  # fmt: skip
    from tpu_utility import GradientCheckpointing

    train = PackedDataset(instructions(48, seed=3), length=32)

    def fit(folder, *callbacks, **kwargs):
        return one_cycle_fit(lora(causal_lm("llama")), train, epochs=2, max_lr=3e-3, batch_size=2, accumulate_steps=2,
                             callbacks=[GradientCheckpointing(), *callbacks], checkpoint_dir=str(tmp_path / folder),
                             progress=False, **kwargs)  # fmt: skip

    straight = fit("straight")
    with pytest.raises(KeyboardInterrupt):
        fit("resumed", StopBefore(2))
    resumed = fit("resumed", resume=True)
    assert [r.epoch for r in resumed.records] == [1, 2] and [r.host_syncs for r in straight.records] == [0, 0]
    assert resumed.records[1].train_loss == pytest.approx(straight.records[1].train_loss, rel=1e-6)
    for a, b in zip(straight.model.state_dict().values(), resumed.model.state_dict().values()):
        assert torch.allclose(a.cpu(), b.cpu(), atol=1e-6)  # the same rows in the same seeded order after the resume


def test_rows_of_several_lengths_fill_as_one_length_does_with_shorter_rows_and_batch_one_length_at_a_time():
    lengths = alpaca_lengths(3000)
    capacities = [128, 256, 512, 1024]
    bins = first_fit_decreasing(lengths, capacities, seed=0)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    rooms = [min(c for c in capacities if c >= lengths[b[0]]) for b in bins]  # the smallest room its first sample fits
    assert all(sum(lengths[i] for i in b) <= room for b, room in zip(bins, rooms))
    assert sum(lengths) / sum(rooms) >= 0.95
    assert sum(r * r for r in rooms) / sum(rooms) < 0.6 * 1024, "attention over shorter rows than 1,024"
    packed = PackedDataset([{"input_ids": [s + 1] * n} for s, n in enumerate([3, 3, 7, 8, 1])], length=[4, 8], pad_token_id=9)
    assert packed.row_lengths == [8, 8, 4, 4] and "4 rows of 4/8 (2/2)" in packed.summary()
    assert packed.attention_length == (2 * 64 + 2 * 16) / 24
    assert [tuple(b["input_ids"].shape) for b in packed.loader(2, shuffle=False)] == [(2, 4), (2, 8)]
    carried = packed.collate([packed[3], packed[0]])  # a short row joining a batch of long ones: padded
    assert carried["input_ids"][0].tolist() == packed[3]["input_ids"][:3].tolist() + [9] * 5
    assert carried["labels"][0, 3:].eq(-100).all() and carried["input_ids"][1].tolist() == packed[0]["input_ids"].tolist()
    assert carried["position_ids"][0].tolist() == [0, 1, 2, 0, 0, 1, 2, 3], "the padding added: a segment of its own"
    with pytest.raises(ValueError, match=r"train_data is a PackedDataset of rows of 2 lengths \[4, 8\].*train_data.loader"):
        one_cycle_fit(causal_lm("llama"), packed, epochs=1, max_lr=1e-3, batch_size=2, progress=False)
    with pytest.raises(ValueError, match=r"length must be an int or increasing ints, but given length=\[8, 4\]"):
        PackedDataset([{"input_ids": [1]}], length=[8, 4])


def test_a_sample_longer_than_the_row_is_cut_into_pieces_when_asked_each_a_sample_of_its_own():
    samples = [{"input_ids": list(range(1, 12)), "labels": [-100] * 3 + list(range(4, 12))},
               {"input_ids": [7, 8], "labels": [7, 8]}]  # fmt: skip
    with pytest.raises(ValueError, match=r"^sample 0 has 11 tokens, longer than the row length 4"):
        PackedDataset(samples, length=4)
    packed = PackedDataset(samples, length=4, split=True)
    assert packed.origin == [0, 0, 0, 1] and "2 samples (13 tokens, 1 longer than 4 cut into 3 pieces)" in packed.summary()
    rows = [{k: v.tolist() for k, v in packed[r].items()} for r in range(len(packed))]
    assert rows[1] == {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, 7, 8], "position_ids": [0, 1, 2, 3]}
    assert rows[2] == {"input_ids": [9, 10, 11, 0], "labels": [-100, 10, 11, -100], "position_ids": [0, 1, 2, 0]}
    with pytest.raises(TypeError, match=r"split must be True or False, but given 1"):
        PackedDataset(samples, length=4, split=1)


def test_rows_of_several_lengths_through_their_loader_give_each_sample_its_loss_run_alone():
    samples = instructions(12, seed=4)
    packed = PackedDataset(samples, length=[12, 24])
    assert set(packed.row_lengths) == {12, 24}
    model = causal_lm("llama").eval()
    losses = {}
    with torch.no_grad():
        alone = [model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]])).loss.item()
                 for s in samples]  # fmt: skip
        packed_attention(model)
        order = [r for b in packed.loader(2, shuffle=False, drop_last=False).batch_sampler for r in b]
        for batch, rows in zip(packed.loader(2, shuffle=False, drop_last=False), zip(*[iter(order)] * 2)):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")
            for k, r in enumerate(rows):
                at = 0
                for i in packed.rows[r]:
                    n = len(samples[i]["input_ids"])
                    counted = batch["labels"][k, at + 1 : at + n] != -100
                    losses[i] = (ce[k, at : at + n - 1][counted].sum() / counted.sum()).item()
                    at += n
    assert [losses[i] for i in sorted(losses)] == pytest.approx([alone[i] for i in sorted(losses)], abs=1e-5)
    assert len(losses) >= 10, "the batches hold most samples"


def test_samples_padded_to_one_length_get_tokens_per_second_of_their_real_tokens_from_the_attention_mask(monkeypatch):
    """Unpacked token data (what most notebooks train: a datasets split padded to max_length) has tokens/s too:
    the items per second times the mean of each sample's attention_mask ones, not the padded length."""
    datasets = pytest.importorskip("datasets")
    from tpu_utility.data.packing import real_token_lengths

    monkeypatch.setenv("TPU_UTILITY_DEVICE_NAME", "v5e")
    samples, width = instructions(32, seed=3), 20
    real = [len(s["input_ids"]) for s in samples]
    columns = {"input_ids": [s["input_ids"] + [0] * (width - n) for s, n in zip(samples, real)],
               "attention_mask": [[1] * n + [0] * (width - n) for n in real],
               "labels": [s["labels"] + [-100] * (width - n) for s, n in zip(samples, real)]}  # fmt: skip
    split = datasets.Dataset.from_dict(columns).shuffle(seed=0).select(range(24))  # a selection, reordered
    assert real_token_lengths(split) == [int(sum(m)) for m in split["attention_mask"]]
    assert real_token_lengths(samples) == real and real_token_lengths([(1, 2)]) is None
    history = one_cycle_fit(causal_lm("llama"), split.with_format("torch"), epochs=1, max_lr=1e-3, batch_size=8,
                            progress=False)  # fmt: skip
    record, lengths = history.records[0], real_token_lengths(split)
    assert record.tokens_per_s == pytest.approx(record.samples_per_s * sum(lengths) / len(lengths))
    flops = training_flops_per_token(history.model, round(sum(n * n for n in lengths) / sum(lengths)))
    assert record.mfu == pytest.approx(record.tokens_per_s * flops / 197e12)
    assert f"{record.tokens_per_s:,.0f} tokens/s" in record.line(1)


def parted_losses(model, packed, samples, device):
    """Each sample's mean loss over its targets, from the logits of a batch of every parted row (``packed.starts``)."""
    batch = torch.utils.data.default_collate([packed[r] for r in range(len(packed))])
    labels = batch.pop("labels")
    logits = model(**{k: v.to(device) if torch.is_tensor(v) else [g.to(device) for g in v] for k, v in batch.items()}).logits
    ce = torch.nn.functional.cross_entropy(logits[:, :-1].cpu().float().transpose(1, 2), labels[:, 1:], reduction="none")
    losses = {}
    for r, (row, starts) in enumerate(zip(packed.rows, packed.starts)):
        for i, at in zip(row, starts):
            counted = labels[r, at + 1 : at + len(samples[i]["input_ids"])] != -100
            losses[i] = (ce[r, at : at + len(samples[i]["input_ids"]) - 1][counted].sum() / counted.sum()).item()
    return [losses[i] for i in range(len(samples))]


def test_parted_rows_give_each_sample_its_loss_run_alone_each_part_attending_as_a_row_of_its_own():
    """Rows of one layout (a first part, then chunks; no sample crossing a part): each group of equal parts runs
    as a batch of its own (attention over the part, not the row), on the CPU and on XLA with 0 host syncs."""
    samples = instructions(10, seed=0)
    packed = PackedDataset(samples, length=24, chunks=[8, 12, 12])
    assert packed.parts == (24, 12, 12, 8) and packed.length == 56 and len(packed) * 56 * packed.fill == 111
    row = packed[0]
    assert [tuple(g.shape) for g in row["packed_parts"]] == [(1, 24), (2, 12), (1, 8)]
    assert torch.equal(torch.cat([g.flatten() for g in row["packed_parts"]]), row["position_ids"])
    for r in range(len(packed)):  # each part starts a sample, or is all padding: no sample crosses into it
        assert all(packed[r]["position_ids"][at] == 0 for at in (0, 24, 36, 48))
    assert "into 4 rows of 56 (24, then chunks 2 x 12 + 1 x 8)" in packed.summary()
    for kind in ("llama", "gemma2", "gpt2"):
        model = MODELS[kind]().eval()
        seen = []
        attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
        attention.register_forward_pre_hook(lambda m, a, k: seen.append(tuple((a[0] if a else k["hidden_states"]).shape[:2])),
                                            with_kwargs=True)  # fmt: skip
        with torch.no_grad():
            alone = [model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]])).loss.item()
                     for s in samples]  # fmt: skip
            handle = packed_attention(model)
            seen.clear()
            on_cpu = parted_losses(model, packed, samples, "cpu")
            assert seen == [(4, 24), (8, 12), (4, 8)], "each group of parts a batch of its own"
            if kind == "llama":
                with pytest.raises(ValueError, match=r"a batch of parted rows \(packed_parts\) runs with its position_ids "
                                                     r"and without an attention_mask"):  # fmt: skip
                    one = torch.utils.data.default_collate([packed[0]])
                    model(input_ids=one["input_ids"], position_ids=one["position_ids"], packed_parts=one["packed_parts"],
                          attention_mask=torch.ones(1, 56))  # fmt: skip
            on_xla = _on_xla_with_no_host_read(model, parted_losses, packed, samples, "the layout (in the shapes)")
            handle.remove()
            assert "forward" not in vars(model.base_model), "the decoder's forward given back"
        assert on_cpu == pytest.approx(alone, abs=1e-5), kind
        assert on_xla == pytest.approx(alone, abs=1e-5), kind


def test_a_parted_run_compiles_one_train_step_with_no_host_syncs_and_its_parted_valid_loss_is_the_unpacked_one():
    train = PackedDataset(instructions(48, seed=1), length=24, chunks="auto")
    valid = counting(12, seed=2, ignored=3)  # 12 samples of 16: rows of two parts of 16, one sample each
    valid_parted = PackedDataset([{k: s[k] for k in ("input_ids", "labels")} for s in valid], length=16, chunks=[16])
    assert train.chunks and max(train.chunks) <= 24 and valid_parted.fill == 1.0
    history = one_cycle_fit(lora(causal_lm("llama")), train, valid_data=valid_parted, epochs=2, max_lr=3e-3, batch_size=2,
                            progress=False)  # fmt: skip
    assert [r.host_syncs for r in history.records] == [0, 0]
    assert history.records[1].compiles == history.records[0].compiles  # flat after epoch 1
    assert len({str(g.shapes) for g in history.graphs if g.graph == "train step"}) == 1, "one train-step shape"
    assert f"rows of {train.length} (24, then chunks" in history.summary
    assert history.records[-1].valid_loss == pytest.approx(evaluate(history.model, valid, batch_size=4)["loss"], rel=1e-5)
    assert "forward" not in vars(history.model.get_base_model().model), "given back after"


def test_parted_rows_refuse_bad_chunks_by_name():
    samples = [{"input_ids": [1, 2, 3]}, {"input_ids": [4]}]
    for chunks, message in (([9], r"every chunk must be at most length=8 .*given chunks=\[9\]"),
                            ([], r"chunks must be 'auto' or a non-empty list of chunk lengths .*given chunks=\[\]"),
                            ("some", r"given chunks='some'"), ([0], r"every chunk must be an int >= 1, but given 0")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            PackedDataset(samples, length=8, chunks=chunks)
    with pytest.raises(TypeError, match=r"every chunk must be an int, but given 2.5"):
        PackedDataset(samples, length=8, chunks=[2.5])
    with pytest.raises(ValueError, match=r"chunks takes rows of one length .*given length=\[4, 8\]"):
        PackedDataset(samples, length=[4, 8], chunks=[2])
    with pytest.raises(ValueError, match=r"give the PackedDataset itself with batch_size"):
        PackedDataset(samples, length=8, chunks=[4]).loader(2)
