"""``EarlyStopping``: end ``fit`` when the monitored value stops improving (Keras's).

At each epoch end the monitored value is compared with the best so far; after ``patience`` epochs
without an improvement training stops. With ``restore_best_weights`` the model gets back the
weights of its best epoch when training ends; they are kept as a CPU copy, so holding them costs
host memory, not accelerator memory. The counters and the best weights are part of the
callback's ``state_dict``, so a run resumed by ``BackupAndRestore`` keeps counting.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from mirrored.callbacks.callback import Logs
from mirrored.callbacks.monitor import MonitorCallback

__all__ = ["EarlyStopping"]


class EarlyStopping(MonitorCallback):
    """Stop training after ``patience`` epochs without improvement of ``logs[monitor]``.

    ``baseline``: a value to beat; epochs that improve on the best so far but not on the baseline
    still count towards ``patience`` (Keras 3). ``start_from_epoch``: epochs of warm-up before
    monitoring starts. ``verbose`` > 0 prints when training stops and when weights are restored.
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        min_delta: float = 0.0,
        patience: int = 0,
        verbose: int = 0,
        mode: str = "auto",
        baseline: float | None = None,
        restore_best_weights: bool = False,
        start_from_epoch: int = 0,
    ) -> None:
        super().__init__(monitor, mode, baseline, min_delta)
        for name, value in (("patience", patience), ("start_from_epoch", start_from_epoch)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"EarlyStopping: {name}={value!r}; expected an int >= 0")
        self.patience = patience
        self.verbose = verbose
        self.restore_best_weights = restore_best_weights
        self.start_from_epoch = start_from_epoch
        self.best = None  # the baseline only decides whether patience restarts
        self.wait = 0
        self.best_epoch = 0
        self.stopped_epoch = 0
        self.best_weights: dict[str, Any] | None = None

    def on_train_begin(self, logs: Logs | None = None) -> None:
        # A reused instance starts afresh; BackupAndRestore loads a saved state after this.
        self.best = None
        self.wait = 0
        self.best_epoch = 0
        self.stopped_epoch = 0
        self.best_weights = None

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        current = self.get_monitor_value(logs)
        if current is None or epoch < self.start_from_epoch:
            return
        if self.restore_best_weights and self.best_weights is None:
            # Until something improves, the weights of the first monitored epoch are the best.
            self.best_weights = self._copy_weights()
            self.best_epoch = epoch
        self.wait += 1
        if self._is_improvement(current, self.best):
            self.best = current
            self.best_epoch = epoch
            if self.restore_best_weights:
                self.best_weights = self._copy_weights()
            if self.baseline is None or self._is_improvement(current, self.baseline):
                self.wait = 0
            return
        if self.wait >= self.patience and epoch > 0:
            self.stopped_epoch = epoch
            self.fit_model().stop_training = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        model = self.fit_model()
        speaks = self.verbose > 0 and model.strategy.should_checkpoint
        if self.stopped_epoch > 0 and speaks:
            print(f"Epoch {self.stopped_epoch + 1}: early stopping", flush=True)
        if self.restore_best_weights and self.best_weights is not None:
            if speaks:
                print(
                    "Restoring model weights from the end of the best epoch: "
                    f"{self.best_epoch + 1}.",
                    flush=True,
                )
            model.load_state_dict(self.best_weights)

    def _copy_weights(self) -> dict[str, Any]:
        return {
            name: value.detach().to("cpu", copy=True)
            if isinstance(value, torch.Tensor)
            else copy.deepcopy(value)
            for name, value in self.fit_model().state_dict().items()
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "wait": self.wait,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "stopped_epoch": self.stopped_epoch,
            "best_weights": None if self.best_weights is None else dict(self.best_weights),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.wait = int(state["wait"])
        self.best = None if state["best"] is None else float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.stopped_epoch = int(state["stopped_epoch"])
        weights = state["best_weights"]
        self.best_weights = None if weights is None else dict(weights)
