"""TensorFlow's ``tf.train.Checkpoint``, ``CheckpointManager`` and ``latest_checkpoint``.

A ``Checkpoint`` names the objects a custom loop trains (a mirrored module and optimizer, an LR
scheduler, a ``mirrored.Model``, plain torch modules, tensors such as a step counter) and writes
their ``state_dict()`` as one file, atomically (:mod:`mirrored.checkpoint`), numbered
``prefix-N.pt``. A restore reads it with ``weights_only=True`` and checks every object's state
against the object before it loads any, so a file that does not fit changes nothing. A
``CheckpointManager`` keeps the last few in a folder and finds them again after a restart, by
their number, never by modification time. Among workers, only the chief writes, and a restore
or a manager fails on every worker unless all of them read the same files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mirrored import checkpoint
from mirrored.core.context import get_strategy, has_strategy
from mirrored.core.state_checks import (
    check_module_state,
    check_optimizer_state,
    check_scheduler_state,
)
from mirrored.core.strategy import Strategy
from mirrored.replication.mirrored_module import MirroredModule
from mirrored.replication.mirrored_optimizer import MirroredOptimizer
from mirrored.replication.replica_optimizers import ReplicaOptimizers

__all__ = ["FORMAT", "Checkpoint", "CheckpointManager", "RestoreStatus", "latest_checkpoint"]

FORMAT = "mirrored.checkpoint/1"  # the "format" entry of a Checkpoint file
_SUFFIX = ".pt"


@dataclasses.dataclass(frozen=True)
class RestoreStatus:
    """What ``Checkpoint.restore`` did: TensorFlow's status object, for code that chains
    ``.expect_partial()`` or ``.assert_consumed()``."""

    path: str | None  # None: nothing was restored (``restore(None)``, a first run)
    unused: tuple[str, ...] = ()  # entries of the file that no object of the checkpoint took

    def expect_partial(self) -> RestoreStatus:
        """Accept entries of the file that this checkpoint has no object for."""
        return self

    def assert_consumed(self) -> RestoreStatus:
        """Raise unless every entry of the file was restored into an object."""
        if self.unused:
            raise AssertionError(
                f"{self.path!r} holds {list(self.unused)}, which this Checkpoint has no object "
                "for: name them in Checkpoint(...), or call expect_partial()"
            )
        return self

    def assert_existing_objects_matched(self) -> RestoreStatus:
        """Every object was restored (a restore that returns always did)."""
        return self


class Checkpoint:
    """The objects of a training run, saved and restored together (``tf.train.Checkpoint``).

    ``Checkpoint(model=model, optimizer=optimizer, step=torch.zeros((), dtype=torch.int64))``:
    each object has ``state_dict()`` and ``load_state_dict()`` (a tensor is copied in place), and
    is an attribute of the checkpoint (``checkpoint.step``), so a name the checkpoint uses itself
    (``save``, ``restore``, ``save_counter``, ...) is refused. ``save_counter`` counts the saves
    and is saved with them.
    """

    def __init__(self, **objects: Any) -> None:
        for name, value in objects.items():
            if name == "save_counter" or name.startswith("_") or hasattr(type(self), name):
                raise ValueError(
                    f"Checkpoint({name}=...): {name!r} is reserved: the Checkpoint uses it "
                    f"itself, so checkpoint.{name} would not give the object; pick another name"
                )
            if not isinstance(value, torch.Tensor) and not (
                callable(getattr(value, "state_dict", None))
                and callable(getattr(value, "load_state_dict", None))
            ):
                raise TypeError(
                    f"Checkpoint({name}={type(value).__name__}): expected an object with "
                    "state_dict() and load_state_dict() (a module, an optimizer, an LR "
                    "scheduler, a mirrored.Model) or a tensor"
                )
        self._objects = dict(objects)
        self.save_counter = 0

    def __getattr__(self, name: str) -> Any:
        objects = self.__dict__.get("_objects", {})
        if name in objects:
            return objects[name]
        raise AttributeError(f"this Checkpoint has no object {name!r}; it has {list(objects)}")

    def __repr__(self) -> str:
        names = ", ".join(f"{k}={type(v).__name__}" for k, v in self._objects.items())
        return f"Checkpoint({names})"

    # -- writing ---------------------------------------------------------------------------------
    def save(self, file_prefix: str | os.PathLike[str]) -> str:
        """Write ``{file_prefix}-{N}.pt`` with N the new ``save_counter``, atomically, where the
        strategy writes checkpoints (the chief); every worker returns the path. Call it on every
        worker at the same point. A write that fails counts nothing."""
        counter = self.save_counter + 1
        path = self._write(f"{os.fspath(file_prefix)}-{counter}{_SUFFIX}", counter)
        self.save_counter = counter  # only once the file is there
        return path

    def write(self, path: str | os.PathLike[str]) -> str:
        """Write the checkpoint to ``path`` exactly, as ``save`` does but without a number."""
        return self._write(path, self.save_counter)

    def _write(self, path: str | os.PathLike[str], save_counter: int) -> str:
        state = self._state(save_counter)  # on every worker: a sharded optimizer state is gathered
        target = os.fspath(path)
        self._strategy().save_on_chief(lambda: checkpoint.save(state, target))
        return target

    def _state(self, save_counter: int) -> dict[str, Any]:
        objects = {
            name: value.detach().clone() if isinstance(value, torch.Tensor) else value.state_dict()
            for name, value in self._objects.items()
        }
        return {"format": FORMAT, "save_counter": save_counter, "objects": objects}

    def _strategy(self) -> Strategy:
        """The strategy that decides who writes: the one whose scope this is, else the one that
        mirrored an object, else the default (this process writes)."""
        if has_strategy():
            return get_strategy()
        for value in self._objects.values():
            if isinstance(value, (MirroredModule, MirroredOptimizer)):
                return value._strategy
            owner = getattr(value, "strategy", None)  # a mirrored.Model's
            if isinstance(owner, Strategy):
                return owner
        return get_strategy()

    # -- reading ---------------------------------------------------------------------------------
    def restore(self, save_path: str | os.PathLike[str] | None) -> RestoreStatus:
        """Load a file written by ``save`` into the objects, all or nothing: every object's
        state is checked first, and a ValueError names the entry that does not fit. None (what
        ``latest_checkpoint`` gives on a first run) restores nothing. Among workers, call it on
        every worker: unless all of them read the same (a file on separate disks, or read
        while the chief wrote it), every worker raises before any loads it."""
        read: tuple[Mapping[str, Any], int] | None = None
        failure: Exception | None = None
        if save_path is not None:
            try:
                read = self._read(save_path)
            except Exception as caught:  # the other workers still compare what they read
                failure = caught
        self._check_same_on_workers(save_path, read, failure)
        if save_path is None or read is None:
            return RestoreStatus(None)
        states, counter = read
        source = repr(os.fspath(save_path))
        for name, value in self._objects.items():
            _check_state(value, states[name], f"{source}, entry {name!r}")
        for name, value in self._objects.items():
            if isinstance(value, torch.Tensor):
                with torch.no_grad():
                    value.copy_(states[name])
            else:
                value.load_state_dict(states[name])
        self.save_counter = counter
        return RestoreStatus(
            os.fspath(save_path), tuple(n for n in states if n not in self._objects)
        )

    def _read(self, save_path: str | os.PathLike[str]) -> tuple[Mapping[str, Any], int]:
        """The objects' states and the save counter of a Checkpoint file, with an entry for
        every object of this checkpoint."""
        source = repr(os.fspath(save_path))
        saved = checkpoint.load(save_path)
        if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
            raise ValueError(
                f"{source} is not a mirrored.Checkpoint file (written by Checkpoint.save or "
                "CheckpointManager.save); for Model.save files use Model.load"
            )
        states = saved.get("objects")
        counter = saved.get("save_counter")
        if (
            not isinstance(states, Mapping)
            or isinstance(counter, bool)
            or not isinstance(counter, int)
        ):
            raise ValueError(
                f"{source}: a mirrored.Checkpoint file without its 'objects' and 'save_counter' "
                "entries (damaged, or written by another program); nothing was restored"
            )
        missing = [name for name in self._objects if name not in states]
        if missing:
            raise ValueError(
                f"{source} has no entry for {missing} (it holds {list(states)}); name the "
                "objects as they were named when it was saved; nothing was restored"
            )
        return states, counter

    def _check_same_on_workers(
        self,
        save_path: str | os.PathLike[str] | None,
        read: tuple[Mapping[str, Any], int] | None,
        failure: Exception | None,
    ) -> None:
        """Compare what every worker read (one small collective; nothing in one process), then
        raise this worker's own failure if it had one."""
        taken = None
        if read is not None:
            states, counter = read
            taken = ([states[name] for name in self._objects], torch.tensor(counter))
        what = "restore(None)" if save_path is None else f"{os.fspath(save_path)!r}"
        try:
            self._strategy().check_same_on_workers(taken, f"the checkpoint restored from {what}")
        except ValueError:
            if failure is None:
                raise
        if failure is not None:
            raise failure


def _check_state(value: Any, state: Any, where: str) -> None:
    """A ValueError naming ``where`` unless ``value.load_state_dict(state)`` loads it whole."""
    if isinstance(value, torch.Tensor):
        if not isinstance(state, torch.Tensor) or state.shape != value.shape:
            got = tuple(state.shape) if isinstance(state, torch.Tensor) else type(state).__name__
            raise ValueError(f"{where}: {got}, expected a tensor of shape {tuple(value.shape)}")
        if state.dtype != value.dtype:  # copy_ would cast it (a float file into a step count)
            raise ValueError(
                f"{where}: a {state.dtype} tensor, expected {value.dtype}; restore it into a "
                f"tensor of dtype {value.dtype}"
            )
    elif isinstance(value, torch.optim.lr_scheduler.LRScheduler):
        check_scheduler_state(value, state, where)
    elif isinstance(value, torch.optim.Optimizer):
        own = value.optimizer if isinstance(value, ReplicaOptimizers) else value
        check_optimizer_state(own, state, where)
    elif isinstance(value, (torch.nn.Module, MirroredModule)):
        check_module_state(value, state, where)
    else:
        _check_like(value.state_dict(), state, where)


def _check_like(expected: Any, saved: Any, where: str) -> None:
    """``saved`` has ``expected``'s keys, at every level, and its tensors' shapes."""
    if isinstance(expected, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != set(expected):
            keys = sorted(map(str, saved)) if isinstance(saved, Mapping) else type(saved).__name__
            raise ValueError(f"{where}: {keys}, expected the keys {sorted(map(str, expected))}")
        for key, value in expected.items():
            _check_like(value, saved[key], f"{where}[{key!r}]")
    elif isinstance(expected, torch.Tensor) and (
        not isinstance(saved, torch.Tensor) or saved.shape != expected.shape
    ):
        got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
        raise ValueError(f"{where}: {got}, expected a tensor of shape {tuple(expected.shape)}")


# -- the files of a folder ---------------------------------------------------------------------
def _numbered(directory: str | os.PathLike[str], name: str | None) -> list[tuple[int, Path]]:
    """The files ``{name}-{N}.pt`` of ``directory`` (any name when None), by number."""
    pattern = re.compile(
        rf"^({'.+' if name is None else re.escape(name)})-(\d+){re.escape(_SUFFIX)}$"
    )
    found: dict[str, list[tuple[int, Path]]] = {}
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in Path(directory).iterdir():
            match = pattern.match(entry.name)
            if match and entry.is_file():
                found.setdefault(match[1], []).append((int(match[2]), entry))
    if name is None and len(found) > 1:
        raise ValueError(
            f"{os.fspath(directory)!r} holds checkpoints of several names ({sorted(found)}); "
            "pass checkpoint_name= to say which"
        )
    return sorted(file for files in found.values() for file in files)


def latest_checkpoint(
    directory: str | os.PathLike[str], checkpoint_name: str | None = None
) -> str | None:
    """The path of the newest checkpoint in ``directory`` (the highest number of the files
    ``{checkpoint_name}-{N}.pt``; any name when None), or None when there is none."""
    files = _numbered(directory, checkpoint_name)
    return str(files[-1][1]) if files else None


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints of ``checkpoint`` in ``directory`` as
    ``{checkpoint_name}-{N}.pt`` (``tf.train.CheckpointManager``). The files of that name already
    there when it is made are its own, ordered by number: after a restart ``latest_checkpoint`` is
    the last run's newest, and saves go on numbering after it. Among workers, make it on every
    worker at the same point: every worker lists the folder, and none goes on (so the chief
    saves nothing) until all have; a ValueError on every worker unless they found the same
    files (separate disks). In one process that costs nothing."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 5,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"checkpoint={type(checkpoint).__name__}: expected a "
                "mirrored.Checkpoint(model=..., optimizer=...)"
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"max_to_keep={max_to_keep!r}: expected an int >= 1, or None to keep every one"
            )
        if not isinstance(checkpoint_name, str) or not checkpoint_name or "/" in checkpoint_name:
            raise ValueError(
                f"checkpoint_name={checkpoint_name!r}: expected a file name prefix such as 'ckpt'"
            )
        self.checkpoint = checkpoint
        self.directory = os.fspath(directory)
        self.max_to_keep = max_to_keep
        self.checkpoint_name = checkpoint_name
        # Kept in memory after this listing, so that every worker numbers its saves alike
        # while the chief writes.
        self._numbers = [n for n, _ in _numbered(self.directory, checkpoint_name)]
        checkpoint._strategy().check_same_on_workers(
            torch.tensor(self._numbers, dtype=torch.int64),
            f"the checkpoint numbers found in {self.directory!r} (here {self._numbers})",
        )

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, f"{self.checkpoint_name}-{number}{_SUFFIX}")

    @property
    def checkpoints(self) -> list[str]:
        """The paths of the checkpoints kept, oldest first."""
        return [self._path(n) for n in self._numbers]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest checkpoint's path, or None before the first save."""
        return self._path(self._numbers[-1]) if self._numbers else None

    def save(self, checkpoint_number: int | None = None) -> str:
        """Write the next checkpoint and delete the oldest beyond ``max_to_keep``; return its
        path. Its number is ``checkpoint_number`` when given (above the newest kept, so that
        ``latest_checkpoint`` stays the newest), else one more than both the checkpoint's
        ``save_counter`` and the newest file's, so that no file is overwritten. Call it on every
        worker at the same point: the chief writes and deletes. A write that fails changes
        nothing; a deletion that fails raises once the new file is counted and kept, and the
        files it left stay in ``checkpoints``, to be deleted by the next save."""
        number = self._next_number(checkpoint_number)
        counter = number if checkpoint_number is None else self.checkpoint.save_counter + 1
        path = self.checkpoint._write(self._path(number), counter)
        self.checkpoint.save_counter = counter  # the file is there: count and keep it
        self._numbers.append(number)
        excess = 0 if self.max_to_keep is None else max(len(self._numbers) - self.max_to_keep, 0)
        if excess:
            stale = [self._path(old) for old in self._numbers[:excess]]
            self.checkpoint._strategy().save_on_chief(lambda: _remove(stale, path))
            del self._numbers[:excess]
        return path

    def _next_number(self, checkpoint_number: int | None) -> int:
        if checkpoint_number is None:
            return max([self.checkpoint.save_counter, *self._numbers]) + 1
        if (
            isinstance(checkpoint_number, bool)
            or not isinstance(checkpoint_number, int)
            or checkpoint_number < 0
        ):
            raise ValueError(
                f"checkpoint_number={checkpoint_number!r}: expected an int >= 0, or None for "
                "the next number"
            )
        if self._numbers and checkpoint_number <= self._numbers[-1]:
            # TensorFlow writes it, and its latest_checkpoint then names a file that is not
            # the newest (or deletes the file just written).
            raise ValueError(
                f"checkpoint_number={checkpoint_number}: {self.directory!r} holds the "
                f"checkpoints {self._numbers}; pass a number above {self._numbers[-1]}, or "
                "None for the next"
            )
        return checkpoint_number

    def __repr__(self) -> str:
        return (
            f"CheckpointManager(directory={self.directory!r}, max_to_keep={self.max_to_keep}, "
            f"checkpoint_name={self.checkpoint_name!r})"
        )


def _remove(paths: list[str], written: str) -> None:
    """Delete the checkpoints beyond ``max_to_keep`` (ones already gone are fine)."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            raise OSError(
                error.errno, f"wrote {written!r}, but could not delete {path!r}: {error}"
            ) from error
