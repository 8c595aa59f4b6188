"""The Strategy contract: what every strategy implements, the parameter-server one included."""

from __future__ import annotations

import pytest

import mirrored
from mirrored.core.strategy import Strategy
from mirrored.strategies.default import default_strategy
from mirrored.strategies.in_process import InProcessStrategy
from mirrored.strategies.parameter_server import ParameterServerStrategy

CONTRACT = {
    "num_replicas_in_sync",
    "should_checkpoint",
    "save_on_chief",
    "check_same_on_workers",
    "mirror",
    "close",
    "closed",
}
ALL_STRATEGIES = [
    mirrored.MirroredStrategy,
    mirrored.MultiWorkerMirroredStrategy,
    mirrored.PipelineStrategy,
    ParameterServerStrategy,
    type(default_strategy()),
]
# Strategies that close (the default strategy never does), made without a cluster.
MAKE_CLOSABLE = [
    lambda: mirrored.MirroredStrategy(["cpu:0", "cpu:1"]),
    lambda: mirrored.PipelineStrategy(["cpu:0", "cpu:1"], num_microbatches=2),
]


def test_the_public_strategy_is_the_contract():
    assert mirrored.Strategy is Strategy


def test_the_contract_is_what_every_strategy_must_decide():
    assert Strategy.__abstractmethods__ == CONTRACT


@pytest.mark.parametrize("strategy_class", ALL_STRATEGIES, ids=lambda c: c.__name__)
def test_every_strategy_implements_the_contract(strategy_class):
    assert issubclass(strategy_class, Strategy)
    assert not strategy_class.__abstractmethods__


@pytest.mark.parametrize("missing", sorted(CONTRACT))
def test_a_strategy_missing_part_of_the_contract_cannot_be_made(missing):
    members = {name: getattr(ParameterServerStrategy, name) for name in CONTRACT}
    del members[missing]
    incomplete = type("Incomplete", (Strategy,), members)
    with pytest.raises(TypeError, match=missing):
        incomplete()


def test_the_parameter_server_strategy_is_a_strategy_without_in_process_replicas():
    assert issubclass(ParameterServerStrategy, Strategy)
    assert not issubclass(ParameterServerStrategy, InProcessStrategy)
    assert ParameterServerStrategy.should_use_with_coordinator
    for name in ("run", "reduce", "experimental_distribute_dataset"):
        assert not hasattr(ParameterServerStrategy, name), name


@pytest.mark.parametrize("make", MAKE_CLOSABLE, ids=["mirrored", "pipeline"])
def test_closed_says_whether_close_was_called(make):
    strategy = make()
    assert isinstance(strategy, Strategy)
    assert not strategy.closed
    strategy.close()
    assert strategy.closed


@pytest.mark.parametrize("make", MAKE_CLOSABLE, ids=["mirrored", "pipeline"])
def test_a_strategy_is_its_own_context_manager_and_scope(make):
    with make() as strategy, strategy.scope() as scoped:
        assert scoped is strategy
        assert mirrored.get_strategy() is strategy
    assert strategy.closed


def test_the_default_strategy_is_never_closed():
    strategy = default_strategy()
    assert isinstance(strategy, Strategy)
    strategy.close()
    assert not strategy.closed
    assert mirrored.get_strategy() is strategy
