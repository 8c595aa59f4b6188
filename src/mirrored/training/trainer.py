"""``fit``'s one story, the same on every strategy: the epoch loop and the callbacks around it.

A fit opens its run (the model marked as fitting, the callbacks in their order), calls
``on_train_begin`` (where ``BackupAndRestore`` may set where to resume), then runs epoch after
epoch: ``on_epoch_begin``, the epoch's steps, validation and ``on_epoch_end``, until the last
epoch, ``stop_training``, or input that ran out; then ``on_train_end``. With a
``BackupAndRestore``, SIGTERM backs up at the next step boundary and ends the fit
(:mod:`mirrored.preemption`). What differs between
kinds of strategy is only how an epoch's steps run and where its data comes from: the
``FitEpochs`` a model's ``TrainingLoop`` hands over (``strategy.run`` on the replicas here, or
steps a ``ClusterCoordinator`` schedules on parameter-server workers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from mirrored.callbacks.backup_and_restore import BackupAndRestore
from mirrored.preemption import PreemptionWatcher
from mirrored.training.loop import FitEpochs, FitRun

__all__ = ["fit"]


def fit(
    prepared: FitEpochs,
    end_epoch: int,
    start: Callable[[int | None], AbstractContextManager[FitRun]],
) -> None:
    """Train the ``prepared`` epochs until epoch ``end_epoch`` (the last is ``end_epoch - 1``)
    in the run ``start`` opens."""
    with start(prepared.steps_per_epoch) as run, _watching_preemption(run):
        run.callbacks.on_train_begin()
        epoch_logs: dict[str, Any] = {}
        for epoch in range(prepared.first_epoch(run), end_epoch):
            run.begin_epoch(epoch)
            trained = prepared.train_epoch(run, epoch)
            if trained is None:
                break
            epoch_logs = trained
            run.end_epoch(epoch, epoch_logs)
            if run.stop_training:
                break
        prepared.finish(run)
        run.callbacks.on_train_end(epoch_logs)


@contextmanager
def _watching_preemption(run: FitRun) -> Iterator[None]:
    """With a ``BackupAndRestore``, SIGTERM is recorded for it to back up at the next step
    boundary (:mod:`mirrored.preemption`); without one, SIGTERM ends the program as usual."""
    if not any(isinstance(c, BackupAndRestore) for c in run.callbacks.callbacks):
        yield
        return
    with PreemptionWatcher() as watcher:
        run.preemption = watcher
        try:
            yield
        finally:
            run.preemption = None
