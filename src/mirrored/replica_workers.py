"""Persistent worker threads that run each replica's share of a step.

Replica 0 runs on the caller's thread and replicas 1..N-1 on persistent worker threads (starting
a thread per step would cost more than a small model's step). Running replica 0 on the caller
keeps one replica exactly as fast as the plain loop: a worker thread with its own OpenMP team
beside the caller's puts more threads than cores in libgomp's count, which then sleeps between
parallel regions instead of spinning (measured: about 50x the context switches, 0.70x the
plain loop's throughput; see benchmarks/RESULTS.md). It also saves a thread hand-off per step.
Workers hold no reference to the strategy, so an unclosed strategy can still be
garbage-collected, which stops them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from mirrored.rendezvous import SyncTimeoutError

__all__ = ["Outcome", "ReplicaWorkers"]

_STOP = object()

# (True, result) or (False, exception)
Outcome = tuple[bool, Any]


class ReplicaWorkers:
    """Replica 0 on the caller's thread, one daemon thread for each other replica."""

    def __init__(self, names: Sequence[str]) -> None:
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in names[1:]]
        self._done = threading.Condition()
        self._outcomes: list[Outcome | None] = []
        self._names = list(names)
        self._run_lock = threading.Lock()
        self.broken: str | None = None
        self._threads = [
            threading.Thread(
                target=self._loop, args=(i,), name=f"mirrored-replica-{i}-{names[i]}", daemon=True
            )
            for i in range(1, len(names))
        ]
        self._closed = False
        for thread in self._threads:
            thread.start()

    def _loop(self, index: int) -> None:
        while True:
            task = self._queues[index - 1].get()
            if task is _STOP:
                return
            try:
                outcome: Outcome = (True, task())
            except BaseException as error:  # reported to the caller, never lost
                outcome = (False, error)
            del task
            with self._done:
                if index < len(self._outcomes):  # else a run gave up on this replica
                    self._outcomes[index] = outcome
                self._done.notify_all()
            # An exception's traceback reaches the strategy: holding it would keep an unclosed
            # strategy (and this thread) alive.
            del outcome

    def run(
        self,
        tasks: Sequence[Callable[[], Any]],
        timeout_seconds: float | None,
        abort: Callable[[BaseException], None],
    ) -> list[Outcome]:
        """Run ``tasks[i]`` on thread ``i``; return every outcome. One run at a time.

        Once one replica has finished, the rest must finish within ``timeout_seconds`` (else a
        replica is stuck outside any sync point: ``SyncTimeoutError``). If waiting is interrupted
        (Ctrl-C in a notebook, or that timeout), ``abort(reason)`` releases the replicas and the
        workers are drained before the error propagates, so the next run starts clean; workers
        that cannot be drained leave the strategy marked unusable.
        """
        with self._run_lock:
            if self.broken is not None:
                raise RuntimeError(self.broken)
            if self._closed:
                raise RuntimeError("the strategy is closed; create a new one")
            with self._done:
                self._outcomes = [None] * len(tasks)
            for q, task in zip(self._queues, tasks[1:], strict=True):
                q.put(task)
            try:
                outcome: Outcome = (True, tasks[0]())
            except BaseException as error:  # the replica's own error, reported like the others'
                outcome = (False, error)
            with self._done:
                self._outcomes[0] = outcome
            del outcome
            try:
                self._wait_for_all(timeout_seconds)
                with self._done:
                    return [o for o in self._outcomes if o is not None]
            except BaseException as reason:
                abort(reason)
                try:
                    self._wait_for_all(timeout_seconds)
                except BaseException:
                    stuck = [self._names[i] for i, o in enumerate(self._outcomes) if o is None]
                    self.broken = f"the strategy is unusable: replicas on {stuck} are stuck"
                raise
            finally:
                with self._done:
                    self._outcomes = []

    def _wait_for_all(self, timeout_seconds: float | None) -> None:
        deadline: float | None = None
        with self._done:
            while any(o is None for o in self._outcomes):
                if (
                    deadline is None
                    and timeout_seconds is not None
                    and any(o is not None for o in self._outcomes)
                ):
                    deadline = time.monotonic() + timeout_seconds
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    stuck = [i for i, o in enumerate(self._outcomes) if o is None]
                    raise SyncTimeoutError(
                        f"replica(s) {stuck} on {[self._names[i] for i in stuck]} did not finish "
                        f"within {timeout_seconds} s of the others; they are stuck in the replica "
                        "function outside any sync point"
                    )
                # Wake up regularly so that Ctrl-C is noticed promptly.
                self._done.wait(min(remaining, 0.5) if remaining is not None else 0.5)

    def close(self, wait: bool = True) -> None:
        """Stop the threads (after a run in progress); idempotent. Threads of replicas stuck in
        user code (a broken strategy) cannot be stopped: they are left to the process, as daemons,
        rather than hanging the caller."""
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
