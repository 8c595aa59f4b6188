"""ClusterCoordinator: the coordinator's queue of functions for the workers of a
``ParameterServerStrategy`` (TensorFlow's ``tf.distribute.coordinator.ClusterCoordinator``).

``schedule`` queues a function and returns at once with a ``RemoteValue``; one dispatcher thread
per worker takes the next function whenever its worker is free, so a slow worker runs fewer of
them and never holds the others up (unless ``max_staleness`` bounds how far ahead they may get).

A worker whose call fails (its process died, its connection broke, or it stayed silent for the
strategy's timeout) is given up: every ps task fences it (a late push of it is refused), then its
function goes back to the head of the queue for another worker. A function's update reaches each ps
task once even when it ran twice (``mirrored.parameter_server.shard_store``). In synchronous mode
the functions run in rounds of one per worker: a round's updates wait on the ps tasks until every
function of the round has run, the coordinator then commits them as one averaged step, and only then
may the next round start (``join`` commits a last, partial round). An error raised by a function
itself is not retried: it fails its ``RemoteValue``, cancels the functions still queued and is
raised by the next ``schedule``, ``join`` or ``done``, as in TensorFlow.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.rpc as rpc

from mirrored import checkpoint
from mirrored.coordinator import ps_state as parameter_server_state
from mirrored.coordinator.per_worker_datasets import (
    PerWorkerDataset,
    PerWorkerDatasets,
    PerWorkerIterator,
)
from mirrored.coordinator.remote_values import (
    RemoteValue,
    ScheduledFunction,
    ScheduledFunctionError,
)
from mirrored.core.values import map_structure
from mirrored.input import InputContext
from mirrored.parameter_server import checkpoint as parameter_server_checkpoint
from mirrored.parameter_server import shard_store
from mirrored.parameter_server import worker as parameter_server_worker
from mirrored.parameter_server.checkpoint import MirroredModel
from mirrored.parameter_server.rpc_cluster import Member
from mirrored.strategies.parameter_server import ParameterServerStrategy

__all__ = [
    "ClusterCoordinator",
    "PerWorkerDataset",
    "PerWorkerIterator",
    "RemoteValue",
    "ScheduledFunctionError",
]


class ClusterCoordinator:
    """Schedules functions on the workers of ``strategy`` (created on the chief). A strategy has
    one coordinator, as in TensorFlow: ``ClusterCoordinator(strategy)`` returns the one it has
    unless that one was closed."""

    def __new__(cls, strategy: ParameterServerStrategy) -> ClusterCoordinator:
        existing = strategy.coordinator
        if isinstance(existing, ClusterCoordinator) and not existing.closed:
            return existing
        return super().__new__(cls)

    def __init__(self, strategy: ParameterServerStrategy) -> None:
        if strategy.coordinator is self:
            return
        self.strategy = strategy
        self._queue: collections.deque[ScheduledFunction] = collections.deque()
        self._unfinished: set[int] = set()
        self._error: BaseException | None = None
        self._broken: BaseException | None = None  # why the job cannot go on, once it cannot
        self._closing = False
        self._pauses = 0  # checkpoints under way: no function may start
        self._in_flight = 0  # functions a worker is running
        self._datasets = PerWorkerDatasets(strategy)
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
        with strategy.stable_members() as members:  # those that rejoin later: welcome_worker
            strategy.attach_coordinator(self)  # closed before the strategy leaves RPC
            with self._condition:
                for member in members:
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
            function = ScheduledFunction(
                self.strategy.new_function_id(), fn, call, self._open_round
            )
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
        return self._datasets.create(dataset_fn)

    # -- checkpoints ------------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        metadata: dict[str, Any] | None = None,
        models: Sequence[Any] | None = None,
    ) -> Path:
        """Write the mirrored models (``models``: handles from ``strategy.mirror``; None for all
        of them) and their optimizers, as they are once every function scheduled so far has
        run, to ``path`` atomically (``mirrored.parameter_server.checkpoint`` says what the file
        holds), with ``metadata`` (plain data: numbers, strings, tensors, lists, dicts) that
        ``restore`` returns; no function starts while the ps tasks are read."""
        chosen = parameter_server_state.mirrored_models(self.strategy, models)
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
        chosen = parameter_server_state.mirrored_models(self.strategy, models)
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
        (mirrored,) = parameter_server_state.mirrored_models(self.strategy, [model])
        self.join()
        with self._paused():
            (entry,) = self._read([mirrored])
            self._write([mirrored], [{**entry, "model": state_dict}])

    def _read(self, models: list[MirroredModel]) -> list[Any]:
        """The checkpoint entries of ``models``, read while no function runs."""
        with self._paused(), self._losing_ps_breaks_the_job():
            return parameter_server_state.read_entries(self.strategy, models)

    def _write(self, models: list[MirroredModel], entries: list[Any]) -> None:
        """Load checkpoint entries into the ps tasks while no function runs; every entry is
        checked before any ps task receives anything."""
        parts = parameter_server_state.split_entries(self.strategy, models, entries)
        with self._paused(), self._losing_ps_breaks_the_job():
            parameter_server_state.write_entries(self.strategy, models, parts)
        for model, entry in zip(models, entries, strict=True):
            parameter_server_checkpoint.load_hyperparameters(model, entry)

    @contextlib.contextmanager
    def _losing_ps_breaks_the_job(self) -> Iterator[None]:
        """A ps task lost inside ends the job: nothing can be trained without its shards."""
        try:
            yield
        except parameter_server_state.PsTaskLostError as lost:
            with self._condition:
                self._lose(lost)
            raise

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

    def welcome_worker(self, member: Member) -> None:
        """A restarted worker joins (the strategy says so: ``WorkerListener``): it builds every
        per-worker dataset, then takes functions."""
        self._datasets.build_all(member)
        with self._condition:
            if not self._stopped():
                self._add_worker(member.name)
                self._condition.notify_all()

    def retire_worker(self, worker: str, why: str) -> None:
        """Take no more functions to ``worker``, and count no result it still returns (its
        function runs again elsewhere): it was lost, or its task was restarted (``why``; the
        strategy says so: ``WorkerListener``)."""
        with self._condition:
            self._drop(worker, why)

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
                    function.finish(result)
                elif status == "raised":
                    self._fail(function, worker, *result)
                else:  # a ps task is lost: nothing can be trained any more
                    lost = RuntimeError(
                        f"{result} (while {worker} ran {function.name}); the job cannot go on "
                        "without it: restart it from its last checkpoint (ClusterCoordinator."
                        "save / restore)"
                    )
                    function.finish(error=lost)
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

    def _fail(
        self, function: ScheduledFunction, worker: str, kind: str, message: str, trace: str
    ) -> None:
        error = ScheduledFunctionError(
            f"{function.name} raised on {worker}: {kind}: {message}",
            kind,
            trace,
        )
        function.finish(error=error)
        if self._error is None:
            self._error = error
        # TensorFlow cancels what was queued after a failed function.
        self._fail_queued(
            RuntimeError(f"cancelled: an earlier scheduled function failed ({error})")
        )

    def _give_up(self, worker: str, function: ScheduledFunction, error: BaseException) -> None:
        lost: BaseException | None = None
        try:
            self.strategy.give_up_worker(worker)
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
            pending.finish(error=error)
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

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called: ``ClusterCoordinator(strategy)`` then makes a new one."""
        return self._closing

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
