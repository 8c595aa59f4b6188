"""Preemption: SIGTERM (what Kubernetes, SLURM and cloud schedulers send before they kill a
job, with a grace period) turned into a backup at the next step boundary and a clean exit.

A ``PreemptionWatcher`` records the signal instead of dying of it; the training loop asks
``requested(strategy)`` at each step boundary, a flag that is the same on every worker (any
worker's signal counts: the workers must back up at the same step, since a backup is a
collective). ``fit`` does this whenever a ``BackupAndRestore`` is among its callbacks: it backs
up and raises ``Preempted``, which ends the program with exit code 143 (``Preempted.EXIT_CODE``,
what a shell reports for a process that SIGTERM ended) unless caught; running the program again
resumes there. A custom loop does the same with the watcher and its own checkpoint.

Signal handlers can only be set on the main thread; elsewhere the watcher records nothing and
SIGTERM keeps its usual effect.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

from mirrored.core.strategy import Strategy

__all__ = ["PREEMPTED_EXIT_CODE", "Preempted", "PreemptionWatcher"]

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class Preempted(SystemExit):
    """Training stopped at a step boundary because the job is being preempted, after backing
    up. Uncaught, it ends the program with exit code ``Preempted.EXIT_CODE`` (143)."""

    EXIT_CODE = PREEMPTED_EXIT_CODE

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class PreemptionWatcher:
    """Records the ``signals`` the process receives while it is entered (``with``), instead of
    letting them end it; the previous handlers come back on exit."""

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> PreemptionWatcher:
        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self._previous[number] = signal.signal(number, self._record)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        previous, self._previous = self._previous, {}
        for number, handler in previous.items():
            signal.signal(number, handler)

    def _record(self, number: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(number)

    def requested(self, strategy: Strategy | None = None) -> bool:
        """Whether a watched signal arrived here, or, with ``strategy``, on any of its workers:
        then a collective, to be called by every worker at the same step."""
        here = self.received is not None
        return here if strategy is None else strategy.any_worker(here, "was preempted")
