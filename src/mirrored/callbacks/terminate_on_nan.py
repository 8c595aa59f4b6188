"""``TerminateOnNaN``: stop training at the first batch whose loss is NaN or infinite (Keras's).

A diverged run wastes its remaining time and, with checkpoints, can overwrite good files. By
default training stops gracefully, so ``on_train_end`` of every callback still runs;
``raise_error=True`` raises instead, for jobs that must fail loudly.
"""

from __future__ import annotations

import math
from typing import Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["TerminateOnNaN"]


class TerminateOnNaN(Callback):
    """Set ``model.stop_training`` (or raise ``FloatingPointError``) when ``logs["loss"]`` at a
    training batch's end is NaN or infinite."""

    def __init__(self, raise_error: bool = False) -> None:
        super().__init__()
        self.raise_error = raise_error

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        loss: Any = (logs or {}).get("loss")
        if loss is None or math.isfinite(float(loss)):
            return
        if self.raise_error:
            raise FloatingPointError(
                f"TerminateOnNaN: the loss is {float(loss)} at batch {batch}; training stopped. "
                "Lower the learning rate, check the data for NaN/inf, or use "
                "TerminateOnNaN(raise_error=False) to stop without an error"
            )
        print(f"Batch {batch}: Invalid loss, terminating training", flush=True)
        self.fit_model().stop_training = True
