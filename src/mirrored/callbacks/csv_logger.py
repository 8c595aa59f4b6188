"""``CSVLogger``: one row of logs per epoch in a CSV file (Keras's).

The header is ``epoch`` and the sorted log names of the first epoch; each row is flushed as it
is written, so the file can be read (or plotted) while training runs. A log that appears only
later (``val_`` names with ``validation_freq`` > 1) adds its column then, the rows before it
getting ``NA``. ``append=True`` continues an existing file under its header. The number of rows
is part of the ``state_dict``, so a run resumed by ``BackupAndRestore`` drops the rows of the
epochs it repeats instead of logging them twice.
"""

from __future__ import annotations

import csv
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from mirrored.callbacks.callback import Callback, Logs

__all__ = ["CSVLogger"]

_MISSING = "NA"


class CSVLogger(Callback):
    """Write ``epoch`` and every epoch-end log to ``filename``, one line per epoch."""

    def __init__(
        self, filename: str | os.PathLike[str], separator: str = ",", append: bool = False
    ) -> None:
        super().__init__()
        if not os.fspath(filename):
            raise ValueError("CSVLogger: filename is empty; pass the CSV file to write")
        if not isinstance(separator, str) or len(separator) != 1:
            raise ValueError(f"CSVLogger: separator={separator!r}; expected one character")
        self.filename = Path(filename)
        self.separator = separator
        self.append = append
        self._file: IO[str] | None = None
        self._keys: list[str] | None = None
        self._lines = 0  # lines of the file this log holds: the header and the rows
        self._resume_lines: int | None = None

    # -- hooks -------------------------------------------------------------------------------------
    def on_train_begin(self, logs: Logs | None = None) -> None:
        self._close()  # a previous fit that raised may have left the file open
        self._keys = None
        self._resume_lines = None
        self._lines = 0
        if self.append and self.fit_model().strategy.should_checkpoint:
            self._lines = len(self._read())

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        logs = logs or {}
        if not self.fit_model().strategy.should_checkpoint:
            return
        if self._file is None:
            self._open(logs)
        elif self._keys is not None and not set(logs) <= set(self._keys):
            self._close()
            self._rewrite(self._read(), sorted(set(self._keys) | set(logs)))
            self._file = self.filename.open("a", encoding="utf-8", newline="")
        assert self._file is not None and self._keys is not None
        row = [str(epoch)] + [_cell(logs[key]) if key in logs else _MISSING for key in self._keys]
        self._csv_writer().writerow(row)
        self._file.flush()
        self._lines += 1

    def on_train_end(self, logs: Logs | None = None) -> None:
        self._close()

    # -- the file ----------------------------------------------------------------------------------
    def _open(self, logs: Logs) -> None:
        """Open the file at the first row: anew, or after what it holds (append, resume)."""
        rows: list[list[str]] = []
        if self._resume_lines is not None:
            rows = self._read()[: self._resume_lines]
        elif self.append:
            rows = self._read()
        old_keys = rows[0][1:] if rows else []
        keys = sorted(set(old_keys) | set(self._keys or ()) | set(logs))
        if rows and set(keys) == set(old_keys):
            keys = old_keys  # the file's own column order
        if not rows:
            self._file = self.filename.open("w", encoding="utf-8", newline="")
            self._keys = keys
            self._csv_writer().writerow(["epoch", *keys])
            self._lines = 1
            return
        unchanged = (
            keys == old_keys
            and self._resume_lines is None
            and self.filename.read_bytes().endswith(b"\n")
        )
        if not unchanged:
            self._rewrite(rows, keys)
        self._keys = keys
        self._lines = len(rows)
        self._file = self.filename.open("a", encoding="utf-8", newline="")

    def _read(self) -> list[list[str]]:
        if not self.filename.is_file():
            return []
        with self.filename.open(encoding="utf-8", newline="") as file:
            return [row for row in csv.reader(file, delimiter=self.separator) if row]

    def _rewrite(self, rows: list[list[str]], keys: list[str]) -> None:
        """Replace the file with ``rows`` (header first) laid out in the columns ``keys``."""
        self.filename.parent.mkdir(parents=True, exist_ok=True)
        columns = rows[0] if rows else ["epoch"]
        descriptor, temporary = tempfile.mkstemp(
            prefix=f".{self.filename.name}.", dir=self.filename.parent
        )
        try:
            with os.fdopen(descriptor, "w", encoding="utf-8", newline="") as file:
                writer = self._make_writer(file)
                writer.writerow(["epoch", *keys])
                for row in rows[1:]:
                    values = dict(zip(columns, row, strict=False))
                    writer.writerow([values.get(k, _MISSING) for k in ["epoch", *keys]])
            os.replace(temporary, self.filename)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._keys = keys

    def _make_writer(self, file: IO[str]) -> Any:
        return csv.writer(file, delimiter=self.separator, lineterminator="\n")

    def _csv_writer(self) -> Any:
        assert self._file is not None
        return self._make_writer(self._file)

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    # -- resuming ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"keys": None if self._keys is None else list(self._keys), "lines": self._lines}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._close()
        self._keys = None if state["keys"] is None else list(state["keys"])
        self._lines = int(state["lines"])
        self._resume_lines = self._lines


def _cell(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Iterable):
        return f"[{', '.join(map(str, value))}]"
    return str(value)
