"""The training loop a model gets from its strategy, and what the parameter-server one refuses."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from torch import nn

import mirrored
from mirrored.training import model as model_module
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


class _CoordinatedStrategy(mirrored.Strategy):
    """The contract alone, with steps scheduled through a coordinator: no parameter servers."""

    should_use_with_coordinator = True
    num_replicas_in_sync = 1
    should_checkpoint = True
    closed = False

    def save_on_chief(self, write: Any) -> None:
        write()

    def check_same_on_workers(self, value: Any, what: str) -> None:
        pass

    def mirror(self, module: Any, optimizer: Any = None, *, sync_batch_norm: bool = False) -> Any:
        return module if optimizer is None else (module, optimizer)

    def close(self) -> None:
        pass


def test_the_loop_is_chosen_by_the_contract_not_by_the_strategy_s_class() -> None:
    with _CoordinatedStrategy().scope():
        model = mirrored.Model(nn.Linear(2, 1))
    assert isinstance(model._loop, ParameterServerLoop)
    assert model._loop.strategy is model.strategy


def test_the_model_names_no_kind_of_strategy() -> None:
    """``Model`` is written against the contract: no strategy class is imported or tested."""
    tree = ast.parse(Path(model_module.__file__).read_text())
    named = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    named |= {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert not [name for name in named if name.endswith("Strategy")]
