"""Each fixer of the porting tool on its own: the smallest program it rewrites or reports, and one it leaves alone.

Every module of ``tpu_utility/diagnostics/fixers/`` (but the shared ``tree``) has a test here
named ``test_<module>_...``; tests/test_layout.py checks that none is missing.
"""

import pytest

pytest.importorskip("libcst")

from tpu_utility.diagnostics.port import port_source  # noqa: E402


def _port(source):
    new, report = port_source(source)
    return new, {c.rule for c in report.changes} - {"imports"}, {item.rule for item in report.left}


def _unchanged(source):
    new, changed, left = _port(source)
    assert new == source and not changed and not left, (new, changed, left)


def test_amp_autocast_scaler_and_their_import_become_the_kits():
    new, changed, _ = _port("from torch.cuda.amp import autocast, GradScaler\nscaler = GradScaler()\n"
                            "with autocast(dtype=torch.float16):\n    pass\n")
    assert "GradScaler" not in new and "grad_scaler()" in new and "autocast(dtype=torch.float16)" in new
    assert "from tpu_utility import autocast, grad_scaler" in new and changed == {"cuda_amp"}
    _unchanged("from torch import nn\n")


def test_colab_lines_are_named_not_changed():
    source = "import os\nfrom google.colab import drive\nassert os.environ['COLAB_TPU_ADDR']\n"
    new, changed, left = _port(source)
    assert new == source and left == {"colab_only", "colab_tpu_addr"}


def test_cpu_fallback_ops_are_named_with_a_replacement():
    _, _, left = _port("import torch\ncounts = torch.bincount(x)\n")
    assert left == {"cpu_fallback"}
    _unchanged("import torch\ny = torch.relu(x)\n")


def test_cuda_call_unguarded_is_named_and_a_guarded_one_is_not():
    assert _port("import torch\ntorch.cuda.synchronize()\n")[2] == {"cuda_call"}
    _unchanged("import torch\nif torch.cuda.is_available():\n    torch.cuda.synchronize()\n")


def test_cuda_device_torch_device_and_device_keyword():
    new, changed, _ = _port('import torch\ndevice = torch.device("cuda")\nx = torch.zeros(2, device="cuda")\n')
    assert "device = get_device()" in new and "torch.zeros(2, device=device)" in new and changed == {"cuda_device"}
    new, _, _ = _port('import torch\nd = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")\n')
    assert "d = get_device()" in new
    _unchanged('import torch\ndevice = torch.device("cpu")\n')


def test_cuda_flag_test_becomes_the_device_test():
    new, changed, _ = _port("if args.cuda:\n    model.cuda()\n")
    assert 'if get_device().type != "cpu":' in new and "cuda_flag" in changed
    _unchanged("if not args.cuda:\n    print('cpu')\n")
    # pytorch/examples' 2025 spelling (mnist_rnn, gcn): --accel, off by default, picks torch.accelerator's device
    new, changed, _ = _port("if args.accel:\n    device = torch.accelerator.current_accelerator()\nelse:\n"
                            "    device = torch.device('cpu')\n")
    assert 'if get_device().type != "cpu":' in new and "cuda_flag" in changed, new
    new, changed, _ = _port("if use_accel:\n    device = torch.accelerator.current_accelerator()\n")
    assert 'if get_device().type != "cpu":' in new, new
    _unchanged("if args.accel_steps:\n    print('no device here')\n")


def test_cuda_guard_around_amp_is_named():
    assert _port('if device.type == "cuda":\n    use_amp = "amp"\n')[2] == {"cuda_guard"}
    _unchanged('if device.type == "cuda":\n    n = 2\n')


def test_cuda_move_cuda_call_and_to_cuda_go_to_the_device():
    new, changed, _ = _port('x = x.cuda(non_blocking=True)\ny = y.to("cuda")\n')
    assert "x.to(get_device(), non_blocking=True)" in new and "y.to(get_device())" in new
    assert changed == {"cuda_move", "cuda_device"}
    _unchanged("x = x.to(torch.float16)\n")


def test_device_strings_stay_strings():
    new, changed, _ = _port("device = 'cuda'\n")
    assert "device = get_device().type" in new and changed == {"cuda_device"}
    _unchanged("device = 'cpu'\n")


def test_dynamic_shape_mask_index_is_named():
    assert _port("y = x[x > 0]\n")[2] == {"dynamic_shape"}
    _unchanged("y = x[0]\n")


def test_env_setup_lines_of_a_notebook_are_named():
    from tpu_utility.diagnostics.fixers.env_setup import fix_magic

    assert fix_magic("!python pytorch-xla-env-setup.py --version 1.7") == "env_setup"
    assert fix_magic("!pip install timm") is None


def test_host_sync_per_step_read_is_named_and_a_per_epoch_one_is_not():
    source = "for epoch in range(3):\n    for x, y in loader:\n        loss = step(x)\n        print(loss.item())\n    print(total.item())\n"
    _, _, left = _port(source)
    assert left == {"host_sync"}
    new, report = port_source(source)
    assert [item.where for item in report.left] == ["line 4"]


def test_inference_mode_becomes_the_kits():
    new, changed, _ = _port("import torch\nwith torch.inference_mode():\n    pass\n")
    assert "with inference_mode():" in new and changed == {"inference_mode"}
    _unchanged("import torch\nwith torch.no_grad():\n    pass\n")


def test_launch_moves_runtime_code_before_the_spawn_into_the_launched_function():
    source = ("import torch_xla.core.xla_model as xm\nimport torch_xla.distributed.xla_multiprocessing as xmp\n"
              "n = xm.get_local_ordinal()\ndef _mp_fn(rank):\n    print(n)\nxmp.spawn(_mp_fn, args=())\n")
    new, changed, _ = _port(source)
    assert "global n  # tpu_utility.port" in new and new.index("n = xm.get_local_ordinal()") > new.index("def _mp_fn")
    assert changed == {"runtime_before_spawn"}
    _unchanged("import torch_xla.core.xla_model as xm\nn = xm.get_local_ordinal()\n")


def test_move_model_keeps_ties():
    new, changed, _ = _port("model.train()\nmodel.to(device)\n")
    assert "move_model(model, device)" in new and changed == {"tied_weights"}
    new, _, _ = _port("model.eval()\nmodel.train().to(device)\nmodel.to(device).train()\n")
    assert "move_model(model.train(), device)" in new and "move_model(model, device).train()" in new
    _unchanged("batch.to(device)\n")


def test_optimizer_order_moves_the_model_before_the_optimizer():
    new, changed, _ = _port("opt = AdamW(model.parameters())\nmodel.to(device)\n")
    assert new.index("move_model(model, get_device())") < new.index("opt = AdamW") and "optimizer_params" in changed
    _unchanged("x = 1\n")


def test_optimizer_step_becomes_step_optimizer_and_a_scheduler_stays():
    new, changed, _ = _port("optimizer.step()\nscheduler.step()\n")
    assert "step_optimizer(optimizer)" in new and "scheduler.step()" in new and changed == {"optimizer_step"}


def test_samplers_make_sampler_its_loader_and_set_epoch():
    source = ("from torch.utils.data.distributed import DistributedSampler\nsampler = DistributedSampler(ds)\n"
              "loader = DataLoader(ds, sampler=sampler)\nsampler.set_epoch(0)\n")
    new, changed, _ = _port(source)
    assert "sampler = make_sampler(ds)" in new and "shuffle=sampler is None" in new
    assert "if sampler is not None:" in new and changed == {"distributed_sampler"}
    _unchanged("loader = DataLoader(ds, shuffle=True)\n")


def test_spawn_nprocs_goes():
    new, changed, _ = _port("import torch_xla.distributed.xla_multiprocessing as xmp\nxmp.spawn(fn, args=(), nprocs=8)\n")
    assert "xmp.spawn(fn, args=())" in new and changed == {"spawn_nprocs"}
    _unchanged("import torch_xla.distributed.xla_multiprocessing as xmp\nxmp.spawn(fn, args=())\n")


def test_torch_compile_becomes_compile_model():
    new, changed, _ = _port("import torch\nmodel = torch.compile(model, mode='reduce-overhead')\n")
    assert "model = compile_model(model, mode='reduce-overhead')" in new and "torch.compile" not in new, new
    assert changed == {"torch_compile"}


def test_transformers_api_adamw_and_save_pretrained():
    new, changed, _ = _port("from transformers import AdamW\nmodel.train()\nopt = AdamW(model.parameters())\n"
                            "model.save_pretrained('out')\n")
    assert "from torch.optim import AdamW" in new and "weight_decay=0.0" in new and "state_dict={k: v.cpu()" in new
    assert changed == {"transformers_adamw", "save_pretrained"}


def test_xla_renames_come_from_the_table():
    from tpu_utility.diagnostics.fixers.xla_renames import renames

    assert renames()["xm.get_ordinal"] == ("get_ordinal", "xr.global_ordinal", "xr")
    new, changed, _ = _port("import torch_xla.core.xla_model as xm\nd = xm.xla_device()\nxm.mark_step()\n")
    assert "torch_xla.device()" in new and "torch_xla.sync()" in new and "import torch_xla  # tpu_utility.port" in new
    assert changed == {"xla_device", "mark_step"}
    _unchanged("import torch_xla.core.xla_model as xm\nxm.master_print('hi')\n")


def test_xla_use_bf16_is_named():
    assert _port('import os\nos.environ["XLA_USE_BF16"] = "1"\n')[2] == {"xla_use_bf16"}
    _unchanged('import os\nos.environ["PJRT_DEVICE"] = "TPU"\n')


def test_quantized_base_8bit_and_4bit_loads_become_the_int8_base_saying_so_and_a_config_used_elsewhere_is_named():
    new, changed, left = _port("model = AutoModelForCausalLM.from_pretrained(name, load_in_8bit=True)\n")
    assert "model = quantize_base(AutoModelForCausalLM.from_pretrained(name))" in new and changed == {"int8_base"}
    assert "from tpu_utility import" in new and "quantize_base" in new.split("\n", 1)[0] + new and not left
    new, report = port_source("bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')\n"
                              "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, dtype=d)\n")
    assert "model = quantize_base(AutoModelForCausalLM.from_pretrained(name, dtype=d))" in new and not report.left
    said = {c.where: c.after for c in report.changes if c.rule == "int8_base"}
    assert "4-bit asked: mapped to the int8 base" in said["line 1"] and "bnb_4bit_quant_type='nf4'" in said["line 1"]
    new, report = port_source("m = AutoModelForCausalLM.from_pretrained(n, quantization_config=BitsAndBytesConfig("
                              "load_in_4bit=True, bnb_4bit_use_double_quant=True))\n")  # fmt: skip
    assert "m = quantize_base(AutoModelForCausalLM.from_pretrained(n))" in new and not report.left
    assert any("mapped to the int8 base" in c.after and "bnb_4bit_use_double_quant=True" in c.after for c in report.changes)
    # a config given to something else as well: the load and the config are named with the line to write
    new, report = port_source("bnb = BitsAndBytesConfig(load_in_8bit=True)\n"
                              "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, dtype=d)\n"
                              "trainer = SFTTrainer(model_init_kwargs={'quantization_config': bnb})\n")
    assert [(i.rule, i.where) for i in report.left] == [("bitsandbytes", "line 1"), ("bitsandbytes", "line 2")]
    assert "quantize_base(AutoModelForCausalLM.from_pretrained(name, dtype=d))" in report.left[1].fix
    _unchanged("model = AutoModelForCausalLM.from_pretrained(name, load_in_8bit=False)\n")


def test_gradient_checkpointing_enable_becomes_device_checkpointing_its_arguments_kept():
    new, changed, left = _port("model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': True})\n")
    assert "device_checkpointing(model, gradient_checkpointing_kwargs={'use_reentrant': True})" in new
    assert changed == {"gradient_checkpointing"} and not left


# ---------------------------------------------------------------- the imports (port/imports.py: LibCST's AddImportsVisitor)
def test_imports_go_after_the_environment_lines_that_come_before_torch_xla():
    # a kernel sets XLA's environment between its first import and torch_xla's: nothing torch_xla moves above it
    new, _, _ = _port('import os\nos.environ["XLA_FLAGS"] = "--xla_dump_to=/tmp"\nimport torch_xla.core.xla_model as xm\n'
                      "import torch\n\nd = xm.xla_device()\nr = xm.get_ordinal()\n")
    lines = new.splitlines()
    added = [lines.index("import torch_xla  # tpu_utility.port"), lines.index("import torch_xla.runtime as xr  # tpu_utility.port")]
    assert min(added) > lines.index('os.environ["XLA_FLAGS"] = "--xla_dump_to=/tmp"'), new
    assert "d = torch_xla.device()" in lines and "r = xr.global_ordinal()" in lines


def test_imports_merge_into_the_programs_own_kit_line_and_a_star_import_needs_none():
    new, report = port_source('import torch\nfrom tpu_utility import autocast  # mine\ndevice = torch.device("cuda")\n')
    assert new.splitlines()[1] == "from tpu_utility import get_device, autocast  # mine"  # the user's comment stays
    assert [(c.where, c.before, c.after) for c in report.changes if c.rule == "imports"] == [
        ("line 2", "from tpu_utility import autocast  # mine", "from tpu_utility import get_device, autocast  # mine")]
    new, report = port_source('import torch\nfrom tpu_utility import *\ndevice = torch.device("cuda")\n')
    assert new == 'import torch\nfrom tpu_utility import *\ndevice = get_device()\n'
    assert not [c for c in report.changes if c.rule == "imports"]


def test_imports_in_a_notebook_come_no_later_than_the_first_cell_using_them_and_after_its_pip_lines():
    from tpu_utility.diagnostics.port.cells import port_cells
    from tpu_utility.diagnostics.port.report import PortReport

    report = PortReport("notebook")
    # get_device is used in cell 2, before the torch_xla imports of cell 3: it goes with the imports of cell 1
    out = port_cells(["!pip install -q timm\nimport torch\n", "device = torch.device('cuda')\n",
                      "import os\nos.environ['PJRT_DEVICE'] = 'TPU'\nimport torch_xla.core.xla_model as xm\nxm.mark_step()\n"],
                     indexed=True, report=report)
    assert out[0] == "!pip install -q timm\nimport torch\nfrom tpu_utility import get_device  # tpu_utility.port\n"
    assert out[1] == "device = get_device()\n"
    assert out[2].splitlines()[2:4] == ["import torch_xla.core.xla_model as xm", "import torch_xla  # tpu_utility.port"]
    assert sorted(c.where for c in report.changes if c.rule == "imports") == ["cell 1, line 3", "cell 3, line 4"]


# ------------------------------------------------- programs that trained on the CPU after a port (issue 51)
def test_bookkeeping_max_of_a_device_metric_and_its_flag_are_named_and_host_numbers_are_not():
    new, report = port_source("best_acc1 = 0\nfor epoch in range(2):\n    acc1 = validate(model)\n"
                              "    is_best = acc1 > best_acc1\n    best_acc1 = max(acc1, best_acc1)\n    if is_best:\n"
                              "        save(model)\n")  # fmt: skip
    assert [(i.rule, i.where) for i in report.left] == [("device_bookkeeping", "line 5"), ("device_bookkeeping", "line 6")]
    _unchanged("best = 1e9\nv = 0.5\nbest = min(v, best)\n")


def test_cuda_available_check_that_picks_the_device_tests_for_an_accelerator():
    new, changed, _ = _port('import torch\ndevice = "cpu"\nif torch.cuda.is_available():\n    device = "cuda"\n')
    assert 'if get_device().type != "cpu":' in new and "cuda_available" in changed
    new, changed, _ = _port("import torch\nif torch.cuda.is_available():\n    model = model.cuda()\n")
    assert 'if get_device().type != "cpu":' in new, new
    _unchanged("import torch\nif torch.cuda.is_available():\n    torch.backends.cudnn.benchmark = True\n")


def test_cuda_available_opened_check_no_longer_guards_its_cuda_calls():
    new, report = port_source('import torch\nif torch.cuda.is_available():\n    device = "cuda"\n    torch.cuda.synchronize()\n')
    assert [(i.rule, i.where) for i in report.left] == [("cuda_call", "line 4")] and report.status() == 1


def test_ddp_nccl_branch_is_named_line_by_line_and_the_single_process_path_ported():
    new, report = port_source("import torch\nfrom torch.distributed import init_process_group\n"
                              "from torch.nn.parallel import DistributedDataParallel as DDP\n"
                              "if ddp:\n    init_process_group(backend='nccl')\n    device = f'cuda:{rank}'\n"
                              "    torch.cuda.set_device(device)\nelse:\n    device = 'cuda'\nmodel = GPT()\nmodel.train()\n"
                              "model.to(device)\nif ddp:\n    model = DDP(model, device_ids=[rank])\n")  # fmt: skip
    assert [(i.rule, i.where) for i in report.left] == [("ddp_nccl", f"line {n}") for n in (5, 6, 14)], report.text()
    assert "    device = get_device().type" in new and "move_model(model, device)" in new and report.status() == 1
    _unchanged("import torch.distributed as dist\ndist.init_process_group('gloo')\n")


def test_device_calls_get_the_ported_devices_meaning_and_memory_reads_are_named():
    new, changed, left = _port("import torch\nn = torch.cuda.device_count()\ni = torch.accelerator.current_device_index()\n"
                               "torch.cuda.set_device(i)\nm = getattr(torch, device_type).max_memory_allocated()\n")
    assert 'n = int(get_device().type != "cpu")' in new and "i = (get_device().index or 0)" in new
    assert "pass  # tpu_utility.port: torch.cuda.set_device(i) dropped" in new
    assert changed == {"device_calls"} and left == {"memory_stats"}
    _unchanged("import torch\nif torch.cuda.is_available():\n    torch.cuda.empty_cache()\n")


def test_dynamic_shape_is_not_named_for_a_pandas_filter_or_an_array():
    _unchanged('import pandas as pd\ndf = pd.read_csv("train.csv")\ntrain = df[df["fold"] != 0]\n'
               "folds = np.arange(5)\nrest = folds[folds != 2]\nvalid = frame[frame['fold'] == 0]\n")
    assert _port("y = x[x > 0]\n")[2] == {"dynamic_shape"}


def test_host_sync_is_not_named_for_reads_of_lists_and_arrays():
    _unchanged("for x, y in loader:\n    preds = np.zeros(3)\n    out = preds.tolist()\n    seen = []\n    print(seen)\n")


def test_from_pretrained_device_map_becomes_move_model_also_around_a_4bit_load():
    new, changed, left = _port('model = AutoModelForCausalLM.from_pretrained(name, device_map="auto")\n')
    assert "model = move_model(AutoModelForCausalLM.from_pretrained(name), get_device())" in new and changed == {"device_map"}
    new, report = port_source("bnb = BitsAndBytesConfig(load_in_4bit=True)\n"
                              "model = AutoModelForCausalLM.from_pretrained(name, quantization_config=bnb, device_map={'': 0})\n")
    assert "model = move_model(quantize_base(AutoModelForCausalLM.from_pretrained(name)), get_device())" in new
    assert not report.left and report.status() == 0
    _unchanged("tok = AutoTokenizer.from_pretrained(name)\n")


def test_generator_on_the_device_becomes_a_cpu_generator():
    new, changed, _ = _port('import torch\ng = torch.Generator(device="cuda")\n')
    assert "g = torch.Generator()" in new and "generator_device" in changed
    _unchanged("import torch\ng = torch.Generator()\n")


def test_hogwild_share_memory_is_named():
    assert _port("model = Net()\nmodel.share_memory()\n")[2] == {"hogwild"}
    _unchanged("t = x.clone()\n")


def test_import_device_in_a_class_body_or_a_launching_module_stays_lazy():
    new, changed, _ = _port('import torch\nclass args:\n    device = "cuda" if torch.cuda.is_available() else "cpu"\n')
    assert "    device = device_type()" in new and "get_device" not in new and "import_time_device" in changed
    new, _, _ = _port('import torch\nimport torch_xla\ndevice = torch.device("cuda")\ntorch_xla.launch(train)\n')
    assert "device = torch.device(device_type())" in new
    new, _, _ = _port('import torch\ndevice = torch.device("cuda")\n')
    assert "device = get_device()" in new  # one process: the device line of the docs


# ---------------------------------------------- issue 61: what five more public programs did after a port said "yes"
def test_generator_a_programs_own_generator_class_shadows_torchs():
    # every GAN example: class Generator(nn.Module) ... netG = Generator(ngpu).to(device)
    source = ("import torch\nfrom torch import nn\nclass Generator(nn.Module):\n    def __init__(self, ngpu):\n"
              "        super().__init__()\nnetG = Generator(1)\ng = torch.Generator(device='cpu')\n")
    new, changed, _ = _port(source)
    assert "netG = Generator(1)" in new and "g = torch.Generator()" in new and changed == {"generator_device"}
    # from torch import Generator stays torch's
    assert "Generator()" in _port("from torch import Generator\ng = Generator(device)\n")[0]


def test_samplers_a_programs_own_distributed_sampler_is_not_torchs():
    _unchanged("class DistributedSampler:\n    pass\ns = DistributedSampler(ds, 4)\n")


def test_sparse_a_sparse_tensors_move_is_made_dense_and_one_made_on_the_device_is_named():
    new, changed, _ = _port("adj = torch.eye(4).to_sparse()\nadj = adj.to(device)\nb = torch.eye(2).to_sparse().cuda()\n")
    assert "adj = adj.to_dense().to(device)" in new and "torch.eye(2).to_sparse().to_dense().to(get_device())" in new, new
    assert changed == {"sparse_device"}
    assert _port("a = torch.sparse_coo_tensor(i, v, (2, 2), device=device)\n")[2] == {"sparse_on_device"}
    _unchanged("x = torch.eye(4).to(device)\n")


def test_cpu_first_the_runtime_starts_before_a_cpu_baselines_backward_and_a_launching_program_is_named():
    source = ("import torch\nmodel = torch.nn.Linear(2, 1)\nfor x in data:\n    model(x).sum().backward()\n"
              "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    new, changed, left = _port(source)
    assert "get_device()  # tpu_utility.port: the XLA runtime first" in new.split("for x in data")[0], new
    assert "cpu_step_first" in changed and not left
    _, _, left = _port(source.replace("device = ", "xmp.spawn(fn)\ndevice = "))
    assert "cpu_step_before_launch" in left
    # the device first: nothing to do
    assert "cpu_step_first" not in _port("device = torch.device('cuda')\nloss.backward()\n")[1]


def test_module_optimizer_a_module_moves_before_the_optimizer_its_init_builds():
    source = ("import torch\ndevice = torch.device('cuda')\nclass Layer(torch.nn.Linear):\n    def __init__(self):\n"
              "        super().__init__(2, 2)\n        self.opt = torch.optim.Adam(self.parameters())\n")
    new, changed, _ = _port(source)
    assert "        move_model(self, device)  # tpu_utility.port" in new and "optimizer_in_init" in changed, new
    # no device in the program: nothing moves
    _unchanged(source.replace("device = torch.device('cuda')\n", ""))


def test_cuda_seed_is_kept_beside_torch_manual_seed_and_becomes_it_alone_without_a_stop():
    _unchanged("import torch\ntorch.manual_seed(0)\ntorch.cuda.manual_seed_all(0)\n")
    new, changed, left = _port("import torch\ntorch.cuda.manual_seed(0)\n")
    assert "torch.manual_seed(0)" in new and changed == {"cuda_seed"} and not left


def test_tensor_type_a_cuda_or_cpu_tensor_type_builds_on_the_device_and_its_true_false_flag_is_no_device():
    # eriklindernoren/PyTorch-GAN's idiom: the flag is a bool (never the device), the type a constructor on it
    new, changed, left = _port("import torch\ncuda = True if torch.cuda.is_available() else False\n"
                               "Tensor = torch.cuda.LongTensor if cuda else torch.LongTensor\n"
                               "if cuda:\n    generator.cuda()\nx = Tensor(8, 1).fill_(1)\ny = imgs.type(Tensor)\n")
    assert "Tensor = lambda *args: torch.LongTensor(*args).to(get_device())" in new, new
    assert "y = imgs.to(get_device(), torch.int64)" in new and "generator.to(get_device())" in new, new
    assert {"cuda_tensor_type", "cuda_flag"} <= changed and not left, (changed, left)
    # a type chosen by nothing CUDA, and .type() of another name: as written
    _unchanged("import torch\nTensor = torch.FloatTensor\ny = imgs.type(torch.FloatTensor)\n")


def test_cuda_flag_an_availability_flag_of_any_name_that_moves_the_model_is_the_accelerators_test():
    new, changed, _ = _port("import torch\ntrain_on_gpu = torch.cuda.is_available()\nif train_on_gpu:\n    model.cuda()\n")
    assert 'train_on_gpu = get_device().type != "cpu"' in new and "cuda_flag" in changed, new
    # a flag that only prints: as written
    _unchanged("import torch\ntrain_on_gpu = torch.cuda.is_available()\nif train_on_gpu:\n    print('GPU')\n")


def test_item_loop_a_per_sample_item_over_a_tensor_is_named_and_one_over_a_list_is_not():
    assert _port("for i in range(32):\n    out[i] = scores[i].item()\n")[2] == {"item_loop"}
    _unchanged("scores = [1, 2]\nfor i in range(2):\n    out[i] = scores[i].item()\n")


def test_cuda_flag_an_opt_in_flag_with_the_accelerator_test_is_the_default_and_an_opt_out_holds():
    new, changed, _ = _port("if opt.accel and torch.accelerator.is_available():\n"
                            "    device = torch.accelerator.current_accelerator()\n")
    assert 'if get_device().type != "cpu":' in new and "cuda_flag" in changed, new
    # --no-accel: the assignment is ported to the accelerator's test, and `if use_accel:` holds as it is
    new, _, _ = _port("use_accel = not args.no_accel and torch.accelerator.is_available()\nif use_accel:\n"
                      "    device = torch.accelerator.current_accelerator()\n")
    assert 'use_accel = not args.no_accel and get_device().type != "cpu"' in new and "if use_accel:" in new, new
    # --no-cuda with CUDA's test left (it guards loader settings): the device keeps the opt-out
    new, changed, _ = _port("use_cuda = not args.no_cuda and torch.cuda.is_available()\n"
                            "device = torch.device('cuda' if use_cuda else 'cpu')\n")
    assert "torch.device(get_device().type if not args.no_cuda else 'cpu')" in new and "flag_opt_out" in changed, new


def test_device_calls_a_name_bound_to_the_memory_module_lookup_gets_its_xla_meaning():
    # peft's examples' TorchTracemalloc
    new, changed, left = _port("class T:\n    def __enter__(self):\n"
                               "        self.device_module = getattr(torch, device_type, torch.cuda)\n"
                               "        self.device_module.empty_cache()\n        self.device_module.reset_peak_memory_stats()\n"
                               "        self.begin = self.device_module.memory_allocated()\n")  # fmt: skip
    assert new.count("pass  # tpu_utility.port") == 2 and changed == {"device_calls"} and left == {"memory_stats"}, new


def test_transformers_api_names_peft_removed_apis_and_a_trainer_it_cannot_port():
    _, changed, left = _port("from peft import get_peft_model, prepare_model_for_int8_training\n"
                             "model = prepare_model_for_int8_training(model)\n")
    assert left == {"peft_removed"} and not changed
    for source in ("from transformers import Trainer as HfTrainer\nHfTrainer(model=model, args=args).train()\n",
                   "import transformers\ntransformers.Trainer(model=model, args=args).train()\n",
                   "from trl import SFTTrainer\nSFTTrainer(model=model, train_dataset=ds).train()\n"):
        assert _port(source)[2] == {"hf_trainer"}, source
    _unchanged("class Trainer:\n    pass\nTrainer().fit()\n")  # a program's own Trainer is its own
    _unchanged("from peft import prepare_model_for_kbit_training\n")
