"""A model of lazy layers (``nn.LazyLinear``), whose parameters exist only once it has seen a
batch. Mirroring it before that is refused with the fix (there is nothing to copy to the
replicas yet); after the first forward, which torch's docs ask for before building the optimizer,
it mirrors and trains as on one device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from tests.reference_loops import (
    assert_same_parameters,
    make_batches,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


def make_lazy_mlp() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.LazyLinear(32), nn.ReLU(), nn.LazyLinear(16), nn.ReLU(), nn.Linear(16, 5)
    )


def test_mirror_refuses_a_lazy_model_before_it_ran():
    model = make_lazy_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(
            ValueError, match=r"0\.weight, 0\.bias, 2\.weight, 2\.bias .*model\(x\)"
        ):
            strategy.mirror(model, optimizer)
        with pytest.raises(ValueError, match="not initialised yet"):
            strategy.mirror(model)
    assert nn.parameter.is_lazy(model[0].weight)  # the refusal did not run or change the model


def _materialised(
    x: torch.Tensor, optimizer_first: bool
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A lazy MLP after its first forward on ``x``, and Adam over its parameters, built before
    that forward (lazy parameters become real ones in place) or after it (torch's docs)."""
    model = make_lazy_mlp()
    if optimizer_first:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(x)
    if not optimizer_first:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, optimizer


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["optimizer_after", "before"])
@pytest.mark.parametrize("num_devices", [2, 3])
def test_after_one_forward_it_mirrors_and_trains_as_one_device(num_devices, optimizer_first):
    batches = make_batches()  # a ragged last batch
    expected, optimizer = _materialised(batches[0][0], optimizer_first)
    train_plain(expected, optimizer, batches)

    module, optimizer = _materialised(batches[0][0], optimizer_first)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_devices)]) as strategy:
        train_mirrored(strategy, module, optimizer, batches)
    assert_same_parameters(expected, module)
