"""What torch's own gradient clipping, LR schedulers and ``GradScaler`` do inside replicas.

``clip_grad_norm_(model.parameters(), 1.0)`` between backward and ``step()``, ``scheduler.step()``
on every replica, a ``GradScaler`` around the loss: torch calls these with tensors, a scheduler or a
scaler, never with the mirrored optimizer, so :mod:`mirrored.random.torch_compat` routes them to the
functions here, which find the mirrored optimizers concerned in process-wide registries. Clipping
then reads the global batch's gradient, a schedule advances once per update, and a scaler that would
unscale one replica's gradients is refused.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from mirrored.core.context import current_replica_context
from mirrored.random import torch_compat

if TYPE_CHECKING:
    from mirrored.strategies.in_process import InProcessStrategy

__all__ = ["holds_any", "route_torch_calls", "stop_routing"]


class RoutedOptimizer(Protocol):
    """What the clipping route asks of a mirrored optimizer."""

    def holds_any(self, replica_id: int, tensor_ids: set[int]) -> bool: ...

    def all_reduce_gradients(self) -> None: ...


# The registries are process-wide because torch's clipping functions and schedulers are: a
# clipping call inside any strategy's run reaches every mirrored optimizer of the process. All
# are weak: they keep no optimizer and no strategy alive.
# Each strategy's live mirrored optimizers (not released), by creation: the order every replica
# visits them in.
_LIVE_OPTIMIZERS: weakref.WeakKeyDictionary[
    InProcessStrategy, weakref.WeakValueDictionary[int, RoutedOptimizer]
] = weakref.WeakKeyDictionary()
_CREATED = itertools.count()
# Mirrored optimizers and the original optimizers they were built from: their schedulers step
# on the first replica alone (an LR scheduler may be attached to either).
_STEPPED_BY_FIRST_REPLICA: weakref.WeakSet[Any] = weakref.WeakSet()


def route_torch_calls(
    strategy: InProcessStrategy, optimizer: RoutedOptimizer, original: torch.optim.Optimizer
) -> int:
    """Route torch's clipping, schedulers and scalers (once a process) and register
    ``optimizer`` (a mirrored optimizer of ``strategy`` built from ``original``) with the
    routes; returns its creation number, for ``stop_routing``."""
    created = next(_CREATED)
    live = _LIVE_OPTIMIZERS.setdefault(strategy, weakref.WeakValueDictionary())
    live[created] = optimizer
    _STEPPED_BY_FIRST_REPLICA.add(optimizer)
    _STEPPED_BY_FIRST_REPLICA.add(original)
    torch_compat.route_gradient_clipping(_reduce_before_clipping)
    torch_compat.route_scheduler_steps(_stepped_by_first_replica)
    torch_compat.route_grad_scaling(_refuse_grad_scaler_in_replicas)
    return created


def stop_routing(strategy: InProcessStrategy, created: int) -> None:
    """The optimizer ``created`` (its module was released) takes no more part in clipping."""
    live = _LIVE_OPTIMIZERS.get(strategy)
    if live is not None:
        live.pop(created, None)


def holds_any(params: Iterable[nn.Parameter], tensor_ids: set[int]) -> bool:
    """Whether any of ``tensor_ids`` is one of ``params`` or the gradient of one."""
    return any(
        id(p) in tensor_ids or (p.grad is not None and id(p.grad) in tensor_ids) for p in params
    )


def _reduce_before_clipping(tensors: list[torch.Tensor]) -> None:
    """torch's gradient clipping is about to read the gradients of ``tensors`` (parameters, or
    the gradients themselves): inside a replica, the mirrored optimizers holding them sum the
    replicas' gradients first, so it clips the global batch's gradient, as on one device (or
    refuse, where that cannot be done before ``step()``)."""
    replica = current_replica_context()
    if replica is None or not tensors:
        return
    tensor_ids = {id(t) for t in tensors}
    live = _LIVE_OPTIMIZERS.get(replica.strategy)
    for _, optimizer in sorted(live.items() if live is not None else []):
        if optimizer.holds_any(replica.local_replica_id, tensor_ids):
            optimizer.all_reduce_gradients()


def _stepped_by_first_replica(scheduler: Any) -> bool:
    """Whether a torch LR scheduler's ``step()`` is skipped here: inside a replica other than
    this process's first, for a scheduler of a mirrored optimizer (or of the optimizer it was
    built from). Each replica calling it would advance the schedule once per replica; replica
    0 steps it, and the others take its hyperparameters at the next update."""
    replica = current_replica_context()
    if replica is None or replica.local_replica_id == 0:
        return False
    return getattr(scheduler, "optimizer", None) in _STEPPED_BY_FIRST_REPLICA


def _refuse_grad_scaler_in_replicas(scaler: Any) -> None:
    """A ``TypeError`` for an enabled ``torch.amp.GradScaler`` scaling a loss inside a run with
    several replicas in this process (its per-optimizer state is shared by their threads, and
    it unscales replica 0's gradients only), or on a strategy whose gradients come at
    ``step()``."""
    replica = current_replica_context()
    if replica is None or not scaler.is_enabled():
        return
    strategy = replica.strategy
    if replica.exchange.num_replicas > 1 or not strategy.gradients_after_backward:
        raise TypeError(
            f"torch.amp.GradScaler inside strategy.run of {type(strategy).__name__} with "
            f"{replica.exchange.num_replicas} replica(s) here: one scaler's state is shared by "
            "the replicas' threads, and its unscale_() and step() reach replica 0's gradients "
            "only, so the update would not be one device's. Train with mirrored.Model's "
            "compile(precision='16-mixed') (one loss scale for every replica; an overflow on "
            "any skips the update on all), or autocast to torch.bfloat16, which needs no loss "
            "scaling"
        )
