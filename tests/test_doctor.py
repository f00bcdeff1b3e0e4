"""doctor: a clean step gives a clean report; each planted defect is named, and nothing else."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import flat_digits, small_mlp
from tpu_utility import DoctorError, doctor, get_device, step_optimizer, backend
from tpu_utility.device import move_model

DEVICE = None


def device():
    global DEVICE
    DEVICE = DEVICE or get_device()
    return DEVICE


def batches(sizes=(32,) * 6):
    x, y = flat_digits().tensors
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def setup():
    torch.manual_seed(0)
    model = small_mlp().to(device())
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), nn.CrossEntropyLoss()


def port_step(model, optimizer, loss_fn, extra=None):
    """The two-line port of a CUDA step; `extra(loss, logits)` plants a defect."""

    def step(batch):
        x, y = batch[0].to(device()), batch[1].to(device())
        optimizer.zero_grad()
        logits = model(x)
        loss = loss_fn(logits, y)
        if extra is not None:
            loss = extra(loss, logits)
        loss.backward()
        step_optimizer(optimizer)

    return step


def test_a_clean_step_gives_a_clean_report():
    model, optimizer, loss_fn = setup()
    report = doctor(port_step(model, optimizer, loss_fn), batches=batches(), model=model, optimizer=optimizer)
    assert report.clean, str(report)
    assert report.compiles_per_step == 0 and report.host_syncs_per_step == 0
    assert "clean: no recompiles, no host syncs" in str(report)


def test_the_model_form_is_clean_too():
    model, optimizer, _ = setup()
    assert doctor(model, batches=batches(), optimizer=optimizer).clean


def test_changing_shapes_are_named_as_recompiles():
    model, optimizer, loss_fn = setup()
    report = doctor(port_step(model, optimizer, loss_fn), batches=batches((32, 32, 17, 32, 17, 32)))
    assert report.kinds() == {"recompile"}, str(report)
    assert any("(32, 1, 8, 8) -> (17, 1, 8, 8)" in w for w in report.findings[0].where)
    assert "drop_last=True" in report.findings[0].fix
    # issue 59: each compile's own seconds and graph size, at the step that compiled it (the 17-sample batch: step 3)
    assert 3 in {step for step, _ in report.graphs}, report.graphs
    assert all(g.seconds > 0 and g.nodes > 0 for _, g in report.graphs)
    assert "compiled at step 3 (counting warm-up): " in str(report) and " IR nodes" in str(report)


def test_item_every_step_is_named_with_its_line():
    model, optimizer, loss_fn = setup()
    seen = []

    def log_loss(loss, logits):
        seen.append(loss.item())  # the planted host sync
        return loss

    report = doctor(port_step(model, optimizer, loss_fn, log_loss), batches=batches())
    assert report.kinds() == {"host_sync"}, str(report)
    assert report.host_syncs_per_step == 1
    assert any("test_doctor.py" in w and "seen.append(loss.item())" in w for w in report.findings[0].where)


def test_an_op_without_xla_lowering_is_named():
    model, optimizer, loss_fn = setup()

    def with_histogram(loss, logits):
        return loss + 0 * torch.histc(logits.detach(), bins=10).sum()

    report = doctor(port_step(model, optimizer, loss_fn, with_histogram), batches=batches())
    assert report.kinds() == {"cpu_fallback"}, str(report)
    assert report.fallback_ops == ["aten::histc"]


def test_an_optimizer_built_before_the_move_is_named():
    torch.manual_seed(0)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # planted: before .to(device)
    model.to(device())
    try:
        report = doctor(port_step(model, optimizer, nn.CrossEntropyLoss()), batches=batches(),
                        model=model, optimizer=optimizer)  # fmt: skip
    except DoctorError as e:  # where step_optimizer itself refuses CPU parameters
        report = e.report
    assert report.kinds() == {"optimizer_params"}, str(report)
    assert "4 of the optimizer's 4 parameters are not the model's" in str(report)


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 64, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, tokens):
        return self.out(self.emb(tokens).mean(dim=1))


def _token_batches():
    g = torch.Generator().manual_seed(0)
    return [(t := torch.randint(0, 64, (32, 5), generator=g), t[:, 0]) for _ in range(6)]


@pytest.mark.parametrize("move, split", [(lambda m: m.to(device()), True), (lambda m: move_model(m, device()), False)])
def test_tied_weights_split_by_the_move_are_named(move, split):
    torch.manual_seed(0)
    model = move(TiedLM())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = doctor(model, batches=_token_batches(), optimizer=optimizer)
    if split:  # plain .to(xla) makes new Parameters, so the tie is lost
        assert report.kinds() == {"tied_weights"}, str(report)
        assert report.findings[0].where == ["emb.weight == out.weight"]
    else:
        assert report.clean, str(report)


def test_a_batch_that_does_not_divide_across_cores_is_named():
    model, optimizer, loss_fn = setup()
    report = doctor(port_step(model, optimizer, loss_fn), batches=batches((30,) * 6), cores=4)
    assert report.kinds() == {"batch_split"}, str(report)
    assert "30 samples, which does not divide across 4 cores" in str(report)


def test_doctor_argument_errors():
    model, optimizer, _ = setup()
    with pytest.raises(TypeError, match=r"doctor\(model, ...\) needs optimizer="):
        doctor(model, batch=batches()[0])
    with pytest.raises(ValueError, match=r"exactly one of batch= .* or batches="):
        doctor(model, optimizer=optimizer)
    with pytest.raises(ValueError, match=r"steps must be an int >= 1 or 'all' .*, but given 'every'"):
        doctor(model, batches=batches(), optimizer=optimizer, steps="every")
    with pytest.raises(TypeError, match=r"warmup must be an int >= 0, but given 1.5 \(float\)"):
        doctor(model, batches=batches(), optimizer=optimizer, warmup=1.5)
    with pytest.raises(ValueError, match=r"mode must be one of \('train', 'eval'\), but given 'test'"):
        doctor(model, batches=batches(), mode="test")
    with pytest.raises(ValueError, match=r"steps='all' runs a whole loader: give batches=loader"):
        doctor(model, batch=batches()[0], optimizer=optimizer, steps="all")


# ---------------------------------------------------- what used to fool doctor
def test_a_step_without_a_graph_cut_is_named_as_graph_growth():
    model, optimizer, loss_fn = setup()

    def cuda_step(batch):  # only the device line ported: optimizer.step() cuts nothing
        x, y = batch[0].to(device()), batch[1].to(device())
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    report = doctor(cuda_step, batches=batches(), model=model, optimizer=optimizer)
    assert report.kinds() == {"graph_growth"}, str(report)
    assert "step_optimizer(optimizer)" in report.findings[0].fix
    assert "device_loader(loader)" in report.findings[0].fix


def test_a_manual_update_without_a_cut_grows_and_the_one_line_fix_is_clean():
    model, _, loss_fn = setup()

    def manual_step(batch, cut=False):  # word_language_model's update
        x, y = batch[0].to(device()), batch[1].to(device())
        model.zero_grad()
        loss_fn(model(x), y).backward()
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.1)
        if cut:
            backend.sync()  # the fix doctor names: torch_xla.sync() at the end of the step

    grown = doctor(manual_step, batches=batches(), model=model)
    assert grown.kinds() == {"graph_growth"}, str(grown)
    assert "torch_xla.sync() at the end of the step" in grown.findings[0].fix
    fixed = doctor(lambda b: manual_step(b, cut=True), batches=batches(), model=model)
    assert fixed.clean, str(fixed)


def digit_loader(n, batch_size=32, drop_last=False):
    return DataLoader(flat_digits(n), batch_size=batch_size, drop_last=drop_last)


def test_a_short_last_batch_is_a_recompile_over_the_whole_loader():
    model, optimizer, loss_fn = setup()
    step = port_step(model, optimizer, loss_fn)
    report = doctor(step, batches=digit_loader(32 * 5 + 7), steps="all")
    assert report.steps == 4 and report.step_compiles[-1] >= 1, str(report)  # the last batch ran
    assert report.kinds() == {"recompile"}, str(report)
    assert any("(32, 1, 8, 8) -> (7, 1, 8, 8)" in w for w in report.findings[0].where)
    assert "drop_last=True" in report.findings[0].fix
    assert doctor(step, batches=digit_loader(32 * 5 + 7, drop_last=True), steps="all").clean
    # a bounded run that stops before the last batch still names it, from the loader
    bounded = doctor(step, batches=digit_loader(32 * 9 + 7), steps=2)
    assert bounded.kinds() == {"recompile"} and "last batch holds 7 samples" in str(bounded)


def test_an_evaluation_step_is_accepted_and_its_last_batch_gets_the_masked_fix():
    model, _, loss_fn = setup()
    correct = []

    def eval_step(batch):
        x, y = batch[0].to(device()), batch[1].to(device())
        with torch.no_grad():
            correct.append((model(x).argmax(1) == y).sum())  # kept on the device
        backend.sync()

    report = doctor(eval_step, batches=digit_loader(32 * 4 + 5), steps="all", mode="eval")
    assert report.kinds() == {"recompile"}, str(report)
    assert "masked_loader(loader)" in report.findings[0].fix and "drop_last=True" not in report.findings[0].fix
    assert "(eval step)" in str(report)
    assert doctor(model, batches=batches(), mode="eval").clean  # the model form evaluates too


def test_a_step_that_raises_returns_the_earlier_findings_with_the_exception():
    torch.manual_seed(0)
    model = small_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # planted: before .to(device)
    model.to(device())
    calls = []

    def step(batch):
        calls.append(1)
        if len(calls) == 4:
            raise KeyError("no such column: 'label'")
        x, y = batch[0].to(device()), batch[1].to(device())
        nn.functional.cross_entropy(model(x), y).backward()
        model.zero_grad()
        backend.sync()

    with pytest.raises(DoctorError) as raised:
        doctor(step, batches=batches(), model=model, optimizer=optimizer)
    report = raised.value.report
    assert isinstance(raised.value.__cause__, KeyError)
    assert report.error is raised.value.__cause__ and report.error_step == 4
    assert report.kinds() == {"optimizer_params"}, str(report)
    assert "KeyError" in str(raised.value) and "4 of the optimizer's 4 parameters" in str(raised.value)
    assert "__getitem__" not in torch.Tensor.__dict__ and "item" not in torch.Tensor.__dict__  # tracing undone


def test_a_one_time_lr_change_is_a_note_not_a_per_step_recompile():
    model, _, loss_fn = setup()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    step = port_step(model, optimizer, loss_fn)
    seen = []

    def step_with_schedule(batch):
        seen.append(1)
        if len(seen) == 4:  # the learning rate leaves its initial value once
            optimizer.param_groups[0]["lr"] = 0.5
        step(batch)

    report = doctor(step_with_schedule, batches=batches((32,) * 8), steps=6)
    assert sum(report.step_compiles) >= 1, str(report)  # it did compile once: doctor saw it
    assert report.clean, str(report)
    assert "compiled once with unchanged input shapes, not every step" in str(report), str(report)


def test_a_dataset_on_the_device_sliced_with_python_ints_is_named():
    model, optimizer, loss_fn = setup()
    data, targets = (t.to(device()) for t in flat_digits(400).tensors)
    offsets = torch.arange(32, device=device())

    def train_on(x, y):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        step_optimizer(optimizer)

    def sliced_step(i):
        train_on(data[i : i + 32], targets[i : i + 32])  # planted: a new offset in the graph every step

    sliced_step.__wrapped__ = train_on

    def indexed_step(i):  # the fix doctor names
        idx = offsets + i
        optimizer.zero_grad()
        loss_fn(model(data.index_select(0, idx)), targets.index_select(0, idx)).backward()
        step_optimizer(optimizer)

    report = doctor(sliced_step, batches=range(5, 300, 37))
    assert report.kinds() == {"device_slicing"}, str(report)
    assert report.compiles_per_step >= 1
    assert any("data[i : i + 32]" in w and "[79:111]" in w for w in report.findings[0].where), str(report)
    assert "index_select" in report.findings[0].fix and ".to(device)" in report.findings[0].fix
    assert doctor(indexed_step, batches=range(5, 300, 37)).clean
    narrowed = doctor(lambda i: sliced_step.__wrapped__(data.narrow(0, i, 32), targets.narrow(0, i, 32)),
                      batches=range(5, 300, 37))  # fmt: skip
    assert narrowed.kinds() == {"device_slicing"}, str(narrowed)


def test_the_same_python_indices_every_step_are_not_slicing():
    model, optimizer, loss_fn = setup()

    def unrolled_step(batch):  # an RNN-style loop over time steps: the same indices every step
        x, y = batch[0].to(device()).flatten(1), batch[1].to(device())
        h = sum(x[:, t * 16 : (t + 1) * 16].sum(1, keepdim=True) for t in range(4))
        optimizer.zero_grad()
        loss_fn(model(x + 0 * h), y).backward()
        step_optimizer(optimizer)

    report = doctor(unrolled_step, batches=batches())
    assert report.clean, str(report)


def test_a_model_left_on_the_cpu_is_named_not_clean():
    torch.manual_seed(0)
    model = small_mlp()  # planted: never moved
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    report = doctor(model, batches=batches(), optimizer=optimizer)
    assert report.kinds() == {"not_on_xla"}, str(report)
    assert "on cpu, not on the XLA device" in str(report) and not report.clean

    def cpu_step(batch):  # no model given: doctor sees that nothing ran on XLA
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()

    assert doctor(cpu_step, batches=batches()).kinds() == {"not_on_xla"}


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(64, 16, mode="mean")
        self.out = nn.Linear(16, 4)

    def forward(self, tokens):
        return self.out(self.bag(tokens))


def test_embedding_bag_gets_its_lowered_replacement():
    torch.manual_seed(0)
    model = BagClassifier().to(device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 64, (16, 6), generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(6)]
    report = doctor(model, batches=data, optimizer=optimizer)
    assert report.kinds() == {"cpu_fallback"}, str(report)
    assert "aten::_embedding_bag" in report.fallback_ops
    assert "nn.EmbeddingBag -> nn.Embedding and a masked sum/mean" in report.findings[0].fix


def test_changing_sequence_lengths_get_a_bucket_collate_suggestion():
    torch.manual_seed(0)
    model = BagClassifier().to(device())
    model.bag = nn.Embedding(64, 16).to(device())
    model.forward = lambda tokens: model.out(model.bag(tokens).mean(1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    lengths = [10, 10, 13, 21, 30, 38]  # each batch padded to its longest sequence
    data = [(torch.randint(0, 64, (16, n), generator=g), torch.randint(0, 4, (16,), generator=g)) for n in lengths]
    report = doctor(model, batches=data, optimizer=optimizer)
    assert report.kinds() == {"recompile"}, str(report)
    assert "sequence lengths: dim 1 of input 0 took 5 values, 10..38" in report.findings[0].message
    # quartiles of the lengths seen (10, 13, 30, 38), rounded up to multiples of 8
    assert "BucketCollate(buckets=[16, 32, 40])" in report.findings[0].fix
    assert "drop_last" not in report.findings[0].fix


def test_predictions_read_every_step_get_the_accumulate_on_device_fix():
    model, optimizer, loss_fn = setup()
    preds = []

    def keep_preds(loss, logits):
        preds.append(logits.argmax(1).cpu().numpy())  # planted: a host sync per step
        return loss

    report = doctor(port_step(model, optimizer, loss_fn, keep_preds), batches=batches())
    assert report.kinds() == {"host_sync"}, str(report)
    assert "torch.cat(preds).cpu()" in report.findings[0].fix


def test_a_model_without_parameters_is_a_clear_error_or_finding_not_stop_iteration():
    from tpu_utility.diagnostics.doctor import check_optimizer

    with pytest.raises(ValueError, match=r"the Flatten given has none; pass your own step\(batch\)"):
        doctor(nn.Flatten(), batches=batches(), mode="eval")  # was: StopIteration from next(model.parameters())
    stray = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
    finding = check_optimizer(nn.ReLU(), stray)
    assert finding.kind == "optimizer_params" and "the model has no parameters at all" in finding.message


def test_an_evaluation_under_inference_mode_is_named_with_its_fix():
    model, _, _ = setup()
    model.eval()

    def eval_step(batch):
        with torch.inference_mode():  # as torchvision's reference evaluates
            return model(batch[0].to(device())).argmax(1)

    with pytest.raises(DoctorError) as e:
        doctor(eval_step, batches=batches(), mode="eval")
    assert "inference_mode" in e.value.report.kinds()
    (finding,) = [f for f in e.value.report.findings if f.kind == "inference_mode"]
    assert "tpu_utility.inference_mode()" in finding.fix and "torch.no_grad()" in finding.fix


def test_every_finding_kind_is_a_rule_of_the_shared_table():
    from typing import get_args

    from tpu_utility.diagnostics.doctor import Kind
    from tpu_utility.diagnostics.rules import RULES, for_tool

    assert set(get_args(Kind)) <= set(RULES)
    doctor_rules = {rule.id for rule in for_tool("doctor")} - {"hf_mask_sync"}  # a host_sync finding's fix
    assert set(get_args(Kind)) == doctor_rules, "a rule doctor never reports, or a finding with no rule"
    assert RULES["hf_mask_sync"].part_of == "host_sync"
