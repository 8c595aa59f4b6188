"""The training loop a model gets from its strategy, and what the parameter-server one refuses."""

from __future__ import annotations

import pytest
from torch import nn

import mirrored
from mirrored.training.parameter_server_fit import ParameterServerLoop
from mirrored.training.replicated_loop import ReplicatedLoop


@pytest.mark.parametrize("num_replicas", [0, 2])
def test_a_model_on_a_replicated_strategy_trains_with_the_replicated_loop(
    num_replicas: int,
) -> None:
    if num_replicas == 0:
        model = mirrored.Model(nn.Linear(2, 1))  # the default strategy
    else:
        strategy = mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
        with strategy.scope():
            model = mirrored.Model(nn.Linear(2, 1))
    assert isinstance(model._loop, ReplicatedLoop)
    assert model._loop.local_strategy is model.strategy


def test_the_parameter_server_loop_refuses_a_module_with_lazy_parameters() -> None:
    loop = ParameterServerLoop(strategy=None)  # type: ignore[arg-type]  # no cluster needed
    loop.check_compile(nn.Linear(2, 1))  # built: accepted
    with pytest.raises(ValueError, match=r"lazy parameters.*call the module once"):
        loop.check_compile(nn.Sequential(nn.LazyLinear(1)))


def test_the_parameter_server_loop_evaluates_on_the_coordinator_s_own_copy() -> None:
    loop = ParameterServerLoop(strategy=None)  # type: ignore[arg-type]
    assert loop.local_strategy is mirrored.get_strategy()  # the default strategy, one device
