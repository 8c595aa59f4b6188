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
        straggler_timeout: float | None,
        on_straggler: Callable[[list[int]], BaseException],
    ) -> list[Outcome]:
        """Run ``tasks[i]`` on thread ``i``; return every outcome.

        Once one replica has finished, the rest must finish within ``straggler_timeout`` seconds
        (a replica stuck outside any sync point); otherwise the workers are marked broken and
        ``on_straggler(stuck_replica_ids)`` is raised.
        """
        if self.broken is not None:
            raise RuntimeError(self.broken)
        if not self._threads or not self._threads[0].is_alive():
            raise RuntimeError("the strategy is closed; create a new one")
        with self._done:
            self._outcomes = [None] * len(self._threads)
        for q, task in zip(self._queues, tasks, strict=True):
            q.put(task)
        deadline: float | None = None
        with self._done:
            while any(o is None for o in self._outcomes):
                if (
                    deadline is None
                    and straggler_timeout is not None
                    and any(o is not None for o in self._outcomes)
                ):
                    deadline = time.monotonic() + straggler_timeout
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    stuck = [i for i, o in enumerate(self._outcomes) if o is None]
                    error = on_straggler(stuck)
                    self.broken = f"the strategy is unusable: {error}"
                    raise error
                self._done.wait(remaining if remaining is not None else 1.0)
            outcomes = [o for o in self._outcomes if o is not None]
            self._outcomes = []
        return outcomes

    def close(self, wait: bool = True) -> None:
        """Stop the threads (after their current task); idempotent."""
        for q in self._queues:
            q.put(_STOP)
        if wait:
            for thread in self._threads:
                if thread is not threading.current_thread():
                    thread.join()
        self._threads = []
