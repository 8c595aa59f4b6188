"""Packing many tensors into a few flat buckets, so an all-reduce pays per bucket, not per tensor.

The plan is computed from shapes and dtypes alone (no devices, no threads) and is the same on
every replica, which is what lets replicas reduce bucket ``i`` together.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import torch

__all__ = ["Bucket", "PackedTensors", "plan_buckets"]


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
    """
    if num_packs < 0 or bytes_per_pack < 0 or first_pack_bytes < 0:
        raise ValueError(
            f"num_packs={num_packs}, bytes_per_pack={bytes_per_pack}, "
            f"first_pack_bytes={first_pack_bytes}: all must be >= 0"
        )
    numels = [math.prod(shape) for shape in shapes]
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        by_dtype.setdefault(dtype, []).append(index)

    groups: list[tuple[torch.dtype, list[int]]] = []
    for dtype, indices in by_dtype.items():
        itemsize = torch.empty((), dtype=dtype).element_size()
        if bytes_per_pack > 0:
            current: list[int] = []
            size = 0
            for index in indices:
                nbytes = numels[index] * itemsize
                cap = first_pack_bytes if first_pack_bytes and not groups else bytes_per_pack
                if current and size + nbytes > cap:
                    groups.append((dtype, current))
                    current, size = [], 0
                current.append(index)
                size += nbytes
            groups.append((dtype, current))
        elif num_packs == 0:
            groups += [(dtype, [index]) for index in indices]
        else:
            total = sum(numels[i] for i in indices)
            target = math.ceil(total / num_packs)
            current, size = [], 0
            for index in indices:
                current.append(index)
                size += numels[index]
                if size >= target:
                    groups.append((dtype, current))
                    current, size = [], 0
            if current:
                groups.append((dtype, current))

    buckets = []
    for dtype, indices in groups:
        sizes = [numels[i] for i in indices]
        offsets = (0, *itertools.accumulate(sizes[:-1]))
        buckets.append(Bucket(tuple(indices), offsets, sum(numels[i] for i in indices), dtype))
    return tuple(buckets)


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
