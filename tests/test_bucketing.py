"""Bucket plans (pure) and packing gradients into flat buffers."""

from __future__ import annotations

import pytest
import torch

from mirrored.bucketing import PackedTensors, plan_buckets

SHAPES = [(4, 3), (3,), (2, 2), (5,)]
FLOATS = [torch.float32] * 4


def test_one_pack_holds_every_tensor_of_a_dtype():
    (bucket,) = plan_buckets(SHAPES, FLOATS, num_packs=1)
    assert bucket.indices == (0, 1, 2, 3) and bucket.offsets == (0, 12, 15, 19)
    assert bucket.numel == 24


def test_zero_packs_means_one_bucket_per_tensor():
    plan = plan_buckets(SHAPES, FLOATS, num_packs=0)
    assert [b.indices for b in plan] == [(0,), (1,), (2,), (3,)]


def test_num_packs_splits_evenly_in_order():
    plan = plan_buckets([(10,)] * 6, [torch.float32] * 6, num_packs=3)
    assert [b.indices for b in plan] == [(0, 1), (2, 3), (4, 5)]


def test_bytes_per_pack_caps_bucket_size_and_oversized_tensors_stand_alone():
    plan = plan_buckets([(10,), (10,), (100,), (5,)], [torch.float32] * 4, bytes_per_pack=80)
    assert [b.indices for b in plan] == [(0, 1), (2,), (3,)]


def test_dtypes_never_share_a_bucket():
    plan = plan_buckets([(2,), (2,), (2,)], [torch.float32, torch.float64, torch.float32])
    assert [(b.dtype, b.indices) for b in plan] == [(torch.float32, (0, 2)), (torch.float64, (1,))]


def test_negative_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_packs=-1"):
        plan_buckets(SHAPES, FLOATS, num_packs=-1)


def test_pack_and_unpack_round_trip_with_missing_tensors_as_zeros():
    tensors = [torch.randn(s) for s in SHAPES]
    for plan in (plan_buckets(SHAPES, FLOATS), plan_buckets(SHAPES, FLOATS, num_packs=0)):
        packed = PackedTensors(plan, SHAPES, torch.device("cpu"))
        packed.pack(tensors)
        for original, view in zip(tensors, packed.unpacked(), strict=True):
            assert torch.equal(original, view)
        packed.pack([None, tensors[1], None, tensors[3]])
        views = packed.unpacked()
        assert not views[0].any() and torch.equal(views[1], tensors[1])
        views[3].add_(1)  # a view packed again into itself keeps its value
        packed.pack([tensors[0], tensors[1], tensors[2], views[3]])
        assert torch.equal(packed.unpacked()[3], tensors[3] + 1)
