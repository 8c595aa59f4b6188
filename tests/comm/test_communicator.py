"""The communicator of one process: its layout, and every collective over the local replicas
alone (with a worker group: tests/multiprocess/test_communicator.py)."""

from __future__ import annotations

import torch

import mirrored
from mirrored.comm.communicator import Communicator, WorkerLayout
from mirrored.core.values import PerReplica, ReduceOp
from mirrored.strategies.in_process import InProcessStrategy


def test_a_layout_counts_every_worker_s_replicas_and_places_this_worker_s_first() -> None:
    layout = WorkerLayout((2, 3, 1), rank=1)
    assert (layout.num_workers, layout.num_replicas, layout.first_replica) == (3, 6, 2)
    assert WorkerLayout((4,), rank=0).first_replica == 0


def test_a_strategy_holds_a_communicator_of_its_replicas_alone() -> None:
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        communicator = strategy.communicator
        assert communicator.workers is None
        assert communicator.layout == WorkerLayout((3,), rank=0)
        assert communicator.num_replicas_in_sync == strategy.num_replicas_in_sync == 3
        assert communicator.cross_device_ops is strategy.cross_device_ops


def test_collectives_over_the_local_replicas_sum_in_replica_order() -> None:
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(7, dtype=torch.float64, generator=generator) for _ in range(3)]
    shards = [torch.randn(n, 2, generator=generator) for n in (1, 3, 2)]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        communicator = Communicator(mirrored.ReductionToOneDevice(), strategy.devices)

        def replica_fn(value: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, ...]:
            replica = mirrored.get_replica_context()
            assert replica is not None
            (reduced,) = communicator.all_reduce_tensors(replica, ReduceOp.SUM, [value])
            (gathered,) = communicator.all_gather_tensors(replica, [shard], 0)
            return reduced, gathered

        reduced, gathered = strategy.run(replica_fn, args=(PerReplica(values), PerReplica(shards)))
        total = values[0] + values[1] + values[2]
        whole = torch.cat(shards)
        for replica in range(3):
            assert torch.equal(reduced.values[replica], total)
            assert torch.equal(gathered.values[replica], whole)
        assert torch.equal(communicator.reduce(ReduceOp.SUM, PerReplica(values), None), total)
        mean = (shards[0].sum(0) + shards[1].sum(0) + shards[2].sum(0)) / 6
        assert torch.equal(communicator.reduce(ReduceOp.MEAN, PerReplica(shards), 0), mean)
        assert torch.equal(communicator.gather(shards, 0), whole)
        # A plain value is the same on every replica: SUM counts it once per replica.
        assert torch.equal(
            communicator.reduce(ReduceOp.SUM, torch.tensor(2.0), None), torch.tensor(6.0)
        )


def test_the_multi_worker_strategy_takes_its_collectives_from_its_communicator() -> None:
    collectives = {"all_reduce_tensors", "all_gather_tensors", "reduce", "gather"}
    assert not collectives & set(vars(mirrored.MultiWorkerMirroredStrategy))
    assert collectives <= set(vars(InProcessStrategy))
