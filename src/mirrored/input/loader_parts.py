"""A DataLoader's global batches, of which each worker loads only its own part.

Every worker iterates the same global batches of indices (the same sampler and seed); each loads
the examples of its own shards only, through a clone of the user's DataLoader whose batch sampler
keeps this worker's indices, and records each global batch's size so that the loss is still
divided by it. A DistributedSampler, which gives each worker other batches, is refused.
"""

from __future__ import annotations

import array
import functools
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, Sampler

from mirrored.core.values import map_structure
from mirrored.input.batch_split import shard_sizes, split_batch
from mirrored.input.distributed_dataset import DistributedDataset, StepAgreement
from mirrored.input.options import InputOptions, input_settings
from mirrored.input.prefetch import ahead

__all__ = ["distribute_loader_parts", "refuse_distributed_sampler", "shardable_loader"]


class _WorkerBatchSampler(Sampler[list[int]]):
    """A DataLoader's global batches of indices -> the indices of this worker's shards.

    Records (global batch size, examples kept) for every batch, in order, for the consumer; a
    worker whose part is empty loads one example and drops it (a batch cannot be empty).
    """

    def __init__(
        self,
        batch_sampler: Iterable[list[int]],
        first_shard: int,
        num_local: int,
        num_shards: int,
        sizes: deque[tuple[int, int]],
    ) -> None:
        self._batch_sampler = batch_sampler
        self._first, self._num_local, self._num_shards = first_shard, num_local, num_shards
        self._sizes = sizes
        self.first_batch: int | None = None  # a fingerprint of the first global batch's indices

    def __iter__(self) -> Iterator[list[int]]:
        for number, indices in enumerate(self._batch_sampler):
            indices = list(indices)
            if not number:
                self.first_batch = _fingerprint(indices)
            sizes = shard_sizes(len(indices), self._num_shards)
            start = sum(sizes[: self._first])
            kept = sum(sizes[self._first : self._first + self._num_local])
            self._sizes.append((len(indices), kept))
            yield indices[start : start + kept] if kept else indices[:1]

    def __len__(self) -> int:
        return len(self._batch_sampler)  # type: ignore[arg-type]


def _fingerprint(indices: Iterable[int]) -> int:
    """A checksum of a batch's example indices (equal lists, equal checksums)."""
    return zlib.crc32(array.array("q", indices).tobytes())


def refuse_distributed_sampler(dataset: Any) -> None:
    """A DistributedSampler gives each worker other examples, while every worker must iterate
    the same global batches (the strategy shards each of them): refuse it."""
    if not isinstance(dataset, DataLoader):
        return
    samplers = [dataset.sampler, getattr(dataset.batch_sampler, "sampler", None)]
    if any(isinstance(sampler, DistributedSampler) for sampler in samplers):
        raise ValueError(
            "the DataLoader uses a DistributedSampler, which gives each worker different "
            "examples; the strategy shards every global batch over the workers itself: pass a "
            "DataLoader over the whole dataset (shuffle=True is fine) with the global batch size"
        )


def shardable_loader(dataset: Any) -> bool:
    """A DataLoader over a map-style dataset, in order: each worker can load only its part."""
    return (
        isinstance(dataset, DataLoader)
        and not isinstance(dataset.dataset, IterableDataset)
        and dataset.batch_sampler is not None
        and getattr(dataset, "in_order", True)
    )


def _with_batch_sampler(loader: DataLoader[Any], sampler: Sampler[list[int]]) -> DataLoader[Any]:
    """A clone of ``loader`` (same dataset and settings) whose batches come from ``sampler``."""
    return DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        prefetch_factor=loader.prefetch_factor,
        persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )


def _none_of(leaf: Any, batch_dim: int) -> Any:
    """A batch's leaf with no example (this worker keeps none of the global batch)."""
    if isinstance(leaf, torch.Tensor) and leaf.dim() > batch_dim:
        return leaf.narrow(batch_dim, 0, 0)
    return leaf


def distribute_loader_parts(
    loader: DataLoader[Any],
    devices: Sequence[torch.device | None],
    first_shard: int,
    num_shards: int,
    agreement: StepAgreement | None = None,
    options: InputOptions | None = None,
) -> DistributedDataset:
    """Like ``distribute_global_batches`` for a DataLoader, but this worker loads only the
    examples of its own shards (a clone of ``loader`` over the same dataset, sampler and
    settings, whose batches hold this worker's part of each global batch); ``options``: how
    many batches are read ahead, and the batch dimension."""
    prefetch, batch_dim = input_settings(options)

    def batches() -> Iterator[Any]:
        sizes: deque[tuple[int, int]] = deque()
        assert loader.batch_sampler is not None
        sampler = _WorkerBatchSampler(
            loader.batch_sampler, first_shard, len(devices), num_shards, sizes
        )
        part_loader = _with_batch_sampler(loader, sampler)

        def prepared() -> Iterator[tuple[Any, int]]:
            for part in part_loader:
                global_batch_size, kept = sizes.popleft()
                if not kept:
                    part = map_structure(functools.partial(_none_of, batch_dim=batch_dim), part)
                yield (
                    split_batch(
                        part,
                        devices,
                        global_batch_size=global_batch_size,
                        pin=bool(prefetch),
                        batch_dim=batch_dim,
                    ),
                    global_batch_size,
                )

        begun = False
        for shards, global_batch_size in ahead(prepared(), prefetch, devices):
            if agreement is not None and not begun:
                # Once the first global batch is drawn (drawing it before the loader starts
                # would change its use of its generator): the workers compare its examples.
                agreement.begin(len(part_loader), sampler.first_batch)
            begun = True
            if agreement is not None:
                agreement.batch(global_batch_size)
            yield shards
        if agreement is not None:
            if not begun:
                agreement.begin(0)
            agreement.end()

    return DistributedDataset(batches, loader.__len__)  # one part of every global batch
