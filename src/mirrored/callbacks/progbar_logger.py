"""``ProgbarLogger``: Keras's progress bar, drawn by tqdm.

``verbose=1``: a bar per epoch, ``120/120 [======] - 29s 241ms/step - loss: 1.4100 - ...``
with the ETA while it runs; ``verbose=2``: one such line (without the bar) per epoch, for logs
and pipes; ``verbose=0``: nothing. ``fit(verbose="auto")`` picks 1 on a terminal, else 2.
Only the process that writes logs (``strategy.should_checkpoint``) prints.
"""

from __future__ import annotations

import sys
import time
import warnings
from typing import Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["ProgbarLogger", "format_logs"]

# Per-batch logs that are bookkeeping, not results.
_HIDDEN = {"num_examples"}


def format_logs(logs: Logs) -> str:
    """`` - name: value`` for each log, values as Keras prints them."""
    parts = []
    for name, value in logs.items():
        if name in _HIDDEN:
            continue
        if isinstance(value, float) and abs(value) <= 1e-3 and value != 0.0:
            parts.append(f" - {name}: {value:.4e}")
        elif isinstance(value, (int, float)):
            parts.append(f" - {name}: {value:.4f}")
        else:
            parts.append(f" - {name}: {value}")
    return "".join(parts)


def _timing(seconds: float, steps: int) -> str:
    per_step = seconds / max(steps, 1)
    unit = f"{per_step * 1e3:.0f}ms/step" if per_step >= 1e-3 else f"{per_step * 1e6:.0f}us/step"
    return f" - {seconds:.0f}s {unit}"


class ProgbarLogger(Callback):
    """Prints progress of fit, evaluate and predict (added by them when ``verbose`` is not 0)."""

    def __init__(self) -> None:
        super().__init__()
        self._bar: Any = None
        self._in_fit = False
        self._seen = 0
        self._start = 0.0

    @property
    def _verbose(self) -> int:
        verbose = int(self.params.get("verbose", 1))
        writes = self.model is None or self.model.strategy.should_checkpoint
        return verbose if writes else 0

    # -- one bar -----------------------------------------------------------------------------------
    def _open(self) -> None:
        self._seen = 0
        self._start = time.perf_counter()
        self._bar = None
        if self._verbose != 1:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # an optional extra: fall back to a line per epoch
            warnings.warn(
                "progress bars need tqdm (pip install 'mirrored[progress]'); printing a line "
                "per epoch instead",
                stacklevel=2,
            )
            self.params["verbose"] = 2
            return

        total = self.params.get("steps")
        bar_format = "{n_fmt}/{total_fmt} [{bar:30}]{desc}" if total else "{n_fmt}/Unknown{desc}"
        self._bar = tqdm(
            total=total, bar_format=bar_format, ascii=".=", file=sys.stdout, leave=True
        )

    def _advance(self, batch: int, logs: Logs | None) -> None:
        steps = batch + 1
        if self._bar is None:
            self._seen = steps
            return
        elapsed = time.perf_counter() - self._start
        total = self.params.get("steps")
        eta = ""
        if total:
            eta = f" - ETA: {elapsed / steps * max(total - steps, 0):.0f}s"
        self._bar.set_description_str(eta + format_logs(logs or {}), refresh=False)
        self._bar.update(steps - self._seen)
        self._seen = steps

    def _close(self, logs: Logs | None) -> None:
        elapsed = time.perf_counter() - self._start
        summary = _timing(elapsed, self._seen) + format_logs(logs or {})
        if self._bar is not None:
            self._bar.set_description_str(summary, refresh=False)
            self._bar.close()
            self._bar = None
        elif self._verbose == 2:
            print(f"{self._seen}/{self._seen}{summary}", flush=True)

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._in_fit = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._in_fit = False
        if self._bar is not None:  # training stopped mid-epoch
            self._bar.close()
            self._bar = None

    def on_epoch_begin(self, epoch: int, logs: Logs | None = None) -> None:
        if self._verbose:
            print(f"Epoch {epoch + 1}/{self.params.get('epochs')}", flush=True)
        self._open()

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._advance(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        self._close(logs)

    def on_test_begin(self, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self._open()

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self._advance(batch, logs)

    def on_test_end(self, logs: Logs | None = None) -> None:
        if not self._in_fit:
            self._close(logs)

    def on_predict_begin(self, logs: Logs | None = None) -> None:
        self._open()

    def on_predict_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        self._advance(batch, logs)

    def on_predict_end(self, logs: Logs | None = None) -> None:
        self._close(logs)
