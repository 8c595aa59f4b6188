"""``ProgbarLogger``: Keras's progress bar.

``verbose=1``: on a terminal, a live bar per epoch (drawn by tqdm, fitted to the terminal's
width, with the ETA) that ends as the epoch's full line,
``120/120 [======] - 29s 241ms/step - loss: 1.4100 - ...``; where the output is not a terminal
(a pipe, a file) only that line, once per epoch, as Keras does: no ``\\r`` and no partial bars
in logs. ``verbose=2``: the line without the bar. ``verbose=0``: nothing.
``fit(verbose="auto")`` picks 1 on a terminal, else 2. Only the process that writes logs
(``strategy.should_checkpoint``) prints.

The full line goes on in indented lines where it would pass 100 columns (or a narrower
terminal's width), broken between `` - name: value`` fields, never inside one: Keras prints one
line of any length, which a terminal then breaks in the middle of a figure.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
import warnings
from typing import Any, TextIO

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["ProgbarLogger", "format_logs"]

# Per-batch logs that are bookkeeping, not results.
_HIDDEN = {"num_examples"}
_BAR_WIDTH = 30
# The size when the terminal reports none (a pseudo-terminal never sized says 0 x 0; tqdm then
# draws nothing).
_FALLBACK_SIZE = os.terminal_size((80, 24))
# The widest a finished line gets before it goes on in the next.
_LINE_WIDTH = 100


def _log_fields(logs: Logs) -> list[str]:
    """`` - name: value`` for each log, values as Keras prints them."""
    fields = []
    for name, value in logs.items():
        if name in _HIDDEN:
            continue
        if isinstance(value, float) and abs(value) <= 1e-3 and value != 0.0:
            fields.append(f" - {name}: {value:.4e}")
        elif isinstance(value, (int, float)):
            fields.append(f" - {name}: {value:.4f}")
        else:
            fields.append(f" - {name}: {value}")
    return fields


def format_logs(logs: Logs) -> str:
    """`` - name: value`` for each log, values as Keras prints them, on one line."""
    return "".join(_log_fields(logs))


def _wrap_fields(head: str, fields: list[str], width: int, indent: int) -> str:
    """``head`` then ``fields``, broken between fields into lines of at most ``width``
    characters, the lines after the first indented by ``indent`` spaces; a field wider than
    that alone stays whole on its line."""
    lines, line = [], head
    for field in fields:
        if len(line) + len(field) > width and line.strip():
            lines.append(line)
            line = " " * indent
        line += field
    return "\n".join([*lines, line])


def _timing(seconds: float, steps: int) -> str:
    per_step = seconds / max(steps, 1)
    unit = f"{per_step * 1e3:.0f}ms/step" if per_step >= 1e-3 else f"{per_step * 1e6:.0f}us/step"
    return f" - {seconds:.0f}s {unit}"


def _bar(done: int, total: int | None) -> str:
    """``done/total [====....]``; ``total`` unknown counts as ``done`` (a full bar)."""
    total = total or done
    filled = _BAR_WIDTH * min(done, total) // max(total, 1)
    return f"{done}/{total} [{'=' * filled}{'.' * (_BAR_WIDTH - filled)}]"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty is not None and isatty())


def _redraws(stream: TextIO) -> bool:
    """Whether ``\\r`` redraws a line of ``stream``: a terminal, or a notebook (Keras's rule)."""
    return _is_terminal(stream) or "ipykernel" in sys.modules


def _terminal_size(stream: TextIO) -> os.terminal_size:
    """The size of the terminal behind ``stream``; 80 x 24 for what it does not report."""
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):  # no file descriptor, or not a terminal
        size = shutil.get_terminal_size(_FALLBACK_SIZE)
    return os.terminal_size(
        (size.columns or _FALLBACK_SIZE.columns, size.lines or _FALLBACK_SIZE.lines)
    )


class ProgbarLogger(Callback):
    """Prints progress of fit, evaluate and predict (added by them when ``verbose`` is not 0)."""

    def __init__(self) -> None:
        super().__init__()
        self._live: Any = None  # the tqdm bar being redrawn, on a terminal
        self._wants_live = False  # drawn from the first batch, after the epoch's other output
        self._without_tqdm = False
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
        self._live = None
        self._wants_live = self._verbose == 1 and _redraws(sys.stdout)

    def _draw_live(self) -> None:
        """Start the live bar (at the first batch: what other callbacks print as the epoch
        begins comes before it, not across it)."""
        self._wants_live = False
        if self._without_tqdm:
            return
        try:
            from tqdm import tqdm
        except ImportError:  # an optional extra: the epoch's line alone
            warnings.warn(
                "live progress bars need tqdm (pip install 'mirrored[progress]'); printing a "
                "line per epoch instead",
                stacklevel=2,
            )
            self._without_tqdm = True
            return

        total = self.params.get("steps")
        bar_format = "{n_fmt}/{total_fmt} [{bar:30}]{desc}" if total else "{n_fmt}/Unknown{desc}"
        size = _terminal_size(sys.stdout)
        self._live = tqdm(
            total=total,
            bar_format=bar_format,
            ascii=".=",
            file=sys.stdout,
            ncols=size.columns,  # tqdm cuts the live line to this width
            nrows=size.lines,
            leave=False,  # the epoch's full line replaces it (tqdm would cut that one too)
        )

    def _advance(self, batch: int, logs: Logs | None) -> None:
        steps = batch + 1
        if self._wants_live:
            self._draw_live()
        if self._live is None:
            self._seen = steps
            return
        elapsed = time.perf_counter() - self._start
        total = self.params.get("steps")
        eta = ""
        if total:
            eta = f" - ETA: {elapsed / steps * max(total - steps, 0):.0f}s"
        self._live.set_description_str(eta + format_logs(logs or {}), refresh=False)
        self._live.update(steps - self._seen)
        self._seen = steps

    def _clear_live(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None

    def _close(self, logs: Logs | None) -> None:
        elapsed = time.perf_counter() - self._start
        fields = [_timing(elapsed, self._seen), *_log_fields(logs or {})]
        self._clear_live()
        if self._verbose not in (1, 2):
            return
        total = (self.params.get("steps") if self._verbose == 1 else None) or self._seen
        head = _bar(self._seen, total) if self._verbose == 1 else f"{self._seen}/{total}"
        width = _LINE_WIDTH
        if _is_terminal(sys.stdout):
            width = min(width, _terminal_size(sys.stdout).columns)
        # Lines after the first start under the bar, after the step count.
        print(_wrap_fields(head, fields, width, len(f"{self._seen}/{total}")), flush=True)

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._in_fit = True

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._in_fit = False
        self._clear_live()  # an epoch that never ended

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
