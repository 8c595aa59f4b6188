"""The placement plan of a ParameterServerStrategy: shard counts, row ranges, ps loads."""

from __future__ import annotations

import pytest
import torch

from mirrored.partitioners import (
    FixedShardsPartitioner,
    MinSizePartitioner,
    ShardSpec,
    plan_shards,
)


def test_fixed_shards_cut_dim_0_but_never_below_one_row_each() -> None:
    partitioner = FixedShardsPartitioner(3)
    assert partitioner(torch.Size([10, 4]), torch.float32) == 3
    assert partitioner(torch.Size([2, 4]), torch.float32) == 2
    assert partitioner(torch.Size([]), torch.float32) == 1


def test_min_size_keeps_each_shard_at_least_min_bytes_up_to_max_shards() -> None:
    partitioner = MinSizePartitioner(min_shard_bytes=1024, max_shards=4)
    assert partitioner(torch.Size([100, 4]), torch.float32) == 1  # 1600 bytes: one shard
    assert partitioner(torch.Size([200, 4]), torch.float32) == 3  # 3200 bytes: three of 1 KiB
    assert partitioner(torch.Size([1000, 4]), torch.float32) == 4  # capped by max_shards
    assert partitioner(torch.Size([2, 4096]), torch.float64) == 2  # capped by dim 0
    assert partitioner(torch.Size([100, 4]), torch.float16) == 1
    assert MinSizePartitioner()(torch.Size([1 << 20]), torch.float32) == 1  # TF's defaults


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FixedShardsPartitioner(0), "num_shards=0"),
        (lambda: FixedShardsPartitioner(True), "num_shards=True"),
        (lambda: MinSizePartitioner(min_shard_bytes=0), "min_shard_bytes=0"),
        (lambda: MinSizePartitioner(max_shards=2.5), "max_shards=2.5"),
    ],
)
def test_bad_partitioner_arguments_are_named(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]


def test_whole_tensors_go_largest_first_to_the_least_loaded_ps() -> None:
    parameters = [
        ("small", torch.Size([10]), torch.float32),  # 40 bytes
        ("big", torch.Size([100, 10]), torch.float32),  # 4000
        ("medium", torch.Size([30, 10]), torch.float32),  # 1200
        ("other", torch.Size([25, 10]), torch.float32),  # 1000
    ]
    shards = plan_shards(parameters, num_ps=2)
    assert [s.name for s in shards] == ["small", "big", "medium", "other"]  # parameter order
    placement = {s.name: s.ps for s in shards}
    # big -> ps0 (4000); medium -> ps1 (1200); other -> ps1 (2200); small -> ps1 (2240)
    assert placement == {"big": 0, "medium": 1, "other": 1, "small": 1}
    assert all(
        s.num_shards == 1 and s.shape == tuple(p[1])
        for s, p in zip(shards, parameters, strict=True)
    )


def test_a_partitioned_tensor_s_shards_cover_its_rows_and_spread_over_the_ps_tasks() -> None:
    parameters = [
        ("embedding", torch.Size([10, 3]), torch.float32),
        ("bias", torch.Size([3]), torch.float32),
    ]
    shards = plan_shards(parameters, num_ps=3, partitioner=FixedShardsPartitioner(3))
    embedding = [s for s in shards if s.name == "embedding"]
    assert [(s.start, s.stop) for s in embedding] == [(0, 4), (4, 7), (7, 10)]
    assert [s.shape for s in embedding] == [(4, 3), (3, 3), (3, 3)]
    assert {s.ps for s in embedding} == {0, 1, 2}
    assert [s.key for s in embedding] == ["embedding/0", "embedding/1", "embedding/2"]
    bias = [s for s in shards if s.name == "bias"]
    assert [(s.start, s.stop, s.shape) for s in bias] == [(0, 1, (1,)), (1, 2, (1,)), (2, 3, (1,))]
    # 120 bytes of embedding shards are placed first, then the bias rows fill the lighter tasks.
    loads = [sum(s.nbytes for s in shards if s.ps == ps) for ps in range(3)]
    assert max(loads) - min(loads) <= 12


def test_a_partitioner_that_answers_nonsense_is_named() -> None:
    def too_many(shape: torch.Size, dtype: torch.dtype) -> int:
        return 5

    with pytest.raises(ValueError, match=r"cut 'w' \(shape \[3, 2\]\) into 5 shards"):
        plan_shards([("w", torch.Size([3, 2]), torch.float32)], 2, too_many)
    with pytest.raises(ValueError, match="at least one ps task"):
        plan_shards([("w", torch.Size([3, 2]), torch.float32)], 0)


def test_a_shard_knows_its_size() -> None:
    shard = ShardSpec("w", 0, 1, 0, 3, (3, 2), torch.float64, ps=0)
    assert shard.nbytes == 48 and shard.key == "w/0"
