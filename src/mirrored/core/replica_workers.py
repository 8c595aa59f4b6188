"""Persistent worker threads that run each replica's share of a step.

Replica 0 runs on the caller's thread and replicas 1..N-1 on persistent worker threads (starting
a thread per step would cost more than a small model's step). Running replica 0 on the caller
keeps one replica exactly as fast as the plain loop: a worker thread with its own OpenMP team
beside the caller's puts more threads than cores in libgomp's count, which then sleeps between
parallel regions instead of spinning (measured: about 50x the context switches, 0.70x the
plain loop's throughput; see benchmarks/RESULTS.md). It also saves a thread hand-off per step.
Workers hold no reference to the strategy, so an unclosed strategy can still be
garbage-collected, which stops them.

A thread cannot be stopped from outside, so a replica stuck in user code past the timeout is
left to finish on its own: the run fails at once, and the next run starts once that replica has
returned (its late result is dropped).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from mirrored.core.context import current_replica_context
from mirrored.core.replica_meeting import ReplicaAbortedError, SyncTimeoutError, caused_by_timeout

__all__ = ["Outcome", "ReplicaWorkers", "close_threads"]

_STOP = object()

# How long replicas released from a sync point by a failed run get to return before the run
# gives up on them: leaving a wait and unwinding takes milliseconds.
_RELEASE_SECONDS = 0.5

# (True, result) or (False, exception)
Outcome = tuple[bool, Any]


class ReplicaWorkers:
    """Replica 0 on the caller's thread, one daemon thread for each other replica."""

    def __init__(self, names: Sequence[str]) -> None:
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in names[1:]]
        self._done = threading.Condition()
        self._outcomes: list[Outcome | None] = []
        self._run_number = 0  # a task's outcome counts only for the run that gave the task
        self._running = [False] * len(names)  # per worker thread: a task is under way
        self._gave_up = False  # a run gave up on replicas still running (stragglers)
        self._names = list(names)
        self._run_lock = threading.Lock()
        self._threads = [
            threading.Thread(
                target=self._loop, args=(i,), name=f"mirrored-replica-{i}-{names[i]}", daemon=True
            )
            for i in range(1, len(names))
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    @property
    def broken(self) -> str | None:
        """Why the replicas' state cannot be trusted now: replicas a failed run gave up on are
        still running its function (None once they have all returned)."""
        stuck = self._still_running()
        if not stuck:
            return None
        return (
            f"replicas on {stuck} are still running the replica function of a run that failed "
            "(stuck in user code); the strategy runs again once they return"
        )

    def _still_running(self) -> list[str]:
        with self._done:
            if self._outcomes:  # a run is under way: its replicas are not stuck
                return []
            return [self._names[i] for i, running in enumerate(self._running) if running]

    def _loop(self, index: int) -> None:
        while True:
            item = self._queues[index - 1].get()
            if item is _STOP:
                return
            number, task = item
            try:
                outcome: Outcome = (True, task())
            except BaseException as error:  # reported to the caller, never lost
                outcome = (False, error)
            del task, item
            with self._done:
                if number == self._run_number and self._outcomes:  # else the run gave up on it
                    self._outcomes[index] = outcome
                self._running[index] = False
                self._done.notify_all()
            # An exception's traceback reaches the strategy: holding it would keep an unclosed
            # strategy (and this thread) alive.
            del outcome

    def run(
        self,
        tasks: Sequence[Callable[[], Any]],
        timeout_seconds: float | None,
        abort: Callable[[BaseException], None],
        after_stragglers: Callable[[], None] | None = None,
    ) -> list[Outcome]:
        """Run ``tasks[i]`` on thread ``i``; return every outcome. One run at a time.

        Once one replica has finished, the rest must finish within ``timeout_seconds`` (else a
        replica is stuck outside any sync point: ``SyncTimeoutError``). No wait is repeated: a
        replica missing from a sync point that timed out has had its time, and is not waited
        for again here. Replicas still running when the run fails (or is interrupted: Ctrl-C
        in a notebook) are released with ``abort(reason)`` and given up on; the next run first
        waits up to ``timeout_seconds`` for them to return, then calls ``after_stragglers()``
        (where the strategy resyncs the replicas, which it could not do under a running one).
        """
        with self._run_lock:
            if self._closed:
                raise RuntimeError("the strategy is closed; create a new one")
            if self._wait_for_stragglers(timeout_seconds) and after_stragglers is not None:
                after_stragglers()
            with self._done:
                self._run_number += 1
                number = self._run_number
                self._outcomes = [None] * len(tasks)
                self._running = [index > 0 for index in range(len(tasks))]
            for q, task in zip(self._queues, tasks[1:], strict=True):
                q.put((number, task))
            try:
                outcome: Outcome = (True, tasks[0]())
            except BaseException as error:  # the replica's own error, reported like the others'
                outcome = (False, error)
            with self._done:
                self._outcomes[0] = outcome
            del outcome
            try:
                return self._collect(timeout_seconds)
            except BaseException as reason:
                abort(reason)
                self._collect_released()
                raise
            finally:
                with self._done:
                    self._outcomes = []

    def _wait_for_stragglers(self, timeout_seconds: float | None) -> bool:
        """Before a run: wait for replicas an earlier run gave up on; whether there were any
        since the last such wait."""
        deadline = None if timeout_seconds is None else time.monotonic() + timeout_seconds
        with self._done:
            if not self._gave_up:
                return False
            while any(self._running):
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    stuck = [self._names[i] for i, running in enumerate(self._running) if running]
                    raise SyncTimeoutError(
                        f"replicas on {stuck} are still running the replica function of an "
                        f"earlier run that failed, {timeout_seconds} s after this run began "
                        "waiting for them (stuck in user code); the strategy runs again once "
                        "they return"
                    )
                self._done.wait(min(remaining, 0.5) if remaining is not None else 0.5)
            self._gave_up = False
            return True

    def _collect(self, timeout_seconds: float | None) -> list[Outcome]:
        """Every replica's outcome. A failed run gives up on the replicas that have not
        returned by its deadline (their outcome: released); a run where no replica failed
        raises ``SyncTimeoutError`` for them instead."""
        deadline: float | None = None
        with self._done:
            while any(o is None for o in self._outcomes):
                now = time.monotonic()
                if deadline is None and timeout_seconds is not None:
                    if any(o is not None and _timed_out(o) for o in self._outcomes):
                        deadline = now + _RELEASE_SECONDS
                    elif any(o is not None for o in self._outcomes):
                        deadline = now + timeout_seconds
                remaining = None if deadline is None else deadline - now
                if remaining is not None and remaining <= 0:
                    break
                # Wake up regularly so that Ctrl-C is noticed promptly.
                self._done.wait(min(remaining, 0.5) if remaining is not None else 0.5)
            stuck = [i for i, o in enumerate(self._outcomes) if o is None]
            self._gave_up = self._gave_up or bool(stuck)
            if stuck and all(o is None or o[0] for o in self._outcomes):
                raise SyncTimeoutError(
                    f"replica(s) {stuck} on {[self._names[i] for i in stuck]} did not finish "
                    f"within {timeout_seconds} s of the others; they are stuck in the replica "
                    "function outside any sync point"
                )
            given_up = ReplicaAbortedError(
                "given up on: still running when the run failed (stuck in user code?)"
            )
            return [(False, given_up) if o is None else o for o in self._outcomes]

    def _collect_released(self) -> None:
        """After ``abort``: give the replicas it released a moment to return."""
        deadline = time.monotonic() + _RELEASE_SECONDS
        with self._done:
            while any(o is None for o in self._outcomes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._gave_up = True
                    return
                self._done.wait(remaining)

    def close(self, wait: bool = True) -> None:
        """Stop the threads (after a run in progress); idempotent. Threads of replicas stuck in
        user code cannot be stopped: they are left to the process, as daemons, rather than
        hanging the caller."""
        with self._run_lock:
            if self._closed:
                return
            self._closed = True
            for q in self._queues:
                q.put(_STOP)
        if wait and self.broken is None:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()


def _timed_out(outcome: Outcome) -> bool:
    """A replica failed on a timeout, or was released by one."""
    ok, value = outcome
    return not ok and caused_by_timeout(value)


def close_threads(finalizer: weakref.finalize, stop: Callable[[], None]) -> None:
    """``strategy.close()`` of a strategy whose threads ``finalizer`` ends at collection: the
    first call detaches it and runs ``stop``, which waits for the threads; later calls do nothing.

    A replica function cannot close its own strategy: its peers would wait on it forever.
    """
    if current_replica_context() is not None:
        raise RuntimeError(
            "strategy.close() was called inside a replica function; close the strategy "
            "from the training loop, after strategy.run() returns"
        )
    if finalizer.detach() is not None:
        stop()
