"""Programs of the parameter-server tests: every task runs the job; the chief (the coordinator)
writes ``OUT_DIR/chief.pt``. The scheduled functions are module functions, importable on the
workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.cluster_coordinator import ClusterCoordinator
from mirrored.parameter_server import ParameterServerStrategy
from mirrored.partitioners import FixedShardsPartitioner

BATCH = 32


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from examples.mnist_mlp import load_digits_split

    (x, y), (x_test, y_test) = load_digits_split(seed=0)
    return (torch.from_numpy(x), torch.from_numpy(y)), (
        torch.from_numpy(x_test),
        torch.from_numpy(y_test),
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def digits_batches(context: mirrored.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's shard of the training digits, reshuffled differently per worker."""
    (x, y), _ = digits()
    mine = torch.arange(context.input_pipeline_id, len(x), context.num_input_pipelines)
    order = mine[
        torch.randperm(
            len(mine), generator=torch.Generator().manual_seed(context.input_pipeline_id)
        )
    ]
    return [(x[i], y[i]) for i in order.split(BATCH)]


def train_step(model: nn.Module, optimizer: Any, iterator: Any) -> torch.Tensor:
    x, y = next(iterator)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_digits(out: Path, mode: str = "async", epochs: str = "8") -> None:
    """Digits on 2 workers and 2 ps tasks (parameters cut in 2 shards each); the chief records
    the test accuracy and the ps tasks' parameters."""
    staleness = {"async": None, "ssp": 1}[mode]
    with ParameterServerStrategy(
        variable_partitioner=FixedShardsPartitioner(2), max_staleness=staleness, timeout_seconds=60
    ) as strategy:
        coordinator = ClusterCoordinator(strategy)
        module = make_model()
        model, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters(), 3e-3))
        iterator = iter(coordinator.create_per_worker_dataset(digits_batches))
        (x, _), (x_test, y_test) = digits()
        steps = int(epochs) * -(-len(x) // BATCH)
        losses = [
            coordinator.schedule(train_step, (model, optimizer, iterator)) for _ in range(steps)
        ]
        coordinator.join()
        model.pull()
        torch.save(
            {
                "accuracy": accuracy(model, x_test, y_test),
                "losses": torch.stack([loss.fetch() for loss in losses]),
                "weights": model.module.state_dict(),
            },
            out / "chief.pt",
        )


def plain_digits_accuracy(epochs: int = 8) -> float:
    """The same model trained synchronously on one device, for comparison."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    (x, y), (x_test, y_test) = digits()
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for index in torch.randperm(len(x), generator=generator).split(BATCH * 2):
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return accuracy(model, x_test, y_test)
