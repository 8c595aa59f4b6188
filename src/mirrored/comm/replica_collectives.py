"""Collectives among the replicas of one run, over their ``ReplicaExchange``.

A bucketed all-reduce (every replica's tensors packed into the cross-device op's buckets, one
all-reduce per bucket) and an all-gather between the replicas of this process. The caller,
:mod:`mirrored.comm.communicator`, chooses how one bucket is summed (``all_reduce_buffer``): across
workers, it adds a cross-process step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from mirrored.comm.bucketing import PackedTensors
from mirrored.comm.cross_device_ops import CrossDeviceOps
from mirrored.core.replica_meeting import ReplicaExchange
from mirrored.core.values import ReduceOp

if TYPE_CHECKING:
    from mirrored.core.replica_set import Participant

__all__ = ["all_gather_local", "all_reduce_in_buckets"]


def all_reduce_in_buckets(
    replica: Participant,
    reduce_op: ReduceOp,
    tensors: Sequence[torch.Tensor],
    cross_device_ops: CrossDeviceOps,
    all_reduce_buffer: Callable[[ReplicaExchange, torch.Tensor], None],
    num_replicas_in_sync: int,
) -> list[torch.Tensor]:
    """Collective: reduce ``tensors`` over every replica, packed into buckets; a ValueError
    naming every replica's shapes unless they all pass the same shapes and dtypes."""
    if num_replicas_in_sync == 1:  # the same results as N > 1 would give
        return [t / 1 if reduce_op is ReduceOp.MEAN else t for t in tensors]
    signature = [(tuple(t.shape), t.dtype) for t in tensors]
    everyone = replica.exchange.all("all_reduce", signature)
    if any(other != signature for other in everyone):
        shapes = ", ".join(
            f"replica {i}: {[shape for shape, _ in sig]} {sorted({str(d) for _, d in sig})}"
            for i, sig in enumerate(everyone)
        )
        raise ValueError(
            f"all_reduce needs the same shapes and dtypes on every replica; got {shapes}. "
            "Reduce per-replica sums or counts (e.g. x.sum(0)), not ragged shards"
        )
    plan = cross_device_ops.plan(tensors)
    packed = PackedTensors(plan, [t.shape for t in tensors], replica.exchange.device)
    packed.pack(tensors)
    for buffer in packed.buffers:
        all_reduce_buffer(replica.exchange, buffer)
    if reduce_op is ReduceOp.SUM:
        return packed.unpacked()
    if all(b.is_floating_point() or b.is_complex() for b in packed.buffers):
        for buffer in packed.buffers:  # one division a bucket (BatchNorm's 104 statistics)
            buffer.div_(num_replicas_in_sync)
        return packed.unpacked()
    # Out of place: the mean of integer counts is a float.
    return [t / num_replicas_in_sync for t in packed.unpacked()]


def all_gather_local(
    replica: Participant, tensors: Sequence[torch.Tensor], axis: int
) -> list[torch.Tensor]:
    """Collective: each tensor concatenated along ``axis`` over this process's replicas, in
    replica order, on this replica's device (sizes along ``axis`` may differ)."""
    everyone = replica.exchange.all("all_gather", list(tensors), cross_device=True)
    gathered = [
        torch.cat([peer[i].to(replica.exchange.device) for peer in everyone], dim=axis)
        for i in range(len(tensors))
    ]
    # Peers must not change their inputs before everyone has read them.
    replica.exchange.barrier("all_gather done", cross_device=True)
    return gathered
