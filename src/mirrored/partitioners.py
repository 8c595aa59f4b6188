"""Where each parameter of a ``ParameterServerStrategy`` lives: which ps task, whole or in shards.

A partitioner says how many shards a tensor is cut into along its first dimension (TensorFlow's
``variable_partitioner``, which answers per axis; we cut only dim 0, as TensorFlow's built-in
partitioners do). ``plan_shards`` then places every shard: the largest first, each on the ps task
holding the fewest bytes so far, so that the ps tasks carry equal loads and a large embedding's
shards land on different tasks. This module is the plan alone (names and shapes, no tensor, no
process), so every rule is unit-tested.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "Partitioner",
    "ShardSpec",
    "plan_shards",
]

#: ``(shape, dtype) -> number of shards along dim 0``.
Partitioner = Callable[[torch.Size, torch.dtype], int]


class FixedShardsPartitioner:
    """Cut every tensor into ``num_shards`` pieces along dim 0 (fewer when dim 0 is smaller)."""

    def __init__(self, num_shards: int) -> None:
        if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
            raise ValueError(f"num_shards={num_shards!r}: expected an int >= 1")
        self.num_shards = num_shards

    def __call__(self, shape: torch.Size, dtype: torch.dtype) -> int:
        return max(1, min(self.num_shards, shape[0] if len(shape) else 1))

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards})"


class MinSizePartitioner:
    """As many shards as keep each at least ``min_shard_bytes``, at most ``max_shards`` (and at
    most dim 0's length): TensorFlow's ``MinSizePartitioner`` (defaults 256 KiB and 1)."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1) -> None:
        if not isinstance(min_shard_bytes, int) or min_shard_bytes < 1:
            raise ValueError(f"min_shard_bytes={min_shard_bytes!r}: expected an int >= 1")
        if not isinstance(max_shards, int) or isinstance(max_shards, bool) or max_shards < 1:
            raise ValueError(f"max_shards={max_shards!r}: expected an int >= 1")
        self.min_shard_bytes = min_shard_bytes
        self.max_shards = max_shards

    def __call__(self, shape: torch.Size, dtype: torch.dtype) -> int:
        if not len(shape):
            return 1
        size = math.prod(shape) * _element_size(dtype)
        return max(1, min(self.max_shards, shape[0], size // self.min_shard_bytes))

    def __repr__(self) -> str:
        return (
            f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
            f"max_shards={self.max_shards})"
        )


@dataclass(frozen=True)
class ShardSpec:
    """One piece of one parameter: rows ``start:stop`` of dim 0 (the whole tensor when it is not
    cut), kept on ps task ``ps``."""

    name: str
    index: int  # among the parameter's shards
    num_shards: int
    start: int
    stop: int
    shape: tuple[int, ...]  # the shard's own shape
    dtype: torch.dtype
    ps: int

    @property
    def key(self) -> str:
        """The shard's name on its ps task."""
        return f"{self.name}/{self.index}"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _element_size(self.dtype)


def plan_shards(
    parameters: Sequence[tuple[str, torch.Size, torch.dtype]],
    num_ps: int,
    partitioner: Partitioner | None = None,
) -> list[ShardSpec]:
    """Every shard of ``parameters`` (name, shape, dtype), in parameter order, each placed on one
    of ``num_ps`` ps tasks. Without a partitioner every tensor stays whole."""
    if num_ps < 1:
        raise ValueError(f"num_ps={num_ps}: a ParameterServerStrategy needs at least one ps task")
    shards = []
    for name, shape, dtype in parameters:
        count = partitioner(shape, dtype) if partitioner is not None else 1
        rows = shape[0] if len(shape) else 1
        if not isinstance(count, int) or not 1 <= count <= max(rows, 1):
            raise ValueError(
                f"the partitioner {partitioner!r} cut {name!r} (shape {list(shape)}) into "
                f"{count!r} shards; expected an int in 1..{max(rows, 1)} (dim 0's length)"
            )
        bounds = _split(rows, count)
        for index, (start, stop) in enumerate(bounds):
            own = (stop - start, *shape[1:]) if count > 1 else tuple(shape)
            shards.append(ShardSpec(name, index, count, start, stop, own, dtype, ps=-1))
    loads = [0] * num_ps
    placed: dict[int, int] = {}
    by_size = sorted(range(len(shards)), key=lambda i: -shards[i].nbytes)  # stable: ties in order
    for i in by_size:
        ps = min(range(num_ps), key=lambda p: (loads[p], p))
        placed[i] = ps
        loads[ps] += shards[i].nbytes
    return [dataclasses.replace(shard, ps=placed[i]) for i, shard in enumerate(shards)]


def _split(rows: int, count: int) -> list[tuple[int, int]]:
    """``count`` contiguous row ranges, larger ones first (as ``torch.tensor_split``)."""
    base, extra = divmod(rows, count)
    bounds, start = [], 0
    for index in range(count):
        stop = start + base + (index < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
