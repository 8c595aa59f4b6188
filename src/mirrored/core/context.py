"""Which strategy is current, and which replica this thread is: thread-local state.

Three situations, as in TensorFlow:
- outside any ``strategy.scope()``: the default strategy, in its one default replica context;
- inside a scope, outside ``strategy.run``: cross-replica context (``get_replica_context()`` is
  None);
- inside ``strategy.run``: a replica context on the replica's worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import torch

from mirrored.core.strategy import Strategy, scoped_strategy
from mirrored.core.trace_recording import (
    HostCalls,
    TraceUnsupported,
    recording,
    refuse_while_recording,
)
from mirrored.core.values import ReduceOp, flatten, map_structure, regroup, select_replica

if TYPE_CHECKING:
    from mirrored.core.replica_meeting import ReplicaExchange
    from mirrored.core.replica_set import ReplicaSet

__all__ = [
    "ReplicaContext",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.replica_context: ReplicaContext | None = None
        self.in_merge = False


_state = _State()


class _Default:
    """The strategy in effect outside any scope, and its one replica context.

    The strategies layer names them at import (:func:`set_default_strategy`): the contexts sit
    below the strategies and do not import them.
    """

    def __init__(self) -> None:
        self.strategy: Callable[[], Strategy] = _no_default
        self.replica_context: Callable[[], ReplicaContext] = _no_default


def _no_default() -> Any:
    raise RuntimeError("no default strategy: import mirrored, which sets it")


_default = _Default()


def set_default_strategy(
    strategy: Callable[[], Strategy], replica_context: Callable[[], ReplicaContext]
) -> None:
    """Name what ``get_strategy()`` and ``get_replica_context()`` return outside any scope."""
    _default.strategy = strategy
    _default.replica_context = replica_context


class ReplicaContext:
    """What a replica function knows about itself and how it talks to its peers."""

    def __init__(
        self,
        strategy: ReplicaSet,
        replica_id: int,
        exchange: ReplicaExchange,
        global_batch_size: int | None = None,
    ) -> None:
        self.strategy = strategy
        self.replica_id_in_sync_group = replica_id
        self.exchange = exchange
        self.global_batch_size = global_batch_size
        # Backward passes this replica started since a mirrored optimizer last stepped.
        self.backward_passes = 0

    @property
    def local_replica_id(self) -> int:
        """This replica's index among the replicas of its own process (its worker)."""
        return self.exchange.replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas of the strategy running this replica."""
        return self.strategy.num_replicas_in_sync

    @property
    def device(self) -> torch.device:
        """This replica's torch device."""
        return self.exchange.device

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any) -> Any:
        """Reduce a nested structure of tensors (or numbers) across replicas; every replica
        receives the result on its own device. Not differentiable: the result is detached."""
        op = ReduceOp.of(reduce_op)
        leaves = flatten(value)
        recorder = recording()
        if recorder is not None:  # a traced step: the sum is taken at each replay
            return self._recorded_all_reduce(recorder, op, value, leaves)
        tensors = [torch.as_tensor(v, device=self.device).detach() for v in leaves]
        reduced = iter(self.strategy.all_reduce_tensors(self, op, tensors))
        results = [
            next(reduced) if isinstance(v, torch.Tensor) else next(reduced).item() for v in leaves
        ]
        it = iter(results)
        return map_structure(lambda _: next(it), value)

    def _recorded_all_reduce(
        self, recorder: HostCalls, op: ReduceOp, value: Any, leaves: list[Any]
    ) -> Any:
        if not all(isinstance(v, torch.Tensor) for v in leaves):
            raise TraceUnsupported(
                "an all_reduce of Python numbers inside the step (a replay cannot give the new "
                "sum back to Python; compute_average_loss without global_batch_size is one)"
            )

        def reduce(real: list[torch.Tensor]) -> list[torch.Tensor]:
            replica = current_replica_context()  # this replay's run, not the traced one's
            assert replica is not None
            it = iter(real)
            return flatten(replica.all_reduce(op, map_structure(lambda _: next(it), value)))

        specs = [(tuple(v.shape), v.dtype, self.device) for v in leaves]
        results = iter(recorder.host_call(reduce, [v.detach() for v in leaves], specs))
        return map_structure(lambda _: next(results), value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate each tensor of a nested structure along ``axis`` across replicas,
        in replica order; shards may differ in size along ``axis``. Detached."""
        refuse_while_recording("a replica context's all_gather inside the step")
        leaves = [torch.as_tensor(v).detach() for v in flatten(value)]
        it = iter(self.strategy.all_gather_tensors(self, leaves, axis))
        return map_structure(lambda _: next(it), value)

    def merge_call(
        self,
        merge_fn: Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Run ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context, with the
        arguments of all replicas grouped into PerReplica values; each replica gets the result
        (its own part, where the result is PerReplica)."""
        refuse_while_recording("merge_call inside the step")
        label = f"merge_call({getattr(merge_fn, '__qualname__', repr(merge_fn))})"
        everyone = self.exchange.all(label, (args, kwargs or {}))
        result = None
        if self.local_replica_id == 0:
            grouped_args, grouped_kwargs = regroup(everyone)
            try:
                with _merge_scope():
                    result = merge_fn(self.strategy, *grouped_args, **grouped_kwargs)
            except BaseException as error:
                self.exchange.meeting.abort(error)
                raise
        result = self.exchange.all(label + " result", result)[0]
        return select_replica(self.local_replica_id, result)


@contextmanager
def _thread_state(name: str, value: Any) -> Iterator[None]:
    """Set one field of this thread's state for the duration of a block."""
    previous = getattr(_state, name)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, previous)


def _merge_scope() -> AbstractContextManager[None]:
    return _thread_state("in_merge", True)


def replica_scope(context: ReplicaContext) -> AbstractContextManager[None]:
    """Enter a replica context on this thread (used by strategies around the replica function)."""
    return _thread_state("replica_context", context)


def in_merge_call() -> bool:
    """True while a merge call's function runs on a replica thread."""
    return _state.in_merge


def current_replica_context() -> ReplicaContext | None:
    """The replica context of this thread while a replica function runs, else None."""
    return None if _state.in_merge else _state.replica_context


def get_strategy() -> Strategy:
    """The current strategy: the one running this replica, the one whose scope we are in, or
    the default one-device strategy."""
    if _state.replica_context is not None:
        return _state.replica_context.strategy
    scoped = scoped_strategy()
    return scoped if scoped is not None else _default.strategy()


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or replica function."""
    return _state.replica_context is not None or scoped_strategy() is not None


def in_cross_replica_context() -> bool:
    """True inside a strategy scope but outside any replica function (or inside a merge call)."""
    if _state.in_merge:
        return True
    return _state.replica_context is None and scoped_strategy() is not None


def get_replica_context() -> ReplicaContext | None:
    """This thread's replica context; None in cross-replica context; the default strategy's
    replica context outside any scope."""
    if _state.in_merge:
        return None
    if _state.replica_context is not None:
        return _state.replica_context
    if scoped_strategy() is not None:
        return None
    return _default.replica_context()
