"""The overlapped gradient reducer's buckets are its plan's (its reduction across processes is
tested in tests/multiprocess/test_multi_worker.py)."""

from __future__ import annotations

import torch
from torch import nn

import mirrored
from mirrored.comm.bucketing import plan_gradient_buckets
from mirrored.replication.gradient_reducer import OverlappedGradientReducer


def test_each_replicas_gradients_are_packed_where_the_plan_says() -> None:
    torch.manual_seed(0)
    replicas = [nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3).double()) for _ in "ab"]
    params = [list(replica.parameters()) for replica in replicas]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        reducer = OverlappedGradientReducer(
            strategy,
            params,
            strategy.communicator,  # no workers' group: nothing here communicates
            None,
            None,
            None,
            bytes_per_pack=64,
            first_pack_bytes=24,
        )
        try:
            shapes, dtypes = [p.shape for p in params[0]], [p.dtype for p in params[0]]
            plan = plan_gradient_buckets(shapes, dtypes, 64, 24)
            assert reducer.plan == plan
            assert len(plan.buckets) > 2
            for r, replica in enumerate(params):
                for b, bucket in enumerate(plan.buckets):
                    buffer = reducer._buffers[r][b]
                    assert (buffer.numel(), buffer.dtype) == (plan.length(b), bucket.dtype)
                    for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
                        view = reducer._views[r][index]
                        assert view.shape == replica[index].shape
                        start = buffer.data_ptr() + offset * buffer.element_size()
                        assert view.data_ptr() == start
        finally:
            reducer.remove_hooks()
