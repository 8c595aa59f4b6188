"""The bytes of tensors a program allocates, counted the same on every run and every machine.

Peak RSS is what a user feels, but it moves with the allocator (freed pages kept, an arena per
thread) and with the machine; a test needs a figure only the code changes. A dispatch mode sees
every torch op's outputs: a storage none of its inputs had is new, and a finalizer on the
storage's Python object (torch keeps one per storage for as long as it lives) counts it freed.
Like every dispatch mode it is per thread: enter ``tracking()`` on each thread whose allocations
count. With one thread allocating, the peak is the same on every run.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mirrored

_PACKAGE = str(Path(mirrored.__file__).parent) + "/"


class AllocationCount:
    """What the ops run inside ``tracking()`` allocated: ``alive`` bytes now, ``peak`` bytes
    alive at once, and ``largest``: the largest tensor allocated where each of mirrored's
    modules called torch (by path in the package; ``""``: outside mirrored)."""

    def __init__(self) -> None:
        self.alive = 0
        self.peak = 0
        self.largest: dict[str, int] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        with _Counting(self):
            yield

    def _allocated(self, storage: torch.UntypedStorage) -> None:
        nbytes = storage.nbytes()
        module = _calling_module()
        with self._lock:
            self.alive += nbytes
            self.peak = max(self.peak, self.alive)
            self.largest[module] = max(self.largest.get(module, 0), nbytes)
        weakref.finalize(storage, self._freed, nbytes)

    def _freed(self, nbytes: int) -> None:
        with self._lock:
            self.alive -= nbytes


class _Counting(TorchDispatchMode):
    def __init__(self, count: AllocationCount) -> None:
        super().__init__()
        self._count = count

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _counts(t)}
        out = func(*args, **kwargs)
        for tensor in tree_leaves(out):
            if _counts(tensor):
                storage = tensor.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    self._count._allocated(storage)
        return out


def _counts(value: object) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.layout is torch.strided
        and value.device.type != "meta"
    )


def _calling_module() -> str:
    """The innermost of mirrored's modules on the stack, as a path in the package."""
    frame: Any = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_PACKAGE):
            return frame.f_code.co_filename.removeprefix(_PACKAGE)
        frame = frame.f_back
    return ""
