"""Issue 59: each graph a run compiles on XLA, with its compile seconds, size and cause, in History and warnings."""

import warnings

import torch
from torch import nn
from torch.utils.data import TensorDataset

from tpu_utility import Callback, backend, get_device, one_cycle_fit


def test_last_compiles_gives_each_graphs_seconds_and_size_in_order():
    import torch_xla

    dev = get_device()
    a = torch.randn(7, 7, device=dev)  # shapes no other test uses: torch_xla would reuse a graph compiled before
    torch_xla.sync()
    before = backend.compile_count()
    b = (a + 1).sum()  # kept alive: a graph is what live tensors wait for
    torch_xla.sync()  # a small graph
    c = a
    for _ in range(30):
        c = (c @ a).tanh()
    torch_xla.sync()  # a graph about 30 times larger
    small, large = backend.current().diagnosis.last_compiles(backend.compile_count() - before)
    assert small.seconds > 0 and large.seconds > 0
    assert large.nodes > 10 * small.nodes, (small, large)


class Narrow(nn.Module):
    """Uses the first `width` features: a Python value that changes the traced graph, not the input shapes."""

    def __init__(self):
        super().__init__()
        self.width, self.fc = 8, nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(nn.functional.pad(x[:, : self.width], (0, 8 - self.width)))


class Narrower(Callback):
    def on_train_epoch_start(self, loop, epoch):
        loop.model.width = 8 if epoch == 0 else 6


def test_history_lists_each_graph_and_a_later_recompile_is_warned_with_its_cause():
    torch.manual_seed(0)
    x, y = torch.randn(48, 8), torch.randint(0, 2, (48,))
    model = Narrow()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = one_cycle_fit(model, TensorDataset(x, y), valid_data=TensorDataset(x[:16], y[:16]), epochs=2,
                                max_lr=1e-2, batch_size=16, progress=False, callbacks=[Narrower()])
    first = [g for g in history.graphs if g.epoch == 1]
    kinds = {g.graph for g in first}
    # the model's own graphs; the epoch's figures (loss sums of these batch counts) are a graph another run of this
    # process may have compiled already, which torch_xla reuses (not listed then)
    assert {"train step", "eval step"} <= kinds, history.graphs
    assert all(k in ("setup", "epoch figures") or k.endswith(("train step", "eval step")) for k in kinds), kinds
    assert all(g.seconds > 0 and g.nodes > 0 for g in history.graphs), history.graphs
    train = next(g for g in first if g.graph == "train step")
    assert train.shapes == [(16, 8), (16,)] and train.cause == "the first train step"
    later = [g for g in history.graphs if g.epoch == 2]
    assert later and {g.graph for g in later} >= {"train step"}, history.graphs
    assert all("the same input shapes as an earlier" in g.cause for g in later if g.graph != "epoch figures")
    said = [str(w.message) for w in caught if "after the first epoch" in str(w.message)]
    assert said and "train step [(16, 8), (16,)]: the same input shapes as an earlier train step" in said[0], said
