"""``MonitorCallback``: what EarlyStopping and ModelCheckpoint share (Keras's ``MonitorCallback``).

Both watch one value of the logs (``monitor``), decide whether it got better than a reference
(lower for losses, higher for accuracies, by more than ``min_delta``) and start from an optional
threshold. A monitored name missing from the logs (a typo, or ``val_loss`` without validation
data) is warned about with the names that are there, instead of silently never improving.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["MonitorCallback"]

MODES = ("auto", "min", "max")

# Keras's rule for mode="auto": these quantities improve upwards, everything else downwards.
_HIGHER_IS_BETTER = ("acc", "auc", "precision", "recall")


class MonitorCallback(Callback):
    """Base of callbacks that act when ``logs[monitor]`` improves.

    ``mode``: "min", "max", or "auto" (max when the name contains "acc", "accuracy", "auc",
    "precision" or "recall", else min). An improvement beats the reference by more than
    ``min_delta`` (its sign is ignored). ``baseline`` is the value to beat at first (None: the
    first value is an improvement).
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        mode: str = "auto",
        baseline: float | None = None,
        min_delta: float = 0.0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(
                f"{name}: monitor={monitor!r}; pass the name of a log, e.g. 'val_loss'"
            )
        if mode not in MODES:
            raise ValueError(f"{name}: mode={mode!r}; expected one of {list(MODES)}")
        if not _is_number(min_delta):
            raise ValueError(f"{name}: min_delta={min_delta!r}; expected a number")
        if baseline is not None and not _is_number(baseline):
            raise ValueError(f"{name}: baseline={baseline!r}; expected a number or None")
        self.monitor = monitor
        self.mode = mode
        self.min_delta = abs(float(min_delta))
        self.baseline = None if baseline is None else float(baseline)
        self.best: float | None = self.baseline
        lowered = monitor.lower()
        self.higher_is_better = mode == "max" or (
            mode == "auto" and any(word in lowered for word in _HIGHER_IS_BETTER)
        )

    def _is_improvement(self, current: float, reference: float | None) -> bool:
        """Whether ``current`` beats ``reference`` by more than ``min_delta`` (None: always;
        NaN never improves)."""
        if math.isnan(current):
            return False
        if reference is None:
            return True
        if self.higher_is_better:
            return current - self.min_delta > reference
        return current + self.min_delta < reference

    def get_monitor_value(self, logs: Logs | None) -> float | None:
        """``logs[monitor]`` as a float, or None with a warning naming the logs there are."""
        logs = logs or {}
        value = logs.get(self.monitor)
        if value is None:
            available = ", ".join(sorted(logs)) or "none"
            warnings.warn(
                f"{type(self).__name__} monitors {self.monitor!r}, which is not in the logs "
                f"(available: {available}); pass one of those as monitor=, or validation_data "
                "to fit() for 'val_' names",
                stacklevel=3,
            )
            return None
        return float(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
