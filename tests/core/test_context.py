"""Strategy and replica contexts, and the collectives a replica can call."""

from __future__ import annotations

import pytest
import torch

import mirrored


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


def test_collectives_give_the_same_kinds_of_result_with_one_replica():
    with mirrored.MirroredStrategy(["cpu:0"]) as strategy:
        weight = torch.ones(2, requires_grad=True)

        def fn():
            replica = mirrored.get_replica_context()
            total = replica.all_reduce("sum", weight * 2)
            mean = replica.all_reduce("mean", torch.tensor(3))
            gathered = replica.all_gather(weight * 1, axis=0)
            return total.requires_grad, mean.dtype, gathered.requires_grad

        assert strategy.run(fn) == (False, torch.float32, False)


def test_results_may_be_dict_subclasses():
    import collections

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        result = strategy.run(lambda: collections.defaultdict(list, {"loss": torch.ones(1)}))
        assert isinstance(result, collections.defaultdict)
        assert strategy.reduce("sum", result, axis=None)["loss"].item() == 2
