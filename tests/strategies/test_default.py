"""The default strategy's run: the base run's contract, for one replica on the caller's thread."""

from __future__ import annotations

import threading

import pytest
import torch

import mirrored
from mirrored.core.values import PerReplica, ReduceOp
from mirrored.strategies.default import default_strategy


def test_fn_runs_on_the_caller_s_thread_in_a_replica_context_of_its_own() -> None:
    strategy = default_strategy()
    batch = next(iter(strategy.experimental_distribute_dataset([torch.arange(6.0)])))
    seen = {}

    def fn(x: torch.Tensor, scale: float, *, offset: torch.Tensor) -> torch.Tensor:
        replica = mirrored.get_replica_context()
        assert replica is not None
        seen.update(
            thread=threading.current_thread(),
            replica=replica,
            id=replica.replica_id_in_sync_group,
            global_batch_size=replica.global_batch_size,
            summed=replica.all_reduce(ReduceOp.SUM, x.sum()),
            merged=replica.merge_call(lambda s, v: v, args=(3,)),
        )
        return x * scale + offset

    offset = PerReplica([torch.tensor(1.0)])
    result = strategy.run(fn, args=(batch, 2.0), kwargs={"offset": offset})
    assert torch.equal(result, torch.arange(6.0) * 2 + 1)
    assert seen["thread"] is threading.current_thread()
    assert seen["replica"] is not strategy.default_replica_context()
    assert (seen["id"], seen["global_batch_size"], seen["merged"]) == (0, 6, 3)
    assert torch.equal(seen["summed"], torch.tensor(15.0))
    assert mirrored.get_replica_context() is strategy.default_replica_context()


def test_a_failure_names_the_replica_and_the_next_run_is_clean() -> None:
    strategy = default_strategy()

    def fails() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError) as raised:
        strategy.run(fails)
    assert raised.value.__notes__ == ["raised in replica 0 of 1 (device cpu:0)"]
    assert strategy.run(lambda: mirrored.get_replica_context().merge_call(lambda s: 5)) == 5


def test_run_refuses_what_the_base_run_refuses() -> None:
    strategy = default_strategy()
    with pytest.raises(RuntimeError, match="inside a replica function"):
        strategy.run(lambda: strategy.run(lambda: None))
    with pytest.raises(TypeError, match="args must be a tuple or list"):
        strategy.run(lambda x: x, args=torch.zeros(2))  # type: ignore[arg-type]


def test_several_optimizers_come_back_unchanged_in_order():
    module = torch.nn.Linear(2, 2)
    first = torch.optim.SGD([module.weight], lr=0.1)
    second = torch.optim.SGD([module.bias], lr=0.1)
    assert mirrored.get_strategy().mirror(module, first, second) == (module, first, second)
    assert mirrored.get_strategy().mirror(module) is module
