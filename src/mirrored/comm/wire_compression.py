"""Gradients on the wire in 16 bits, summed in 32: half the bytes between workers.

With ``CommunicationOptions(compression="bf16")`` (or ``"fp16"``) each float32 gradient bucket
crosses processes as bfloat16 (float16). A plain all-reduce of a 16-bit tensor would also add
the workers' values in 16 bits, rounding again at every addition; here the sum is a reduce-scatter
and an all-gather instead: every worker sends the i-th of N equal chunks of its 16-bit bucket to
worker i (one all-to-all), worker i adds the N chunks it received in float32, in rank order, and
rounds that sum to 16 bits once; an all-gather hands every worker all the sums. Per worker that
is (N-1)/N of the bucket out and as much in, twice: the bytes of a ring all-reduce at 16 bits,
half those of float32.

What is lost: each worker's (locally summed) gradient and each sum are rounded to 16 bits once.
bfloat16 keeps float32's range with an 8-bit significand; float16 keeps an 11-bit significand
but flushes magnitudes below 6e-8 to zero and overflows above 65504, so bfloat16 is the safe
choice for unscaled gradients. The per-parameter replica counts that travel in each bucket stay
exact up to 256 replicas (bfloat16) or 2048 (float16).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from mirrored.comm.powersgd import PowerSGD, PowerSGDBucket, PowerSGDSum

if TYPE_CHECKING:
    from mirrored.comm.worker_group import PendingCollective, WorkerGroup

__all__ = ["WIRE_DTYPES", "BucketCompressor", "SixteenBitSum", "bucket_compressor"]

WIRE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

# Each tensor of a gradient bucket as (offset, shape), in bucket order.
Layout = Sequence[tuple[int, torch.Size]]


class PendingSum(Protocol):
    def wait(self) -> None: ...


class BucketCompressor(Protocol):
    """How gradient bucket ``bucket`` is summed over the workers when compressed."""

    def start(
        self, group: WorkerGroup, bucket: int, tensor: torch.Tensor, label: str
    ) -> PendingSum:
        """Start summing ``tensor`` (bucket ``bucket``) in place; ``wait()`` finishes it."""
        ...


class _SixteenBitWire:
    def __init__(self, wire_dtype: torch.dtype) -> None:
        self._wire_dtype = wire_dtype

    def start(
        self, group: WorkerGroup, bucket: int, tensor: torch.Tensor, label: str
    ) -> PendingSum:
        # Shared memory between the workers of one machine carries the full tensor.
        if tensor.dtype != torch.float32 or group.sums_in_shared_memory(tensor):
            return group.all_reduce_async(tensor, label)
        return SixteenBitSum(group, tensor, self._wire_dtype, label)


class _PowerSGDWire:
    def __init__(self, options: PowerSGD, layouts: Sequence[Layout], numels: Sequence[int]) -> None:
        self._plans = [
            PowerSGDBucket(options, layout, numel, seed=b)
            for b, (layout, numel) in enumerate(zip(layouts, numels, strict=True))
        ]

    def start(
        self, group: WorkerGroup, bucket: int, tensor: torch.Tensor, label: str
    ) -> PendingSum:
        plan = self._plans[bucket]
        if not plan.compressed:
            return group.all_reduce_async(tensor, label)
        return PowerSGDSum(group, tensor, plan, label)


def bucket_compressor(
    option: str | PowerSGD | None, layouts: Sequence[Layout], numels: Sequence[int]
) -> BucketCompressor | None:
    """The compressor for ``CommunicationOptions.compression`` (None: buckets go whole), given
    each bucket's tensors (``layouts``) and length (``numels``, replica counts included)."""
    if option is None:
        return None
    if isinstance(option, PowerSGD):
        return _PowerSGDWire(option, layouts, numels)
    return _SixteenBitWire(WIRE_DTYPES[option])


class SixteenBitSum:
    """The sum over every worker of one bucket, in flight: started at construction (the
    all-to-all), finished by ``wait()`` (the float32 sums, the all-gather, the result written
    into the bucket in place)."""

    def __init__(
        self, group: WorkerGroup, tensor: torch.Tensor, wire_dtype: torch.dtype, label: str
    ) -> None:
        self._group = group
        self._tensor = tensor
        self._label = label
        self._wire_dtype = wire_dtype
        self._chunk = -(-tensor.numel() // group.world_size)  # ceil: the last chunk is padded
        padded = self._chunk * group.world_size
        outgoing = torch.zeros(padded, dtype=wire_dtype, device=tensor.device)
        outgoing[: tensor.numel()].copy_(tensor.reshape(-1))
        self._received = torch.empty_like(outgoing)
        self._pending: PendingCollective | None = group.all_to_all_async(
            self._received, outgoing, f"{label} (16-bit reduce-scatter)"
        )

    def wait(self) -> None:
        """Finish the sum: raises the group's diagnosis if a worker is missing."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        pending.wait()
        chunks = self._received.view(self._group.world_size, self._chunk)
        total = chunks[0].float()
        for chunk in chunks[1:]:  # rank order: the same sum on every run
            total += chunk.float()
        gathered = torch.empty_like(self._received)
        self._group.all_gather_into_async(
            gathered, total.to(self._wire_dtype), f"{self._label} (16-bit all-gather)"
        ).wait()
        self._tensor.view(-1).copy_(gathered[: self._tensor.numel()])
