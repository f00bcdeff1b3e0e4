"""The code blocks of the README and of the documentation (docs/*.md), run as a new user would: one after
another in one fresh interpreter, as cells of one notebook (each block in its own namespace and folder,
with the names a notebook would already hold: a prelude), the "after" side of each diff, and on 4
XLA:CPU devices where a block uses all cores. A block that starts processes has an interpreter of its
own. A block that stops working is a broken promise.

The blocks train on 256 of the digits' 1,437 training samples (the prelude's train_ds): a case checks that
a block runs as written, and a block's time here is its steps. How well a block trains is checked where a
bar needs all the data: the "Train with one call" block on 4 devices, with its outputs and accuracy
checked, is in test_user_input.py, and the notebook's run in test_notebook.py.
"""

import glob
import json
import os
import re

import pytest
from filelock import FileLock

from conftest import ROOT, run_python

PRELUDE = """
import warnings; warnings.simplefilter("ignore")
import os, torch, numpy as np
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from tpu_utility import *
from tpu_utility.demo import digits_datasets, small_cnn, marker_sequences, pad_to_longest, MarkerClassifier
os.chdir({tmp!r})
train_ds, valid_ds = digits_datasets()
train_ds = TensorDataset(*train_ds[:256])  # 256 of the 1,437 training digits: 4 batches of 64 an epoch (see the top)
test_ds = TensorDataset(valid_ds.tensors[0]); test_ids = torch.arange(len(test_ds))
Net = small_cnn; model = small_cnn(); loss_fn = nn.CrossEntropyLoss(); epochs = 2; lr = 0.05
"""


DOCUMENTS = [f"{ROOT}/README.md", *sorted(glob.glob(f"{ROOT}/docs/*.md"))]


def _blocks() -> list[str]:
    """Every python block, and the lines a diff block keeps or adds, in README then docs order."""
    blocks = []
    for path in DOCUMENTS:
        with open(path) as f:
            blocks += re.findall(r"```(python|diff)\n(.*?)```", f.read(), re.S)
    return [code if kind == "python" else "\n".join(line[1:] for line in code.splitlines() if line[:1] in " +")
            for kind, code in blocks]  # fmt: skip


USED: set[str] = set()  # the blocks some case runs


def block(marker: str) -> str:
    """The one block holding marker (a block shown on two pages, as written, counts once)."""
    (found,) = {code for code in _blocks() if marker in code}
    USED.add(found)
    return found


PORTED_IDIOMS = """
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
name, local_rank = "tiny-llama", 0  # a model folder on disk (no download), as a Kaggle dataset holds one
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(name)
"""
FAKE_WANDB = """
import sys, types
logged = []  # a stand-in for wandb (not installed): records what the block logs
class _Run:
    def log(self, figures, step):
        logged.append((step, figures))
    def finish(self):
        logged.append("finished")
import importlib.machinery
wandb = types.ModuleType("wandb")  # a module with a spec: libraries that probe for wandb (accelerate) find it
wandb.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
wandb.init = lambda **kwargs: _Run()
sys.modules["wandb"] = wandb
"""
ON_DEVICE = "device = get_device(); model = model.to(device)\n"
TEXT = "train_ds = marker_sequences(512); device = get_device(); model = MarkerClassifier().to(device); optimizer = torch.optim.AdamW(model.parameters())\n"
TEXT_STEP = """
    tokens, mask, target = tokens.to(device), mask.to(device), target.to(device)
    optimizer.zero_grad(); nn.functional.cross_entropy(model(tokens, mask), target).backward(); step_optimizer(optimizer)
"""
LLM = """
import pandas as pd
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=2))
class Characters:  # a stand-in tokenizer (no download): a character is a token
    def __call__(self, text):
        return {"input_ids": [3 + ord(c) % 60 for c in text]}
    def batch_decode(self, rows, skip_special_tokens=True):
        return ["".join(chr(97 + t % 26) for t in row if not (skip_special_tokens and t == 2)) for row in rows]
tokenizer = Characters()
texts = torch.randint(3, 64, (80, 16))
train_ds = [{"input_ids": t, "labels": t} for t in texts[:64]]; valid_ds = [{"input_ids": t, "labels": t} for t in texts[64:]]
test_df = pd.DataFrame({"id": range(5), "prompt": ["abc", "a longer prompt of words", "xy", "hello there", "q"]})
"""
IMAGES = """
from PIL import Image
import torchvision.transforms as T
from torchvision.transforms import v2
from torchvision.datasets import ImageFolder
g = np.random.default_rng(0)
for c in ("cat", "dog"):
    os.makedirs(f"photos/{c}", exist_ok=True)
    for i in range(160):
        Image.fromarray(g.integers(0, 255, (96, 90, 3), dtype=np.uint8)).save(f"photos/{c}/{i}.jpg")
MEAN, STD = [0.5] * 3, [0.25] * 3
net = nn.Sequential(nn.Conv2d(3, 4, 7, stride=8), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
"""
DOCTOR = ON_DEVICE + """optimizer = torch.optim.AdamW(model.parameters())
train_loader = DataLoader(train_ds, batch_size=64, drop_last=True); valid_loader = DataLoader(valid_ds, batch_size=64)
def train_step(batch):
    x, y = (t.to(device) for t in batch)
    optimizer.zero_grad(); loss = loss_fn(model(x), y); loss.backward(); step_optimizer(optimizer); return loss
def eval_step(batch):
    x, y = (t.to(device) for t in batch)
    return model(x)
"""


# The one-call block's find_lr sweeps 30 learning rates instead of its default 100 here, in test_user_input.py
# and test_packaging.py: each step is a device step (on 4 devices 100 cost 21 CPU-s, 30 cost 10), the sweep still
# ends where the loss diverges, and its suggested max_lr still trains the digits past the tests' bars (4 devices,
# all the data: 0.95 test accuracy after 100 steps, 0.96 after 30).
ONE_CALL_SWEEP = ("find_lr(model, train_ds)", "find_lr(model, train_ds, num_steps=30)")


def one_call_block() -> str:
    """The "Train with one call" block, as run here: its sweep shortened (ONE_CALL_SWEEP)."""
    code = block("find_lr(model, train_ds)")
    assert ONE_CALL_SWEEP[0] in code, "the one-call block no longer calls find_lr(model, train_ds): update ONE_CALL_SWEEP"
    return code.replace(*ONE_CALL_SWEEP)


def _cases():
    """(name, code, devices): the blocks with what each needs around it; '...' filled where it stands for a step."""
    masked = (ON_DEVICE + "valid_loader = DataLoader(valid_ds, batch_size=64)\n"
              "correct, seen = torch.zeros((), device=device), torch.zeros((), device=device)\n"
              + block("masked_loader(valid_loader)") + "\nassert int(seen.item()) == len(valid_ds), seen\n")  # fmt: skip
    spmd_masked = masked.replace("device = get_device()", "cores = use_all_cores(); device = get_device()").replace(
        "batch_size=64", "batch_size=64 * cores")
    spmd, _ = block("use_all_cores()").split("\n\nlaunch(train)")
    presize = (IMAGES + block("presize_images(").replace("/kaggle/input/photos", "photos")
               .replace("/kaggle/working/", "work/").replace("epochs=8", "epochs=1")
               .replace("RandomResizedCrop(224)", "RandomResizedCrop(64)"))  # fmt: skip
    return [
        ("two-line port", block("device = get_device()                # XLA first"), 1),
        ("port", block("make_sampler(train_ds)"), 1),
        ("port", block("make_sampler(train_ds)"), 4),
        ("device_loader", ON_DEVICE + "loader = DataLoader(train_ds, batch_size=64, drop_last=True)\n"
         + block("for data, targets in device_loader(loader)").replace("    ...", "    model.zero_grad(); loss_fn(model(data), targets).backward()"), 1),
        ("autocast", ON_DEVICE + "optimizer = torch.optim.SGD(model.parameters(), lr=0.05)\n"
         "loader = DataLoader(train_ds, batch_size=64, drop_last=True)\n" + block("grad_scaler(device)"), 1),
        ("masked_loader", masked, 1),
        ("masked_loader", spmd_masked, 4),
        ("use_all_cores", spmd, 4),
        ("launch", "def train(index):\n    print('core', index, get_device())\n"
         "if __name__ == '__main__':\n    " + block("launch(train)").splitlines()[-1].split("#")[0].strip(), 1),
        ("checkpoint", ON_DEVICE + "optimizer = torch.optim.AdamW(model.parameters()); epoch = 3\n"
         + block("save_checkpoint(") + "\nassert state['epoch'] == 3\n", 1),
        ("compile_model", "given = model\n" + block("model = compile_model(model)   # was")
         + "\nassert model is given  # on XLA: the model itself, XLA compiles the step\n", 1),
        ("torch.accelerator", "import argparse; args = argparse.Namespace(no_accel=False)\n"
         + block("use_accel = device.type") + "\nassert device.type == 'xla' and use_accel\n", 1),
        ("BucketCollate", TEXT + block("num_buckets=4, batch_size=32)").rstrip() + TEXT_STEP, 1),
        ("BucketBatchSampler", TEXT + block("BucketBatchSampler(lengths") + "\nfor tokens, mask, target in loader:" + TEXT_STEP, 1),
        ("train with one call", one_call_block(), 1),
        # one device: 48 photos a class, one batch of 64 (4 devices need 160 a class: a global batch is 4 x 64)
        ("presize, cache, train", presize.replace("range(160)", "range(48)"), 1),
        ("presize, cache, train", presize, 4),
        ("doctor", DOCTOR + block("report = doctor("), 1),
        ("callbacks", FAKE_WANDB + block("class WandbLogger(Callback)")
         + "\nassert [s for s, _ in logged[:-1]] == [1, 2, 3, 4, 5] and logged[-1] == 'finished', logged\n", 1),
        ("callbacks", block("class StopAt(Callback)") + "\nassert history.records[-1].epoch >= 2 and"
         " os.listdir('runs/digits')\n", 1),
        ("static_masks", block("static_masks(model)   # was") + "\nassert model.config._attn_implementation != 'sdpa'\n", 1),
        ("bring a scheduler", block("class Scheduled(Callback)")
         + "\nassert hf_linear.scheduler.last_epoch == len(history.step_lrs) and os.path.isdir('ckpt-timm')\n", 1),
        ("fine-tune an LLM", LLM + block("peft.LoraConfig(r=8")
         + "\nassert os.path.exists('adapter/adapter_model.safetensors') and history.records[-1].valid_loss > 0"
         + "\nassert not any('lora_' in k for k in AutoModelForCausalLM.from_pretrained('merged').state_dict())\n", 1),
        ("pack your data", LLM + block("packed = PackedDataset(train_ds, length=1024)").replace("length=1024", "length=64")
         + "\nassert packed.fill == 1.0 and '100.0% real tokens' in history.summary and history.records[-1].tokens_per_s > 0"
         + "\nassert history.records[-1].host_syncs == 0 and 'tokens/s' in history.records[-1].line(2)\n", 1),
        ("memory_plan", block("from tpu_utility import memory_plan").replace(
            'AutoConfig.from_pretrained("google/gemma-7b")',  # google/gemma-7b's config.json, no download
            "AutoConfig.for_model('gemma', hidden_size=3072, intermediate_size=24576, num_hidden_layers=28, "
            "num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000)").replace(
            'device_memory="v5e")', 'device_memory="v5e", method="estimate")')  # a traced 7B step: 30 s here
         + "\nassert not plan.fits_replicated and plan.fits_sharded, plan\n", 1),
        ("device_bytes", block("class Held(Callback)")
         + "\none_cycle_fit(small_cnn(), train_ds, epochs=1, max_lr=1e-3, progress=False, callbacks=[Held()])\n", 1),
        ("strategy fsdp", LLM + block("strategy=FSDP(wrap=") + "\nassert 'fsdp on 4' in history.summary\n", 4),
        ("shard_model", LLM + block("model = shard_model(model)") + "\nassert loss.item() > 0\n", 4),
        ("generate a submission", LLM + block("the best valid_loss's epoch\nprompts =")
         + "\nsub = pd.read_csv('submission.csv'); assert list(sub['id']) == list(range(5)) and len(sub) == 5, sub\n", 4),
        ("the port's device idioms", PORTED_IDIOMS + block("device = device_type()              # \"xla\"")
         + "\nassert device == args.device == model.device.type == 'xla' and n_gpu == 1, (device, args.device, n_gpu)"
         + "\nassert model.get_input_embeddings().weight is model.get_output_embeddings().weight  # the tie kept"
         + "\nassert g.device.type == 'cpu'\n", 1),
        ("reload best.pt", "one_cycle_fit(small_cnn(), train_ds, epochs=1, max_lr=1e-3, checkpoint_dir='ckpt', progress=False)\n"
         + block('load_checkpoint("ckpt/best.pt"') + "\nassert preds.shape == (len(test_ds), 10)\n", 1),
    ]  # fmt: skip


def test_every_block_runs_in_some_case():
    """A block added to the README or a docs page without a case here would go untested."""
    _cases()
    unrun = [code for code in _blocks() if code not in USED]
    assert not unrun, "blocks no case runs:\n" + "\n---\n".join(unrun)


OWN_INTERPRETER = {"launch"}  # starts processes from __main__

# Runs every block of one device count in this interpreter, each from its own folder and namespace;
# after each block one line "BLOCK <index> OK", or "BLOCK <index> FAILED" followed by its traceback.
NOTEBOOK = """
import json, os, sys, traceback
prelude, cases = json.load(open(sys.argv[1]))
for index, (folder, code) in enumerate(cases):
    try:
        os.makedirs(folder)
        exec(compile(prelude.format(tmp=folder) + code, f"<block {index}>", "exec"), {"__name__": "__main__"})
        print(f"BLOCK {index} OK", flush=True)
    except BaseException:
        print(f"BLOCK {index} FAILED", flush=True)
        print(traceback.format_exc(), flush=True)
"""


def _ids() -> list[str]:
    """test ids: name-<devices>dev, with a number after it where one name and device count recur."""
    ids = [f"{n}-{d}dev" for n, _, d in _cases()]
    return [f"{i}{ids[:k].count(i)}" if ids.count(i) > 1 else i for k, i in enumerate(ids)]


def _run_shared(devices: int, folder) -> dict[int, tuple[bool, str]]:
    """{case index: (passed, what the block printed or raised)} for the blocks of this device count that share an interpreter."""
    chosen = [k for k, (name, _, d) in enumerate(_cases()) if d == devices and name not in OWN_INTERPRETER]
    (folder / "cases.json").write_text(json.dumps([PRELUDE, [(str(folder / f"block{k}"), _cases()[k][1]) for k in chosen]]))
    (folder / "notebook.py").write_text(NOTEBOOK)
    r = run_python(f"import sys, runpy; sys.argv = ['notebook.py', {str(folder / 'cases.json')!r}]; "
                   f"runpy.run_path({str(folder / 'notebook.py')!r}, run_name='__main__')",
                   env={"CPU_NUM_DEVICES": str(devices)}, timeout=900)  # fmt: skip
    said = re.split(r"^BLOCK (\d+) (OK|FAILED)$", r.stdout, flags=re.M)  # printed, index, verdict, printed, ...
    ends = {int(said[i]): (said[i + 1] == "OK", said[i - 1][-2000:] + said[i + 2][:3000]) for i in range(1, len(said), 3)}
    stopped = (False, f"the interpreter stopped before this block:\n{r.stderr[-3000:]}")
    return {k: ends.get(position, stopped) for position, k in enumerate(chosen)}


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """devices -> the results of _run_shared, run once per test run and device count, when a test first asks.

    Under pytest-xdist the workers share the run's temporary folder: the first to ask runs the blocks
    under a lock and leaves the results there, and the others read them.
    """
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # this run's, never an earlier run's

    def get(devices: int) -> dict[int, tuple[bool, str]]:
        folder = shared / f"readme-notebook{devices}"
        with FileLock(f"{folder}.lock"):
            if not (folder / "results.json").exists():
                folder.mkdir(exist_ok=True)
                (folder / "results.json").write_text(json.dumps(_run_shared(devices, folder)))
            return {int(k): tuple(v) for k, v in json.loads((folder / "results.json").read_text()).items()}

    return get


@pytest.mark.parametrize("index", [
    pytest.param(k, id=i, marks=[pytest.mark.multidevice] if d > 1 else []) for k, ((n, c, d), i) in enumerate(zip(_cases(), _ids()))])
def test_readme_block_runs_as_written(index, shared_runs, tmp_path):
    name, code, devices = _cases()[index]
    if name in OWN_INTERPRETER:
        r = run_python(PRELUDE.format(tmp=str(tmp_path)) + code + "\nprint('BLOCK OK')\n",
                       env={"CPU_NUM_DEVICES": str(devices)}, timeout=600)  # fmt: skip
        assert r.returncode == 0 and "BLOCK OK" in r.stdout, f"README block {name!r} failed:\n{r.stderr[-3000:]}"
    else:
        passed, said = shared_runs(devices)[index]
        assert passed, f"README block {name!r} on {devices} device(s) failed:\n{said}"
