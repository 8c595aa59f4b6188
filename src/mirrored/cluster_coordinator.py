"""ClusterCoordinator: the coordinator's queue of functions for the workers of a
``ParameterServerStrategy`` (TensorFlow's ``tf.distribute.coordinator.ClusterCoordinator``).

``schedule`` queues a function and returns at once with a ``RemoteValue``; one dispatcher thread
per worker takes the next function whenever its worker is free, so a slow worker runs fewer of
them and never holds the others up (unless ``max_staleness`` bounds how far ahead they may get).

A worker whose call fails (its process died, its connection broke, or it stayed silent for the
strategy's timeout) is given up: every ps task fences it (a late push of it is refused), then its
function goes back to the head of the queue for another worker. A function's update reaches each
ps task once even when it ran twice (``mirrored.shard_store``). In synchronous mode the
functions run in rounds of one per worker: a round's updates wait on the ps tasks until every
function of the round has run, the coordinator then commits them as one averaged step, and only
then may the next round start (``join`` commits a last, partial round). An error raised by a
function itself is not retried: it fails its ``RemoteValue``, cancels the functions still queued
and is raised by the next ``schedule``, ``join`` or ``done``, as in TensorFlow.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.rpc as rpc

from mirrored import checkpoint, parameter_server_checkpoint, parameter_server_worker, shard_store
from mirrored.input import InputContext
from mirrored.parameter_server import ParameterServerStrategy
from mirrored.rpc_cluster import Member
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

    def done(self) -> bool:
        """Whether the function has run (or failed)."""
        return self._done.is_set()

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
    call: bytes  # (fn, args, kwargs) pickled when scheduled: what a worker runs
    round: int  # synchronous mode's round (0 otherwise)
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
    """Schedules functions on the workers of ``strategy`` (created on the chief). A strategy has
    one coordinator, as in TensorFlow: ``ClusterCoordinator(strategy)`` returns the one it has
    unless that one was closed."""

    def __new__(cls, strategy: ParameterServerStrategy) -> ClusterCoordinator:
        existing = strategy._coordinator
        if existing is not None and not existing._closing:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        if strategy._coordinator is self:
            return
        self.strategy = strategy
        self._dataset_ids = itertools.count()
        self._queue: collections.deque[_Function] = collections.deque()
        self._unfinished: set[int] = set()
        self._error: BaseException | None = None
        self._broken: BaseException | None = None  # why the job cannot go on, once it cannot
        self._closing = False
        self._pauses = 0  # checkpoints under way: no function may start
        self._in_flight = 0  # functions a worker is running
        self._datasets: list[tuple[int, Callable[[InputContext], Iterable[Any]]]] = []
        # Synchronous mode: the functions of each round not yet committed, the round that
        # schedule fills, and the last round committed.
        self._rounds: dict[int, list[int]] = {}
        self._open_round = 0
        self._committed = -1
        self._committing = False
        self._condition = threading.Condition()
        self._live: set[str] = set()  # the workers that take functions
        self._clocks: dict[str, int] = {}  # functions each has run (max_staleness)
        self._threads: list[threading.Thread] = []
        self._no_worker_timer: threading.Timer | None = None
        with strategy._membership:  # workers that rejoin from now on are welcomed here
            strategy._coordinator = self  # closed before the strategy leaves RPC
            with self._condition:
                for member in strategy._live_members():
                    self._add_worker(member.name)

    # -- scheduling -------------------------------------------------------------------------------
    def schedule(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> RemoteValue:
        """Queue ``fn(*args, **kwargs)`` for the next free worker; ``fn`` must be importable
        there (a module-level function of the script every task runs)."""
        try:
            call = pickle.dumps((fn, tuple(args), dict(kwargs or {})))
        except Exception as error:
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)!r} or its arguments cannot be sent to a worker "
                f"({error}): schedule a module-level function of the script every task runs"
            ) from error
        with self._condition:
            self._check()
            function = _Function(next(self.strategy._function_ids), fn, call, self._open_round)
            if self.strategy.synchronous:
                members = self._rounds.setdefault(self._open_round, [])
                members.append(function.id)
                if len(members) == self.strategy.num_workers:
                    self._open_round += 1
            self._queue.append(function)
            self._unfinished.add(function.id)
            self._condition.notify_all()
        return function.value

    def join(self) -> None:
        """Wait until every scheduled function has run and its update is applied; raise the
        first error among them."""
        with self._condition:
            if self._open_round in self._rounds:  # synchronous mode: close the partial round
                self._open_round += 1
        self._commit_rounds()
        with self._condition:
            self._condition.wait_for(
                lambda: self._finished() or self._error is not None or self._stopped()
            )
            self._check()

    def done(self) -> bool:
        """Whether every scheduled function has run (raises the first error among them); in
        synchronous mode a partial last round is applied by ``join``."""
        with self._condition:
            self._check()
            return self._finished()

    def _stopped(self) -> bool:
        return self._closing or self._broken is not None

    def _check(self) -> None:
        """Raise the first error of a function once, then, for good, why nothing more can run
        (the job is broken, or this coordinator closed); under the condition."""
        self._raise_error()
        if self._broken is not None:
            raise RuntimeError(f"the job cannot go on: {self._broken}")
        if self._closing:
            raise RuntimeError("this ClusterCoordinator is closed")

    def _finished(self) -> bool:
        return not self._unfinished and self._committed == self._open_round - 1

    def fetch(self, values: Any) -> Any:
        """The results of a structure of ``RemoteValue`` s, waiting for each."""
        return map_structure(lambda v: v.fetch() if isinstance(v, RemoteValue) else v, values)

    def create_per_worker_dataset(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> PerWorkerDataset:
        """Build a dataset on every worker: ``dataset_fn(InputContext)``, where the context
        says which of the ``num_input_pipelines`` workers it is (shard by it); importable there."""
        dataset_id = next(self._dataset_ids)
        with self.strategy._membership:  # a worker that rejoins builds it too
            futures = [
                self._register(dataset_id, dataset_fn, member)
                for member in self.strategy._live_members()
            ]
            for future in futures:
                future.wait()
            self._datasets.append((dataset_id, dataset_fn))
        return PerWorkerDataset(dataset_id)

    def _register(
        self, dataset_id: int, dataset_fn: Callable[[InputContext], Iterable[Any]], member: Member
    ) -> Any:
        """Build a dataset on ``member``, as the shard of its task (a future)."""
        num_workers = self.strategy.num_workers
        context = InputContext(num_workers, self.strategy._task_index(member), num_workers)
        return rpc.rpc_async(
            member.name,
            parameter_server_worker.register_dataset,
            (dataset_id, dataset_fn, context),
            timeout=self.strategy.timeout_seconds,
        )

    # -- checkpoints ------------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        metadata: dict[str, Any] | None = None,
        models: Sequence[Any] | None = None,
    ) -> Path:
        """Write the mirrored models (``models``: handles from ``strategy.mirror``; None for all
        of them) and their optimizers, as they are once every function scheduled so far has
        run, to ``path`` atomically (``mirrored.parameter_server_checkpoint`` says what the file
        holds), with ``metadata`` (plain data: numbers, strings, tensors, lists, dicts) that
        ``restore`` returns; no function starts while the ps tasks are read."""
        chosen = self._mirrored(models)
        self.join()
        entries = self._read(chosen)
        return checkpoint.save(
            {
                "format": parameter_server_checkpoint.FORMAT,
                "models": entries,
                "metadata": metadata or {},
            },
            path,
        )

    def restore(
        self, path: str | os.PathLike[str], models: Sequence[Any] | None = None
    ) -> dict[str, Any]:
        """Load a file written by ``save`` into the ps tasks, for the same ``models`` in the
        same order (None: all of the strategy's), all or nothing: it is checked against every
        model first; and the optimizers' hyperparameters into their handles. Functions
        scheduled before it run first. Returns the file's metadata."""
        chosen = self._mirrored(models)
        saved = checkpoint.load(path)
        if not isinstance(saved, dict) or saved.get("format") != parameter_server_checkpoint.FORMAT:
            raise ValueError(f"{str(path)!r} was not written by ClusterCoordinator.save()")
        if len(saved["models"]) != len(chosen):
            raise ValueError(
                f"{str(path)!r} holds {len(saved['models'])} model(s), restore() was given "
                f"{len(chosen)}: mirror and pass the same models, in the same order, as save()"
            )
        self.join()
        self._write(chosen, saved["models"])
        return dict(saved["metadata"])

    def load_weights(self, model: Any, state_dict: dict[str, Any]) -> None:
        """Replace a mirrored model's parameters and buffers on the ps tasks with
        ``state_dict`` (its ``state_dict()`` keys and shapes, else nothing changes), keeping
        its optimizer's state; functions scheduled before it run first."""
        (mirrored,) = self._mirrored([model])
        self.join()
        with self._paused():
            (entry,) = self._read([mirrored])
            self._write([mirrored], [{**entry, "model": state_dict}])

    def _mirrored(
        self, handles: Sequence[Any] | None
    ) -> list[parameter_server_checkpoint.MirroredModel]:
        """The strategy's records of the models behind ``handles`` (None: every model)."""
        if handles is None:
            return list(self.strategy.models)
        by_id = {m.model_id: m for m in self.strategy.models}
        unknown = [h for h in handles if getattr(h, "model_id", None) not in by_id]
        if unknown:
            raise ValueError(
                f"{unknown[0]!r} was not mirrored by this coordinator's strategy: pass the "
                "handles strategy.mirror() returned"
            )
        return [by_id[h.model_id] for h in handles]

    def _read(self, models: list[parameter_server_checkpoint.MirroredModel]) -> list[Any]:
        """The checkpoint entries of ``models``, read while no function runs."""
        with self._paused():
            states = self._on_every_ps(
                shard_store.state_dict, [[(m.model_id,) for m in models]] * self.strategy.num_ps
            )
        return [
            parameter_server_checkpoint.gather(model, [task[i] for task in states])
            for i, model in enumerate(models)
        ]

    def _write(
        self, models: list[parameter_server_checkpoint.MirroredModel], entries: list[Any]
    ) -> None:
        """Load checkpoint entries into the ps tasks while no function runs; every entry is
        checked before any ps task receives anything."""
        per_model = [  # one list per model, of each ps task's part
            parameter_server_checkpoint.scatter(model, entry, self.strategy.num_ps)
            for model, entry in zip(models, entries, strict=True)
        ]
        with self._paused():
            self._on_every_ps(
                shard_store.load_state_dict,
                [
                    [(model.model_id, per_model[i][ps]) for i, model in enumerate(models)]
                    for ps in range(self.strategy.num_ps)
                ],
            )
        for model, entry in zip(models, entries, strict=True):
            parameter_server_checkpoint.load_hyperparameters(model, entry)

    def _on_every_ps(
        self, function: Callable[..., Any], calls: list[list[tuple[Any, ...]]]
    ) -> list[list[Any]]:
        """``function(*args)`` for each of ``calls[i]`` on ps task i, all at once; the results
        in the same layout. A lost ps task breaks the job."""
        futures = [
            [
                rpc.rpc_async(ps, function, args, timeout=self.strategy.timeout_seconds)
                for args in task
            ]
            for ps, task in zip(self.strategy.cluster.ps, calls, strict=True)
        ]
        try:
            return [[future.wait() for future in task] for task in futures]
        except Exception as error:
            lost = RuntimeError(
                f"a ps task was lost during {function.__name__} ({error}); restart the job "
                "from its last checkpoint"
            )
            with self._condition:
                self._lose(lost)
            raise lost from error

    @contextlib.contextmanager
    def _paused(self) -> Iterator[None]:
        """No function starts, and none is running, inside."""
        with self._condition:
            self._pauses += 1
            self._condition.wait_for(lambda: self._in_flight == 0)
        try:
            yield
        finally:
            with self._condition:
                self._pauses -= 1
                self._condition.notify_all()

    # -- workers --------------------------------------------------------------------------------
    def _add_worker(self, worker: str) -> None:
        """Start dispatching to ``worker`` (under the condition); a newcomer's clock starts at
        the slowest live worker's, so that max_staleness neither holds the others back nor lets
        it run ahead."""
        self._clocks[worker] = min((self._clocks[w] for w in self._live), default=0)
        self._live.add(worker)
        if self._no_worker_timer is not None:
            self._no_worker_timer.cancel()
            self._no_worker_timer = None
        thread = threading.Thread(target=self._dispatch, args=(worker,), daemon=True, name=worker)
        self._threads.append(thread)
        thread.start()

    def _welcome(self, member: Member) -> None:
        """A restarted worker joins: it builds every per-worker dataset, then takes functions."""
        for dataset_id, dataset_fn in self._datasets:
            self._register(dataset_id, dataset_fn, member).wait()
        with self._condition:
            if not self._stopped():
                self._add_worker(member.name)
                self._condition.notify_all()

    def _retire(self, worker: str) -> None:
        """Take no more functions to ``worker``, and count no result it still returns (its
        function runs again elsewhere): its task was restarted."""
        with self._condition:
            self._drop(worker, "its task was restarted")

    def _drop(self, worker: str, why: object) -> None:
        """``worker`` takes no more functions (under the condition). With no worker left, the
        functions wait for one to rejoin, for the strategy's timeout at most; then the job
        fails."""
        self._live.discard(worker)
        self._condition.notify_all()
        if self._live or self._stopped() or self._no_worker_timer is not None:
            return
        timeout = self.strategy.timeout_seconds

        def expire() -> None:
            with self._condition:
                if not self._live and not self._stopped():
                    self._lose(
                        RuntimeError(
                            f"every worker was lost (the last, {worker}: {why}) and none "
                            f"rejoined within {timeout:g} s"
                        )
                    )

        self._no_worker_timer = threading.Timer(timeout, expire)
        self._no_worker_timer.daemon = True
        self._no_worker_timer.start()

    # -- dispatch ---------------------------------------------------------------------------------
    def _dispatch(self, worker: str) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(
                    lambda: (
                        self._closing
                        or worker not in self._live
                        or (self._queue and not self._pauses and self._may_start(worker))
                    )
                )
                if self._closing or worker not in self._live:
                    return
                function = self._queue.popleft()
                finished_below = min(self._unfinished)
                self._in_flight += 1
            try:
                status, result = rpc.rpc_sync(
                    worker,
                    parameter_server_worker.run_function,
                    (function.id, finished_below, function.call),
                    timeout=self.strategy.timeout_seconds,
                )
            except Exception as error:  # the worker is lost: fence it, hand its function on
                self._give_up(worker, function, error)
                return
            with self._condition:
                self._in_flight -= 1
                if worker not in self._live:  # retired meanwhile: its pushes may be refused
                    self._queue.appendleft(function)
                    self._condition.notify_all()
                    return
                self._unfinished.discard(function.id)
                self._clocks[worker] += 1
                if status == "ok":
                    function.value._finish(result)
                elif status == "raised":
                    self._fail(function, worker, *result)
                else:  # a ps task is lost: nothing can be trained any more
                    lost = RuntimeError(
                        f"{result} (while {worker} ran {_name(function)}); the job cannot go on "
                        "without it: restart it from its last checkpoint (ClusterCoordinator."
                        "save / restore)"
                    )
                    function.value._finish(error=lost)
                    self._lose(lost)
                self._condition.notify_all()
            self._commit_rounds()

    def _may_start(self, worker: str) -> bool:
        if self.strategy.synchronous:
            return self._queue[0].round <= self._committed + 1
        limit = self.strategy.max_staleness
        slowest = min(self._clocks[w] for w in self._live)
        return limit is None or self._clocks[worker] - slowest <= limit

    def _commit_rounds(self) -> None:
        """Commit every round whose functions have all run (synchronous mode), in order; one
        thread at a time does it, and it looks again after each round it committed."""
        while True:
            with self._condition:
                round_ = self._committed + 1
                members = self._rounds.get(round_)
                if (
                    self._committing
                    or members is None
                    or round_ >= self._open_round
                    or any(f in self._unfinished for f in members)
                    or self._error is not None
                    or self._broken is not None
                ):
                    return
                self._committing = True
            try:
                for ps in self.strategy.cluster.ps:
                    rpc.rpc_sync(
                        ps, shard_store.commit, (members,), timeout=self.strategy.timeout_seconds
                    )
            except Exception as error:
                with self._condition:
                    self._committing = False
                    self._lose(
                        RuntimeError(
                            f"a ps task was lost ({error}) while committing round {round_}; "
                            "restart the job from its last checkpoint"
                        )
                    )
                return
            with self._condition:
                del self._rounds[round_]
                self._committed = round_
                self._committing = False
                self._condition.notify_all()

    def _fail(self, function: _Function, worker: str, kind: str, message: str, trace: str) -> None:
        error = ScheduledFunctionError(
            f"{_name(function)} raised on {worker}: {kind}: {message}",
            kind,
            trace,
        )
        function.value._finish(error=error)
        if self._error is None:
            self._error = error
        # TensorFlow cancels what was queued after a failed function.
        self._fail_queued(
            RuntimeError(f"cancelled: an earlier scheduled function failed ({error})")
        )

    def _give_up(self, worker: str, function: _Function, error: BaseException) -> None:
        lost: BaseException | None = None
        try:
            self.strategy._give_up(worker)
        except Exception as fence_error:
            lost = RuntimeError(
                f"a ps task was lost ({fence_error}) while giving up {worker}; restart the job "
                "from its last checkpoint"
            )
        with self._condition:
            self._in_flight -= 1
            self._queue.appendleft(function)  # another worker runs it again
            if lost is not None:
                self._lose(lost)
            self._drop(worker, error)

    def _lose(self, error: BaseException) -> None:
        """The job cannot go on (a ps task or every worker is lost): fail what is queued."""
        self._error = self._error or error
        self._broken = self._broken or error
        self._fail_queued(error)

    def _fail_queued(self, error: BaseException) -> None:
        for pending in self._queue:
            self._unfinished.discard(pending.id)
            pending.value._finish(error=error)
        self._queue.clear()
        self._condition.notify_all()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop dispatching: the functions still queued fail, and those running finish first;
        idempotent. The strategy closes its coordinator when it closes."""
        with self._condition:
            self._closing = True
            self._fail_queued(RuntimeError("the ClusterCoordinator was closed before it ran"))
            if self._no_worker_timer is not None:
                self._no_worker_timer.cancel()
        for thread in self._threads:
            thread.join()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _name(function: _Function) -> str:
    return str(getattr(function.fn, "__qualname__", function.fn))
