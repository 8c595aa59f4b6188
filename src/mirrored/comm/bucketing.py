"""Packing many tensors into a few flat buckets, so an all-reduce pays per bucket, not per tensor.

The plan is computed from shapes and dtypes alone (no devices, no threads) and is the same on
every replica, which is what lets replicas reduce bucket ``i`` together. The gradient reducer's
plan (:class:`GradientBucketPlan`) packs gradients in the order backward produces them.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "Bucket",
    "GradientBucketPlan",
    "PackedTensors",
    "plan_buckets",
    "plan_gather",
    "plan_gradient_buckets",
]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Tensors ``indices`` (positions in the packed list) laid end to end in one flat tensor."""

    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    dtype: torch.dtype


def plan_buckets(
    shapes: Sequence[torch.Size | tuple[int, ...]],
    dtypes: Sequence[torch.dtype],
    num_packs: int = 1,
    bytes_per_pack: int = 0,
    first_pack_bytes: int = 0,
) -> tuple[Bucket, ...]:
    """Group tensors into buckets of one dtype each, keeping their order.

    ``bytes_per_pack > 0``: fill buckets up to that many bytes (a larger tensor gets its own);
    ``first_pack_bytes > 0`` caps the first bucket lower, so that an all-reduce started while
    backward runs can begin early.
    Otherwise ``num_packs`` buckets per dtype of about equal size (TensorFlow's meaning);
    ``num_packs == 0`` means no packing, one bucket per tensor.

    One plan per set of shapes and dtypes: a collective repeated every step (synchronised batch
    norm's statistics, local SGD's averages) plans its buckets once (plans are immutable).
    """
    return _planned(
        tuple(tuple(shape) for shape in shapes),
        tuple(dtypes),
        num_packs,
        bytes_per_pack,
        first_pack_bytes,
    )


@functools.lru_cache(maxsize=256)
def _planned(
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    num_packs: int,
    bytes_per_pack: int,
    first_pack_bytes: int,
) -> tuple[Bucket, ...]:
    if num_packs < 0 or bytes_per_pack < 0 or first_pack_bytes < 0:
        raise ValueError(
            f"num_packs={num_packs}, bytes_per_pack={bytes_per_pack}, "
            f"first_pack_bytes={first_pack_bytes}: all must be >= 0"
        )
    numels = [math.prod(shape) for shape in shapes]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        by_dtype.setdefault(dtype, []).append(index)
    buckets: list[Bucket] = []
    for dtype, indices in by_dtype.items():
        if bytes_per_pack > 0:
            itemsize = torch.empty((), dtype=dtype).element_size()
            nbytes = [numels[i] * itemsize for i in indices]
            first_cap = first_pack_bytes if first_pack_bytes and not buckets else bytes_per_pack
            groups = _fill(nbytes, first_cap, bytes_per_pack)
        elif num_packs == 0:
            groups = [[j] for j in range(len(indices))]
        else:
            groups = _split_evenly([numels[i] for i in indices], num_packs)
        for group in groups:
            members = [indices[j] for j in group]
            sizes = [numels[i] for i in members]
            offsets = (0, *itertools.accumulate(sizes[:-1]))
            buckets.append(Bucket(tuple(members), offsets, sum(sizes), dtype))
    return tuple(buckets)


def _fill(nbytes: Sequence[int], first_cap: int, cap: int) -> list[list[int]]:
    """Consecutive groups of the tensors of ``nbytes`` bytes each, of at most ``cap`` bytes
    (``first_cap`` for the first) unless one tensor alone is larger."""
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for j, n in enumerate(nbytes):
        if current and size + n > (cap if groups else first_cap):
            groups.append(current)
            current, size = [], 0
        current.append(j)
        size += n
    groups.append(current)
    return groups


def _split_evenly(numels: Sequence[int], num_packs: int) -> list[list[int]]:
    """About ``num_packs`` consecutive groups of the tensors of ``numels`` elements each, each
    closed once it holds 1/``num_packs`` of the elements."""
    target = math.ceil(sum(numels) / num_packs)
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for j, numel in enumerate(numels):
        current.append(j)
        size += numel
        if size >= target:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


@dataclasses.dataclass(frozen=True)
class GradientBucketPlan:
    """The buckets of one optimizer's gradients, reduced while backward runs: filled in the
    order backward produces the gradients (the last parameters first), each bucket holding its
    gradients end to end and then one count per parameter (how many replicas produced it)."""

    buckets: tuple[Bucket, ...]  # indices: the parameters' positions in a replica's list
    shapes: tuple[torch.Size, ...]  # per parameter position
    bucket_of: tuple[int, ...]  # per parameter position: the bucket it is in

    def length(self, b: int) -> int:
        """Elements of bucket ``b``: its gradients and their counts."""
        return self.buckets[b].numel + len(self.buckets[b].indices)

    def layouts(self) -> list[list[tuple[int, torch.Size]]]:
        """Per bucket, where each of its gradients starts and its shape."""
        return [
            [(offset, self.shapes[i]) for i, offset in zip(b.indices, b.offsets, strict=True)]
            for b in self.buckets
        ]


def plan_gradient_buckets(
    shapes: Sequence[torch.Size],
    dtypes: Sequence[torch.dtype],
    bytes_per_pack: int,
    first_pack_bytes: int,
) -> GradientBucketPlan:
    """The buckets of gradients of ``shapes`` and ``dtypes`` (a replica's parameters, in
    order), as :func:`plan_buckets` packs them by ``bytes_per_pack`` and ``first_pack_bytes``
    taken in the order backward produces them."""
    order = list(reversed(range(len(shapes))))  # backward reaches the last layers first
    plan = plan_buckets(
        [shapes[i] for i in order], [dtypes[i] for i in order], 1, bytes_per_pack, first_pack_bytes
    )
    buckets = tuple(
        dataclasses.replace(bucket, indices=tuple(order[j] for j in bucket.indices))
        for bucket in plan
    )
    bucket_of = [0] * len(shapes)
    for b, bucket in enumerate(buckets):
        for index in bucket.indices:
            bucket_of[index] = b
    return GradientBucketPlan(buckets, tuple(torch.Size(s) for s in shapes), tuple(bucket_of))


# Where each tensor starts in a gather's packed bytes: any dtype can be viewed there.
GATHER_ALIGNMENT = 16


def plan_gather(sizes: Sequence[Sequence[Sequence[int]]]) -> tuple[list[int], int]:
    """Where each tensor's bytes start in the one flat byte buffer every worker gathers, and
    the buffer's length: room for the longest worker's rows of each tensor, each start aligned.
    ``sizes[worker][tensor]`` is ``(rows, bytes per row)``, bytes -1 where a worker has no
    rows; a ValueError unless the workers' rows of each tensor are the same size."""
    starts, total = [], 0
    for index, per_worker in enumerate(zip(*sizes, strict=True)):
        row_bytes = {int(row) for _, row in per_worker if row >= 0}
        if len(row_bytes) > 1:
            shapes = [f"worker {w}: {n} rows of {b} bytes" for w, (n, b) in enumerate(per_worker)]
            raise ValueError(
                f"all_gather of tensor {index}: the workers' tensors differ in every dimension "
                f"but the gathered one ({', '.join(shapes)}); gather tensors whose shapes "
                "differ only along the axis"
            )
        starts.append(total)
        size = max(int(n) for n, _ in per_worker) * max(row_bytes, default=0)
        total += -(-size // GATHER_ALIGNMENT) * GATHER_ALIGNMENT
    return starts, total


class PackedTensors:
    """One replica's flat bucket buffers for a fixed plan, reused step after step."""

    def __init__(
        self,
        plan: Sequence[Bucket],
        shapes: Sequence[torch.Size | tuple[int, ...]],
        device: torch.device,
    ) -> None:
        self.plan = tuple(plan)
        self.buffers = [torch.empty(b.numel, dtype=b.dtype, device=device) for b in plan]
        self.views: list[torch.Tensor | None] = [None] * len(shapes)
        for bucket, buffer in zip(self.plan, self.buffers, strict=True):
            for index, offset in zip(bucket.indices, bucket.offsets, strict=True):
                numel = math.prod(shapes[index])
                self.views[index] = buffer[offset : offset + numel].view(shapes[index])

    def pack(self, tensors: Sequence[torch.Tensor | None]) -> None:
        """Copy ``tensors`` into the buffers; None counts as zeros."""
        for bucket, buffer in zip(self.plan, self.buffers, strict=True):
            parts = [tensors[i] for i in bucket.indices]
            fresh = [
                p
                for p, i in zip(parts, bucket.indices, strict=True)
                if p is not None and p is not self.views[i]
            ]
            if len(fresh) == len(parts):
                flats = [p.reshape(-1) for p in parts if p is not None]
                if len(flats) == 1:
                    buffer.copy_(flats[0])
                else:
                    torch.cat(flats, out=buffer)
                continue
            for index, part in zip(bucket.indices, parts, strict=True):
                view = self.views[index]
                assert view is not None
                if part is None:
                    view.zero_()
                elif part is not view:
                    view.copy_(part)

    def unpacked(self) -> list[torch.Tensor]:
        """Views of the buffers shaped as the packed tensors, in their order."""
        return [v for v in self.views if v is not None]
