"""``LearningRateScheduler``: set the learning rate at each epoch's start from a function of the
epoch (Keras's).

``schedule(epoch, lr)`` gets the 0-based epoch and the current rate and returns the new rate;
a function of the epoch alone works too, as in Keras. For a rate that changes every step, give
``compile`` a schedule instead (``mirrored.optimizers`` or ``lr_scheduler=``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["LearningRateScheduler"]


class LearningRateScheduler(Callback):
    """``model.learning_rate = schedule(epoch, model.learning_rate)`` at every epoch's start.

    The epoch-end logs get the rate as ``learning_rate``. A run resumed in the middle of an
    epoch by ``BackupAndRestore`` does not apply that epoch's schedule a second time.
    """

    def __init__(self, schedule: Callable[..., float], verbose: int = 0) -> None:
        super().__init__()
        if not callable(schedule):
            raise TypeError(
                f"LearningRateScheduler: schedule={schedule!r} is not callable; pass a function "
                "(epoch, lr) -> new lr"
            )
        self.schedule = schedule
        self.verbose = verbose
        self._takes_lr = _takes_two_arguments(schedule)
        self._scheduled_epoch = -1  # the last epoch whose rate was set

    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._scheduled_epoch = -1

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if epoch == self._scheduled_epoch:
            return  # resumed mid-epoch: the restored optimizer already has this epoch's rate
        model = self.fit_model()
        if self._takes_lr:
            learning_rate = self.schedule(epoch, model.learning_rate)
        else:
            learning_rate = self.schedule(epoch)
        if not isinstance(learning_rate, (float, np.floating)):
            raise ValueError(
                f"LearningRateScheduler: schedule({epoch}, ...) returned {learning_rate!r} "
                f"({type(learning_rate).__name__}); it must return a float, e.g. 0.01 or "
                "float(lr * 0.5)"
            )
        model.learning_rate = float(learning_rate)
        self._scheduled_epoch = epoch
        if self.verbose > 0 and model.strategy.should_checkpoint:
            print(
                f"\nEpoch {epoch + 1}: LearningRateScheduler setting learning rate to "
                f"{float(learning_rate)}.",
                flush=True,
            )

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if logs is not None:
            logs["learning_rate"] = self.fit_model().learning_rate

    def state_dict(self) -> dict[str, Any]:
        return {"scheduled_epoch": self._scheduled_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._scheduled_epoch = int(state["scheduled_epoch"])


def _takes_two_arguments(schedule: Callable[..., Any]) -> bool:
    """Whether ``schedule`` accepts ``(epoch, lr)``; else it is called with the epoch alone."""
    try:
        signature = inspect.signature(schedule)
    except (TypeError, ValueError):  # builtins without a signature: try Keras's form
        return True
    try:
        signature.bind(0, 0.0)
    except TypeError:
        try:
            signature.bind(0)
        except TypeError:
            raise TypeError(
                f"LearningRateScheduler: schedule{signature} takes neither (epoch, lr) nor "
                "(epoch); pass a function (epoch, lr) -> new lr"
            ) from None
        return False
    return True
