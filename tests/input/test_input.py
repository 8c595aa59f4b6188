"""Distributed datasets through a strategy: epochs, len(), input functions, the default strategy."""

from __future__ import annotations

import pytest
import torch

import mirrored


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
