"""Training steps shared by the tests of mirrored modules and optimizers."""

from __future__ import annotations

import torch.nn.functional as F

import mirrored


def train_plain_scheduled(model, optimizer, scheduler, batches):
    """The plain loop with an LR scheduler stepped after every update."""
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def one_step(strategy, model, optimizer, batch):
    """One distributed step of the average cross-entropy loss."""

    def step(batch):
        x, y = batch
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(batch,))
