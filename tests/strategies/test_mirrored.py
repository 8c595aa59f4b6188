"""MirroredStrategy against the plain single-device loop, and its run/reduce/gather contract."""

from __future__ import annotations

import gc
import threading
import weakref
from types import MethodType

import pytest
import torch
from torch import nn

import mirrored
from tests.exactness import assert_close_float64, assert_within_reordering, sharded_forward
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("ops_name", sorted(CROSS_DEVICE_OPS))
def test_matches_single_device_with_ragged_last_batch(num_replicas, optimizer_name, ops_name):
    batches = make_batches()  # 203 examples in batches of 16: the last holds 11
    reference = make_mlp()
    reference_losses = train_plain(reference, OPTIMIZERS[optimizer_name](reference), batches)

    devices = [f"cpu:{i}" for i in range(num_replicas)]
    with mirrored.MirroredStrategy(devices, CROSS_DEVICE_OPS[ops_name]()) as strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS[optimizer_name](model)
        mirrored_model, _, losses = train_mirrored(strategy, model, optimizer, batches)

    assert_same_parameters(reference, mirrored_model)
    assert_replicas_identical(mirrored_model)
    assert_close_float64(losses, reference_losses)


@pytest.mark.float32
@pytest.mark.parametrize("num_replicas", [2, 3, 4])
@pytest.mark.parametrize("optimizer_name", ["sgd_momentum", "adam"])
def test_float32_matches_the_plain_loop_to_its_own_rounding(num_replicas, optimizer_name):
    """What users run: float32, where N replicas are as close to the plain loop as the plain
    loop summing each batch in the same N shards is (tests/exactness.py)."""
    batches = make_batches()
    reference, reordered = make_mlp(), make_mlp()
    train_plain(reference, OPTIMIZERS[optimizer_name](reference), batches)
    reordered.forward = MethodType(sharded_forward(nn.Sequential.forward, num_replicas), reordered)
    train_plain(reordered, OPTIMIZERS[optimizer_name](reordered), batches)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        model = make_mlp()
        mirrored_model, _, _ = train_mirrored(
            strategy, model, OPTIMIZERS[optimizer_name](model), batches
        )
    assert next(mirrored_model.parameters()).dtype == torch.float32
    assert_within_reordering(reference, mirrored_model, reordered)
    assert_replicas_identical(mirrored_model)


def test_batches_smaller_than_replica_count_give_empty_shards():
    batches = make_batches(num_examples=23, batch_size=3)  # last batch: 2 examples on 4 replicas
    reference = make_mlp()
    train_plain(reference, OPTIMIZERS["sgd_momentum"](reference), batches)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(4)]) as strategy:
        model = make_mlp()
        mirrored_model, _, _ = train_mirrored(
            strategy, model, OPTIMIZERS["sgd_momentum"](model), batches
        )
    assert_same_parameters(reference, mirrored_model)


def test_run_slices_per_replica_arguments_and_regroups_results():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        values = mirrored.PerReplica([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)])

        def fn(value, scale, *, offset):
            replica = mirrored.get_replica_context()
            return {"id": replica.replica_id_in_sync_group, "value": value * scale + offset}

        result = strategy.run(fn, args=(values, 10.0), kwargs={"offset": 1.0})
        assert isinstance(result["id"], mirrored.PerReplica)
        assert strategy.experimental_local_results(result["id"]) == (0, 1, 2)
        assert [v.item() for v in result["value"].values] == [11.0, 21.0, 31.0]
        assert strategy.run(lambda: "same") == "same"


def test_reduce_with_and_without_axis_is_exact_on_ragged_shards():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        data = torch.arange(10.0).reshape(10, 1).repeat(1, 2)
        (batch,) = list(strategy.experimental_distribute_dataset([data]))  # shards 4, 3, 3
        per_replica = strategy.run(lambda shard: shard * 1.0, args=(batch,))
        torch.testing.assert_close(strategy.reduce("mean", per_replica, axis=0), data.mean(0))
        torch.testing.assert_close(
            strategy.reduce(mirrored.ReduceOp.SUM, per_replica, axis=0), data.sum(0)
        )
        sums = strategy.run(lambda shard: shard.sum(), args=(batch,))
        assert strategy.reduce("SUM", sums, axis=None).item() == data.sum().item()
        assert strategy.reduce("mean", sums, axis=None).item() == pytest.approx(data.sum() / 3)
        torch.testing.assert_close(strategy.gather(per_replica, axis=0), data)
        nested = strategy.reduce("sum", {"a": sums, "b": [sums]}, axis=None)
        assert nested["a"].item() == nested["b"][0].item() == data.sum().item()


def test_reduce_rejects_bad_ops_and_treats_plain_values_as_mirrored():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(ValueError, match="reduce_op='max'"):
            strategy.reduce("max", mirrored.PerReplica([torch.ones(1)] * 2), axis=None)
        # Equal small ints are one object: run() returns it unwrapped, SUM still counts both.
        counts = strategy.run(lambda: 3)
        assert counts == 3
        assert strategy.reduce("sum", counts, axis=None).item() == 6
        assert strategy.reduce("mean", torch.ones(1), axis=None).item() == 1.0


def test_distribute_values_from_function_places_values_per_replica():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        values = strategy.experimental_distribute_values_from_function(
            lambda ctx: torch.full((2,), float(ctx.replica_id_in_sync_group))
        )
        result = strategy.run(lambda v: v.sum(), args=(values,))
        assert [v.item() for v in strategy.experimental_local_results(result)] == [0.0, 2.0]


def test_single_replica_strategy_returns_plain_values():
    with mirrored.MirroredStrategy(["cpu:1"]) as strategy:
        assert strategy.num_replicas_in_sync == 1
        result = strategy.run(lambda: torch.tensor(2.0))
        assert isinstance(result, torch.Tensor)
        assert strategy.experimental_local_results(result) == (result,)
        assert strategy.reduce("sum", result, axis=None).item() == 2.0


def test_default_devices_are_the_gpus_else_all_logical_cpu_devices():
    # TensorFlow's default: every GPU where there is one, else the (here split) CPU.
    gpus = torch.cuda.device_count()
    expected = [f"cuda:{i}" for i in range(gpus)] or ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    with mirrored.MirroredStrategy() as strategy:
        assert [d.short_name for d in strategy.devices] == expected
        if not gpus:
            assert isinstance(strategy.cross_device_ops, mirrored.HierarchicalCopyAllReduce)


def test_constructor_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"does not exist.*cpu:0"):
        mirrored.MirroredStrategy(["cpu:0", "cpu:9"])
    with pytest.raises(ValueError, match="listed twice"):
        mirrored.MirroredStrategy(["cpu:0", "/device:CPU:0"])
    with pytest.raises(ValueError, match="NcclAllReduce needs CUDA devices"):
        mirrored.MirroredStrategy(["cpu:0", "cpu:1"], mirrored.NcclAllReduce())
    with pytest.raises(TypeError, match="cross_device_ops='nccl'"):
        mirrored.MirroredStrategy(["cpu:0"], "nccl")
    with pytest.raises(TypeError, match=r"cross_device_ops=<class 'torch\.nn"):
        mirrored.MirroredStrategy(["cpu:0"], torch.nn.Linear)
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        mirrored.MirroredStrategy(["cpu:0"], timeout_seconds=0)
    with pytest.raises(TypeError, match=r"devices='cpu:0': expected a list of devices"):
        mirrored.MirroredStrategy("cpu:0")


@pytest.mark.parametrize("ops", [mirrored.HierarchicalCopyAllReduce, mirrored.ReductionToOneDevice])
def test_a_cross_device_ops_class_is_taken_with_its_defaults(ops):
    """The articles write cross_device_ops=tf.distribute.HierarchicalCopyAllReduce (the class)."""
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], cross_device_ops=ops) as strategy:
        assert type(strategy.cross_device_ops) is ops
        total = strategy.reduce("sum", strategy.run(lambda: torch.ones(2)), axis=None)
        assert total.tolist() == [2.0, 2.0]


def test_run_argument_errors():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with pytest.raises(TypeError, match=r"pass args=\(batch,\)"):
            strategy.run(lambda x: x, args={"x": 1})
        with pytest.raises(ValueError, match="results of different structure"):
            strategy.run(
                lambda: [0] * (1 + mirrored.get_replica_context().replica_id_in_sync_group)
            )
        with pytest.raises(ValueError, match="results of different structure"):
            strategy.run(lambda: {mirrored.get_replica_context().replica_id_in_sync_group: 0})


def test_a_strategy_a_program_drops_is_collected_with_its_threads():
    """A notebook makes strategy after strategy: one dropped after training a mirrored model
    must go, its replica threads with it (gradient hooks live where the collector cannot see)."""

    def train() -> weakref.ref[mirrored.MirroredStrategy]:
        strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            model = make_mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_mirrored(strategy, model, optimizer, make_batches()[:2])
        return weakref.ref(strategy)

    dropped = train()
    gc.collect()
    assert dropped() is None, "the strategy outlived the program's last reference to it"
    for thread in threading.enumerate():
        if thread.name.startswith("mirrored-replica-"):
            thread.join(timeout=5)
            assert not thread.is_alive(), f"{thread.name} outlived its strategy"
