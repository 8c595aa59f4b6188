"""A mirrored optimizer's update plan: one path per configuration, fixed when it is mirrored."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mirrored
from mirrored.replication.update_plan import SyncPath
from tests.reference_loops import make_mlp

SGD = torch.optim.SGD


class NotBuiltIn(torch.optim.SGD):
    """An optimizer torch does not ship: its update may read more than one parameter."""


@pytest.mark.parametrize(
    ("devices", "options", "optimizer", "path"),
    [
        (1, {}, SGD, SyncPath.AT_STEP),
        (2, {}, SGD, SyncPath.REDUCED_ON_OWNERS),
        (2, {}, NotBuiltIn, SyncPath.REDUCED),
        (2, {"cross_device_ops": mirrored.ReductionToOneDevice()}, SGD, SyncPath.REDUCED),
        (2, {"local_sgd": mirrored.LocalSGD(period=2)}, SGD, SyncPath.REDUCED),
        (2, {"zero_stage": 1}, SGD, SyncPath.REDUCED_ZERO),
        (2, {"zero_stage": 2}, SGD, SyncPath.AT_STEP),
    ],
    ids=["one-replica", "owners", "not-built-in", "to-one-device", "local-sgd", "zero1", "zero2"],
)
def test_each_configuration_takes_one_path(
    devices: int, options: dict[str, Any], optimizer: type, path: SyncPath
) -> None:
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)], **options) as strategy:
        with strategy.scope():
            model = make_mlp()
            _, mirrored_optimizer = strategy.mirror(model, optimizer(model.parameters(), lr=0.1))
        plan = mirrored_optimizer.update_plan
        assert plan.path is path
        assert (plan.reducer is None) == (path is SyncPath.AT_STEP)
        assert (plan.sharded is not None) == (path is SyncPath.REDUCED_ON_OWNERS)
        assert (plan.zero is not None) == ("zero_stage" in options)
        assert (plan.local is not None) == ("local_sgd" in options)


def test_a_plan_is_frozen() -> None:
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with strategy.scope():
            model = make_mlp()
            _, optimizer = strategy.mirror(model, SGD(model.parameters(), lr=0.1))
        with pytest.raises(AttributeError):
            optimizer.update_plan.sharded = None  # type: ignore[misc]


@pytest.mark.parametrize(
    "options",
    [
        {"gradient_accumulation_steps": 2},
        {"local_sgd": mirrored.LocalSGD(period=2)},
        {"zero_stage": 1},
    ],
    ids=["accumulation", "local-sgd", "zero"],
)
def test_step_with_a_closure_is_refused_where_it_cannot_be_exact(options: dict[str, Any]) -> None:
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], **options) as strategy:
        with strategy.scope():
            model = make_mlp()
            _, optimizer = strategy.mirror(model, SGD(model.parameters(), lr=0.1))
        refusal = optimizer.update_plan.closure_refusal()
        assert refusal is not None and "LBFGS" in refusal
        with pytest.raises(ValueError, match="needs the gradients summed in each backward"):
            strategy.run(lambda: optimizer.step(lambda: torch.zeros(())))
