"""``save_freq`` of the callbacks that write files: "epoch", or every N training batches.

One execution of ``steps_per_execution`` batches calls the batch hooks once, so batches are
counted from the first and last index an execution reports, not per call.
"""

from __future__ import annotations

from typing import Any

from mirrored.callbacks.callback import Logs

__all__ = ["SaveFrequency", "SaveFrequencyHooks"]


class SaveFrequency:
    """Counts training batches and says when a save is due."""

    def __init__(self, save_freq: Any, owner: str) -> None:
        if save_freq != "epoch" and (
            not isinstance(save_freq, int) or isinstance(save_freq, bool) or save_freq <= 0
        ):
            raise ValueError(
                f"{owner}: save_freq={save_freq!r}; expected 'epoch' or a positive number of "
                "batches"
            )
        self.save_freq: str | int = save_freq
        self.batches_since_save = 0
        self._first_batch = 0

    @property
    def per_epoch(self) -> bool:
        return self.save_freq == "epoch"

    def begin(self, batch: int) -> None:
        """From ``on_train_batch_begin``: the execution's first batch."""
        self._first_batch = batch

    def due(self, batch: int) -> bool:
        """From ``on_train_batch_end``: count the execution's batches; True when N are done."""
        if isinstance(self.save_freq, str):
            return False
        self.batches_since_save += batch - self._first_batch + 1
        return self.batches_since_save >= self.save_freq

    def saved(self) -> None:
        self.batches_since_save = 0


class SaveFrequencyHooks:
    """The batch hooks of a callback that saves every ``save_freq`` batches (put it before
    ``Callback`` among the bases): each execution's first batch is noted, and a batch's logs are
    read only when saves are per batch."""

    _frequency: SaveFrequency

    def on_train_batch_begin(self, batch: int, logs: Logs | None = None) -> None:
        self._frequency.begin(batch)

    def reads_batch_logs(self, hook: str) -> bool:
        return hook == "on_train_batch_end" and not self._frequency.per_epoch
