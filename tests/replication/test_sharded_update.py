"""Owner-only updates on replicas that share memory: balanced, exact, one copy of the state."""

from __future__ import annotations

import pytest

import mirrored
from mirrored.replication.sharded_update import assign_owners
from mirrored.replication.update_plan import SyncPath
from tests.exactness import assert_close_float64
from tests.reference_loops import OPTIMIZERS, make_batches, make_mlp, train_mirrored, train_plain

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


def test_owners_are_balanced_largest_first():
    assert assign_owners([100, 10, 60, 50], 2) == [0, 0, 1, 1]
    assert assign_owners([5, 5, 5, 5], 4) == [0, 1, 2, 3]
    assert assign_owners([1], 3) == [0]
    assert assign_owners([], 2) == []


def _optimizer_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


@pytest.mark.parametrize("name", ["adam", "sgd_momentum"])
def test_state_is_one_copy_shared_by_every_replica_and_state_dict_is_complete(name):
    batches = make_batches()
    reference = make_mlp()
    reference_optimizer = OPTIMIZERS[name](reference)
    train_plain(reference, reference_optimizer, batches)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model = make_mlp()
        _, optimizer, _ = train_mirrored(strategy, model, OPTIMIZERS[name](model), batches)
    primary = optimizer.optimizer
    for replica_optimizer in optimizer.optimizers[1:]:
        for first, param in zip(
            _optimizer_params(primary), _optimizer_params(replica_optimizer), strict=True
        ):
            assert replica_optimizer.state[param] is primary.state[first]
    expected, actual = reference_optimizer.state_dict(), optimizer.state_dict()
    assert expected["param_groups"] == actual["param_groups"]
    assert expected["state"].keys() == actual["state"].keys()
    for index, state in expected["state"].items():
        for key, value in state.items():
            assert_close_float64(actual["state"][index][key], value)


def test_unknown_optimizers_update_in_full_on_every_replica():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = make_mlp()
        _, optimizer = strategy.mirror(model, OPTIMIZERS["custom"](model))
        assert optimizer.update_plan.path is SyncPath.REDUCED
        model = make_mlp()
        _, optimizer = strategy.mirror(model, OPTIMIZERS["adam"](model))
        assert optimizer.update_plan.path is SyncPath.REDUCED_ON_OWNERS
