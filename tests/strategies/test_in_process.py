"""The in-process strategies' base: an abstract class that each strategy whose replicas run in
this process completes."""

from __future__ import annotations

import pytest

import mirrored
from mirrored.strategies.default import default_strategy
from mirrored.strategies.in_process import InProcessStrategy


@pytest.mark.parametrize(
    "strategy_class",
    [mirrored.MirroredStrategy, mirrored.PipelineStrategy, type(default_strategy())],
    ids=lambda c: c.__name__,
)
def test_the_in_process_strategies_run_their_steps_here(strategy_class):
    assert issubclass(strategy_class, InProcessStrategy)
    assert not strategy_class.should_use_with_coordinator


def test_the_in_process_base_cannot_be_made():
    with pytest.raises(TypeError, match="abstract"):
        InProcessStrategy([], mirrored.HierarchicalCopyAllReduce(), None)  # type: ignore[abstract]


@pytest.mark.parametrize("missing", ["_execute", "mirror", "close", "closed"])
def test_an_in_process_strategy_missing_part_of_its_base_cannot_be_made(missing):
    complete = type(default_strategy())
    members = {name: getattr(complete, name) for name in InProcessStrategy.__abstractmethods__}
    del members[missing]
    incomplete = type("Incomplete", (InProcessStrategy,), members)
    with pytest.raises(TypeError, match=missing):
        incomplete(default_strategy().devices, mirrored.HierarchicalCopyAllReduce(), None)


def test_the_in_process_base_leaves_what_each_strategy_decides():
    assert InProcessStrategy.__abstractmethods__ == {"_execute", "mirror", "close", "closed"}
