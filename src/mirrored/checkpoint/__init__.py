"""Checkpoint files: written atomically, read without unpickling code, verified, all-or-nothing.

A checkpoint is a plain structure of tensors, numbers, strings, lists and dicts, so that
``torch.load(path, weights_only=True)`` reads it and a file from an untrusted source cannot run
code. A write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the target: a process killed at any moment leaves either the old file or the new one, never half
of one. The temporary file of a writer killed mid-write is named after its target, machine and
process, so the next write of that target (or ``remove_stale_temporaries``) removes it once that
process has ended, and never another live writer's. A write that fails (a full disk, a read-only
folder) raises an ``OSError`` saying so, and a Ctrl-C raises ``KeyboardInterrupt``, not the
``RuntimeError`` torch's writer turns it into; either way the last good file stays as it was.

Every file carries checksums (``checksums.py``): a CRC32 of each member of the zip archive
``torch.save`` writes, one per tensor storage and one for the rest, in one more member, so that
``torch.load`` still reads the file as before. ``load`` checks them before it returns anything:
a damaged, truncated or foreign file is a ``ValueError`` naming it and, where known, the entry;
a file written before checksums loads with a warning that it was not verified.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import signal
import socket
import threading
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import IO, Any, cast

import torch

from mirrored.checkpoint.checksums import add_checksums, check_archive, unreadable
from mirrored.core.state_checks import check_module_state, first_non_finite

__all__ = [
    "all_finite",
    "check_module_state",
    "load",
    "load_module_state",
    "remove_stale_temporaries",
    "save",
]

PathLike = str | os.PathLike[str]

_SUFFIX = ".tmp"
_REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "no permission to write there",
    errno.EPERM: "no permission to write there",
}


def save(obj: Any, path: PathLike) -> Path:
    """Write ``obj`` to ``path`` atomically (write, fsync, rename, fsync the folder), with
    checksums, first removing what killed writers of ``path`` left
    (``remove_stale_temporaries``)."""
    target = Path(path)
    temporary = target.with_name(
        f".{target.name}.{_machine()}.{os.getpid()}.{secrets.token_hex(4)}{_SUFFIX}"
    )
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(target)
        _write(obj, temporary)
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):
            raise _write_error(error, target) from error
        raise
    _fsync_folder(target.parent)
    return target


def _write(obj: Any, temporary: Path) -> None:
    """``torch.save`` into a new file with its checksums, flushed to disk. A failure of the
    write itself (a full disk, Ctrl-C) is raised as itself: torch's writer turns an exception
    raised in its write callback into a ``RuntimeError`` ("enforce fail at
    inline_container.cc"), a third of the Ctrl-Cs pressed during a save in our runs."""
    with _interrupts_noted() as interrupts, open(temporary, "x+b") as file:
        written = _RecordingFile(file)
        try:
            torch.save(obj, cast("IO[bytes]", written))  # torch calls only write and flush
        except Exception as error:
            raise (interrupts[0] if interrupts else None) or written.failure or error from None
        failure = (interrupts[0] if interrupts else None) or written.failure
        if failure is not None:  # one that torch's writer swallowed
            raise failure
        add_checksums(file)
        file.flush()
        os.fsync(file.fileno())


class _RecordingFile:
    """The file ``torch.save`` writes through, which keeps the first exception a write
    raised."""

    def __init__(self, file: IO[bytes]) -> None:
        self._file = file
        self.failure: BaseException | None = None

    def write(self, data: bytes) -> int:
        try:
            return self._file.write(data)
        except BaseException as error:
            self.failure = self.failure or error
            raise

    def flush(self) -> None:
        self._file.flush()


@contextlib.contextmanager
def _interrupts_noted() -> Iterator[list[KeyboardInterrupt]]:
    """Note each Ctrl-C of the block (raised as usual, at once) in the list yielded, so that it
    surfaces even where the code it lands in turns it into another error. Only on the main
    thread, the one Python runs signal handlers on, and only under Python's own handler: one the
    program installed is left alone."""
    noted: list[KeyboardInterrupt] = []
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield noted
        return

    def note(signum: int, frame: FrameType | None) -> None:
        noted.append(KeyboardInterrupt())
        raise noted[-1]

    signal.signal(signal.SIGINT, note)
    try:
        yield noted
    finally:
        if signal.getsignal(signal.SIGINT) is note:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def remove_stale_temporaries(path: PathLike) -> list[Path]:
    """Remove the temporary files that writers of ``path`` on this machine left when they were
    killed mid-write (their process has ended); return them. Those of a live process (another
    writer, now) and of other machines sharing the folder stay."""
    target = Path(path)
    prefix = f".{target.name}."
    removed = []
    with contextlib.suppress(OSError):  # no folder yet, or one that cannot be listed
        for entry in target.parent.iterdir():
            name = entry.name
            if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
                continue
            writer = name[len(prefix) : -len(_SUFFIX)].split(".")
            if len(writer) != 3 or writer[0] != _machine() or not writer[1].isdigit():
                continue  # another target's, another machine's, or not ours at all
            if not _process_ended(int(writer[1])):
                continue
            with contextlib.suppress(FileNotFoundError):  # removed by another writer meanwhile
                entry.unlink()
                removed.append(entry)
    return removed


def _machine() -> str:
    """This machine's name as it goes into a temporary file's name (no dots)."""
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname()) or "localhost"


def _process_ended(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (never guessed: only where POSIX's
    signal 0 says it does not exist)."""
    if os.name != "posix":
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # another user's process: alive
        return False
    return False


def _write_error(error: OSError, target: Path) -> OSError:
    """``error`` of a failed write, saying which checkpoint and why, of the same class."""
    reason = _REASONS.get(error.errno or 0)
    message = (
        f"could not write the checkpoint {str(target)!r}: "
        f"{f'{reason} ({error})' if reason else error}; the last good file there, if any, is "
        "kept as it was"
    )
    return OSError(error.errno, message) if error.errno else OSError(message)


def all_finite(state_dict: Mapping[str, Any]) -> bool:
    """True when no floating tensor of ``state_dict`` holds a NaN or an infinity: the test a
    backup passes before it may replace the last good one."""
    return first_non_finite(state_dict) is None


def _fsync_folder(folder: Path) -> None:
    """Make the rename itself durable (POSIX); a no-op where folders cannot be opened."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def load(path: PathLike, map_location: str | torch.device = "cpu") -> Any:
    """Read a checkpoint with ``weights_only=True``, checked against its checksums before
    anything is returned. A missing file is a ``FileNotFoundError``; a damaged, truncated or
    foreign one a ``ValueError`` naming it and, where known, the entry; one without checksums
    (written before them, or by ``torch.save``) loads with a ``UserWarning``."""
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(source)!r}")
    with open(source, "rb") as file:
        checked = check_archive(file, source)
        if checked is None:
            warnings.warn(
                f"checkpoint {str(source)!r} has no checksums (written before mirrored added "
                "them, or by torch.save): it was loaded without being verified; save it again "
                "to add them",
                UserWarning,
                stacklevel=2,
            )
        file.seek(0)
        try:
            loaded = torch.load(file, map_location=map_location, weights_only=True)
        except Exception as error:  # torch's decoding errors: RuntimeError, KeyError, OSError...
            raise unreadable(source, error) from error
        if checked is not None:
            checked.check_storages(loaded)
    return loaded


def load_module_state(module: Any, state_dict: Mapping[str, Any], source: str) -> None:
    """Load ``state_dict`` into ``module`` only if every key and shape matches.

    ``nn.Module.load_state_dict`` copies the matching tensors before it reports mismatches, which
    would leave a half-loaded model; here a mismatch raises before anything is copied.
    """
    check_module_state(module, state_dict, source)
    module.load_state_dict(state_dict)
