"""``BackupAndRestore``: a killed training run, started again, carries on where it was.

At the end of every epoch (or every ``save_freq`` batches) it writes one backup file, atomically,
holding everything the rest of the run depends on: the model, the optimizer, the learning-rate
schedule and loss scale, the position in the data (epoch and batch), every random generator, the
epoch's running metrics and the other callbacks' progress (History, EarlyStopping, ...). Running
the same command again restores it when training begins, so the run ends with exactly the weights
an uninterrupted run ends with. A finished run deletes the backup (``delete_checkpoint=True``).

``fit`` runs this callback after the others, so that a backup taken at the end of an epoch
includes what they recorded for it.

Preemption: while it is among fit's callbacks, SIGTERM does not kill the process (on its main
thread); at the next step boundary it backs up, prints where, and raises
``mirrored.Preempted``, which ends the program with exit code 143 (:mod:`mirrored.preemption`):
the resume loses no step. With several workers, any worker's SIGTERM counts for all (one small
all-reduce per step).
"""

from __future__ import annotations

import math
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from mirrored import checkpoint
from mirrored.callbacks.callback import Callback, Logs
from mirrored.callbacks.save_frequency import SaveFrequency, SaveFrequencyHooks
from mirrored.preemption import Preempted
from mirrored.random import rng_state

__all__ = ["BackupAndRestore"]

_FORMAT = "mirrored.backup/1"
_FILE_NAME = "backup.pt"


class BackupAndRestore(SaveFrequencyHooks, Callback):
    """Back up the whole training state to ``backup_dir`` and resume from it."""

    def __init__(
        self,
        backup_dir: str | Path,
        save_freq: str | int = "epoch",
        delete_checkpoint: bool = True,
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("backup_dir is empty; pass the folder where backups go")
        self._frequency = SaveFrequency(save_freq, "BackupAndRestore")
        self.backup_dir = Path(backup_dir)
        self.save_freq = save_freq
        self.delete_checkpoint = delete_checkpoint

    @property
    def path(self) -> Path:
        """The backup file."""
        return self.backup_dir / _FILE_NAME

    # -- restore -----------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._frequency.saved()
        model = self.fit_model()
        if model.strategy.should_checkpoint:  # what a write killed with the last run left
            checkpoint.remove_stale_temporaries(self.path)
        if self.path.exists():
            self._restore()
        model.strategy.check_same_on_workers(
            model.state_dict(), f"the weights restored from {str(self.path)!r} (or not)"
        )

    def _restore(self) -> None:
        """All or nothing: the backup's parts are checked first, the training state against the
        model (``Model.load_training_state``), and the callbacks take their old states back if
        any part fails to load."""
        backup = checkpoint.load(self.path)
        source = repr(str(self.path))
        _check_backup(backup, source)
        model = self.fit_model()
        # Parts restored later in the epoch (random states, running metrics) are checked now,
        # before the weights or the optimizer change.
        rng_state.check(backup["rng"], f"{source}: 'rng'")
        if backup["epoch_rng"] is not None:
            rng_state.check(backup["epoch_rng"], f"{source}: 'epoch_rng'")
        _check_layout(backup["metrics"], model.fit_position()[2], f"{source}: 'metrics'")
        others = self._other_callbacks()
        before = [callback.state_dict() for callback in others]
        try:
            self._restore_callbacks(backup["callbacks"])
            model.load_training_state(backup["training"], repr(str(self.path)))
        except BaseException:
            for callback, state in zip(others, before, strict=True):
                callback.load_state_dict(state)
            raise
        model.resume_fit(backup["progress"], backup["rng"], backup["epoch_rng"], backup["metrics"])

    def _restore_callbacks(self, states: list[dict[str, Any]]) -> None:
        """Each callback gets the state saved by the callback of its class at the same rank
        among those of that class (a callback added or removed since leaves the others be)."""
        saved = dict(zip(_keys([s["class"] for s in states]), states, strict=True))
        others = self._other_callbacks()
        fresh = []
        for key, callback in zip(_keys([type(c).__name__ for c in others]), others, strict=True):
            if key in saved:
                try:
                    callback.load_state_dict(saved[key]["state"])
                except Exception as error:
                    raise ValueError(
                        f"the backup in {str(self.backup_dir)!r} holds a state for {key[0]} that "
                        f"it cannot load ({error!r}); nothing was restored"
                    ) from error
            elif callback.state_dict():
                fresh.append(key[0])
        if fresh:
            warnings.warn(
                f"the backup in {str(self.backup_dir)!r} holds no state for {fresh}: their "
                "progress (patience counters, best values) starts anew",
                stacklevel=2,
            )

    # -- back up -----------------------------------------------------------------------------------
    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        due = self._frequency.due(batch)
        if due:
            self._save(logs)
        model = self.fit_model()
        if model.preemption_requested():  # SIGTERM on some worker: back up here, and stop
            if not due:
                self._save(logs)
            progress = model.fit_position()[0]
            message = (
                f"mirrored: the job is being preempted (SIGTERM); backed up to "
                f"{str(self.path)!r} at epoch {progress['epoch'] + 1}, batch "
                f"{progress['step']}: run the program again to resume there"
            )
            if model.strategy.should_checkpoint:
                print(message, file=sys.stderr, flush=True)
            raise Preempted(message)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._save(logs)

    def _save(self, logs: Logs | None) -> None:
        model = self.fit_model()
        if not _finite_loss(logs) or not checkpoint.all_finite(model.state_dict()):
            warnings.warn(
                f"not backing up to {str(self.path)!r}: the loss "
                f"({(logs or {}).get('loss')}) or the weights are not finite; the last good "
                "backup stays",
                stacklevel=2,
            )
            return
        self._frequency.saved()

        training = model.training_state()  # on every worker: it may gather (zero_stage)

        def write() -> None:
            progress, epoch_rng, metrics = model.fit_position()
            backup = {
                "format": _FORMAT,
                "training": training,
                "progress": progress,
                "rng": rng_state.capture(),
                "epoch_rng": epoch_rng,
                "metrics": metrics,
                "callbacks": [
                    {"class": type(c).__name__, "state": c.state_dict()}
                    for c in self._other_callbacks()
                ],
            }
            checkpoint.save(backup, self.path)

        model.strategy.save_on_chief(write)

    def on_train_end(self, logs: Logs | None = None) -> None:
        if (
            _finite_loss(logs)
            and self.delete_checkpoint
            and self.fit_model().strategy.should_checkpoint
        ):
            self.path.unlink(missing_ok=True)  # a run that ended on a NaN keeps its last backup

    # -- helpers -----------------------------------------------------------------------------------
    def _other_callbacks(self) -> list[Callback]:
        return [c for c in self.fit_model().callbacks_in_fit() if c is not self]


def _check_backup(backup: Any, source: str) -> None:
    """Refuse a file that is not a whole backup of this format, naming the part that is not."""
    if not isinstance(backup, dict) or backup.get("format") != _FORMAT:
        raise ValueError(
            f"{source} is not a mirrored backup (format "
            f"{backup.get('format') if isinstance(backup, dict) else type(backup)}); point "
            "backup_dir at a folder of its own"
        )
    progress = backup.get("progress")
    callbacks = backup.get("callbacks")
    parts = {
        "training": isinstance(backup.get("training"), dict),
        "progress": isinstance(progress, dict)
        and all(isinstance(progress.get(k), int) for k in ("epoch", "step", "consumed")),
        "rng": isinstance(backup.get("rng"), dict),
        "epoch_rng": backup.get("epoch_rng") is None or isinstance(backup["epoch_rng"], dict),
        "metrics": isinstance(backup.get("metrics"), list),
        "callbacks": isinstance(callbacks, list)
        and all(
            isinstance(c, dict)
            and isinstance(c.get("class"), str)
            and isinstance(c.get("state"), dict)
            for c in callbacks
        ),
    }
    broken = [part for part, fine in parts.items() if not fine]
    if broken:
        raise ValueError(
            f"{source} is a damaged backup: {broken} missing or malformed; nothing was restored. "
            "Delete it to start the training anew"
        )


def _check_layout(saved: Any, current: Any, where: str) -> None:
    """A ValueError unless ``saved`` is laid out as ``current`` is: the same keys, lengths,
    types, and tensors of the same shapes and dtypes (the running metrics of this fit)."""
    if isinstance(current, torch.Tensor):
        fits = (
            isinstance(saved, torch.Tensor)
            and saved.shape == current.shape
            and saved.dtype == current.dtype
        )
    elif isinstance(current, dict):
        fits = isinstance(saved, dict) and saved.keys() == current.keys()
    elif isinstance(current, list):
        fits = isinstance(saved, list) and len(saved) == len(current)
    else:
        fits = type(saved) is type(current)
    if not fits:
        raise ValueError(
            f"{where} does not fit this fit's metrics ({_described(saved)} where "
            f"{_described(current)} belongs): compiled with other metrics? nothing was restored"
        )
    if isinstance(current, dict):
        for key in current:
            _check_layout(saved[key], current[key], f"{where}[{key!r}]")
    elif isinstance(current, list):
        for index, (mine, theirs) in enumerate(zip(saved, current, strict=True)):
            _check_layout(mine, theirs, f"{where}[{index}]")


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    if isinstance(value, (dict, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return type(value).__name__


def _keys(class_names: list[str]) -> list[tuple[str, int]]:
    """(class name, how many of that class came before) for each callback."""
    seen: dict[str, int] = {}
    keys = []
    for name in class_names:
        keys.append((name, seen.get(name, 0)))
        seen[name] = seen.get(name, 0) + 1
    return keys


def _finite_loss(logs: Logs | None) -> bool:
    loss = (logs or {}).get("loss")
    return not isinstance(loss, float) or math.isfinite(loss)
