"""The replicated family: the mirrored strategies' features live on it, not on the contract."""

from __future__ import annotations

import pytest
import torch

import mirrored
from mirrored.core.strategy import Strategy
from mirrored.replication.mirror_features import NO_FEATURES, MirrorFeatures
from mirrored.strategies.default import default_strategy
from mirrored.strategies.in_process import InProcessStrategy
from mirrored.strategies.replicated import ReplicatedStrategy

FAMILY_ATTRIBUTES = ["gradient_accumulation_steps", "local_sgd", "zero_stage"]
# The mirrored optimizer's features (mirrored.replication.mirror_features), which the family hands
# over.
FEATURE_METHODS = [
    "accumulation_window",
    "holding_gradients",
    "local_steps",
    "zero_redundancy",
    "gradient_reducer",
]


def test_the_mirrored_strategies_are_the_replicated_family():
    assert issubclass(mirrored.MirroredStrategy, ReplicatedStrategy)
    assert issubclass(mirrored.MultiWorkerMirroredStrategy, ReplicatedStrategy)
    assert not issubclass(mirrored.PipelineStrategy, ReplicatedStrategy)
    assert not issubclass(mirrored.ParameterServerStrategy, ReplicatedStrategy)


def test_a_mirrored_strategy_keeps_its_features_as_attributes():
    local_sgd = mirrored.LocalSGD(period=2)
    with mirrored.MirroredStrategy(
        ["cpu:0", "cpu:1"], gradient_accumulation_steps=3, local_sgd=local_sgd
    ) as strategy:
        assert strategy.gradient_accumulation_steps == 3
        assert strategy.local_sgd is local_sgd
        assert strategy.zero_stage == 0
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=2) as strategy:
        assert strategy.zero_stage == 2


def test_a_pipeline_carries_none_of_the_family_features():
    with mirrored.PipelineStrategy(["cpu:0", "cpu:1"], num_microbatches=2) as strategy:
        for name in FAMILY_ATTRIBUTES + FEATURE_METHODS:
            assert not hasattr(strategy, name), name


@pytest.mark.parametrize("name", FAMILY_ATTRIBUTES + FEATURE_METHODS)
def test_the_parameter_server_strategy_carries_none_of_the_family_features(name):
    assert not hasattr(mirrored.ParameterServerStrategy, name)


@pytest.mark.parametrize("name", FEATURE_METHODS)
def test_the_base_of_the_other_strategies_carries_none_of_the_features(name):
    assert not hasattr(Strategy, name)
    assert not hasattr(InProcessStrategy, name)
    assert not hasattr(default_strategy(), name)


def test_the_family_hands_its_features_to_what_it_mirrors():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], gradient_accumulation_steps=2) as strategy:
        net = torch.nn.Linear(4, 1)
        module, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert isinstance(strategy, MirrorFeatures)
        assert module._features is strategy
        assert optimizer.accumulation_steps == 2


def test_a_pipeline_optimizer_runs_without_the_family_features():
    """PipelinedOptimizer is a mirrored optimizer: the features it is handed answer with 'none'
    (no window, no local steps, no sharding, no reducer)."""
    with mirrored.PipelineStrategy(["cpu:0", "cpu:1"], num_microbatches=2) as strategy:
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        module, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=0.1))
        assert optimizer.zero_stage == 0
        assert optimizer.accumulation_steps == 1
        assert module._features is NO_FEATURES
        assert not NO_FEATURES.holding_gradients(0)
