"""The Strategy contract: an abstract base that every strategy completes."""

from __future__ import annotations

import pytest

import mirrored
from mirrored.default_strategy import default_strategy
from mirrored.strategy import Strategy


def test_the_base_strategy_cannot_be_made():
    with pytest.raises(TypeError, match="abstract"):
        Strategy([], mirrored.HierarchicalCopyAllReduce(), None)  # type: ignore[abstract]


@pytest.mark.parametrize("missing", ["_execute", "mirror", "close", "closed"])
def test_a_strategy_missing_part_of_the_contract_cannot_be_made(missing):
    complete = type(default_strategy())
    members = {name: getattr(complete, name) for name in Strategy.__abstractmethods__}
    del members[missing]
    incomplete = type("Incomplete", (Strategy,), members)
    with pytest.raises(TypeError, match=missing):
        incomplete(default_strategy().devices, mirrored.HierarchicalCopyAllReduce(), None)


def test_the_contract_is_what_a_strategy_must_decide():
    assert Strategy.__abstractmethods__ == {"_execute", "mirror", "close", "closed"}


@pytest.mark.parametrize(
    "make",
    [
        lambda: mirrored.MirroredStrategy(["cpu:0", "cpu:1"]),
        lambda: mirrored.PipelineStrategy(["cpu:0", "cpu:1"], num_microbatches=2),
    ],
    ids=["mirrored", "pipeline"],
)
def test_closed_says_whether_close_was_called(make):
    strategy = make()
    assert not strategy.closed
    strategy.close()
    assert strategy.closed


def test_the_default_strategy_is_never_closed():
    strategy = default_strategy()
    strategy.close()
    assert not strategy.closed
    assert mirrored.get_strategy() is strategy
