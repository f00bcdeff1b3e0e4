"""The CUDA idioms that left a ported program on the host CPU (issue 51), each ported and RUN on XLA:CPU.

Each original below is the smallest program of its idiom; the port of each runs in one child
interpreter (in this order: the import-time device first, before anything starts the runtime), and
each test asserts where its parameters and batches ended up. Idioms the port cannot rewrite stop it
(exit 1) with the line named; those are asserted on the report.
"""

import json
import textwrap

import pytest

from conftest import run_python
from tpu_utility.diagnostics.port import port_source

TIED = """\
class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(16, 8)
        self.lm_head = nn.Linear(8, 16, bias=False)
        self.lm_head.weight = self.wte.weight
"""
ORIGINALS = {
    "import_time": """\
        import torch
        from tpu_utility import backend
        class args:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        started_at_import = backend.runtime_started()
        x = torch.ones(2).to(args.device)
        RESULT = {"started_at_import": started_at_import, "batch": x.device.type}
        """,
    "guard_string": """\
        import torch
        from torch import nn
        device = "cpu"
        if torch.cuda.is_available():
            device = "cuda"
        model = nn.Linear(4, 2).to(device)
        x = torch.ones(3, 4).to(device)
        loss = model(x).sum()
        RESULT = {"params": model.weight.device.type, "batch": x.device.type, "loss": float(loss)}
        """,
    "guard_kaggle": """\
        import torch
        from torch import nn
        model = nn.Linear(4, 2)
        model.train()
        x = torch.ones(3, 4)
        if torch.cuda.is_available():
            model = model.cuda()
            x = x.cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(x).sum().backward()
        optimizer.step()
        RESULT = {"params": model.weight.device.type, "batch": x.device.type}
        """,
    "use_cuda_flag": """\
        import torch
        no_cuda = False
        use_cuda = not no_cuda and torch.cuda.is_available()
        if use_cuda:
            device = torch.device("cuda")
        else:
            device = torch.device("cpu")
        x = torch.ones(2, device=device)
        RESULT = {"batch": x.device.type}
        """,
    "device_map": """\
        import torch
        from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel
        GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)).save_pretrained(PATH)
        model = AutoModelForCausalLM.from_pretrained(PATH, device_map="auto")
        model.train()
        batch = torch.arange(8).view(1, 8).to(model.device)
        loss = model(input_ids=batch, labels=batch).loss
        RESULT = {"params": model.device.type, "batch": batch.device.type, "loss": float(loss),
                  "tied": model.lm_head.weight is model.transformer.wte.weight}
        """,
    "device_calls": """\
        import torch
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        n = torch.cuda.device_count()
        i = torch.accelerator.current_device_index()
        torch.accelerator.set_device_index(i)
        torch.cuda.reset_peak_memory_stats()
        x = torch.ones(2, device=device_type)
        RESULT = {"count": n, "index": i, "batch": x.device.type}
        """,
    "chained_moves": """\
        import torch
        from torch import nn
        """ + textwrap.indent(TIED, " " * 8).lstrip() + """
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        a = Tied()
        a.train().to(device)
        b = Tied()
        b.to(device).train()
        c = Tied().to(device)
        optimizer = torch.optim.SGD(c.parameters(), lr=0.1)
        RESULT = {k: [m.wte.weight.device.type, m.lm_head.weight is m.wte.weight] for k, m in (("a", a), ("b", b), ("c", c))}
        """,
    "generator": """\
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        g = torch.Generator(device=device)
        g.manual_seed(0)
        idx = torch.randperm(8, generator=g).to(device)
        RESULT = {"batch": idx.device.type}
        """,
    "ddp_single_process": """\
        import os, torch
        from torch import nn
        from torch.distributed import init_process_group
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = int(os.environ.get("RANK", -1)) != -1
        if ddp:
            init_process_group(backend="nccl")
            ddp_local_rank = int(os.environ["LOCAL_RANK"])
            device = f"cuda:{ddp_local_rank}"
            torch.cuda.set_device(device)
        else:
            device = "cpu"
            if torch.cuda.is_available():
                device = "cuda"
        model = nn.Linear(4, 2)
        model.to(device)
        model.train()
        if ddp:
            model = DDP(model, device_ids=[ddp_local_rank])
        RESULT = {"params": model.weight.device.type}
        """,
}
RUN = """
import json, torch, traceback
from tpu_utility import backend
torch.set_num_threads(1)
for name, code in {snippets!r}:
    namespace = {{"__name__": "__main__", "PATH": {path!r}}}
    try:
        exec(compile(code, name, "exec"), namespace)
        result = namespace["RESULT"]
    except BaseException:
        result = {{"error": traceback.format_exc()[-1500:]}}
    print("SNIPPET", name, json.dumps(result), flush=True)
print("EXECUTED", backend.execute_count())
"""


@pytest.fixture(scope="module")
def ported(tmp_path_factory):
    """name -> (report, the ported run's RESULT), every port run in one interpreter."""
    reports, snippets = {}, []
    for name, original in ORIGINALS.items():
        new, report = port_source(textwrap.dedent(original), name)
        reports[name] = report
        snippets.append((name, new))
    r = run_python(RUN.format(snippets=snippets, path=str(tmp_path_factory.mktemp("tiny_gpt2"))), env={"PJRT_DEVICE": "CPU"})
    assert r.returncode == 0, r.stderr[-3000:]
    said = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2]) for line in r.stdout.splitlines() if line.startswith("SNIPPET ")}
    executed = int(r.stdout.split("EXECUTED ")[1].split()[0])
    assert executed > 0, r.stdout  # XLA ran graphs
    return {name: (reports[name], said[name]) for name in ORIGINALS}


def _ran(ported, name):
    report, result = ported[name]
    assert "error" not in result, f"{name} after the port:\n{result['error']}"
    return report, result


def test_1_a_cuda_check_that_picks_the_device_becomes_the_accelerator_check_and_trains_on_xla(ported):
    for name in ("guard_string", "guard_kaggle", "use_cuda_flag"):
        report, result = _ran(ported, name)
        assert {v for k, v in result.items() if k in ("params", "batch")} == {"xla"}, (name, result)
        assert {"cuda_available", "cuda_flag"} & {c.rule for c in report.changes}, report.text()


def test_2_device_map_is_dropped_and_the_model_moved_keeping_ties_so_batches_follow_it_to_xla(ported):
    report, result = _ran(ported, "device_map")
    assert result["params"] == result["batch"] == "xla" and result["tied"], result
    assert "device_map" in {c.rule for c in report.changes} and report.status() == 0


def test_2_a_4bit_load_stops_the_port_naming_its_lines():
    _, report = port_source("from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
                            "bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')\n"
                            "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, device_map='auto')\n"
                            "model8 = AutoModelForCausalLM.from_pretrained(name, load_in_8bit=True)\n")  # fmt: skip
    assert [(i.rule, i.where) for i in report.left] == [("bitsandbytes", f"line {n}") for n in (2, 3)]
    assert [(c.rule, c.where) for c in report.changes if c.rule != "imports"] == [("int8_base", "line 4")]
    assert report.status() == 1 and "bfloat16" in report.text()


def test_3_a_device_chosen_at_import_does_not_start_the_runtime_and_lands_on_xla(ported):
    report, result = _ran(ported, "import_time")
    assert result == {"started_at_import": False, "batch": "xla"}, result
    assert "import_time_device" in {c.rule for c in report.changes}


def test_4_device_calls_answer_for_the_ported_device_and_memory_reads_stop_the_port(ported):
    report, result = _ran(ported, "device_calls")
    assert result == {"count": 1, "index": 0, "batch": "xla"}, result
    _, report = port_source("import torch\nx = 1\nprint(torch.accelerator.max_memory_allocated())\n"
                            "used = getattr(torch, device_type).memory_allocated()\n")
    assert [(i.rule, i.where) for i in report.left] == [("memory_stats", "line 3"), ("memory_stats", "line 4")]
    assert report.status() == 1


def test_5_the_ddp_branch_stops_the_port_by_line_and_the_single_process_path_runs_on_xla(ported):
    report, result = _ran(ported, "ddp_single_process")
    assert result == {"params": "xla"}, result
    lines = textwrap.dedent(ORIGINALS["ddp_single_process"]).splitlines()
    named = [int(i.where.split()[1]) for i in report.left if i.rule == "ddp_nccl"]
    assert [lines[n - 1].strip() for n in named] == ['init_process_group(backend="nccl")', 'device = f"cuda:{ddp_local_rank}"',
                                                     "model = DDP(model, device_ids=[ddp_local_rank])"]  # fmt: skip
    assert report.status() == 1 and "launch(train)" in report.text()


def test_6_every_chained_move_keeps_the_tie_on_xla(ported):
    _, result = _ran(ported, "chained_moves")
    assert result == {"a": ["xla", True], "b": ["xla", True], "c": ["xla", True]}, result


def test_7_a_generator_on_the_device_becomes_a_cpu_one_and_runs(ported):
    report, result = _ran(ported, "generator")
    assert result == {"batch": "xla"} and "generator_device" in {c.rule for c in report.changes}


def test_8_hogwild_stops_the_port_with_the_data_parallel_alternative():
    _, report = port_source("import torch.multiprocessing as mp\nmodel = Net()\nmodel.share_memory()\n"
                            "for rank in range(4):\n    p = mp.Process(target=train, args=(rank, model))\n")
    assert [(i.rule, i.where) for i in report.left] == [("hogwild", "line 3")] and report.status() == 1
    assert "launch(train)" in report.text()


def test_9_python_bookkeeping_on_device_metrics_is_named():
    _, report = port_source("best_acc1 = 0\nfor epoch in range(3):\n    acc1 = validate(val_loader, model)\n"
                            "    is_best = acc1 > best_acc1\n    best_acc1 = max(acc1, best_acc1)\n    if is_best:\n"
                            "        save_checkpoint(model)\n")  # fmt: skip
    assert [(i.rule, i.where) for i in report.left] == [("device_bookkeeping", "line 5"), ("device_bookkeeping", "line 6")]
    assert report.status() == 0  # it costs compiles, it does not stop the program


def test_10_pandas_filters_arrays_and_lists_are_no_tensors():
    source = ('import pandas as pd\nimport numpy as np\ndf = pd.read_csv("train.csv")\nfor fold in range(5):\n'
              '    train = df[df["fold"] != fold]\n    valid = df[df.fold == fold]\n    idx = np.arange(10)\n'
              "    for x, y in loader:\n        seen = []\n        print(seen, idx[idx > 2].tolist())\n")
    new, report = port_source(source)
    assert new == source and not report.left, report.text()


# ------------------------------------------------------------------ --check: the verdict is checked
TRAINS = """\
import sys
import torch
from torch import nn
device = "cpu"
if torch.cuda.is_available():
    device = "cuda"
model = nn.Linear(4, 2)
model.to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(int(sys.argv[1])):
    loss = model(torch.randn(8, 4).to(device)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("source, status, said", [
    (TRAINS, 0, "passed: stopped after 2 optimizer step(s) with the parameters on XLA"),
    # a device the port cannot see as CUDA's: it exits 0, and the check finds the CPU
    (TRAINS.replace('device = "cpu"\nif torch.cuda.is_available():\n    device = "cuda"\n', 'device = "cpu"\n'), 4,
     "failed: the optimizer's parameters are on cpu: it trains on the host CPU"),
])  # fmt: skip
def test_check_runs_the_first_steps_on_xla_and_fails_a_program_that_trains_on_the_cpu(tmp_path, capsys, source, status, said):
    from tpu_utility.diagnostics.port import main

    script = tmp_path / "train.py"
    script.write_text(source)
    assert main([str(script), "--check", "--check-steps", "2", "--", "100"]) == status
    assert said in capsys.readouterr().out
