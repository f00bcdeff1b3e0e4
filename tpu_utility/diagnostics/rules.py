"""The pitfalls of PyTorch on TPUs, one table: what each costs, the fix, the API it replaces.

``doctor`` (at run time), ``check`` (the platform) and ``port`` (the source) read
their texts from here, so a new pitfall is one entry. Pure data: no torch, no
torch_xla.

Example:
    >>> from tpu_utility.diagnostics.rules import RULES
    >>> RULES["host_sync"].fix
    'keep values on the device (running_loss += loss.detach()) and read them once per epoch'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tool = Literal["doctor", "check", "port"]


@dataclass(frozen=True)
class Rule:
    """One pitfall.

    Attributes:
        id: Short name; ``doctor``'s findings carry it as their ``kind``.
        cost: What it costs on XLA (speed, a wrong result, an error).
        fix: What to write instead.
        replaces: The API or pattern it replaces ("" when it is not an API).
        removed_in: The torch_xla release from which a replaced API is gone (it raises),
            "" when it still works or the rule is not about an API.
        deprecated_in: The release from which it warns, where known.
        tools: Which of doctor, check and port know it.
        breaks: For a line ``port`` leaves as written: True where the line stops the program on XLA or
            makes it compute something else there (the port's exit status 1), False where it only costs speed.
        part_of: For a rule ``doctor`` reports inside another rule's finding (its fix added there): that
            rule's id; "" for a rule that is a finding of its own (one of ``DOCTOR_KINDS``).
    """

    id: str
    cost: str
    fix: str
    replaces: str = ""
    removed_in: str = ""
    deprecated_in: str = ""
    tools: tuple[Tool, ...] = ("doctor",)
    breaks: bool = False
    part_of: str = ""


NO_DYNAMIC_SHAPE = "it has a data-dependent shape: keep the shape fixed with torch.where(mask, x, 0) and a mask"
_EMBEDDING_BAG = (
    "nn.EmbeddingBag -> nn.Embedding and a masked sum/mean: e = emb(tokens) * mask[..., None]; "
    "e.sum(1) (mean: / mask.sum(1, keepdim=True)), with tokens padded to a fixed length"
)
# Ops that XLA cannot lower (aten name), and a replacement it can lower.
LOWERED_REPLACEMENTS: dict[str, str] = {
    "aten::_embedding_bag": _EMBEDDING_BAG,
    "aten::_embedding_bag_backward": _EMBEDDING_BAG,
    "aten::histc": "torch.histc -> F.one_hot(((x - lo) / (hi - lo) * bins).long().clamp(0, bins - 1), bins).sum(0)",
    "aten::bincount": "torch.bincount -> F.one_hot(x, num_classes).sum(0)",
    "aten::nonzero": f"nonzero: {NO_DYNAMIC_SHAPE}",
    "aten::masked_select": f"masked_select: {NO_DYNAMIC_SHAPE}",
    "aten::_unique2": f"unique: {NO_DYNAMIC_SHAPE} (or compute it on the host once per epoch)",
}
# The same ops as a source file calls them (function or method name -> aten name).
SOURCE_FALLBACKS: dict[str, str] = {
    "EmbeddingBag": "aten::_embedding_bag",
    "embedding_bag": "aten::_embedding_bag",
    "histc": "aten::histc",
    "bincount": "aten::bincount",
    "nonzero": "aten::nonzero",
    "masked_select": "aten::masked_select",
    "unique": "aten::_unique2",
}

# the host-sync fix for reads that copy a tensor out (.cpu(), .numpy(), .tolist())
COLLECT_ON_DEVICE = ("collect predictions on the device (preds.append(logits.argmax(1))) and move them once after "
                     "the loop: torch.cat(preds).cpu().numpy()")
_MOVE_FIX = "device = get_device(); model.to(device) before building the optimizer; move each batch with .to(device)"
_BOTH = ("doctor", "port")
_PORT = ("port",)

RULES_LIST: tuple[Rule, ...] = (
    # ---------------------------------------------------------- what doctor measures, port sees in the source
    Rule("not_on_xla", "nothing runs on XLA: the step runs on the host CPU", _MOVE_FIX),
    Rule("not_on_device", "the model is not on the backend's device: the step runs on the host CPU", _MOVE_FIX),
    Rule("optimizer_params", "the optimizer was built before model.to(device), so on XLA it holds the CPU copies: "
         "optimizer.step() updates them and the model does not learn",
         "build the optimizer after the move: model.to(device); optimizer = AdamW(model.parameters())",
         replaces="optimizer = AdamW(model.parameters()) before model.to(device)", tools=_BOTH),
    Rule("tied_weights", "tied weights that model.to(device) split apart train independently",
         "move with move_model(model, device) (from tpu_utility import move_model), which keeps ties, or re-tie "
         "after the move (model.out.weight = model.emb.weight; model.tie_weights() for Hugging Face)",
         replaces="model.to(device)", tools=_BOTH, breaks=True),
    Rule("batch_split", "a batch that does not divide across the cores", "use a batch size that is a multiple of the cores"),
    Rule("graph_growth", "a graph that grows every step: nothing cuts it, so each step compiles and runs more",
         "end each step with step_optimizer(optimizer) (or torch_xla.sync())"),
    Rule("recompile", "a new input shape compiles a new graph", "keep every batch the same shape: "
         "DataLoader(..., drop_last=True) in training, tpu_utility.masked_loader in evaluation, BucketCollate for "
         "variable lengths"),
    Rule("device_slicing", "slicing a device-resident dataset with Python integers bakes them into the graph: "
         "a compile per step", "index with a device tensor of indices, or serve batches from a DataLoader"),
    Rule("host_sync", "each read of a device value (.item(), .cpu(), .numpy(), .tolist(), print) waits for the "
         "device: a host sync per step stops the host from tracing the next step while the device runs this one",
         "keep values on the device (running_loss += loss.detach()) and read them once per epoch", tools=_BOTH),
    Rule("hf_mask_sync", "transformers' SDPA mask code reads padding_mask.all() on the host in every forward, to "
         "skip an all-ones mask", "static_masks(model): the same attention with the mask built on the device "
         "(one_cycle_fit, evaluate, predict and find_lr do it for the run)", replaces="model(**batch) with sdpa",
         tools=("doctor",), part_of="host_sync"),
    Rule("cpu_fallback", "an op with no XLA lowering runs on the host CPU, copying tensors each way",
         "replace it with ops XLA lowers (tpu_utility.diagnostics.rules.LOWERED_REPLACEMENTS), or compute it "
         "outside the step, once per epoch", tools=_BOTH),
    Rule("dynamic_shape", "a boolean mask (x[x > 0]) gives a tensor whose size depends on the data: a host sync to "
         "learn it, and a new graph for each new size", NO_DYNAMIC_SHAPE.replace("it has a data-dependent shape: ", ""),
         replaces="x[mask]", tools=_PORT),
    Rule("inference_mode", "XLA cannot run it: a layer that views a weight made outside "
         "inference mode (nn.Linear transposes its weight) stops with 'Cannot set version_counter for inference tensor'",
         "with tpu_utility.inference_mode(): (torch.no_grad() on XLA, the same speed there; torch.inference_mode() "
         "elsewhere), or torch.no_grad() directly", replaces="torch.inference_mode()", tools=_BOTH),
    # ------------------------------------------------------------------------ CUDA lines (port)
    Rule("cuda_device", "the device is CUDA or the CPU: never the TPU", "device = get_device()",
         replaces='torch.device("cuda" if torch.cuda.is_available() else "cpu")', tools=_PORT),
    Rule("cuda_move", ".cuda() raises where there is no CUDA", "x.to(device)", replaces="x.cuda()", tools=_PORT),
    Rule("optimizer_step", "on XLA the step must cut the graph, and with several cores average the gradients; "
         "optimizer.step() does neither", "step_optimizer(optimizer)", replaces="optimizer.step()", tools=_PORT),
    Rule("cuda_amp", "CUDA's autocast and GradScaler do nothing on a TPU (or raise); TPUs need bfloat16 and no "
         "loss scaling", "autocast(dtype=...) and grad_scaler() from tpu_utility: bfloat16 on TPU, your dtype on CUDA",
         replaces="torch.autocast('cuda') / torch.cuda.amp.autocast / torch.amp.GradScaler('cuda')", tools=_PORT),
    Rule("distributed_sampler", "a DistributedSampler wants the world size and rank of a process group",
         "make_sampler(dataset, shuffle=...): this process's part when several run, None (plain shuffling) with one",
         replaces="DistributedSampler(dataset, num_replicas=..., rank=...)", tools=_PORT),
    Rule("cuda_call", "torch.cuda calls do nothing or raise where there is no CUDA",
         "remove it, or guard it with `if device.type == \"cuda\":`; to wait for the TPU: torch_xla.sync(wait=True)",
         replaces="torch.cuda.*", tools=_PORT, breaks=True),
    Rule("cuda_guard", "a `device.type == \"cuda\"` / torch.cuda.is_available() test is False on a TPU, so the "
         "feature it guards (mixed precision, a GradScaler) is switched off without a word",
         "test what the feature needs instead: tpu_utility.autocast/grad_scaler work on every device, so guard "
         "them with the user's flag alone (if args.amp:)", tools=_PORT),
    Rule("runtime_before_spawn", "code at the top level of the launching process that asks the XLA runtime "
         "(world size, ordinal, device) starts it there, and a multi-process launch then refuses: "
         "'Runtime is already initialized'", "build samplers, loaders and devices inside the function you spawn",
         replaces="a DistributedSampler built before xmp.spawn", tools=_PORT, breaks=True),
    # ---------------------- torch_xla 1.x names that fail or warn on 2.8 and 2.9 (port rewrites; check lists them)
    # From torch_xla's history: xrt_world_size/get_ordinal warned from 2.5 (#7679) and went in 2.7 (#8927);
    # xla_device and mark_step warn from 2.8 (#9086, #9200); xmp.spawn raises for nprocs other than None or 1
    # from 2.6 (#7971). Still current on 2.9 and left as they are: get_local_ordinal, is_master_ordinal,
    # master_print, mesh_reduce, rendezvous, optimizer_step, MpModelWrapper, MpSerialExecutor, ParallelLoader.
    Rule("xrt_world_size", "gone from torch_xla: AttributeError", "xr.world_size()",
         replaces="xm.xrt_world_size()", removed_in="2.7", deprecated_in="2.5", tools=("port", "check")),
    Rule("get_ordinal", "gone from torch_xla: AttributeError", "xr.global_ordinal()",
         replaces="xm.get_ordinal()", removed_in="2.7", deprecated_in="2.5", tools=("port", "check")),
    Rule("spawn_nprocs", "under PJRT xmp.spawn starts one process per chip itself: any nprocs but None or 1 raises "
         "ValueError: Unsupported nprocs", "xmp.spawn(fn, args=...) without nprocs (TPU_NUM_DEVICES limits the chips)",
         replaces="xmp.spawn(..., nprocs=8)", removed_in="2.6", tools=("port", "check")),
    Rule("xla_device", "deprecated: a DeprecationWarning per call", "torch_xla.device()",
         replaces="xm.xla_device()", deprecated_in="2.8", tools=("port", "check")),
    Rule("mark_step", "deprecated: a DeprecationWarning per call", "torch_xla.sync()",
         replaces="xm.mark_step()", deprecated_in="2.8", tools=("port", "check")),
    Rule("env_setup", "the 2020-era setup lines install torch_xla 1.x (XRT) over the image's own torch and "
         "torch_xla, or fail offline", "delete them: Kaggle's TPU image ships torch_xla 2.8, Colab's 2.9",
         replaces="!python pytorch-xla-env-setup.py --version 1.7", tools=_PORT, breaks=True),
    # ---------------------------------------------------- what CUDA programs people have do (issue 39)
    Rule("cuda_flag", "the GPU is chosen by a flag (--cuda, --no-cuda, use_cuda, --accel): without it the program trains "
         "on the CPU, and with it torch.cuda raises where there is no CUDA",
         'test the device instead of the flag: get_device().type != "cpu" (the accelerator, the CPU where there is '
         "none)", replaces="if args.cuda: model.cuda()", tools=_PORT),
    Rule("cuda_flag_settings", "the flag and torch.cuda.is_available() still decide what they guard (loader "
         "workers, pin_memory, shuffling), and both are False on a TPU; the device itself is get_device()",
         'if what it guards should hold on the TPU too, test get_device().type != "cpu" instead',
         replaces="use_cuda = not args.no_cuda and torch.cuda.is_available()", tools=_PORT),
    # ------------------------------------------------- programs that trained on the CPU after a port (issue 51)
    Rule("cuda_available", "torch.cuda.is_available() is False on a TPU, so a branch that picks or moves to the "
         "accelerator is never taken there: the program trains on the host CPU",
         'test for an accelerator instead: get_device().type != "cpu"',
         replaces='if torch.cuda.is_available(): device = "cuda"', tools=_PORT),
    Rule("device_map", "device_map places the model on CUDA or the CPU, never on XLA, and batch.to(model.device) "
         "follows it: the whole run stays on the host CPU",
         "load without device_map and move the model: model = move_model(AutoModel.from_pretrained(name), "
         "get_device())", replaces='from_pretrained(name, device_map="auto")', tools=_PORT),
    Rule("bitsandbytes", "bitsandbytes' 4-bit and 8-bit layers have CUDA kernels only, none for XLA: the load "
         "raises or the quantized layers run on the host",
         "an int8 base under LoRA: model = quantize_base(from_pretrained(name)) or load_quantized(path) "
         "(tpu_utility; 4-bit is not built), or load in bfloat16 (from_pretrained(name, dtype=torch.bfloat16)) "
         "and shard it with tpu_utility.FSDP",
         replaces="BitsAndBytesConfig(load_in_4bit=True) / load_in_8bit=True", tools=_PORT, breaks=True),
    Rule("gradient_checkpointing", "model.gradient_checkpointing_enable() checkpoints each block with torch's "
         "checkpoint, which fails on XLA tensors in a hand loop (it looks up torch.xla, which does not exist)",
         "device_checkpointing(model): the same call, with torch_xla's checkpoint in each block on XLA "
         "(one_cycle_fit does it itself)", replaces="model.gradient_checkpointing_enable()", tools=_PORT),
    Rule("int8_base", "bitsandbytes' 8-bit and 4-bit loads have CUDA kernels only: on XLA the load raises or runs "
         "on the host", "model = quantize_base(from_pretrained(name)): the linear layers in int8 with a scale per "
         "output channel, LoRA on top (tpu_utility.quantization); a 4-bit config is mapped to the int8 base",
         replaces="from_pretrained(name, load_in_8bit=True) / quantization_config=BitsAndBytesConfig(load_in_4bit=True)",
         tools=_PORT),
    Rule("import_time_device", "a device chosen when the module is imported (a config class's attribute, a "
         "module-level line of a program that launches processes) starts the XLA runtime at import, and the "
         "launch then refuses: 'Runtime is already initialized'",
         "keep it lazy: device_type() (the device's type, without starting the runtime) or get_device() inside "
         "the launched function", replaces='class args: device = "cuda" if torch.cuda.is_available() else "cpu"',
         tools=_PORT),
    Rule("device_calls", "torch.cuda and torch.accelerator device calls (set_device, device_count, "
         "current_device) ask CUDA, which a TPU host lacks: they raise ('Found no NVIDIA driver') or answer for "
         "no device", "let the ported device answer: get_device() is this process's one device, chosen by the "
         "launch", replaces="torch.cuda.set_device(local_rank) / torch.accelerator.device_count()", tools=_PORT),
    Rule("memory_stats", "torch.cuda and torch.accelerator memory statistics (memory_allocated, "
         "max_memory_allocated, memory_reserved) raise where there is no CUDA, and XLA:CPU keeps none",
         "drop the line, or on a TPU read torch_xla.core.xla_model.get_memory_info(device) (bytes_used, "
         "peak_bytes_used)", replaces="torch.cuda.max_memory_allocated()", tools=_PORT, breaks=True),
    Rule("ddp_nccl", "a CUDA DDP job (init_process_group with nccl, the device cuda:{local_rank}, "
         "DDP(model, device_ids=[local_rank])) has neither nccl nor a CUDA device on a TPU",
         "run the ported single-process path (no torchrun), or one process per core: put the training in a "
         "function and run launch(train) (from tpu_utility), where get_device() is each process's core, "
         "make_sampler(dataset) its part of the data and step_optimizer(optimizer) averages the gradients, "
         "with no DDP wrapper", replaces='init_process_group(backend="nccl"); DDP(model, device_ids=[rank])',
         tools=_PORT, breaks=True),
    Rule("generator_device", "torch.Generator(device=...) raises for an XLA device ('XLA device type not an "
         "accelerator')", "a CPU generator, torch.Generator(): draw on the host and move what it drew with "
         ".to(device)", replaces="torch.Generator(device=device)", tools=_PORT),
    Rule("hogwild", "Hogwild (model.share_memory() and mp.Process workers updating one model in shared host "
         "memory) has no XLA form: each worker trains on the host CPU",
         "train data-parallel instead: launch(train) (from tpu_utility) runs train once per core, "
         "make_sampler(dataset) gives each its part and step_optimizer(optimizer) averages the gradients",
         replaces="model.share_memory(); mp.Process(target=train, args=(model,))", tools=_PORT, breaks=True),
    Rule("device_bookkeeping", "a Python max(), comparison or if on a device value (best_acc1 = max(acc1, "
         "best_acc1); if is_best:) reads it on the host and bakes the number into the next graphs: a host sync "
         "and new compiles every epoch", "read the metric once, as a Python number, where it is made "
         "(acc1 = float(acc1)), and keep the bookkeeping in Python numbers", replaces="best = max(acc, best)",
         tools=_PORT),
    Rule("torch_compile", "torch.compile's default backend (inductor) does not compile for XLA: InductorError",
         "compile_model(model, mode=..., fullgraph=..., dynamic=...): the model itself on torch_xla, which traces "
         "and compiles the step on its own, and torch.compile on CUDA, TorchTPU and the CPU (a ported script keeps "
         "its compiled speed on a GPU)", replaces="model = torch.compile(model)", tools=_PORT),
    Rule("colab_tpu_addr", "COLAB_TPU_ADDR was set by the 2020-era Colab TPU (a remote TPU node) only: a KeyError "
         "anywhere else, today's Colab and Kaggle TPU VMs included",
         "delete it: on a TPU VM torch_xla finds the chips itself (tpu_utility.setup_tpu() checks them)",
         replaces="assert os.environ['COLAB_TPU_ADDR']", tools=_PORT, breaks=True),
    Rule("colab_only", "google.colab exists on Colab only: ModuleNotFoundError on Kaggle, a TPU VM or a laptop",
         "keep it for Colab behind try: ... except ModuleNotFoundError:, and read the data from a local path "
         "elsewhere", replaces="from google.colab import drive", tools=_PORT, breaks=True),
    Rule("save_pretrained", "save_pretrained writes with safetensors, which needs storage pointers that XLA "
         "tensors lack: it raises for a model that lives on XLA",
         "give it a CPU copy of the weights: model.save_pretrained(path, state_dict={k: v.cpu() for k, v in "
         "model.state_dict().items()})", replaces="model.save_pretrained(path)", tools=_PORT, breaks=True),
    Rule("peft_removed", "peft no longer has it (prepare_model_for_kbit_training replaced it, for 8-bit and 4-bit "
         "loads that XLA has no kernels for): ImportError",
         "delete the call with its load_in_8bit=True: load in bfloat16 (from_pretrained(name, dtype=torch.bfloat16)); "
         "get_peft_model freezes the base itself, and with gradient checkpointing add "
         "model.enable_input_require_grads()", replaces="from peft import prepare_model_for_int8_training",
         tools=_PORT, breaks=True),
    Rule("hf_trainer", "Hugging Face's Trainer runs a loop of its own, which port does not rewrite",
         "give its model and datasets to one_cycle_fit (TrainingArguments' num_train_epochs -> epochs, learning_rate "
         "-> max_lr, per_device_train_batch_size -> batch_size, warmup_steps -> warmup, lr_scheduler_type -> "
         "schedule; docs/llm.md), or keep Trainer, which runs on XLA through accelerate",
         replaces="Trainer(model=model, args=TrainingArguments(...), ...).train()", tools=_PORT),
    Rule("transformers_adamw", "transformers.AdamW is gone from transformers 5: ImportError",
         "torch.optim.AdamW(params, weight_decay=0.0, ...): weight_decay=0.0 was transformers' default (torch's "
         "is 0.01)", replaces="from transformers import AdamW", removed_in="", tools=_PORT),
    Rule("xla_use_bf16", "deprecated since 2.4 (torch_xla prints that it goes after 2.6): it makes every float32 "
         "tensor bfloat16 on the device while its dtype still says float32",
         "bfloat16 autocast: with tpu_utility.autocast(): (one_cycle_fit(..., precision='bf16')), or "
         "model.to(torch.bfloat16)", replaces='os.environ["XLA_USE_BF16"] = "1"', deprecated_in="2.4",
         tools=("port", "check")),
    # ------------------------------------------- what five more public programs did after a port said "yes" (issue 61)
    Rule("sparse_device", "XLA has no sparse tensors: moving one to the device raises NotImplementedError "
         "('SparseXLA' backend)", "move it dense: adj.to_dense().to(device) (torch.sparse.mm and torch.spmm take "
         "dense tensors too; the zeros cost memory, n*n, not correctness)",
         replaces="torch.eye(n).to_sparse().to(device)", tools=_PORT),
    Rule("sparse_on_device", "XLA has no sparse tensors: a sparse tensor made on the device raises "
         "NotImplementedError ('SparseXLA' backend)", "make it on the CPU and move it dense: "
         "torch.sparse_coo_tensor(i, v, size).to_dense().to(device)",
         replaces="torch.sparse_coo_tensor(i, v, size, device=device)", tools=_PORT, breaks=True),
    Rule("cpu_step_first", "a backward run on the CPU before the XLA runtime starts (a CPU baseline trained "
         "first) breaks every later backward on XLA (pytorch/xla#4174): get_device() then raises",
         "start the runtime before the first backward: get_device() at the top of the program (the CPU steps "
         "still run on the CPU)", replaces="model.fit on the CPU, then device = ...", tools=_PORT),
    Rule("cpu_step_before_launch", "a backward run on the CPU in the launching process breaks every later "
         "backward on XLA (pytorch/xla#4174), and starting the runtime there first makes the launch refuse",
         "train the CPU baseline in the launched function, after get_device(), or in its own program",
         replaces="loss.backward() before xmp.spawn(...)", tools=_PORT, breaks=True),
    Rule("optimizer_in_init", "an optimizer built in a module's __init__ holds its CPU parameters; the move after "
         "it (model.to(device)) makes new parameters on XLA, so the optimizer updates the CPU copies and the "
         "model does not learn (step_optimizer refuses)",
         "move the module before its optimizer is built: move_model(self, device) before self.opt = "
         "Adam(self.parameters()) (the later move is then a no-op)",
         replaces="self.opt = Adam(self.parameters()) in __init__; model.to(device) after", tools=_PORT),
    Rule("flag_opt_out", "the program's opt-out flag (--no-cuda, --no-accel) and torch.cuda.is_available() "
         "decide the device together, and the availability test is False on a TPU",
         'keep the flag, test the device: not args.no_cuda and get_device().type != "cpu"',
         replaces='torch.device("cuda" if use_cuda else "cpu") with use_cuda = not args.no_cuda and ...',
         tools=_PORT),
    Rule("cuda_seed", "torch.cuda.manual_seed seeds CUDA's generators only: on a TPU it does nothing, so the "
         "run is not seeded", "torch.manual_seed(seed), which seeds every device's generator",
         replaces="torch.cuda.manual_seed_all(seed)", tools=_PORT),
    Rule("cuda_tensor_type", "torch.cuda.FloatTensor (a legacy typed-tensor constructor) builds CUDA tensors, and "
         "there is no XLA tensor type: with a CUDA test choosing it the batches stay on the CPU",
         "a constructor that moves its result: Tensor = lambda *args: torch.FloatTensor(*args).to(device), and "
         "x.type(Tensor) -> x.to(device, torch.float32)",
         replaces="Tensor = torch.cuda.FloatTensor if cuda else torch.FloatTensor", tools=_PORT),
    Rule("item_loop", "a per-sample .item() (or an indexed write of one) over a device tensor reads the device "
         "once per sample: a host sync each, and each indexed write compiles a graph (32 samples: 33 compiles)",
         "read the tensor to the host once, then loop there: values = scores.cpu() (or .tolist()) before the "
         "loop, out[i] = values[i] inside it", replaces="for i in range(n): out[i] = scores[i].item()",
         tools=_PORT),
)
RULES: dict[str, Rule] = {rule.id: rule for rule in RULES_LIST}
# the kinds of doctor's findings (doctor.Kind): its rules, less those it reports inside another's finding
DOCTOR_KINDS: tuple[str, ...] = tuple(rule.id for rule in RULES_LIST if "doctor" in rule.tools and not rule.part_of)

# doctor's fixes that depend on what it measured or on the loop it ran (a rule's id, _ and the case;
# "{...}" is filled in by doctor); the rule's own fix above is the general one
MEASURED_FIXES: dict[str, str] = {
    "batch_split": "use a batch size that is a multiple of {cores} (for example {example})",
    "recompile_train": "keep every batch full: DataLoader(..., drop_last=True) (one fixed shape, one graph)",
    "recompile_eval": "evaluate full-size batches only: `for batch, mask in tpu_utility.masked_loader(loader):` pads "
                      "the last batch to the batch size and masks the padded samples, so every sample still counts "
                      "once; drop_last would skip samples",
    "recompile_lengths": "pad each batch to one of a few lengths: DataLoader(..., collate_fn=tpu_utility.BucketCollate("
                         "buckets={buckets})) (from the lengths seen here), or BucketCollate.from_lengths(lengths, "
                         "num_buckets=4) from all your samples' lengths; with batch_sampler=tpu_utility."
                         "BucketBatchSampler(lengths, collate.buckets, batch_size) each batch holds similar lengths and "
                         "pads little{also}",
    "recompile_values": "pass changing values as device tensors, not Python numbers; avoid data-dependent Python "
                        "branches inside the step",
    "graph_growth_train": "end the step with step_optimizer(optimizer) (was: optimizer.step()), which cuts the graph; "
                          "a loop with a manual update (p.data.add_(...)): for x, y in tpu_utility.device_loader("
                          "loader), or torch_xla.sync() at the end of the step",
    "graph_growth_eval": "for x, y in tpu_utility.device_loader(loader) (one graph cut per batch), or torch_xla.sync() "
                         "at the end of the step",
    "device_slicing": "slice on the host and move the slice: keep data on the CPU and use data[i:i + bptt].to(device); "
                      "or index on the device with a device tensor: data.index_select(0, offsets + i) with offsets = "
                      "torch.arange(bptt, device=device) made once",
    "cpu_fallback_unknown": "replace them with ops XLA lowers (see the names), or compute them outside the step, once "
                            "per epoch",
}  # fmt: skip


def for_tool(tool: Tool) -> list[Rule]:
    """The rules one tool applies, in table order."""
    return [rule for rule in RULES_LIST if tool in rule.tools]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("+")[0].split(".")[:2])


def gone_in(xla_version: str) -> list[Rule]:
    """The replaced APIs that raise on this torch_xla release (for ``check``'s report).

    Example:
        >>> [rule.replaces for rule in gone_in("2.9.0")][:2]
        ['xm.xrt_world_size()', 'xm.get_ordinal()']
    """
    found = _release(xla_version)
    return [rule for rule in RULES_LIST if rule.removed_in and _release(rule.removed_in) <= found]
