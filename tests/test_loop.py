"""device_loader, masked_loader, launch and use_all_cores, and step_optimizer's graph cut."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

from conftest import BLOCK_TORCH_XLA, run_python
from tpu_utility import device_loader, get_device, launch, masked_loader, step_optimizer, backend
from tpu_utility.optim import _CHECKED


def _regression_data(n: int = 320, features: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, x @ torch.arange(float(features)).unsqueeze(1) / features)


def _manual_update_epochs(wrap, features: int, epochs: int = 2) -> list[int]:
    """A loop with a hand-written SGD update, no optimizer, and loss.item(); compiles per epoch."""
    torch.manual_seed(0)
    device = get_device()
    model = nn.Linear(features, 1).to(device)
    loader = DataLoader(_regression_data(features=features), batch_size=32, drop_last=True)
    per_epoch = []
    for _ in range(epochs):
        before = backend.compile_count()
        total = 0.0
        for x, y in wrap(loader):
            x, y = x.to(device), y.to(device)
            model.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-0.05)
            total += loss.item()
        backend.sync()
        per_epoch.append(backend.compile_count() - before)
    return per_epoch


def test_manual_update_needs_device_loader_to_stop_recompiling():
    # different shapes per variant, so neither finds the other's graphs in the cache
    grown = _manual_update_epochs(lambda loader: loader, features=7)
    fixed = _manual_update_epochs(device_loader, features=9)
    assert grown[0] >= 10, f"10 steps without a graph cut: the graph grows, a compile per step: {grown}"
    assert fixed[0] <= 3 and fixed[1] == 0, f"device_loader cuts the graph per batch: compiles per epoch {fixed}"


def test_step_optimizer_and_device_loader_cut_the_graph_once_per_step():
    torch.manual_seed(0)
    device = get_device()
    model = nn.Linear(8, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(_regression_data(), batch_size=32, drop_last=True)
    runs = []
    for _ in range(3):
        before = backend.execute_count()
        running = torch.zeros((), device=device)
        for x, y in device_loader(loader):
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            step_optimizer(optimizer)
            running += loss.detach()  # runs with the next step's graph, not as a graph of its own
        running.item()
        runs.append(backend.execute_count() - before)
    # 10 steps: one graph each, plus the epoch's tail (last sum, read); a second cut would add 10
    assert runs[-1] <= len(loader) + 2, f"graphs run per epoch: {runs}"


def test_device_loader_off_xla_moves_nested_batches_and_keeps_length():
    batches = [{"x": torch.ones(2, 3), "meta": "a"}, {"x": torch.zeros(2, 3), "meta": "b"}]
    loader = device_loader(batches, torch.device("cpu"))
    assert len(loader) == 2
    for _ in range(2):  # re-iterable, one pass per epoch
        out = list(loader)
        assert [b["meta"] for b in out] == ["a", "b"]
        assert all(b["x"].device.type == "cpu" for b in out)


def test_device_loader_refuses_a_dataset_of_single_samples():
    with pytest.raises(TypeError, match=r"but given the dataset TensorDataset.*DataLoader\(dataset, batch_size=64"):
        device_loader(_regression_data(8))
    with pytest.raises(TypeError, match="iterable of batches, but given int"):
        device_loader(3)


def test_device_loader_on_xla_gives_device_batches():
    loader = DataLoader(_regression_data(64), batch_size=16)
    batches = list(device_loader(loader))
    assert len(batches) == 4 and all(x.device.type == "xla" for x, _ in batches)


def test_masked_loader_pads_to_full_batches_and_masks_the_padding():
    ds = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    out = list(masked_loader(ds, batch_size=4))
    assert [tuple(y.shape) for (_, y), _ in out] == [(4,), (4,), (4,)]
    ys = torch.cat([y[m] for (_, y), m in out])
    assert sorted(ys.tolist()) == list(range(10))  # each sample once; the 2 padded ones masked
    loader = DataLoader(ds, batch_size=4, num_workers=0)
    assert len(masked_loader(loader)) == 3


def test_masked_loader_refuses_what_it_would_silently_change():
    ds = TensorDataset(torch.arange(10.0), torch.arange(10))
    subset = DataLoader(ds, batch_size=4, sampler=SubsetRandomSampler(range(5)))
    with pytest.raises(ValueError, match="sampler is a SubsetRandomSampler.*Subset"):
        masked_loader(subset)
    with pytest.raises(ValueError, match=r"batch_size=8 differs from data.batch_size=4"):
        masked_loader(DataLoader(ds, batch_size=4), batch_size=8)
    with pytest.warns(UserWarning, match="drop_last=True is not used"):
        assert len(masked_loader(DataLoader(ds, batch_size=4, drop_last=True))) == 3


def test_launch_validates_start_method():
    with pytest.raises(ValueError, match=r"start_method must be one of \('auto', 'fork', 'spawn'\), but given 'thread'"):
        launch(print, start_method="thread")


def test_cpu_params_with_gradients_are_a_cpu_model_not_a_stale_optimizer():
    model = nn.Linear(4, 1)  # trained on the CPU on purpose while XLA is in use
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    get_device()
    model(torch.ones(2, 4)).sum().backward()
    before = model.weight.detach().clone()
    step_optimizer(optimizer)
    assert not torch.equal(before, model.weight)
    assert optimizer in _CHECKED  # checked once, not every step


def test_off_xla_use_all_cores_is_one_and_launch_runs_here():
    r = run_python(BLOCK_TORCH_XLA + """
import torch
from tpu_utility import device_loader, launch, use_all_cores
print("cores", use_all_cores())
seen = []
launch(lambda index, tag: seen.append((index, tag)), args=("here",))
print("launched", seen)
print("moved", [x.device.type for x in device_loader([torch.ones(1)])])
""", env={"PJRT_DEVICE": None})  # a machine without torch_xla sets no PJRT device
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cores 1" in r.stdout
    assert "launched [(0, 'here')]" in r.stdout
    assert "moved ['cpu']" in r.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_loader_and_masked_loader_on_cuda():
    cuda = torch.device("cuda")
    ds = TensorDataset(torch.arange(10.0).unsqueeze(1), torch.arange(10))
    batches = list(device_loader(masked_loader(ds, batch_size=4), cuda))
    assert all(x.is_cuda and y.is_cuda and m.is_cuda for (x, y), m in batches)
    assert sum(int(y[m].sum()) for (_, y), m in batches) == 45


def test_each_launched_process_gets_its_own_part(monkeypatch):
    # what make_sampler and masked_loader see inside launch() with 4 processes, as process 2
    monkeypatch.setattr(backend.current().processes, "world_size", lambda: 4)
    monkeypatch.setattr(backend.current().processes, "rank", lambda: 2)
    from tpu_utility import make_sampler

    ds = TensorDataset(torch.arange(10.0), torch.arange(10))
    sampler = make_sampler(ds, shuffle=False)
    assert (sampler.num_replicas, sampler.rank, list(sampler)) == (4, 2, [2, 6, 0])  # 0: padding
    parts = list(masked_loader(ds, batch_size=2))  # padded to 16 = 2 batches x 2 x 4 processes
    assert [(y.tolist(), m.tolist()) for (_, y), m in parts] == [([2, 6], [True, True]), ([0, 4], [False, False])]


def _open_handle(worker_id):  # a user's per-worker set-up (an HDF5/LMDB handle, say)
    pass


def test_masked_loader_keeps_the_loaders_own_settings():
    generator = torch.Generator().manual_seed(3)
    loader = DataLoader(TensorDataset(torch.arange(10.0)), batch_size=4, num_workers=1,
                        worker_init_fn=_open_handle, generator=generator, timeout=30)  # fmt: skip
    masked = masked_loader(loader)
    assert (masked.worker_init_fn, masked.generator, masked.timeout, masked.num_workers) == (_open_handle, generator, 30, 1)
    values = torch.cat([b[0][m] for b, m in masked])
    assert sorted(values.tolist()) == [float(i) for i in range(10)]  # each sample once, through a worker
