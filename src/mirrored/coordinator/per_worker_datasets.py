"""The datasets ``ClusterCoordinator.create_per_worker_dataset`` builds on every worker, and the
handles that scheduled functions take.

A ``PerWorkerDataset`` or ``PerWorkerIterator`` holds only an id: pickled into a scheduled
function's arguments, it becomes, on the worker that runs the function, that worker's own
iterator (``mirrored.parameter_server.worker``). ``PerWorkerDatasets`` remembers how each dataset
was built, so that a worker restarted after it was lost builds them all again before it runs a
function.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch.distributed.rpc as rpc

from mirrored.input import InputContext
from mirrored.parameter_server import worker as parameter_server_worker
from mirrored.parameter_server.rpc_cluster import Member
from mirrored.strategies.parameter_server import ParameterServerStrategy

__all__ = ["PerWorkerDataset", "PerWorkerDatasets", "PerWorkerIterator"]


class PerWorkerIterator:
    """An iterator on every worker over its own dataset; pass it to scheduled functions, where
    it is that worker's iterator."""

    def __init__(self, dataset_id: int) -> None:
        self.dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator yields only inside a scheduled function, on its worker: pass "
            "it to coordinator.schedule(fn, args=(iterator,)) and call next() in fn"
        )

    def __reduce__(self) -> tuple[Callable[[int], Any], tuple[int]]:
        return parameter_server_worker.iterator, (self.dataset_id,)


class PerWorkerDataset:
    """A dataset built on every worker by ``dataset_fn`` (``create_per_worker_dataset``)."""

    def __init__(self, dataset_id: int) -> None:
        self.dataset_id = dataset_id

    def __iter__(self) -> PerWorkerIterator:
        return PerWorkerIterator(self.dataset_id)


class PerWorkerDatasets:
    """Every per-worker dataset of one coordinator: built on each worker that takes part, and
    on each that rejoins."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self.strategy = strategy
        self._ids = itertools.count()
        self._built: list[tuple[int, Callable[[InputContext], Iterable[Any]]]] = []

    def create(self, dataset_fn: Callable[[InputContext], Iterable[Any]]) -> PerWorkerDataset:
        """Build ``dataset_fn``'s dataset on every worker taking part, and remember it."""
        dataset_id = next(self._ids)
        with self.strategy.stable_members():  # a worker that rejoins builds it too
            self.strategy.on_every_worker(
                lambda member: self._build(dataset_id, dataset_fn, member)
            )
            self._built.append((dataset_id, dataset_fn))
        return PerWorkerDataset(dataset_id)

    def build_all(self, member: Member) -> None:
        """Build every dataset so far on ``member`` (a restarted worker), waiting for each."""
        for dataset_id, dataset_fn in self._built:
            self._build(dataset_id, dataset_fn, member).wait()

    def _build(
        self, dataset_id: int, dataset_fn: Callable[[InputContext], Iterable[Any]], member: Member
    ) -> Any:
        """Build a dataset on ``member``, as the shard of its task (a future)."""
        num_workers = self.strategy.num_workers
        context = InputContext(num_workers, self.strategy.worker_task_index(member), num_workers)
        return rpc.rpc_async(
            member.name,
            parameter_server_worker.register_dataset,
            (dataset_id, dataset_fn, context),
            timeout=self.strategy.timeout_seconds,
        )
