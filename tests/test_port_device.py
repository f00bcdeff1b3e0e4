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
    # ------------------------------------------ issue 61: public programs' idioms, each smallest (the program named)
    "gan_generator": """\
        import torch
        from torch import nn
        device = torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
        class Generator(nn.Module):  # pytorch/examples dcgan: netG = Generator(ngpu).to(device)
            def __init__(self, ngpu):
                super().__init__()
                self.ngpu = ngpu
                self.main = nn.Linear(4, 8)
            def forward(self, x):
                return self.main(x)
        netG = Generator(1).to(device)
        fake = netG(torch.randn(2, 4, device=device))
        RESULT = {"params": netG.main.weight.device.type, "batch": fake.device.type, "ngpu": netG.ngpu}
        """,
    "sparse": """\
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        adj = torch.eye(4).to_sparse().to(device)  # pytorch/examples gcn
        x = torch.arange(8.0).view(4, 2).to(device)
        y = torch.sparse.mm(adj, x)
        RESULT = {"batch": y.device.type, "equal": bool((y.cpu() == x.cpu()).all())}
        """,
    "module_optimizer": """\
        import torch
        from torch import nn
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        class Layer(nn.Linear):  # pytorch/examples mnist_forward_forward
            def __init__(self, a, b):
                super().__init__(a, b)
                self.opt = torch.optim.Adam(self.parameters(), lr=0.03)
            def train_step(self, x):
                loss = self(x).pow(2).mean()
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList([Layer(4, 4), Layer(4, 4)])
        net = Net().to(device)
        before = net.layers[0].weight.detach().cpu().clone()
        for layer in net.layers:
            layer.train_step(torch.ones(2, 4).to(device))
        RESULT = {"params": net.layers[0].weight.device.type,
                  "learned": not torch.equal(before, net.layers[0].weight.detach().cpu())}
        """,
    "accel_opt_in": """\
        import torch
        class opt:  # pytorch/examples dcgan today: parser.add_argument('--accel', action='store_true'), not given
            accel = False
        if opt.accel and torch.accelerator.is_available():
            device = torch.accelerator.current_accelerator()
        else:
            device = torch.device("cpu")
        RESULT = {"batch": torch.ones(2).to(device).device.type}
        """,
    "cuda_seed": """\
        import torch
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        def set_seed(seed):
            torch.cuda.manual_seed_all(seed)
        set_seed(0)
        a = torch.rand(3)
        set_seed(0)
        RESULT = {"seeded": torch.equal(a, torch.rand(3))}
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
        assert {"cuda_available", "cuda_flag", "flag_opt_out"} & {c.rule for c in report.changes}, report.text()


def test_2_device_map_is_dropped_and_the_model_moved_keeping_ties_so_batches_follow_it_to_xla(ported):
    report, result = _ran(ported, "device_map")
    assert result["params"] == result["batch"] == "xla" and result["tied"], result
    assert "device_map" in {c.rule for c in report.changes} and report.status() == 0


def test_2_a_4bit_load_becomes_the_int8_base_on_the_device_and_the_report_says_4bit_is_mapped():
    new, report = port_source("from transformers import AutoModelForCausalLM, BitsAndBytesConfig\n"
                              "bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')\n"
                              "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, device_map='auto')\n"
                              "model8 = AutoModelForCausalLM.from_pretrained(name, load_in_8bit=True)\n")  # fmt: skip
    assert "model = move_model(quantize_base(AutoModelForCausalLM.from_pretrained(name)), get_device())" in new
    assert [(c.rule, c.where) for c in report.changes if c.rule != "imports"] == [("int8_base", f"line {n}") for n in (2, 3, 4)]
    assert "4-bit asked: mapped to the int8 base" in report.changes[0].after + report.changes[1].after
    assert not report.left and report.status() == 0


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


# ---------------------------------------------- issue 61: the idioms five more public programs hit, ported and run
def test_11_a_programs_own_generator_class_keeps_its_arguments_and_trains_on_xla(ported):
    report, result = _ran(ported, "gan_generator")
    assert result == {"params": "xla", "batch": "xla", "ngpu": 1}, result
    assert "generator_device" not in {c.rule for c in report.changes}


def test_12_a_sparse_adjacency_moves_dense_and_multiplies_on_xla(ported):
    report, result = _ran(ported, "sparse")
    assert result == {"batch": "xla", "equal": True} and "sparse_device" in {c.rule for c in report.changes}


def test_13_an_optimizer_built_in_init_is_built_on_the_device_and_the_layers_learn_on_xla(ported):
    report, result = _ran(ported, "module_optimizer")
    assert result == {"params": "xla", "learned": True}, result
    assert "optimizer_in_init" in {c.rule for c in report.changes} and report.status() == 0


def test_14_an_opt_in_accelerator_flag_is_the_default_after_the_port(ported):
    report, result = _ran(ported, "accel_opt_in")
    assert result == {"batch": "xla"} and "cuda_flag" in {c.rule for c in report.changes}, (result, report.text())


def test_15_a_cuda_only_seed_becomes_torchs_and_seeds_without_stopping_the_port(ported):
    report, result = _ran(ported, "cuda_seed")
    assert result == {"seeded": True} and report.status() == 0 and "cuda_seed" in {c.rule for c in report.changes}


CPU_FIRST = """\
import torch
from torch import nn
model = nn.Linear(4, 2)  # a CPU baseline trained first (course notebooks)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
opt.step()
device = "cuda" if torch.cuda.is_available() else "cpu"
model2 = nn.Linear(4, 2).to(device)
model2(torch.ones(2, 4).to(device)).sum().backward()
print("RESULT", model2.weight.grad.device.type)
"""


def test_16_a_cpu_baseline_trained_before_the_device_line_then_trains_on_xla():
    # its own interpreter: the runtime must not have started before the CPU backward (pytorch/xla#4174)
    new, report = port_source(CPU_FIRST)
    assert "cpu_step_first" in {c.rule for c in report.changes} and report.status() == 0, report.text()
    r = run_python(new, env={"PJRT_DEVICE": "CPU"})
    assert r.returncode == 0 and "RESULT xla" in r.stdout, r.stderr[-3000:]


# ------------------------------------------------ programs, not files: an entry and the modules of its folder
# karpathy/minGPT's shape, written here from its public idiom (condensed, not copied): chargpt.py has no device
# code; mingpt/trainer.py picks 'cuda' if torch.cuda.is_available() else 'cpu', moves the model and steps.
MINGPT = {
    'chargpt.py': '"""A character-level GPT trainer in the shape of karpathy/minGPT projects/chargpt/chargpt.py (no device code here)."""\nimport sys\n\nimport torch\nfrom torch.utils.data import Dataset\n\nfrom mingpt.model import GPT\nfrom mingpt.trainer import Trainer\nfrom mingpt.utils import set_seed\n\n\nclass CharDataset(Dataset):\n    def __init__(self, data, block_size):\n        chars = sorted(set(data))\n        self.stoi = {ch: i for i, ch in enumerate(chars)}\n        self.vocab_size, self.block_size, self.data = len(chars), block_size, data\n\n    def __len__(self):\n        return len(self.data) - self.block_size\n\n    def __getitem__(self, idx):\n        dix = [self.stoi[s] for s in self.data[idx:idx + self.block_size + 1]]\n        return torch.tensor(dix[:-1], dtype=torch.long), torch.tensor(dix[1:], dtype=torch.long)\n\n\nif __name__ == "__main__":\n    set_seed(3407)\n    text = "hello tpu world, " * 40\n    train_dataset = CharDataset(text, block_size=8)\n    model = GPT(vocab_size=train_dataset.vocab_size, n_embd=16)\n    config = Trainer.get_default_config()\n    config.max_iters = int(sys.argv[1]) if len(sys.argv) > 1 else 4\n    trainer = Trainer(config, model, train_dataset)\n\n    def batch_end_callback(trainer):\n        print(f"iter {trainer.iter_num}: train loss {trainer.loss.item():.5f}")\n\n    trainer.set_callback("on_batch_end", batch_end_callback)\n    trainer.run()\n    print("RESULT", next(model.parameters()).device.type)\n',
    'mingpt/__init__.py': '',
    'mingpt/utils.py': 'import random\n\nimport numpy as np\nimport torch\n\n\ndef set_seed(seed):\n    random.seed(seed)\n    np.random.seed(seed)\n    torch.manual_seed(seed)\n    torch.cuda.manual_seed_all(seed)\n',
    'mingpt/model.py': 'import torch\nfrom torch import nn\nfrom torch.nn import functional as F\n\n\nclass GPT(nn.Module):\n    def __init__(self, vocab_size, n_embd):\n        super().__init__()\n        self.wte = nn.Embedding(vocab_size, n_embd)\n        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)\n\n    def configure_optimizers(self, train_config):\n        return torch.optim.AdamW(self.parameters(), lr=train_config.learning_rate, betas=train_config.betas)\n\n    def forward(self, idx, targets=None):\n        logits = self.lm_head(self.wte(idx))\n        loss = None\n        if targets is not None:\n            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)\n        return logits, loss\n',
    'mingpt/trainer.py': '"""Simple training loop, in the shape of karpathy/minGPT mingpt/trainer.py."""\nimport time\nfrom collections import defaultdict\n\nimport torch\nfrom torch.utils.data.dataloader import DataLoader\n\n\nclass CfgNode:\n    pass\n\n\nclass Trainer:\n\n    @staticmethod\n    def get_default_config():\n        C = CfgNode()\n        C.device = \'auto\'\n        C.num_workers = 0\n        C.max_iters = None\n        C.batch_size = 8\n        C.learning_rate = 3e-4\n        C.betas = (0.9, 0.95)\n        C.grad_norm_clip = 1.0\n        return C\n\n    def __init__(self, config, model, train_dataset):\n        self.config = config\n        self.model = model\n        self.optimizer = None\n        self.train_dataset = train_dataset\n        self.callbacks = defaultdict(list)\n        if config.device == \'auto\':\n            self.device = \'cuda\' if torch.cuda.is_available() else \'cpu\'\n        else:\n            self.device = config.device\n        self.model = self.model.to(self.device)\n        print("running on device", self.device)\n        self.iter_num = 0\n\n    def set_callback(self, onevent, callback):\n        self.callbacks[onevent] = [callback]\n\n    def trigger_callbacks(self, onevent):\n        for callback in self.callbacks.get(onevent, []):\n            callback(self)\n\n    def run(self):\n        model, config = self.model, self.config\n        self.optimizer = model.configure_optimizers(config)\n        train_loader = DataLoader(self.train_dataset, shuffle=False, pin_memory=True, batch_size=config.batch_size,\n                                  num_workers=config.num_workers, drop_last=True)\n        model.train()\n        self.iter_time = time.time()\n        data_iter = iter(train_loader)\n        while True:\n            try:\n                batch = next(data_iter)\n            except StopIteration:\n                data_iter = iter(train_loader)\n                batch = next(data_iter)\n            batch = [t.to(self.device) for t in batch]\n            x, y = batch\n            logits, self.loss = model(x, y)\n            model.zero_grad(set_to_none=True)\n            self.loss.backward()\n            torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_norm_clip)\n            self.optimizer.step()\n            self.trigger_callbacks(\'on_batch_end\')\n            self.iter_num += 1\n            if config.max_iters is not None and self.iter_num >= config.max_iters:\n                break\n',
}


def _write(folder, files):
    for rel, text in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)


def test_17_an_entry_whose_device_is_chosen_in_an_imported_module_is_ported_as_a_program_and_trains_on_xla(tmp_path, capsys):
    from tpu_utility.diagnostics.port import main

    _write(tmp_path / "chargpt", MINGPT)
    entry = tmp_path / "chargpt" / "chargpt.py"
    assert main([str(entry), "--check", "--check-steps", "2", "--", "10"]) == 0
    out = capsys.readouterr().out
    assert "mingpt/trainer.py, line 34: 'cuda' if torch.cuda.is_available() else 'cpu' -> get_device().type" in out, out
    assert "mingpt/trainer.py, line 68: self.optimizer.step() -> step_optimizer(self.optimizer)" in out
    assert "check (2 step(s) on XLA:CPU): passed: stopped after 2 optimizer step(s) with the parameters on XLA" in out
    ported = tmp_path / "chargpt_tpu"
    assert sorted(p.relative_to(ported).as_posix() for p in ported.rglob("*.py")) == sorted(MINGPT)
    assert (ported / "chargpt.py").read_text() == MINGPT["chargpt.py"]  # nothing to change in the entry
    assert (tmp_path / "chargpt" / "mingpt" / "trainer.py").read_text() == MINGPT["mingpt/trainer.py"]  # never changed


def test_18_a_folder_ports_every_module_into_one_report_and_has_nothing_to_run(tmp_path, capsys):
    from tpu_utility.diagnostics.port import main

    _write(tmp_path / "mingpt", {k[len("mingpt/"):]: v for k, v in MINGPT.items() if k.startswith("mingpt/")})
    assert main([str(tmp_path / "mingpt"), "--check"]) == 0
    out = capsys.readouterr().out
    assert "trainer.py, line 34:" in out and "expected to run unchanged on XLA: nothing to run: a folder" in out, out
    assert "get_device().type" in (tmp_path / "mingpt_tpu" / "trainer.py").read_text()
    assert main([str(tmp_path / "mingpt"), "-o", str(tmp_path / "mingpt" / "inside")]) == 2  # never inside its input


# ------------------------------------------------ the word is a run: "yes" only after the first steps ran on XLA:CPU
SPAWN_NOTEBOOK = [
    "!pip install -q tpu_utility\n%matplotlib inline",
    "import torch\nfrom torch import nn\nimport torch_xla.core.xla_model as xm\n"
    "import torch_xla.distributed.xla_multiprocessing as xmp",
    "def _mp_fn(index, flags):\n    device = xm.xla_device()\n    model = nn.Linear(4, 2).to(device)\n"
    "    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n    for step in range(flags['steps']):\n"
    "        loss = model(torch.randn(8, 4).to(device)).pow(2).mean()\n        optimizer.zero_grad()\n"
    "        loss.backward()\n        xm.optimizer_step(optimizer)\n        xm.mark_step()",
    "xmp.spawn(_mp_fn, args=({'steps': 100},), nprocs=8, start_method='fork')",
]


def test_19_a_notebook_that_launches_with_xmp_spawn_is_run_by_default_cells_in_order_and_said_yes(tmp_path, capsys):
    nbformat = pytest.importorskip("nbformat")
    from tpu_utility.diagnostics.port import main

    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in SPAWN_NOTEBOOK])
    nbformat.write(notebook, tmp_path / "kernel.ipynb")
    assert main([str(tmp_path / "kernel.ipynb"), "--check-steps", "2"]) == 0  # the check is the default
    out = capsys.readouterr().out
    assert "expected to run unchanged on XLA: yes: its first 2 optimizer step(s) ran on XLA:CPU" in out, out
    assert "passed: stopped after 2 optimizer step(s) with the parameters on XLA" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel.ipynb", "kernel_tpu.ipynb"]  # its script removed


def test_20_a_program_that_needs_data_this_host_lacks_is_not_run_never_yes_and_a_library_module_has_nothing_to_run(
        tmp_path, capsys):
    from tpu_utility.diagnostics.port import main

    script = tmp_path / "train.py"
    script.write_text(TRAINS.replace("model = nn.Linear", "open('/no/such/dataset.csv')\nmodel = nn.Linear"))
    assert main([str(script), "--", "100"]) == 0
    out = capsys.readouterr().out
    assert "expected to run unchanged on XLA: not run: it needs what this host lacks before its first step: " \
           "FileNotFoundError" in out and ": yes" not in out, out
    library = tmp_path / "model.py"
    library.write_text("import torch\ndevice = torch.device('cuda')\nclass Net(torch.nn.Module):\n    pass\n")
    assert main([str(library)]) == 0
    assert "expected to run unchanged on XLA: nothing to run: a module without an entry point" in capsys.readouterr().out
