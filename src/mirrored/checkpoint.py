"""Checkpoint files: written atomically, read without unpickling code, loaded all-or-nothing.

A checkpoint is a plain structure of tensors, numbers, strings, lists and dicts, so that
``torch.load(path, weights_only=True)`` reads it and a file from an untrusted source cannot run
code. A write goes to a temporary file in the same folder, is flushed to disk, then renamed over
the target: a process killed at any moment leaves either the old file or the new one, never half
of one.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mirrored.state_checks import check_module_state, first_non_finite

__all__ = ["all_finite", "check_module_state", "load", "load_module_state", "save"]

PathLike = str | os.PathLike[str]


def save(obj: Any, path: PathLike) -> Path:
    """Write ``obj`` to ``path`` atomically (write, fsync, rename, fsync the folder)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(descriptor, "wb") as file:
            torch.save(obj, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)
    return target


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
    """Read a checkpoint with ``weights_only=True``; a missing or unreadable file is an error
    that names it."""
    source = Path(path)
    if not source.is_file():
        raise FileNotFoundError(f"no checkpoint at {str(source)!r}")
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except (pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, EOFError) as error:
        raise ValueError(
            f"{str(source)!r} is not a readable checkpoint (truncated, corrupt, or it holds "
            f"objects other than tensors, numbers, strings, lists and dicts): {error}"
        ) from error


def load_module_state(module: Any, state_dict: Mapping[str, Any], source: str) -> None:
    """Load ``state_dict`` into ``module`` only if every key and shape matches.

    ``nn.Module.load_state_dict`` copies the matching tensors before it reports mismatches, which
    would leave a half-loaded model; here a mismatch raises before anything is copied.
    """
    check_module_state(module, state_dict, source)
    module.load_state_dict(state_dict)
