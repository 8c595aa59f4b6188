"""How a mirrored optimizer's updates run, decided once as it is made.

A strategy's update options (gradient accumulation, local SGD, ZeRO, gradients summed in
backward, each parameter updated by one owner, the update on a central parameter device) are
asked of its ``MirrorFeatures`` together, here, into a frozen ``UpdatePlan``: the pieces the
optimizer drives, and the one path its synchronous updates take (``SyncPath``). The optimizer
follows the plan; it never works out again which combination of features it was given.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch
from torch import nn

from mirrored.replication.accumulation import AccumulationWindow
from mirrored.replication.central_update import CentralUpdate
from mirrored.replication.gradient_reducer import OverlappedGradientReducer
from mirrored.replication.local_sgd import LocalSteps
from mirrored.replication.mirror_features import MirrorFeatures
from mirrored.replication.sharded_update import PER_PARAMETER_OPTIMIZERS, ShardedUpdate
from mirrored.replication.zero_redundancy import ZeroRedundancy

__all__ = ["SyncPath", "UpdatePlan", "plan_updates"]


class SyncPath(enum.Enum):
    """Where a synchronous update's gradients are summed and who applies it."""

    # Summed in backward; every replica applies the update with its own optimizer.
    REDUCED = "summed in backward, applied by every replica"
    # Summed in backward; each parameter's owner applies it and copies it to the others.
    REDUCED_ON_OWNERS = "summed in backward, applied once by each parameter's owner"
    # Summed in backward; each replica updates its share of ZeRO's state, then all gathered.
    REDUCED_ZERO = "summed in backward, each replica updating its ZeRO share"
    # Summed at step(): reduce-scattered to ZeRO-2's owners, or a single replica's own.
    AT_STEP = "summed at step() (zero_stage=2), or one replica's own"
    # Summed in backward; applied once on the parameter device and copied to every replica.
    REDUCED_CENTRAL = "summed in backward, applied once on the parameter device"


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    """The pieces one mirrored optimizer drives, and its synchronous path."""

    window: AccumulationWindow | None  # gradient accumulation (None: every step updates)
    local: LocalSteps | None  # local SGD (None: every update is synchronous)
    zero: ZeroRedundancy | None  # ZeRO's sharded state (None: every replica keeps all)
    reducer: OverlappedGradientReducer | None  # sums gradients in backward (None: at step())
    sharded: ShardedUpdate | None  # owner updates (None: every replica updates)
    central: CentralUpdate | None  # the update on a parameter device (None: on the replicas)
    path: SyncPath

    def closure_refusal(self) -> str | None:
        """Why ``step(closure)`` cannot be exact under this plan (None: it can): each of the
        closure's backward passes must be summed as it runs."""
        if self.central is not None:
            return (
                "optimizer.step(closure) re-evaluates the loss on every replica between updates, "
                "which a CentralStorageStrategy applies on its parameter device alone; train "
                "LBFGS with MirroredStrategy"
            )
        if self.reducer is None or any(
            feature is not None for feature in (self.window, self.local, self.zero)
        ):
            return (
                "optimizer.step(closure) needs the gradients summed in each backward the closure "
                "runs: turn gradient_accumulation_steps, local_sgd and zero_stage off for LBFGS"
            )
        return None


def plan_updates(
    features: MirrorFeatures,
    optimizers: Sequence[torch.optim.Optimizer],
    params: Sequence[Sequence[nn.Parameter]],
) -> UpdatePlan:
    """The plan of a new mirrored optimizer over ``optimizers`` (one per replica) and their
    ``params``. A central update (``features.central_update``) excludes owner updates. Owner
    updates need replicas sharing one device's memory, a cross-device op that
    sums in slices (``features.owner_updates()``), a built-in per-parameter optimizer, and
    neither ZeRO nor local SGD (whose replicas keep optimizer states of their own)."""
    window = features.accumulation_window()
    local = features.local_steps()
    zero = features.zero_redundancy(optimizers, params)
    reducer = features.gradient_reducer(params, window, local)
    central = features.central_update(optimizers, params)
    shared_memory = len({p[0].device for p in params if p}) == 1
    sharded = None
    if (
        zero is None
        and central is None
        and local is None
        and len(optimizers) > 1
        and shared_memory
        and features.owner_updates()
        and type(optimizers[0]) in PER_PARAMETER_OPTIMIZERS
    ):
        sharded = ShardedUpdate(optimizers, params)
    if reducer is None:
        path = SyncPath.AT_STEP
    elif central is not None:
        path = SyncPath.REDUCED_CENTRAL
    elif zero is not None:
        path = SyncPath.REDUCED_ZERO
    elif sharded is not None:
        path = SyncPath.REDUCED_ON_OWNERS
    else:
        path = SyncPath.REDUCED
    return UpdatePlan(window, local, zero, reducer, sharded, central, path)
