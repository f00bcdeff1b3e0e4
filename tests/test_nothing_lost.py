"""A run's end never loses the run, and every value a user gives is used or refused (issue 62, items 1, 2, 5).

alpaca-lora's override of ``model.state_dict`` (to save the adapter alone) is refused before the first epoch,
naming it; a restore that still fails at the end comes back as a warning with the History and the checkpoints'
paths. A one-cycle knob beside ``schedule=OneCycle(...)``, a schedule class without its parentheses and a
non-finite ``device_memory`` are refused, naming what was given.
"""

import math
import os
import warnings

import pytest
import torch
from torch import nn

from conftest import flat_digits, small_mlp
from tpu_utility import one_cycle_fit
from tpu_utility.training.memory import memory_plan
from tpu_utility.training.schedule import OneCycle

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 1, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


def adapter_only(model: nn.Module) -> nn.Module:
    """tloen/alpaca-lora's finetune.py: ``model.state_dict`` replaced to return the trainable weights alone."""
    old_state_dict = model.state_dict
    model.state_dict = (lambda self, *_, **__: {k: v for k, v in old_state_dict().items() if k.startswith("3.")}
                        ).__get__(model, type(model))  # fmt: skip
    return model


# ------------------------------------------------------------------ 1. snapshots checked when taken
@pytest.mark.parametrize("asked", [{"restore_best": True}, {"checkpoint_dir": "ckpt"}])
def test_a_state_dict_override_is_refused_before_the_first_epoch_naming_it(tmp_path, asked):
    asked = {k: str(tmp_path / v) if k == "checkpoint_dir" else v for k, v in asked.items()}
    data = flat_digits(64)
    name = "restore_best=True" if "restore_best" in asked else "checkpoint_dir"
    epochs = []

    class Count:
        def on_train_epoch_start(self, loop, epoch):
            epochs.append(epoch)

    with pytest.raises(ValueError, match=rf"{name} snapshots the model with model.state_dict\(\).*but "
                                         rf"model.state_dict \(assigned to the Sequential instance\) is overridden and "
                                         rf"returns 2 names where the model has 4: 2 of the model's own left out "
                                         rf"\(1.weight, 1.bias\)"):  # fmt: skip
        fit(adapter_only(small_mlp()), data, valid_data=data, callbacks=[Count()], **asked)
    assert epochs == []  # nothing trained, nothing lost
    assert not os.path.exists(os.path.join(asked.get("checkpoint_dir", str(tmp_path)), "last.pt"))


class Keeps(nn.Sequential):
    """Overrides state_dict (the same names) and load_state_dict (it fails): the pair is trusted when taken."""

    def state_dict(self, *args, **kwargs):
        return super().state_dict(*args, **kwargs)

    def load_state_dict(self, state, strict=True, assign=False):
        raise RuntimeError("Missing key(s) in state_dict: 'base_model.lora_A'")


def test_a_restore_that_fails_at_the_end_returns_the_history_and_says_where_the_weights_are(tmp_path):
    data = flat_digits(64)
    model = Keeps(*small_mlp())
    with pytest.warns(UserWarning, match=r"restore_best could not load the best weights \(epoch \d\) into the model: "
                                         r"RuntimeError: Missing key\(s\) in state_dict: 'base_model.lora_A'. The model "
                                         r"holds the last epoch's weights; they are in .*best.pt \(the last epoch's in "
                                         r".*last.pt\)"):  # fmt: skip
        history = fit(model, data, valid_data=data, epochs=2, restore_best=True, checkpoint_dir=str(tmp_path))
    assert len(history.records) == 2 and history.model is model
    assert "the best weights were not restored" in history.stop_reason
    assert os.path.exists(tmp_path / "best.pt") and os.path.exists(tmp_path / "last.pt")


# ------------------------------------------------------------------ 2. every given value used or refused
def test_a_one_cycle_knob_beside_a_schedule_that_sets_it_is_refused_naming_both():
    # 0.25 is pct_start's default value: written out, it is given, and OneCycle's 0.3 would have won unsaid
    with pytest.raises(ValueError, match=r"pct_start=0.25 and schedule=OneCycle\(max_lr=None, pct_start=0.3, .*\) both "
                                         r"shape the one-cycle schedule; give the settings in OneCycle\(...\) alone"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), schedule=OneCycle(pct_start=0.3), pct_start=0.25)
    with pytest.raises(ValueError, match=r"div_factor=25.0 shapes schedule='one_cycle' only, but this call gives "
                                         r"schedule='linear'"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), schedule="linear", div_factor=25.0)
    # the default's own value left unwritten, or given alone, is used
    with pytest.warns(FutureWarning, match=r"pct_start=0.25 is deprecated: write schedule=OneCycle\(pct_start=0.25\)"):
        given = fit(small_mlp(), flat_digits(64), pct_start=0.25)
    assert given.step_lrs == fit(small_mlp(), flat_digits(64)).step_lrs


@pytest.mark.parametrize("given, way", [(OneCycle, r"an instance, schedule=OneCycle\(\) or OneCycle\(pct_start=0.3\)"),
                                        (torch.optim.lr_scheduler.OneCycleLR, r"schedule=None and step your own")])
def test_a_schedule_class_without_parentheses_is_named_as_such(given, way):
    name = given.__qualname__
    with pytest.raises(TypeError, match=rf"schedule={name} is the class {name}, not a schedule: give {way}"):
        fit(small_mlp(), flat_digits(64), schedule=given)


@pytest.mark.parametrize("memory", [math.inf, math.nan, -math.inf])
def test_a_non_finite_device_memory_is_refused_naming_it(memory, monkeypatch):
    with pytest.raises(ValueError, match=rf"device_memory must be one chip's bytes .*but given {memory!r}"):
        memory_plan(small_mlp(), device_memory=memory)
    monkeypatch.setenv("TPU_UTILITY_DEVICE_MEMORY_GB", str(memory))
    with pytest.raises(ValueError, match=rf"TPU_UTILITY_DEVICE_MEMORY_GB must be a positive number of GiB per device "
                                         rf"\(e.g. 16\), but is '{memory}'"):  # fmt: skip
        memory_plan(small_mlp())


# ------------------------------------------------------------------ 5. the smaller items
def test_the_summary_says_what_the_weights_are_and_what_computes():
    from tpu_utility.training.precision import PrecisionMode

    cpu = torch.device("cpu")
    lora_like = nn.Sequential(nn.Linear(2, 2).to(torch.bfloat16).requires_grad_(False), nn.Linear(2, 2))
    assert PrecisionMode("fp32", cpu).words(small_mlp()) == "fp32"
    assert PrecisionMode("fp32", cpu).words(small_mlp().to(torch.bfloat16)) == (
        "no autocast (precision='fp32'): computes in the weights' dtype | weights bf16")
    assert PrecisionMode("autocast", cpu).words(lora_like) == "bf16 (autocast) | weights bf16 (frozen), fp32 (trained)"


class HalfBase(nn.Module):
    """A LoRA-like model as loaded in bf16: a frozen bf16 base, a trained fp32 head."""

    def __init__(self):
        super().__init__()
        self.base, self.head = nn.Linear(64, 32).to(torch.bfloat16).requires_grad_(False), nn.Linear(32, 10)

    def forward(self, x):
        return self.head(self.base(x.flatten(1).to(torch.bfloat16)).float())


def test_a_bf16_loaded_model_is_not_summarised_as_fp32():
    history = fit(HalfBase(), flat_digits(64))
    assert ("| no autocast (precision='fp32'): computes in the weights' dtype | weights bf16 (frozen), fp32 (trained) |"
            in history.summary), history.summary


def test_the_version_warning_and_the_docs_claim_only_what_is_measured():
    from tpu_utility.huggingface import transformers_too_old

    told = transformers_too_old("4.57.1")
    assert "host sync" not in told and "pip install -U 'transformers>=5.0'" in told  # 0 measured for a Qwen2 LoRA
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    docs = {name: open(os.path.join(root, "docs", name)).read() for name in os.listdir(os.path.join(root, "docs"))
            if name.endswith(".md")}  # fmt: skip
    # tests/test_huggingface.py measures a BERT's steps at 0 host syncs (its masks built on the device)
    assert "so a BERT step makes 0 host syncs (measured)" in " ".join(docs["training.md"].split())
    assert "makes one host sync" not in docs["training.md"] and "masks are read on the host" not in docs["llm.md"]
    assert not [name for name, text in docs.items() if "torch_dtype=" in text]  # transformers 5 deprecates it: dtype=


def test_the_checks_timeout_stops_the_program_with_the_processes_it_started(tmp_path):
    import sys
    import time

    from tpu_utility.diagnostics.port.check import run_bounded

    started = tmp_path / "server.pid"
    program = (f"import subprocess, sys, time\n"
               f"server = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
               f"open({str(started)!r}, 'w').write(str(server.pid))\n"
               f"time.sleep(600)\n")  # fmt: skip
    assert run_bounded([sys.executable, "-c", program], dict(os.environ), timeout=3) is None
    server = int(started.read_text())
    for _ in range(50):  # killed with its group; reaped by init
        try:
            os.kill(server, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the program's own process {server} outlived the check's timeout")
    ran = run_bounded([sys.executable, "-c", "print('done')"], dict(os.environ), timeout=60)
    assert ran.returncode == 0 and ran.stdout == "done\n"
