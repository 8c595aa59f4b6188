"""The Strategy contract: what every strategy does, the parameter-server one included.

``mirrored.Model``, the callbacks and the checkpoints are written against this and nothing else: a
strategy has a scope, a number of replicas that step in sync, a way to place a model and its
optimizer (``mirror``), a process that writes checkpoints, and a lifetime. How replica functions run
is not part of it: the strategies whose replicas run in this process share that machinery (``run``,
``reduce``, datasets split per replica) in
:class:`mirrored.strategies.in_process.InProcessStrategy`, while a ``ParameterServerStrategy``
schedules its steps on remote workers through a ``ClusterCoordinator``. TensorFlow's
``tf.distribute.Strategy`` draws the same line.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch

__all__ = ["Strategy", "scoped_strategy"]

_StrategyT = TypeVar("_StrategyT", bound="Strategy")


class _Scopes(threading.local):
    """The scopes this thread is in, innermost last (:mod:`mirrored.core.context` reads them)."""

    def __init__(self) -> None:
        self.stack: list[Strategy] = []


_scopes = _Scopes()


def scoped_strategy() -> Strategy | None:
    """The strategy whose ``scope()`` this thread is in, or None."""
    return _scopes.stack[-1] if _scopes.stack else None


class Strategy(abc.ABC):
    """Base class of all strategies: the contract of ``mirrored``'s front-ends."""

    # Whether ``param.grad`` holds a replica's gradient between ``loss.backward()`` and
    # ``optimizer.step()`` (so that it can be unscaled or clipped there).
    gradients_after_backward = True
    # Whether training steps are functions a ``ClusterCoordinator`` schedules on remote workers,
    # rather than ``run`` here (TensorFlow's ``Strategy._should_use_with_coordinator``).
    should_use_with_coordinator = False

    @contextmanager
    def scope(self: _StrategyT) -> Iterator[_StrategyT]:
        """Make this the current strategy (``mirrored.get_strategy()``) on this thread, e.g. to
        create a ``mirrored.Model`` on it."""
        stack = _scopes.stack
        if stack and stack[-1] is not self:
            raise RuntimeError(
                f"cannot enter the scope of {type(self).__name__} inside the scope of another "
                f"strategy ({type(stack[-1]).__name__}); leave that scope first"
            )
        stack.append(self)
        try:
            yield self
        finally:
            stack.pop()

    @property
    @abc.abstractmethod
    def num_replicas_in_sync(self) -> int:
        """The number of replicas a step runs on (global batch = this x per-replica batch)."""

    @property
    @abc.abstractmethod
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints, logs and summaries (TensorFlow's
        ``extended.should_checkpoint``)."""

    @abc.abstractmethod
    def save_on_chief(self, write: Callable[[], object]) -> None:
        """Run ``write`` (a checkpoint's write) where checkpoints are written, and return on
        every process only once it is written; call it on every process at the same point."""

    @abc.abstractmethod
    def check_same_on_workers(self, value: Any, what: str) -> None:
        """Raise ``ValueError`` unless every process that trains holds the same tensors in
        ``value`` (after a restore: processes that read different files would train apart)."""

    def check_same_settings(self, settings: dict[str, Any], what: str) -> None:
        """Raise ``ValueError`` naming the worker and the setting unless every process that
        trains holds the same JSON-plain ``settings`` (an optimizer's hyperparameters, a
        schedule): a collective where there are several; in one process, nothing to check."""
        return None

    def any_worker(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` is set on any process that trains (``what`` names it in errors): a
        collective where there are several, called by every one at the same point; in one
        process, ``flag``."""
        return flag

    @abc.abstractmethod
    def mirror(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> Any:
        """Place ``module`` (and ``optimizer``) where this strategy trains it; returns the
        handles a training step uses (the module's, and the optimizer's when one is given)."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether ``close()`` was called (the strategy cannot train any more)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release threads, processes and other resources; idempotent."""

    def __enter__(self: _StrategyT) -> _StrategyT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
