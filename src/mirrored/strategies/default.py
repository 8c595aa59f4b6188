"""The default strategy: no distribution, what ``get_strategy()`` returns outside any scope.

One replica, run on the caller's thread, tensors where the user put them, so that front-ends
written against the ``Strategy`` contract need no special case for a program without one. Its
``run`` is the base one without what only several replicas need (tasks, buffers to sync, the
replica's timing, a stream of its own), as it runs at every step of ``fit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mirrored.comm.cross_device_ops import HierarchicalCopyAllReduce
from mirrored.config import list_logical_devices
from mirrored.core import context
from mirrored.core.replica_meeting import ReplicaExchange, ReplicaMeeting
from mirrored.core.replica_workers import Outcome
from mirrored.core.values import select_replica
from mirrored.input.batch_split import global_batch_size_of
from mirrored.strategies.in_process import InProcessStrategy

__all__ = ["default_strategy"]


class _DefaultStrategy(InProcessStrategy):
    """No distribution: one replica, run on the caller's thread, tensors where the user put them."""

    def __init__(self) -> None:
        super().__init__(list_logical_devices("CPU")[:1], HierarchicalCopyAllReduce(), None)
        self._device = self.devices[0].torch_device
        self._default_replica = context.ReplicaContext(
            self, 0, ReplicaExchange(ReplicaMeeting(1, None), 0, torch.device("cpu"), ())
        )

    @property
    def _input_devices(self) -> tuple[torch.device | None, ...]:
        return (None,)

    def default_replica_context(self) -> context.ReplicaContext:
        return self._default_replica

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """``fn`` in a replica context of its own on the caller's thread, with the PerReplica
        arguments' one part; a failure raised as the base ``run`` raises it."""
        if (
            context.current_replica_context() is not None
            or context.in_merge_call()
            or not isinstance(args, (tuple, list))
        ):
            return super().run(fn, args, kwargs)  # raises the base's error
        given = (tuple(args), kwargs or {})
        meeting = ReplicaMeeting(1, self.timeout_seconds)
        exchange = ReplicaExchange(meeting, 0, self._device, ())
        replica = context.ReplicaContext(self, 0, exchange, global_batch_size_of(given))
        own_args, own_kwargs = select_replica(0, given)
        with self._run_lock, context.replica_scope(replica):
            try:
                return fn(*own_args, **own_kwargs)
            except BaseException as error:
                meeting.abort(error)
                root = self._root_error([(0, error)], meeting)  # the error, its replica noted
                assert root is error
                self._resync_replicated(root)
                raise

    def _execute(
        self, tasks: Sequence[Callable[[], Any]], meeting: ReplicaMeeting
    ) -> list[Outcome]:
        try:
            return [(True, tasks[0]())]
        except BaseException as error:
            return [(False, error)]

    def mirror(
        self,
        module: torch.nn.Module,
        *optimizers: torch.optim.Optimizer | None,
        sync_batch_norm: bool = False,
    ) -> Any:
        """Nothing to mirror with one replica: the module and optimizers are returned unchanged
        (the module alone without one)."""
        given = [optimizer for optimizer in optimizers if optimizer is not None]
        return (module, *given) if given else module

    @property
    def closed(self) -> bool:
        """Never: there is nothing to release, and every program may fall back on it."""
        return False

    def close(self) -> None:
        """Nothing to release (it runs on the caller's thread)."""

    def at_close(self, release: Callable[[], None]) -> None:
        """Never called: it never closes, and what its optimizers hold goes with them."""


@functools.cache
def default_strategy() -> _DefaultStrategy:
    """The one-replica strategy in effect outside any ``strategy.scope()``."""
    return _DefaultStrategy()


context.set_default_strategy(default_strategy, lambda: default_strategy().default_replica_context())
