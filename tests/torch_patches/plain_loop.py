"""A plain torch training loop, run both inside the test process (after strategies were used and
collected) and in a fresh interpreter that never imported mirrored: the two must agree bit for
bit (``python -m tests.torch_patches.plain_loop OUT`` saves its state dict to OUT)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn


def train_plain(steps: int = 6) -> dict[str, torch.Tensor]:
    """A few SGD steps with dropout, ``clip_grad_norm_`` and an LR schedule (no mirrored)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(steps):
        x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
        F.cross_entropy(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {**model.state_dict(), "lr": torch.tensor(optimizer.param_groups[0]["lr"])}


if __name__ == "__main__":
    torch.save(train_plain(), sys.argv[1])
