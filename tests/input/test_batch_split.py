"""Splitting global batches into per-replica shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mirrored.input.batch_split import PerReplicaShards, shard_sizes, split_batch

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


def test_a_batch_dim_splits_sequence_first_tensors_along_it():
    tokens = torch.arange(4 * 5).reshape(4, 5)  # [seq, batch]: 5 sequences of 4 tokens
    batch = (tokens, tokens + 100, torch.tensor(0.5))
    data, targets, scalar = split_batch(batch, [CPU] * 2, batch_dim=1)
    assert data.global_batch_size == 5
    assert [s.shape for s in data.values] == [(4, 3), (4, 2)]
    assert torch.equal(torch.cat(targets.values, dim=1), tokens + 100)
    assert scalar.item() == 0.5  # no batch dimension: every replica's, as with dim 0
    ragged = split_batch(tokens, [CPU] * 2, first_shard=1, num_shards=3, batch_dim=1)
    assert torch.equal(torch.cat(ragged.values, dim=1), tokens[:, 2:])


def test_a_tensor_without_the_batch_dim_names_its_shape_and_the_option():
    flat_targets = torch.zeros(20)  # word_language_model's target.view(-1)
    with pytest.raises(ValueError, match=r"batch_dim=1.*shape \[20\]") as raised:
        split_batch((torch.zeros(4, 5), flat_targets), [CPU] * 2, batch_dim=1)
    assert "inside the step" in str(raised.value)
    with pytest.raises(ValueError, match=r"common batch dimension \(dim 1\); got \[3, 5\]"):
        split_batch((torch.zeros(4, 5), torch.zeros(4, 3)), [CPU] * 2, batch_dim=1)
