"""An optimizer state loaded into the program's own optimizer after mirroring (the torch optimizer
``Model.optimizer`` returns, or the one given to ``strategy.mirror``) reaches every replica's
update, as if loaded into the mirrored optimizer."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

import mirrored
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    replica_step,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

STRATEGIES: dict[str, Callable[[], mirrored.Strategy]] = {
    "owner_updates": lambda: mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]),
    "every_replica_updates": lambda: mirrored.MirroredStrategy(
        ["cpu:0", "cpu:1", "cpu:2"], cross_device_ops=mirrored.ReductionToOneDevice()
    ),
    "zero_1": lambda: mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], zero_stage=1),
    "central_on_a_replica": lambda: mirrored.CentralStorageStrategy(["cpu:0", "cpu:1"]),
    "central_apart": lambda: mirrored.CentralStorageStrategy(["cpu:1", "cpu:2"], "cpu:0"),
}


def _adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=1e-2)


@pytest.mark.filterwarnings("ignore:zero_stage=1 saves no memory")
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_state_loaded_into_the_program_s_optimizer_reaches_every_replica(name: str) -> None:
    batches = make_batches()
    first, rest = batches[:4], batches[4:]
    trained = make_mlp()
    trained_optimizer = _adam(trained)
    train_plain(trained, trained_optimizer, first)
    saved_model = copy.deepcopy(trained.state_dict())  # training goes on in place
    saved_optimizer = copy.deepcopy(trained_optimizer.state_dict())
    train_plain(trained, trained_optimizer, rest)  # the reference: training went on

    with STRATEGIES[name]() as strategy:
        with strategy.scope():
            model = make_mlp(seed=7)
            optimizer = _adam(model)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        model.load_state_dict(saved_model)
        optimizer.load_state_dict(saved_optimizer)  # the program's own optimizer, after mirror
        for batch in strategy.experimental_distribute_dataset(rest):
            strategy.run(replica_step, (batch, mirrored_model, mirrored_optimizer))
        assert_replicas_identical(mirrored_model)
    assert_same_parameters(trained, model)


@pytest.mark.filterwarnings("ignore:zero_stage=1 saves no memory")
@pytest.mark.parametrize("name", STRATEGIES)
def test_a_state_that_does_not_fit_is_refused_before_it_changes_anything(name: str) -> None:
    """A refused load into the program's optimizer leaves its hyperparameters and state as they
    were, and the next load (the mirrored optimizer's, as Model.load makes) is the one that
    happens."""
    batches = make_batches()
    first, rest = batches[:4], batches[4:]
    trained = make_mlp()
    trained_optimizer = _adam(trained)
    train_plain(trained, trained_optimizer, first)
    saved_model = copy.deepcopy(trained.state_dict())
    saved_optimizer = copy.deepcopy(trained_optimizer.state_dict())
    train_plain(trained, trained_optimizer, rest)
    bad = copy.deepcopy(saved_optimizer)
    bad["param_groups"][0]["lr"] = 123.0
    bad["state"][0]["exp_avg"] = torch.zeros(3)

    with STRATEGIES[name]() as strategy:
        with strategy.scope():
            model = make_mlp(seed=7)
            optimizer = _adam(model)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        with pytest.raises(ValueError, match="exp_avg"):
            optimizer.load_state_dict(bad)
        assert optimizer.param_groups[0]["lr"] == 1e-2
        assert not optimizer.state_dict()["state"]
        model.load_state_dict(saved_model)
        mirrored_optimizer.load_state_dict(saved_optimizer)
        for batch in strategy.experimental_distribute_dataset(rest):
            strategy.run(replica_step, (batch, mirrored_model, mirrored_optimizer))
        assert_replicas_identical(mirrored_model)
    assert_same_parameters(trained, model)
