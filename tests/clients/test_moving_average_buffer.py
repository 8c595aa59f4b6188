"""A model that keeps state in buffers it updates in forward, BatchNorm-free: it centres its
input on an exponential moving average of the batch means (TensorFlow's
``ExponentialMovingAverage`` decay, which warms up with a step counter), as input normalisers in
reinforcement learning code do. Under MirroredStrategy each replica updates its copy from its
shard; after each step the floating average is averaged over the replicas (with shards of equal
size, the mean of the shard means is the global batch's mean) and the counter, which every
replica advances alike, is left as it is, with one warning that names it and says how to
state that choice: the run equals one device's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


class CentredMLP(nn.Module):
    def __init__(self, in_place: bool) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.in_place = in_place
        self.net = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 5))
        self.register_buffer("ema", torch.zeros(12))
        self.register_buffer("num_updates", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.net(x - self.ema)
        if self.training:
            with torch.no_grad():
                self.num_updates += 1
                decay = ((1 + self.num_updates) / (10 + self.num_updates)).clamp(max=0.99)
                if self.in_place:
                    self.ema.mul_(decay).add_((1 - decay) * x.mean(dim=0))
                else:
                    self.ema = decay * self.ema + (1 - decay) * x.mean(dim=0)
        return out


@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "reassigned"])
@pytest.mark.parametrize("num_devices", [2, 4])
def test_moving_average_and_counter_follow_one_device(num_devices, in_place):
    batches = make_batches(num_examples=16 * 8, seed=3)  # shards of equal size
    batches = [(x + 2.0, y) for x, y in batches]  # a mean far from the average's start
    expected = CentredMLP(in_place)
    train_plain(expected, torch.optim.SGD(expected.parameters(), lr=0.1), batches)
    module = CentredMLP(in_place)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_devices)]) as strategy:
        with pytest.warns(mirrored.BufferAggregationWarning, match="'num_updates'") as warned:
            model, _, _ = train_mirrored(
                strategy, module, torch.optim.SGD(module.parameters(), lr=0.1), batches
            )
        assert len(warned) == 1  # once, not every step
        assert_replicas_identical(model)
    assert module.num_updates.item() == len(batches)
    assert_same_parameters(expected, module)  # buffers included
    assert not torch.allclose(module.ema, torch.zeros(12), atol=1.0)


def test_the_average_is_used_by_evaluation_on_the_mirrored_model():
    batches = make_batches(num_examples=16 * 4, seed=3)
    expected = CentredMLP(in_place=True)
    train_plain(expected, torch.optim.SGD(expected.parameters(), lr=0.1), batches)
    module = CentredMLP(in_place=True)
    x, y = batches[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.warns(mirrored.BufferAggregationWarning, match="'num_updates'"):
            model, _, _ = train_mirrored(
                strategy, module, torch.optim.SGD(module.parameters(), lr=0.1), batches
            )
        model.eval()
        with torch.no_grad():
            loss = F.cross_entropy(model(x), y)
    expected.eval()
    with torch.no_grad():
        assert_close_float64(loss, F.cross_entropy(expected(x), y))
