"""A function ``ClusterCoordinator.schedule`` queued, and what it hands back: the function's
``RemoteValue``, filled once a worker has run it, or its ``ScheduledFunctionError``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RemoteValue", "ScheduledFunction", "ScheduledFunctionError"]


class ScheduledFunctionError(RuntimeError):
    """A scheduled function raised on a worker; ``remote_traceback`` is the worker's."""

    def __init__(self, message: str, error_type: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.error_type = error_type
        self.remote_traceback = remote_traceback


class RemoteValue:
    """The result of a scheduled function, once a worker has run it."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def done(self) -> bool:
        """Whether the function has run (or failed)."""
        return self._done.is_set()

    def fetch(self) -> Any:
        """Wait for the function to run and return its result (tensors on the CPU), or raise
        its error."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value

    get = fetch


@dataclass
class ScheduledFunction:
    """A function queued by ``schedule``, as the coordinator tracks it."""

    id: int
    fn: Callable[..., Any]
    call: bytes  # (fn, args, kwargs) pickled when scheduled: what a worker runs
    round: int  # synchronous mode's round (0 otherwise)
    value: RemoteValue = field(default_factory=RemoteValue)

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """The function has run: its ``RemoteValue`` gets ``result``, or fails with ``error``."""
        self.value._finish(result, error)

    @property
    def name(self) -> str:
        """The function's name, for messages."""
        return str(getattr(self.fn, "__qualname__", self.fn))
