"""The mirrored optimizers that torch's clipping, LR schedulers and ``GradScaler`` serve in
replicas, and what those patches do for them.

``clip_grad_norm_(model.parameters(), 1.0)`` between backward and ``step()``, ``scheduler.step()``
on every replica, a ``GradScaler`` around the loss: torch calls these with tensors, a scheduler or a
scaler, never with the mirrored optimizer, so the patches find the mirrored optimizers concerned
in the process-wide registries here. Clipping then reads the global batch's gradient, a schedule
advances once per update, and a scaler that would unscale one replica's gradients is refused.
Each mirrored optimizer holds the three patches from its creation to its release (or its
collection).
"""

from __future__ import annotations

import functools
import itertools
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mirrored.core.context import current_replica_context
from mirrored.torch_patches.clipping import CLIPPING, install_clipping_routes
from mirrored.torch_patches.grad_scaler import GRAD_SCALER, install_scale_check
from mirrored.torch_patches.holders import Holding, Install, Patch
from mirrored.torch_patches.schedulers import SCHEDULERS, install_step_routes

if TYPE_CHECKING:
    from mirrored.core.replica_set import ReplicaSet

__all__ = ["RoutedOptimizer", "hold_optimizer_routes"]


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
    ReplicaSet, weakref.WeakValueDictionary[int, RoutedOptimizer]
] = weakref.WeakKeyDictionary()
_CREATED = itertools.count()
# Mirrored optimizers and the original optimizers they were built from: their schedulers step
# on the first replica alone (an LR scheduler may be attached to either).
_STEPPED_BY_FIRST_REPLICA: weakref.WeakSet[Any] = weakref.WeakSet()


def hold_optimizer_routes(
    strategy: ReplicaSet, optimizer: RoutedOptimizer, original: torch.optim.Optimizer
) -> Holding:
    """Register ``optimizer`` (a mirrored optimizer of ``strategy`` built from ``original``)
    with torch's clipping, schedulers and scalers, patched while it holds them: until the
    returned holding is released (its module was released) or it is collected; then it takes
    no more part in clipping."""
    created = next(_CREATED)
    live = _LIVE_OPTIMIZERS.setdefault(strategy, weakref.WeakValueDictionary())
    live[created] = optimizer
    _STEPPED_BY_FIRST_REPLICA.add(optimizer)
    _STEPPED_BY_FIRST_REPLICA.add(original)

    def stop_routing() -> None:
        live.pop(created, None)

    return Holding(optimizer, _ROUTES, on_release=stop_routing)


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


# The patches a mirrored optimizer holds, each with its installation.
_ROUTES: list[tuple[Patch, Install]] = [
    (
        CLIPPING,
        functools.partial(
            install_clipping_routes,
            module=torch.nn.utils.clip_grad,
            package=torch.nn.utils,
            before=_reduce_before_clipping,
        ),
    ),
    (
        SCHEDULERS,
        functools.partial(
            install_step_routes,
            base=torch.optim.lr_scheduler.LRScheduler,
            skip=_stepped_by_first_replica,
        ),
    ),
    (GRAD_SCALER, functools.partial(install_scale_check, check=_refuse_grad_scaler_in_replicas)),
]
