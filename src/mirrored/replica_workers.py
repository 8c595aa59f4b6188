"""Persistent worker threads, one per replica, that run each replica's share of a step.

Threads live as long as the strategy (starting a thread per step would cost more than a small
model's step). They hold no reference to the strategy, so an unclosed strategy can still be
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
    """N daemon threads; ``run`` hands one task to each and waits for all of them."""

    def __init__(self, names: Sequence[str], thread_setup: Sequence[Callable[[], None]]) -> None:
        self._queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in names]
        self._done = threading.Condition()
        self._outcomes: list[Outcome | None] = []
        self._names = list(names)
        self._run_lock = threading.Lock()
        self.broken: str | None = None
        self._threads = [
            threading.Thread(
                target=self._loop,
                args=(i, setup),
                name=f"mirrored-replica-{i}-{name}",
                daemon=True,
            )
            for i, (name, setup) in enumerate(zip(names, thread_setup, strict=True))
        ]
        for thread in self._threads:
            thread.start()

    def _loop(self, index: int, setup: Callable[[], None]) -> None:
        setup()
        while True:
            task = self._queues[index].get()
            if task is _STOP:
                return
            try:
                outcome: Outcome = (True, task())
            except BaseException as error:  # reported to the caller, never lost
                outcome = (False, error)
            del task
            with self._done:
                self._outcomes[index] = outcome
                self._done.notify_all()

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
            if not self._threads:
                raise RuntimeError("the strategy is closed; create a new one")
            with self._done:
                self._outcomes = [None] * len(self._threads)
            for q, task in zip(self._queues, tasks, strict=True):
                q.put(task)
            try:
                self._wait_for_all(timeout_seconds)
            except BaseException as reason:
                abort(reason)
                try:
                    self._wait_for_all(timeout_seconds)
                except BaseException:
                    stuck = [self._names[i] for i, o in enumerate(self._outcomes) if o is None]
                    self.broken = f"the strategy is unusable: replicas on {stuck} are stuck"
                raise
            with self._done:
                outcomes = [o for o in self._outcomes if o is not None]
                self._outcomes = []
            return outcomes

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
        """Stop the threads (after their current task); idempotent."""
        for q in self._queues:
            q.put(_STOP)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
        self._threads = []
