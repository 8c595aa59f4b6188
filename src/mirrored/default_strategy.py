"""The default strategy: no distribution, what ``get_strategy()`` returns outside any scope.

One replica, run on the caller's thread, tensors where the user put them, so that front-ends
written against the ``Strategy`` contract need no special case for a program without one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mirrored import context
from mirrored.config import list_logical_devices
from mirrored.cross_device_ops import HierarchicalCopyAllReduce
from mirrored.rendezvous import Rendezvous, ReplicaExchange
from mirrored.replica_workers import Outcome
from mirrored.strategy import InProcessStrategy

__all__ = ["default_strategy"]


class _DefaultStrategy(InProcessStrategy):
    """No distribution: one replica, run on the caller's thread, tensors where the user put them."""

    def __init__(self) -> None:
        super().__init__(list_logical_devices("CPU")[:1], HierarchicalCopyAllReduce(), None)
        self._default_replica = context.ReplicaContext(
            self, 0, ReplicaExchange(Rendezvous(1, None), 0, torch.device("cpu"), ())
        )

    @property
    def _input_devices(self) -> tuple[torch.device | None, ...]:
        return (None,)

    def default_replica_context(self) -> context.ReplicaContext:
        return self._default_replica

    def _execute(self, tasks: Sequence[Callable[[], Any]], rendezvous: Rendezvous) -> list[Outcome]:
        try:
            return [(True, tasks[0]())]
        except BaseException as error:
            return [(False, error)]

    def mirror(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> Any:
        """Nothing to mirror with one replica: the module and optimizer are returned unchanged."""
        return module if optimizer is None else (module, optimizer)

    @property
    def closed(self) -> bool:
        """Never: there is nothing to release, and every program may fall back on it."""
        return False

    def close(self) -> None:
        """Nothing to release (it runs on the caller's thread)."""


@functools.cache
def default_strategy() -> _DefaultStrategy:
    """The one-replica strategy in effect outside any ``strategy.scope()``."""
    return _DefaultStrategy()


context.set_default_strategy(default_strategy, lambda: default_strategy().default_replica_context())
