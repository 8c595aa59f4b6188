"""The plain single-device loop and its mirrored twin, for equivalence tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.exactness import assert_close_float64

Batch = tuple[torch.Tensor, torch.Tensor]


def make_batches(
    num_examples: int = 203,
    batch_size: int = 16,
    features: int = 12,
    classes: int = 5,
    seed: int = 0,
) -> list[Batch]:
    """A classification data set whose last batch is ragged (203 = 12 * 16 + 11)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_examples, features, generator=generator)
    y = torch.randint(0, classes, (num_examples,), generator=generator)
    return [
        (x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, num_examples, batch_size)
    ]


def merge_batches(batches: Sequence[Batch], steps: int) -> list[Batch]:
    """Every ``steps`` consecutive batches as one (an unfinished group left out): what one
    device sees where gradient accumulation sees ``steps`` micro-batches."""
    return [
        (
            torch.cat([x for x, _ in batches[i : i + steps]]),
            torch.cat([y for _, y in batches[i : i + steps]]),
        )
        for i in range(0, len(batches) - steps + 1, steps)
    ]


def make_mlp(features: int = 12, classes: int = 5, seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, classes)
    )


class _ScaledSGD(torch.optim.SGD):
    """A user-defined optimizer (a subclass counts as unknown): the unsharded update path."""


class DeepNet(nn.Module):
    """Eight equal hidden layers (so shares can be even), a frozen embedding of the input and a
    head no loss uses (its gradient stays None)."""

    def __init__(self, features: int = 12, classes: int = 5, width: int = 24) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.inp = nn.Linear(features, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(8))
        self.out = nn.Linear(width, classes)
        self.unused = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.frozen(self.inp(x)))
        for layer in self.hidden:
            h = torch.relu(layer(h))
        return self.out(h)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """Two groups: decay on the weights only."""
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW(
        [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}],
        lr=1e-2,
    )


def compiled_deep_net(strategy: mirrored.Strategy) -> mirrored.Model:
    """A DeepNet under ``strategy``'s scope, compiled with AdamW's two groups."""
    with strategy.scope():
        net = DeepNet()
        model = mirrored.Model(net)
        model.compile(
            optimizer=adamw(net),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    # Not a per-parameter optimizer known to mirrored: every replica runs the full update.
    "custom": lambda m: _ScaledSGD(m.parameters(), lr=0.05),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
}


CROSS_DEVICE_OPS = {
    "default": lambda: None,
    "hierarchical": lambda: mirrored.HierarchicalCopyAllReduce(),
    "one_device": lambda: mirrored.ReductionToOneDevice(),
    "hierarchical_unpacked": lambda: mirrored.HierarchicalCopyAllReduce(num_packs=0),
    "one_device_small_packs": lambda: mirrored.ReductionToOneDevice(bytes_per_pack=1024),
}


def train_plain(
    model: nn.Module, optimizer: torch.optim.Optimizer, batches: Sequence[Batch]
) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_mirrored(
    strategy: mirrored.Strategy,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: Sequence[Batch],
    set_to_none: bool = True,
    options: mirrored.InputOptions | None = None,
    step: Callable[..., torch.Tensor] | None = None,
) -> tuple[mirrored.MirroredModule, mirrored.MirroredOptimizer, list[float]]:
    """The issue's program, verbatim in spirit (``set_to_none``: how it zeroes gradients;
    ``options``: how the input is read; ``step``: ``replica_step`` or a wrapper of it, such as
    ``mirrored.function(replica_step)``)."""
    mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
    losses = []
    for batch in strategy.experimental_distribute_dataset(batches, options):
        args = (batch, mirrored_model, mirrored_optimizer, set_to_none)
        result = strategy.run(step or replica_step, args)
        losses.append(strategy.reduce("sum", result, axis=None).item())
    return mirrored_model, mirrored_optimizer, losses


def replica_step(
    batch: Batch,
    model: mirrored.MirroredModule,
    optimizer: mirrored.MirroredOptimizer,
    set_to_none: bool = True,
) -> torch.Tensor:
    """What each replica runs: the loss over the global batch, backward, the update."""
    x, y = batch
    loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return loss


def assert_same_parameters(
    expected: nn.Module, actual: nn.Module, rtol: float | None = None, atol: float | None = None
) -> None:
    """The same state, to float64's reordering (``tests.exactness``); an explicit ``rtol`` and
    ``atol`` make it an approximate comparison, whose reason the caller states."""
    for (name, a), b in zip(
        expected.state_dict().items(), actual.state_dict().values(), strict=True
    ):
        if rtol is None or atol is None:
            assert_close_float64(b, a, msg=name)
        else:
            torch.testing.assert_close(b.cpu(), a.cpu(), rtol=rtol, atol=atol, msg=name)


def assert_replicas_identical(model: mirrored.MirroredModule) -> None:
    first = model.replicas[0].state_dict()
    for replica in model.replicas[1:]:
        for name, value in replica.state_dict().items():
            assert torch.equal(value.cpu(), first[name].cpu()), f"replica diverged at {name}"


def assert_same_state(expected: dict, actual: dict) -> None:
    """Two optimizer state dicts hold the same groups and (to float tolerance) state."""
    assert actual["param_groups"] == expected["param_groups"]
    assert sorted(actual["state"]) == sorted(expected["state"])
    for index, state in expected["state"].items():
        assert sorted(actual["state"][index]) == sorted(state)
        for key, value in state.items():
            assert_close_float64(actual["state"][index][key], value)
