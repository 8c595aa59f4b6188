"""Distributed datasets: an input's batches as per-replica shards, step by step.

``distribute_global_batches`` splits each global batch of a dataset over the replicas (this
worker's part of them); ``distribute_replica_batches`` deals per-replica batches from several
input pipelines. Across workers a ``StepAgreement`` makes every worker take the same steps and
agree on the global batch size, so a worker whose input runs out early fails instead of hanging.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import torch

from mirrored.core.values import fingerprint, map_structure
from mirrored.input.batch_split import (
    batch_size_of,
    from_numpy_leaf,
    global_batch_size_of,
    split_batch,
    stack_replica_batches,
)
from mirrored.input.options import InputOptions, input_settings
from mirrored.input.prefetch import ahead

__all__ = [
    "DistributedDataset",
    "StepAgreement",
    "distribute_global_batches",
    "distribute_replica_batches",
]

_END = object()


class DistributedDataset:
    """An iterable of distributed batches; iterate it once per epoch like the dataset it wraps.
    Its ``len()`` is the number of steps when the dataset it wraps has one."""

    def __init__(
        self, make_batches: Callable[[], Iterator[Any]], length: Callable[[], int] | None = None
    ) -> None:
        self._make_batches = make_batches
        self._length = length

    def __iter__(self) -> Iterator[Any]:
        return self._make_batches()

    def __len__(self) -> int:
        if self._length is None:
            raise TypeError("this distributed dataset has no len(): its input has none")
        return self._length()


class StepAgreement(Protocol):
    """How the workers of a multi-process job agree on each step of their input."""

    def begin(self, num_steps: int | None, first_batch: int | None = None) -> None:
        """An iteration starts; ``num_steps`` is its length when the dataset knows it (then the
        workers can agree once, instead of at every step); ``first_batch`` a fingerprint of the
        examples of its first global batch, when known (every worker must see the same)."""

    def batch(self, num_examples: int) -> int:
        """This worker has a batch of ``num_examples`` for the next step; returns the global
        batch size (raises if another worker's input ran out)."""

    def end(self) -> None:
        """This worker's input ran out; raises unless every worker's did."""


def distribute_global_batches(
    dataset: Iterable[Any],
    devices: Sequence[torch.device | None],
    first_shard: int = 0,
    num_shards: int | None = None,
    agreement: StepAgreement | None = None,
    sizes_of: Callable[[int], list[int]] | None = None,
    options: InputOptions | None = None,
) -> DistributedDataset:
    """Each global batch of ``dataset`` split into per-replica shards on ``devices`` (this
    worker's ``devices`` hold shards ``first_shard ..`` of ``num_shards``), as ``sizes_of``
    says when given (asked afresh for every batch); ``options``: how many batches are read
    ahead, and the dimension each batch is split along."""
    prefetch, batch_dim = input_settings(options)

    def batches() -> Iterator[Any]:
        iterator = iter(dataset)
        if agreement is not None:
            # The first batch is read now, so that the workers can check they read alike.
            first = next(iterator, _END)
            if first is not _END:
                iterator = itertools.chain([first], iterator)
            agreement.begin(
                len(dataset) if isinstance(dataset, Sequence) else None,
                None if first is _END else fingerprint(first),
            )
        prepared = (
            split_batch(
                batch,
                devices,
                first_shard,
                num_shards,
                sizes_of=sizes_of,
                pin=bool(prefetch),
                batch_dim=batch_dim,
            )
            for batch in iterator
        )
        for shards in ahead(prepared, prefetch, devices):
            if agreement is not None:
                agreement.batch(global_batch_size_of(shards) or 0)
            yield shards
        if agreement is not None:
            agreement.end()

    return DistributedDataset(batches, getattr(dataset, "__len__", None))


def distribute_replica_batches(
    datasets: Sequence[Iterable[Any]],
    devices: Sequence[torch.device | None],
    agreement: StepAgreement | None = None,
) -> DistributedDataset:
    """Input pipelines yielding per-replica batches; each step takes one batch per replica,
    dealt round-robin over the pipelines."""

    def batches() -> Iterator[Any]:
        if agreement is not None:
            agreement.begin(None)
        iterators = [iter(d) for d in datasets]
        exhausted = False
        while not exhausted:
            step: list[Any] = []
            for replica in range(len(devices)):
                try:
                    step.append(next(iterators[replica % len(iterators)]))
                except StopIteration:
                    exhausted = True
                    break
            if not step:
                break
            global_batch_size = None
            if agreement is not None:
                local = sum(batch_size_of(map_structure(from_numpy_leaf, b)) for b in step)
                global_batch_size = agreement.batch(local)
            yield stack_replica_batches(step, devices, global_batch_size)
        if agreement is not None:
            agreement.end()

    return DistributedDataset(batches)
