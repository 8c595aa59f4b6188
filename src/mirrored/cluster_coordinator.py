"""ClusterCoordinator: the coordinator's queue of functions for the workers of a
``ParameterServerStrategy`` (TensorFlow's ``tf.distribute.coordinator.ClusterCoordinator``).

``schedule`` queues a function and returns at once with a ``RemoteValue``; one dispatcher thread
per worker takes the next function whenever its worker is free, so a slow worker runs fewer of
them and never holds the others up (unless ``max_staleness`` bounds how far ahead they may get).

A worker whose call fails (its process died, its connection broke, or it stayed silent for the
strategy's timeout) is given up: every ps task fences it (a late push of it is refused), then its
function goes back to the head of the queue for another worker. A function's update reaches each
ps task once even when it ran twice (``mirrored.shard_store``). An error raised by a function
itself is not retried: it fails its ``RemoteValue``, cancels the functions still queued and is
raised by the next ``schedule``, ``join`` or ``done``, as in TensorFlow.
"""

from __future__ import annotations

import collections
import itertools
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed.rpc as rpc

from mirrored import parameter_server_worker, shard_store
from mirrored.input import InputContext
from mirrored.parameter_server import ParameterServerStrategy
from mirrored.values import map_structure

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "ScheduledFunctionError",
]


class ScheduledFunctionError(RuntimeError):
    """A scheduled function raised on a worker; ``remote_traceback`` is the worker's."""

    def __init__(self, message: str, error_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback


class RemoteValue:
    """The result of a scheduled function, once a worker has run it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def fetch(self) -> Any:
        """Wait for the function to run and return its result (tensors on the CPU), or raise
        its error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch


@dataclass
class _Function:
    id: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    value: RemoteValue = field(default_factory=RemoteValue)


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


class ClusterCoordinator:
    """Schedules functions on the workers of ``strategy`` (created on the chief)."""

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        self.strategy = strategy
        self._ids = itertools.count()
        self._dataset_ids = itertools.count()
        self._queue: collections.deque[_Function] = collections.deque()
        self._unfinished: set[int] = set()
        self._error: BaseException | None = None
        self._closing = False
        self._live = set(strategy.cluster.workers)
        self._clocks = dict.fromkeys(strategy.cluster.workers, 0)
        self._condition = threading.Condition()
        strategy._coordinators.append(self)  # closed before the strategy leaves the RPC group
        self._threads = [
            threading.Thread(target=self._dispatch, args=(worker,), daemon=True, name=worker)
            for worker in strategy.cluster.workers
        ]
        for thread in self._threads:
            thread.start()

    # -- scheduling -------------------------------------------------------------------------------
    def schedule(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for the next free worker; ``fn`` must be importable
        there (a module-level function of the script every task runs)."""
        with self._condition:
            self._raise_error()
            function = _Function(next(self._ids), fn, tuple(args), dict(kwargs or {}))
            self._queue.append(function)
            self._unfinished.add(function.id)
            self._condition.notify_all()
        return function.value

    def join(self) -> None:
        """Wait until every scheduled function has run; raise the first error among them."""
        with self._condition:
            self._condition.wait_for(lambda: not self._unfinished or self._error is not None)
            self._raise_error()

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the first error among them)."""
        with self._condition:
            self._raise_error()
            return not self._unfinished

    def fetch(self, values: Any) -> Any:
        """The results of a structure of ``RemoteValue`` s, waiting for each."""
        return map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, values)

    def create_per_worker_dataset(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> PerWorkerDataset:
        """Build a dataset on every worker: ``dataset_fn(InputContext)``, where the context
        says which of the ``num_input_pipelines`` workers it is (shard by it); importable there."""
        dataset_id = next(self._dataset_ids)
        workers = self.strategy.cluster.workers
        futures = [
            rpc.rpc_async(
                worker,
                parameter_server_worker.register_dataset,
                (dataset_id, dataset_fn, InputContext(len(workers), index, len(workers))),
                timeout=self.strategy.timeout_seconds,
            )
            for index, worker in enumerate(workers)
        ]
        for future in futures:
            future.wait()
        return PerWorkerDataset(dataset_id)

    # -- dispatch ---------------------------------------------------------------------------------
    def _dispatch(self, worker: str) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: self._closing or (self._queue and self._may_start(worker))
                )
                if self._closing:
                    return
                function = self._queue.popleft()
                finished_below = min(self._unfinished)
            try:
                ok, result = rpc.rpc_sync(
                    worker,
                    parameter_server_worker.run_function,
                    (function.id, finished_below, function.fn, function.args, function.kwargs),
                    timeout=self.strategy.timeout_seconds,
                )
            except Exception as error:  # the worker is lost: fence it, hand its function on
                self._give_up(worker, function, error)
                return
            with self._condition:
                self._unfinished.discard(function.id)
                self._clocks[worker] += 1
                if ok:
                    function.value._finish(result)
                else:
                    self._fail(function, worker, *result)
                self._condition.notify_all()

    def _may_start(self, worker: str) -> bool:
        limit = self.strategy.max_staleness
        slowest = min(self._clocks[w] for w in self._live)
        return limit is None or self._clocks[worker] - slowest <= limit

    def _fail(self, function: _Function, worker: str, kind: str, message: str, trace: str) -> None:
        error = ScheduledFunctionError(
            f"{getattr(function.fn, '__qualname__', function.fn)} raised on {worker}: "
            f"{kind}: {message}",
            kind,
            trace,
        )
        function.value._finish(error=error)
        if self._error is None:
            self._error = error
        while self._queue:  # TensorFlow cancels what was queued after a failed function
            cancelled = self._queue.popleft()
            self._unfinished.discard(cancelled.id)
            cancelled.value._finish(
                error=RuntimeError(f"cancelled: an earlier scheduled function failed ({error})")
            )

    def _give_up(self, worker: str, function: _Function, error: BaseException) -> None:
        lost: BaseException | None = None
        try:
            for ps in self.strategy.cluster.ps:
                rpc.rpc_sync(
                    ps, shard_store.fence, (worker,), timeout=self.strategy.timeout_seconds
                )
        except Exception as fence_error:
            lost = RuntimeError(
                f"a ps task was lost ({fence_error}) while giving up {worker}; restart the job "
                "from its last checkpoint"
            )
        with self._condition:
            self._live.discard(worker)
            if lost is None and not self._live:
                lost = RuntimeError(f"every worker was lost (the last, {worker}: {error})")
            if lost is not None:
                self._queue.appendleft(function)
                self._error = self._error or lost
                for pending in self._queue:
                    self._unfinished.discard(pending.id)
                    pending.value._finish(error=lost)
                self._queue.clear()
            else:
                self._queue.appendleft(function)  # another worker runs it again
            self._condition.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop dispatching (functions still queued are dropped); idempotent."""
        with self._condition:
            self._closing = True
            self._condition.notify_all()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
