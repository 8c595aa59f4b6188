"""Bucket plans (pure) and packing gradients into flat buffers."""

from __future__ import annotations

import pytest
import torch

from mirrored.comm.bucketing import (
    PackedTensors,
    plan_buckets,
    plan_gather,
    plan_gradient_buckets,
)

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


def test_gradient_buckets_follow_backward_order_with_a_smaller_first_bucket():
    # float32 gradients of 48, 12, 16 and 20 bytes; backward produces the last first.
    shapes = [torch.Size(s) for s in SHAPES]
    plan = plan_gradient_buckets(shapes, FLOATS, bytes_per_pack=32, first_pack_bytes=20)
    assert [b.indices for b in plan.buckets] == [(3,), (2, 1), (0,)]
    assert [b.offsets for b in plan.buckets] == [(0,), (0, 4), (0,)]
    assert plan.bucket_of == (2, 1, 1, 0)
    assert [plan.length(b) for b in range(3)] == [5 + 1, 7 + 2, 12 + 1]  # counts at the end
    assert plan.layouts() == [
        [(0, torch.Size([5]))],
        [(0, torch.Size([2, 2])), (4, torch.Size([3]))],
        [(0, torch.Size([4, 3]))],
    ]


def test_gradient_buckets_hold_every_parameter_once_and_one_dtype_each():
    shapes = [torch.Size([n]) for n in (7, 3, 100, 1, 9, 30)]
    dtypes = [torch.float32, torch.float64, torch.float32, torch.float64, torch.float16]
    dtypes.append(torch.float32)
    plan = plan_gradient_buckets(shapes, dtypes, bytes_per_pack=64, first_pack_bytes=16)
    members = sorted(i for bucket in plan.buckets for i in bucket.indices)
    assert members == list(range(len(shapes)))
    for b, bucket in enumerate(plan.buckets):
        assert {dtypes[i] for i in bucket.indices} == {bucket.dtype}
        assert all(plan.bucket_of[i] == b for i in bucket.indices)
        assert bucket.numel == sum(shapes[i].numel() for i in bucket.indices)
        assert list(bucket.indices) == sorted(bucket.indices, reverse=True)  # backward order
    assert plan.buckets[0].indices == (5,)  # 120 bytes: alone, above the first cap


def test_one_plan_per_set_of_shapes_and_dtypes():
    """A collective repeated every step plans its buckets once: the same plan object for the
    same shapes and dtypes, however they are spelled; another set gets its own."""
    first = plan_buckets([torch.Size([3, 4]), (5,)], [torch.float32, torch.float32], 1)
    again = plan_buckets(((3, 4), torch.Size([5])), (torch.float32, torch.float32), 1)
    assert again is first
    assert plan_buckets([(3, 4), (6,)], [torch.float32] * 2, 1) is not first
    assert plan_buckets([(3, 4), (5,)], [torch.float32] * 2, 0) is not first


def test_a_gather_plans_room_for_the_longest_worker_s_rows_of_each_tensor_aligned():
    # (rows, bytes per row) per worker and tensor; -1: a worker without rows of that tensor.
    sizes = [[(3, 8), (0, -1), (1, 1)], [(5, 8), (2, 4), (1, 1)]]
    assert plan_gather(sizes) == ([0, 48, 64], 80)
    assert plan_gather([[], []]) == ([], 0)


def test_a_gather_of_rows_of_different_sizes_on_the_workers_is_refused():
    with pytest.raises(
        ValueError,
        match=r"tensor 1: .*worker 0: 2 rows of 8 bytes.*worker 1: "
        r"2 rows of 4 bytes.*differ only along the axis",
    ):
        plan_gather([[(1, 4), (2, 8)], [(1, 4), (2, 4)]])
