"""Splitting global batches into per-replica shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import mirrored
from mirrored.input import PerReplicaShards, shard_sizes, split_batch

CPU = torch.device("cpu")


def test_shards_differ_by_at_most_one_larger_first():
    assert shard_sizes(16, 3) == [6, 5, 5]
    assert shard_sizes(11, 3) == [4, 4, 3]
    assert shard_sizes(2, 4) == [1, 1, 0, 0]
    assert sum(shard_sizes(203, 4)) == 203


def test_split_keeps_structure_and_every_example_once():
    batch = {
        "x": (torch.arange(10).reshape(5, 2), np.arange(5)),
        "y": torch.arange(5),
        "name": "tag",
        "scalar": torch.tensor(3),
    }
    shards = split_batch(batch, [CPU] * 3)
    assert isinstance(shards["y"], PerReplicaShards) and shards["y"].global_batch_size == 5
    assert [s.tolist() for s in shards["y"].values] == [[0, 1], [2, 3], [4]]
    assert [s.shape[0] for s in shards["x"][1].values] == [2, 2, 1]  # numpy became tensors
    assert shards["name"] == "tag" and shards["scalar"].item() == 3


def test_a_batch_must_share_its_first_dimension():
    with pytest.raises(ValueError, match=r"one common first \(batch\) dimension; got \[3, 4\]"):
        split_batch((torch.zeros(3), torch.zeros(4)), [CPU] * 2)
    with pytest.raises(ValueError, match="no batched tensor"):
        split_batch(("a", 1), [CPU] * 2)


def test_distributed_dataset_can_be_iterated_once_per_epoch():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        dataset = strategy.experimental_distribute_dataset(
            torch.utils.data.DataLoader(torch.arange(7.0), batch_size=4)
        )
        for _ in range(2):
            sizes = [[s.shape[0] for s in b.values] for b in dataset]
            assert sizes == [[2, 2], [2, 1]]


def test_len_of_a_distributed_batch_is_the_global_batch_size():
    """pytorch/examples' progress line counts examples with batch_idx * len(data)."""
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.zeros(10, 3), torch.zeros(10)), batch_size=4
    )
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        dataset = strategy.experimental_distribute_dataset(loader)
        assert len(dataset) == len(loader) == 3
        lines = []
        for batch_idx, (data, target) in enumerate(dataset):
            lines.append(f"[{batch_idx * len(data)}/{len(loader.dataset)}] {len(target)}")
        assert [len(part) for part in data.values] == [1, 1, 0]  # the shards keep their own
    assert lines == ["[0/10] 4", "[4/10] 4", "[4/10] 2"]
    with pytest.raises(TypeError, match="no len"):
        len(strategy.experimental_distribute_dataset(iter([torch.zeros(2)])))


def test_datasets_from_function_take_one_batch_per_replica():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        contexts = []

        def dataset_fn(input_context):
            contexts.append(input_context)
            per_replica = input_context.get_per_replica_batch_size(6)
            return torch.utils.data.DataLoader(torch.arange(10.0), batch_size=per_replica)

        batches = list(strategy.distribute_datasets_from_function(dataset_fn))
        assert contexts == [mirrored.InputContext(1, 0, 3)]
        # 10 examples in per-replica batches of 2: steps of (2, 2, 2), (2, 2, 0)
        assert [[s.shape[0] for s in b.values] for b in batches] == [[2, 2, 2], [2, 2, 0]]
        assert [b.global_batch_size for b in batches] == [6, 4]
        with pytest.raises(ValueError, match="not divisible"):
            mirrored.InputContext(1, 0, 4).get_per_replica_batch_size(6)


def test_the_default_strategy_leaves_batches_where_they_are():
    strategy = mirrored.get_strategy()
    batch = torch.empty(4, 3, device="meta")  # any device: moving a meta tensor would fail
    (shards,) = list(strategy.experimental_distribute_dataset([batch]))
    assert shards.values[0].device.type == "meta"
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.empty(2, device="meta")
    )
    assert strategy.experimental_local_results(values)[0].device.type == "meta"


def test_a_worker_loads_only_its_shards_of_a_data_loader() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from mirrored.input import distribute_loader_parts

    x = torch.arange(7.0).reshape(7, 1)
    loader = DataLoader(TensorDataset(x), batch_size=5)  # batches of 5 and 2, 4 shards
    cpu = [torch.device("cpu")]
    parts = [
        [
            (batch[0].values[0].flatten().tolist(), batch[0].global_batch_size)
            for batch in distribute_loader_parts(loader, cpu, first_shard, num_shards=4)
        ]
        for first_shard in range(4)
    ]
    assert parts == [
        [([0.0, 1.0], 5), ([5.0], 2)],
        [([2.0], 5), ([6.0], 2)],
        [([3.0], 5), ([], 2)],  # nothing left for this replica in the last batch
        [([4.0], 5), ([], 2)],
    ]
