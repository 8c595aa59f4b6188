"""A worker loads only its shards of each global batch of a DataLoader."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored.input.loader_parts import distribute_loader_parts


def test_a_worker_loads_only_its_shards_of_a_data_loader() -> None:
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


def test_a_worker_s_part_of_sequence_first_batches_splits_along_the_batch_dim() -> None:
    sequences = torch.arange(7.0).reshape(7, 1).expand(7, 3)  # 7 sequences of 3 steps

    def seq_first(examples: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(examples, dim=1)  # [seq, batch], as word_language_model batches

    loader = DataLoader(sequences, batch_size=5, collate_fn=seq_first)  # 5 and 2 sequences
    options = mirrored.InputOptions(batch_dim=1)
    cpu = [torch.device("cpu")]
    parts = [
        [
            (batch.values[0].shape, batch.values[0][0].tolist(), batch.global_batch_size)
            for batch in distribute_loader_parts(loader, cpu, first_shard, 4, options=options)
        ]
        for first_shard in (0, 3)
    ]
    assert parts == [
        [((3, 2), [0.0, 1.0], 5), ((3, 1), [5.0], 2)],
        [((3, 1), [4.0], 5), ((3, 0), [], 2)],  # an empty shard keeps the sequence length
    ]
