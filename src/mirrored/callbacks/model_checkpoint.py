"""``ModelCheckpoint``: save the model during ``fit``, every epoch, every N batches, or only the
best (Keras's).

``filepath`` may name the epoch and any log, ``"ckpt/{epoch:02d}-{val_loss:.2f}.pt"``, to keep
one file per save. Files are written atomically (``Model.save`` / ``save_weights`` go through
``mirrored.checkpoint.save``) and only by the process that writes checkpoints. A save whose loss
is NaN or infinite is skipped with a warning: the last good file stays on disk instead of being
replaced by a diverged model.
"""

from __future__ import annotations

import math
import os
import string
import warnings
from pathlib import Path
from typing import Any

from mirrored import checkpoint
from mirrored.callbacks.callback import Logs
from mirrored.callbacks.monitor import MonitorCallback
from mirrored.callbacks.save_frequency import SaveFrequency, SaveFrequencyHooks

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(SaveFrequencyHooks, MonitorCallback):
    """Save the model (``save_weights_only``: its weights) to ``filepath`` while training.

    ``save_freq``: "epoch" or a number of training batches. ``save_best_only``: save only when
    ``logs[monitor]`` improves on the best so far (and on ``initial_value_threshold``).
    ``filepath`` fields: ``{epoch}`` (1-based), ``{batch}`` (1-based, batch saves) and log names.
    ``Model.save`` writes the full training state (``Model.load`` reads it), ``save_weights``
    the module's state dict (a plain ``torch.load(path, weights_only=True)``-able file).
    """

    def __init__(
        self,
        filepath: str | os.PathLike[str],
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        filepath = os.fspath(filepath)
        if not filepath:
            raise ValueError("ModelCheckpoint: filepath is empty; pass the file to save to")
        self._frequency = SaveFrequency(save_freq, "ModelCheckpoint")
        _check_fields(filepath)
        self.filepath = filepath
        self.verbose = verbose
        self.save_best_only = save_best_only
        self.save_weights_only = save_weights_only
        self.save_freq = save_freq
        self._epoch = 0

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._frequency.saved()

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if self._frequency.due(batch):
            self._frequency.saved()
            self._save(self._epoch, batch, logs or {})

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch, None, logs or {})

    # -- saving ------------------------------------------------------------------------------------
    def _save(self, epoch: int, batch: int | None, logs: Logs) -> None:
        model = self.fit_model()
        path = self._format_path(epoch, batch, logs)
        speaks = self.verbose > 0 and model.strategy.should_checkpoint
        loss = logs.get("loss")
        if (loss is not None and not math.isfinite(float(loss))) or not checkpoint.all_finite(
            model.state_dict()
        ):
            warnings.warn(
                f"ModelCheckpoint: not saving to {path!r} at epoch {epoch + 1}: the loss "
                f"({loss}) or the weights are not finite; the last good checkpoint stays",
                stacklevel=3,
            )
            return
        if self.save_best_only:
            current = self.get_monitor_value(logs)
            if current is None:
                return
            previous = "None" if self.best is None else f"{self.best:.5f}"
            if not self._is_improvement(current, self.best):
                if speaks:
                    print(f"\nEpoch {epoch + 1}: {self.monitor} did not improve from {previous}")
                return
            self.best = current
            if speaks:
                print(
                    f"\nEpoch {epoch + 1}: {self.monitor} improved from {previous} to "
                    f"{current:.5f}, saving model to {path}"
                )
        elif speaks:
            print(f"\nEpoch {epoch + 1}: saving model to {path}")
        if Path(path).is_dir():
            raise ValueError(
                f"ModelCheckpoint: filepath {path!r} is an existing folder; give a file name, "
                "e.g. filepath='checkpoints/model-{epoch:02d}.pt'"
            )
        if self.save_weights_only:
            model.save_weights(path)
        else:
            model.save(path)

    def _format_path(self, epoch: int, batch: int | None, logs: Logs) -> str:
        fields: dict[str, Any] = dict(logs)
        fields["epoch"] = epoch + 1
        if batch is not None:
            fields["batch"] = batch + 1
        try:
            return self.filepath.format(**fields)
        except KeyError as error:
            field = error.args[0] if error.args else "?"
            raise ValueError(
                f"ModelCheckpoint: filepath {self.filepath!r} has the field {{{field}}}, which "
                f"is not among the values available here ({', '.join(sorted(fields))}); use "
                "those names (val_ names need validation_data, batch needs save_freq=N)"
            ) from error
        except (IndexError, ValueError) as error:
            raise ValueError(
                f"ModelCheckpoint: filepath {self.filepath!r} cannot be formatted with the "
                f"values available here ({', '.join(sorted(fields))}): {error}; give each field "
                "a format that fits its value, e.g. {epoch:02d}, {val_loss:.2f}"
            ) from error

    # -- resuming ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "batches_since_save": self._frequency.batches_since_save}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self._frequency.batches_since_save = int(state["batches_since_save"])


def _check_fields(filepath: str) -> None:
    """Reject a filepath that no logs could fill: broken braces, positional fields."""
    try:
        names = [name for _, name, _, _ in string.Formatter().parse(filepath) if name is not None]
    except ValueError as error:
        raise ValueError(
            f"ModelCheckpoint: filepath {filepath!r} is not a valid format string ({error}); "
            "write a literal brace as {{ or }}"
        ) from error
    positional = [name for name in names if name == "" or name.isdigit()]
    if positional:
        raise ValueError(
            f"ModelCheckpoint: filepath {filepath!r} has positional fields; name them, e.g. "
            "{epoch:02d} or {val_loss:.2f}"
        )
