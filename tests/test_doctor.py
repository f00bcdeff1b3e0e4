"""doctor: a clean step gives a clean report; each planted defect is named, and nothing else."""

import pytest
import torch
from torch import nn

from conftest import flat_digits, small_mlp
from tpu_utility import doctor, get_device, step_optimizer
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
    report = doctor(port_step(model, optimizer, nn.CrossEntropyLoss()), batches=batches(),
                    model=model, optimizer=optimizer)  # fmt: skip
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
