"""The two-line port: a CUDA loop with only the device line and the step line changed."""

import torch
from torch import nn
from torch.utils.data import DataLoader

from conftest import flat_digits, small_mlp
from tpu_utility import get_device, step_optimizer, backend


def test_two_line_port_trains_without_recompiling():
    torch.manual_seed(0)
    train_ds = flat_digits()
    # --- a plain training loop, as written for CUDA ---
    device = get_device()  # was: torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = small_mlp().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    loader = DataLoader(train_ds, batch_size=32, shuffle=True, drop_last=True)
    epoch_losses, compiles = [], []
    for epoch in range(3):
        running_loss = 0.0
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            step_optimizer(optimizer)  # was: optimizer.step()
            running_loss += loss.item()  # a host sync per step: correct, if not the fastest
        epoch_losses.append(running_loss / len(loader))
        compiles.append(backend.compile_count())
    # --- end of the loop ---
    assert device.type == "xla"
    assert epoch_losses[-1] < 0.5 * epoch_losses[0], epoch_losses
    assert compiles[0] > 0
    assert compiles[0] == compiles[1] == compiles[2], f"compiles per epoch {compiles}"
