"""Cases that failed late or misleadingly now fail at once, naming the value and the way on."""

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from conftest import Counted, flat_digits, MaskedBag, small_mlp
from tpu_utility import (
    CachedDataset,
    EpochRecord,
    History,
    cache_dataset,
    evaluate,
    find_lr,
    load_checkpoint,
    one_cycle_fit,
    presize_images,
    save_checkpoint,
)
from tpu_utility.data.buckets import BucketCollate

pytestmark = pytest.mark.filterwarnings("ignore:dropping the last")


def fit(model, train, **kwargs):
    args = {"epochs": 1, "max_lr": 3e-3, "batch_size": 32, "progress": False, **kwargs}
    return one_cycle_fit(model, train, **args)


def test_a_monitored_figure_that_does_not_exist_is_named_as_missing():
    with pytest.raises(ValueError, match=r"monitor='val_acc' is not a figure of this run; it has "
                                         r"\['train_loss', 'valid_loss', 'accuracy'\]"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), valid_data=flat_digits(64), monitor="val_acc")
    with pytest.raises(ValueError, match=r"monitor='accuracy' is not a figure of this run; it has \['train_loss'\] "
                                         r"\(metrics are computed on valid_data, and none was given\)"):  # fmt: skip
        fit(small_mlp(), flat_digits(64), monitor="accuracy")


@pytest.mark.parametrize("value", ["no", 1, None])
def test_restore_best_must_be_a_bool(value):
    with pytest.raises(TypeError, match=rf"restore_best must be True or False, but given {value!r}"):
        fit(small_mlp(), flat_digits(64), restore_best=value)


def test_a_validation_sequence_longer_than_the_largest_bucket_fails_before_training():
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 17, (64,), generator=g).tolist()
    train = Counted([(torch.randint(1, 50, (n,), generator=g), n % 2) for n in lengths])
    valid = [(torch.randint(1, 50, (n,), generator=g), n % 2) for n in [8] * 20 + [40]]
    collate = BucketCollate.from_lengths([len(s) for s, _ in train.samples], num_buckets=2)
    assert collate.buckets[-1] < 40
    loader = DataLoader(train, batch_size=8, collate_fn=collate, drop_last=True)
    args = {"loss_fn": nn.CrossEntropyLoss(), "batch_size": None}
    with pytest.raises(ValueError, match=rf"valid_data sample 20 has a sequence of length 40, longer than the largest "
                                         rf"bucket {collate.buckets[-1]} of its BucketCollate"):  # fmt: skip
        fit(MaskedBag(), loader, valid_data=DataLoader(valid, batch_size=8, collate_fn=collate), **args)
    assert train.reads == 0  # refused before any training sample was read
    truncating = BucketCollate(collate.buckets, overflow="truncate")  # the way on the message names
    with pytest.warns(UserWarning, match="truncating sequences longer than 16 tokens"):
        fit(MaskedBag(), loader, valid_data=DataLoader(valid, batch_size=8, collate_fn=truncating), **args)


def test_a_batch_of_three_parts_names_the_layout_and_the_way_on():
    x, y = flat_digits(64).tensors
    weighted = TensorDataset(x, y, torch.ones(64))  # (inputs, targets, weights): not (*inputs, targets)
    for kwargs in ({}, {"loss_fn": nn.CrossEntropyLoss()}, {"loss_fn": nn.CrossEntropyLoss(), "valid_data": weighted}):
        with pytest.raises(TypeError, match=r"a batch has 3 parts, which the default (train|eval)_step reads as "
                                            r"\(\*inputs, targets\): model\(\*batch\[:-1\]\) with 2 inputs, but "
                                            r"Sequential.forward\(input\) does not take 2\. For batches such as "
                                            r"\(inputs, targets, weights\), pass (train|eval)_step="):  # fmt: skip
            fit(small_mlp(), weighted, **kwargs)


def test_a_nan_monitored_figure_is_never_the_best_and_says_so(capsys):
    x, y = flat_digits(64).tensors
    valid = TensorDataset(torch.full_like(x, math.nan), y)
    history = fit(small_mlp(), flat_digits(64), valid_data=valid, epochs=3, early_stopping=2, restore_best=True,
                  progress=True)  # fmt: skip
    out = capsys.readouterr().out
    assert out.count("(valid_loss is nan: never the best epoch)") == 2
    assert history.stop_reason == (
        "early stopping: valid_loss did not improve for 2 epoch(s); no epoch had a finite valid_loss; "
        "no best weights were restored (the model holds the last epoch's)"
    )
    assert history.best_epoch is None


def test_loading_another_optimizers_state_names_both_classes(tmp_path):
    model = small_mlp()
    adam = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    adam.step()
    save_checkpoint(str(tmp_path / "c.pt"), model=model, optimizer=adam)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match=r"c.pt holds the state of torch.optim.adam.Adam, but the optimizer given is "
                                         r"torch.optim.sgd.SGD, which needs \['dampening', 'momentum'\] that state "
                                         r"lacks. "
                                         r"Give the kind of optimizer it was saved from \(Adam\), or load only the "
                                         r"model \(optimizer=None\) and start a fresh SGD"):  # fmt: skip
        load_checkpoint(str(tmp_path / "c.pt"), model=model, optimizer=sgd)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), changed))  # refused before loading anything
    torch.save({"optimizer": torch.optim.SGD(model.parameters(), lr=0.1).state_dict()}, tmp_path / "plain.pt")
    with pytest.raises(ValueError, match=r"plain.pt holds the state of an optimizer with hyperparameters \[.*'momentum'"
                                         r".*\], but the optimizer given is torch.optim.adamw.AdamW, which needs "
                                         r"\['betas', 'eps'\]"):  # fmt: skip
        load_checkpoint(str(tmp_path / "plain.pt"), optimizer=torch.optim.AdamW(model.parameters()))
    adamw = torch.optim.AdamW(model.parameters())  # the same family loads (as torch allows)
    load_checkpoint(str(tmp_path / "c.pt"), model=model, optimizer=adamw)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    assert adamw.state_dict()["state"][0]["step"] == 1


# ------------------------------------------------------------------ issue 40: the audit's unclear errors
def test_a_loss_given_by_name_is_refused_naming_the_callable_to_give():
    data = flat_digits(64)
    # was: "loss_fn 'cross_entropy' has no 'reduction' argument" (evaluate), "must be callable" (one_cycle_fit)
    fix = (r"loss_fn must be a callable \(output, target\) -> loss, but given the string 'cross_entropy'; give the "
           r"function or module itself, for example loss_fn=torch.nn.functional.cross_entropy")  # fmt: skip
    with pytest.raises(TypeError, match=fix):
        evaluate(small_mlp(), data, loss_fn="cross_entropy", batch_size=32)
    with pytest.raises(TypeError, match=fix):
        fit(small_mlp(), data, loss_fn="cross_entropy")
    with pytest.raises(TypeError, match=r"but given 3 of type int"):
        evaluate(small_mlp(), data, loss_fn=3, batch_size=32)


def test_load_checkpoint_refuses_no_path_and_a_state_dict_for_the_model(tmp_path):
    model = small_mlp()
    path = str(tmp_path / "c.pt")
    save_checkpoint(path, model=model)
    # was: TypeError: stat: path should be string, bytes, os.PathLike or integer, not NoneType
    with pytest.raises(TypeError, match=r"load_checkpoint needs the path of a checkpoint file or folder \(a str or "
                                        r"os.PathLike\), but given None of type NoneType"):  # fmt: skip
        load_checkpoint(None)
    # was: AttributeError: 'collections.OrderedDict' object has no attribute 'load_state_dict'
    with pytest.raises(TypeError, match=r"load_checkpoint's model= is what the checkpoint is loaded into, but given a "
                                        r"state dict \(OrderedDict of 4 entries\); pass the model itself "
                                        r"\(load_checkpoint\(path, model=model\)\)"):  # fmt: skip
        load_checkpoint(path, model=model.state_dict())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"load_checkpoint's optimizer= .* given a state dict \(dict of 2 entries\)"):
        load_checkpoint(path, optimizer=sgd.state_dict())
    assert set(load_checkpoint(path, model=model)) == {"model"}


def test_find_lr_on_a_loss_that_is_nan_from_the_first_step_blames_the_data_not_its_size():
    x = torch.randn(64, 64)
    x[:, 3] = float("nan")
    data = TensorDataset(x, torch.randint(0, 10, (64,)))
    # was: "the sweep recorded no loss; give more data or a larger num_steps"
    with pytest.raises(ValueError, match=r"the loss was nan from the sweep's first step \(lr 1.00e-07, too small to be "
                                         r"the cause\).*Look for nan or inf in the inputs"):  # fmt: skip
        find_lr(small_mlp(), data, batch_size=16, num_steps=8, read_every=1)


def test_a_history_row_with_a_key_epochrecord_lacks_is_named_with_the_keys_a_row_holds():
    row = History([EpochRecord(1, 0.5, 0.6, {"accuracy": 0.9}, 1e-3, 2.0, 100.0)]).to_dicts()[0]
    assert History.from_dicts([row]).records[0].metrics == {"accuracy": 0.9}
    # was: TypeError: EpochRecord.__init__() got an unexpected keyword argument 'accuracy'
    with pytest.raises(ValueError, match=r"History.from_dicts: row 1 has \['accuracy'\], which EpochRecord does not "
                                         r"take; a row holds \['epoch', 'train_loss', .*inside its 'metrics' dict"):  # fmt: skip
        History.from_dicts([row, {**row, "accuracy": 0.9}])
    with pytest.raises(ValueError, match=r"row 0 lacks \['lr'\]"):
        History.from_dicts([{k: v for k, v in row.items() if k != "lr"}])


def test_presize_images_into_an_existing_file_names_it_and_the_fix(tmp_path):
    from PIL import Image

    (tmp_path / "src").mkdir()
    Image.new("RGB", (32, 32)).save(tmp_path / "src" / "a.png")
    dst = tmp_path / "out.txt"
    dst.write_text("notes")
    # was: a bare FileExistsError: [Errno 17] File exists
    with pytest.raises(FileExistsError, match=rf"dst_dir '{dst}' is an existing file, not a folder.*Give a folder's path"):
        presize_images(str(tmp_path / "src"), str(dst), 16, progress=False)
    assert dst.read_text() == "notes"


def test_a_cached_dataset_indexed_by_a_float_names_the_index(tmp_path):
    cache_dataset(TensorDataset(torch.arange(8.0).view(8, 1)), str(tmp_path / "c"), progress=False)
    cached = CachedDataset(str(tmp_path / "c"))
    assert cached[np.int64(3)][0].item() == cached[torch.tensor(3)][0].item() == 3.0
    # was: TypeError: list indices must be integers or slices, not float
    with pytest.raises(TypeError, match=r"CachedDataset indices must be integers, but given 1.5 of type float"):
        cached[1.5]


def test_a_bf16_model_given_float32_batches_on_xla_says_what_xla_refused_and_the_ways_on():
    """XLA's HLO verifier refuses an operation mixing bf16 and fp32 ("mixed precision is disallowed"), deep in a
    graph cut: the step says which mix it is and what to give (on the CPU PyTorch names the dtypes itself)."""
    from tpu_utility import backend

    if not backend.current().lazy:
        pytest.skip("the XLA backend's own refusal")
    x = torch.randn(64, 8)
    data = TensorDataset(x, (x.sum(1) > 0).long())
    build = lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(torch.bfloat16)  # noqa: E731
    with pytest.raises(TypeError, match=r"mixes floating-point types .* precision='bf16'.* build or load it again"):
        fit(build(), data, batch_size=16)
    history = fit(build(), data, batch_size=16, precision="bf16")  # the way on
    assert math.isfinite(history.records[0].train_loss)
