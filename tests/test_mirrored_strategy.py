"""MirroredStrategy against the plain single-device loop, and its run/reduce/gather contract."""

from __future__ import annotations

import pytest
import torch

import mirrored
from tests.training import (
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

CROSS_DEVICE_OPS = {
    "default": lambda: None,
    "hierarchical": lambda: mirrored.HierarchicalCopyAllReduce(),
    "one_device": lambda: mirrored.ReductionToOneDevice(),
    "hierarchical_unpacked": lambda: mirrored.HierarchicalCopyAllReduce(num_packs=0),
    "one_device_small_packs": lambda: mirrored.ReductionToOneDevice(bytes_per_pack=1024),
}


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
    torch.testing.assert_close(losses, reference_losses, rtol=1e-5, atol=1e-6)


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


def test_all_cross_device_ops_give_bit_identical_parameters():
    results = []
    for make_ops in CROSS_DEVICE_OPS.values():
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], make_ops()) as strategy:
            model = make_mlp()
            mirrored_model, _, _ = train_mirrored(
                strategy, model, OPTIMIZERS["adam"](model), make_batches()
            )
            results.append(mirrored_model.state_dict())
    for state in results[1:]:
        for name, value in state.items():
            assert torch.equal(value, results[0][name]), name


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


def test_mean_of_integer_counts_is_a_float():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        counts = mirrored.PerReplica([torch.tensor(1), torch.tensor(2)])
        assert strategy.reduce("mean", counts, axis=None).item() == 1.5
        means = strategy.run(
            lambda: mirrored.get_replica_context().all_reduce(
                "mean", mirrored.get_replica_context().replica_id_in_sync_group
            )
        )
        assert strategy.experimental_local_results(means) == (0.5, 0.5)


def test_all_reduce_of_different_shapes_is_an_error_naming_them():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        (batch,) = strategy.experimental_distribute_dataset([torch.arange(7.0)])  # 4 and 3
        with pytest.raises(ValueError, match=r"replica 0: \[\(4,\)\].*replica 1: \[\(3,\)\]"):
            strategy.run(
                lambda shard: mirrored.get_replica_context().all_reduce("sum", shard), args=(batch,)
            )


def test_collectives_detach_their_inputs():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        weight = torch.ones(2, requires_grad=True)

        def fn():
            replica = mirrored.get_replica_context()
            total = replica.all_reduce("sum", [weight * 2, weight * 3])
            gathered = replica.all_gather(weight * 1, axis=0)
            return [t.requires_grad for t in total] + [gathered.requires_grad]

        assert strategy.run(fn) == [False] * 3  # the same on both replicas: unwrapped


def test_all_gather_is_not_disturbed_by_a_replica_changing_its_input_afterwards():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:

        def fn():
            replica = mirrored.get_replica_context()
            mine = torch.full((4,), float(replica.replica_id_in_sync_group))
            gathered = replica.all_gather(mine, axis=0)
            mine.fill_(-1)
            return gathered

        expected = torch.tensor([0.0] * 4 + [1.0] * 4 + [2.0] * 4)
        for _ in range(20):
            for gathered in strategy.experimental_local_results(strategy.run(fn)):
                assert torch.equal(gathered, expected)


def test_contexts_inside_and_outside_scope_and_run():
    assert not mirrored.has_strategy()
    assert not mirrored.in_cross_replica_context()
    default_replica = mirrored.get_replica_context()
    assert default_replica is not None and default_replica.num_replicas_in_sync == 1
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with strategy.scope() as entered:
            assert entered is strategy
            assert mirrored.get_strategy() is strategy
            assert mirrored.has_strategy()
            assert mirrored.in_cross_replica_context()
            assert mirrored.get_replica_context() is None

            def inside():
                replica = mirrored.get_replica_context()
                return (
                    mirrored.get_strategy() is strategy,
                    mirrored.in_cross_replica_context(),
                    replica.replica_id_in_sync_group,
                    replica.num_replicas_in_sync,
                )

            results = strategy.run(inside)
            assert strategy.experimental_local_results(results) == (
                (True, False, 0, 2),
                (True, False, 1, 2),
            )
        with (
            mirrored.MirroredStrategy(["cpu:2"]) as other,
            strategy.scope(),
            pytest.raises(RuntimeError, match="inside the scope of another strategy"),
            other.scope(),
        ):
            pass
    assert mirrored.get_strategy().num_replicas_in_sync == 1


def test_replica_context_collectives_and_merge_call():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:

        def fn():
            replica = mirrored.get_replica_context()
            rid = replica.replica_id_in_sync_group
            total = replica.all_reduce("sum", {"t": torch.tensor([rid, 1.0]), "n": rid})
            mean = replica.all_reduce(mirrored.ReduceOp.MEAN, torch.tensor(float(rid)))
            gathered = replica.all_gather(torch.arange(rid + 1.0), axis=0)

            def merge_fn(merge_strategy, value):
                assert mirrored.in_cross_replica_context()
                assert merge_strategy is strategy
                return mirrored.PerReplica([v * 100 for v in value.values])

            merged = replica.merge_call(merge_fn, args=(rid,))
            return total, mean, gathered, merged

        for rid, (total, mean, gathered, merged) in enumerate(
            strategy.experimental_local_results(strategy.run(fn))
        ):
            assert total["t"].tolist() == [3.0, 3.0] and total["n"] == 3
            assert mean.item() == 1.0
            assert gathered.tolist() == [0.0, 0.0, 1.0, 0.0, 1.0, 2.0]
            assert merged == rid * 100


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


def test_default_devices_are_all_logical_cpu_devices():
    with mirrored.MirroredStrategy() as strategy:
        assert [d.short_name for d in strategy.devices] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
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
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        mirrored.MirroredStrategy(["cpu:0"], timeout_seconds=0)
    with pytest.raises(TypeError, match=r"devices='cpu:0': expected a list of devices"):
        mirrored.MirroredStrategy("cpu:0")
    with pytest.raises(ValueError, match="num_packs=-1"):
        mirrored.HierarchicalCopyAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="bytes_per_pack='big'"):
        mirrored.ReductionToOneDevice(bytes_per_pack="big")


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


def test_reduce_to_device_accepts_any_device_name():
    ops = mirrored.ReductionToOneDevice(reduce_to_device="/device:CPU:1")
    assert ops.reduce_to_device.short_name == "cpu:1"
    with pytest.raises(ValueError, match="does not exist"):
        mirrored.ReductionToOneDevice(reduce_to_device="cpu:99")
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], ops) as strategy:
        total = strategy.run(
            lambda: mirrored.get_replica_context().all_reduce("sum", torch.arange(3.0))
        )
        assert [t.tolist() for t in total.values] == [[0.0, 2.0, 4.0]] * 2
