"""Splitting a global batch into per-replica shards, and the shards' global batch size.

A global batch of B examples is split along dim 0 (or ``InputOptions(batch_dim=...)``) into
shards that differ by at most one example (larger shards first); a batch smaller than the
replica count gives empty shards, which contribute zero gradient. No example is dropped or
counted twice. Each shard is a ``PerReplicaShards`` that remembers the global batch size, so
``compute_average_loss`` divides by it even for the ragged last batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mirrored.core.values import PerReplica, flatten, map_structure

__all__ = [
    "PerReplicaShards",
    "batch_size_of",
    "from_numpy_leaf",
    "global_batch_size_of",
    "shard_sizes",
    "split_batch",
    "stack_replica_batches",
]


class PerReplicaShards(PerReplica):
    """The shards of one tensor of a global batch, with the global batch size.

    Its ``len()`` is the global batch size, as the batch's is in a plain loop, so that progress
    lines such as pytorch/examples' ``batch_idx * len(data)`` count the same examples."""

    __slots__ = ("global_batch_size",)

    def __init__(self, values: Sequence[Any], global_batch_size: int) -> None:
        super().__init__(values)
        self.global_batch_size = global_batch_size

    def __len__(self) -> int:
        return self.global_batch_size


def global_batch_size_of(structure: Any) -> int | None:
    """The global batch size of the distributed batch in ``structure`` (None if there is none)."""
    for leaf in flatten(structure):
        if isinstance(leaf, PerReplicaShards):
            return leaf.global_batch_size
    return None


def shard_sizes(batch_size: int, num_shards: int) -> list[int]:
    """Split ``batch_size`` into ``num_shards`` sizes differing by at most one, larger first."""
    base, extra = divmod(batch_size, num_shards)
    return [base + (1 if i < extra else 0) for i in range(num_shards)]


def from_numpy_leaf(leaf: Any) -> Any:
    """A numpy array as a tensor (sharing its memory), anything else as is."""
    return torch.from_numpy(leaf) if isinstance(leaf, np.ndarray) else leaf


def batch_size_of(batch: Any, batch_dim: int = 0) -> int:
    """Dim ``batch_dim`` of the tensors of a batch; they must all agree. A scalar has no batch
    dimension; any other tensor with no dim ``batch_dim`` is refused."""
    sizes: set[int] = set()
    for t in flatten(batch):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if t.dim() <= batch_dim:
            raise ValueError(
                f"InputOptions(batch_dim={batch_dim}) splits every tensor of a batch along dim "
                f"{batch_dim}, but one has shape {list(t.shape)}; give it that dimension (keep "
                "sequence-first targets [seq, batch] and flatten them inside the step)"
            )
        sizes.add(t.shape[batch_dim])
    if len(sizes) != 1:
        which = (
            "first (batch) dimension" if batch_dim == 0 else f"batch dimension (dim {batch_dim})"
        )
        raise ValueError(
            f"a batch must hold tensors with one common {which}; got "
            f"{sorted(sizes) if sizes else 'no batched tensor'}"
        )
    return sizes.pop()


def _place(tensor: torch.Tensor, device: torch.device | None, pin: bool = False) -> torch.Tensor:
    if device is None:
        return tensor
    if pin and device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()  # a copy from pinned memory does not block the host
    return tensor.to(device, non_blocking=True)


def split_batch(
    batch: Any,
    devices: Sequence[torch.device | None],
    first_shard: int = 0,
    num_shards: int | None = None,
    global_batch_size: int | None = None,
    sizes_of: Callable[[int], list[int]] | None = None,
    pin: bool = False,
    batch_dim: int = 0,
) -> Any:
    """One global batch -> the same structure with ``PerReplicaShards`` leaves on ``devices``
    (a None device leaves its shard where the batch is). ``sizes_of(batch_size)``: the shard
    sizes, when not as even as possible (:mod:`mirrored.input.load_balancing`). ``pin``: shards
    bound for CUDA go through pinned memory (when read ahead, off the training's path).

    Across workers the batch splits into ``num_shards`` (every replica of every worker) and this
    process keeps shards ``first_shard ..`` for its own devices. A worker that loaded only its
    own part passes that part and the ``global_batch_size`` it came from. ``batch_dim``: the
    dimension of every tensor that counts the examples (``InputOptions(batch_dim=...)``).
    """
    batch = map_structure(from_numpy_leaf, batch)
    batch_size = batch_size_of(batch, batch_dim)
    if sizes_of is None:
        all_sizes = shard_sizes(batch_size, num_shards or len(devices))
    else:
        all_sizes = sizes_of(batch_size)
    global_batch_size = global_batch_size or batch_size
    start = sum(all_sizes[:first_shard])
    sizes = all_sizes[first_shard : first_shard + len(devices)]

    whole = sizes == [batch_size]  # one shard, the whole batch: a view of each whole tensor

    def split(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.dim() == 0:
            return leaf
        shards = (
            (leaf.view_as(leaf),)
            if whole
            else torch.split(leaf.narrow(batch_dim, start, sum(sizes)), sizes, dim=batch_dim)
        )
        return PerReplicaShards(
            [_place(s, d, pin) for s, d in zip(shards, devices, strict=True)],
            global_batch_size,
        )

    return map_structure(split, batch)


def stack_replica_batches(
    batches: Sequence[Any],
    devices: Sequence[torch.device | None],
    global_batch_size: int | None = None,
) -> Any:
    """Per-replica batches (one per replica, missing ones at the end) -> PerReplicaShards leaves.

    Replicas without a batch get empty shards shaped like the last batch's. ``global_batch_size``
    defaults to the examples in ``batches`` (one process).
    """
    batches = [map_structure(from_numpy_leaf, b) for b in batches]
    if global_batch_size is None:
        global_batch_size = sum(batch_size_of(b) for b in batches)
    last = batches[-1]
    padded = list(batches) + [
        map_structure(lambda t: t[:0] if isinstance(t, torch.Tensor) and t.dim() else t, last)
    ] * (len(devices) - len(batches))

    def combine(*leaves: Any) -> Any:
        if not isinstance(leaves[0], torch.Tensor) or leaves[0].dim() == 0:
            return leaves[0]
        return PerReplicaShards(
            [_place(t, d) for t, d in zip(leaves, devices, strict=True)],
            global_batch_size,
        )

    return map_structure(combine, *padded)
