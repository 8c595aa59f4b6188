"""What a mirrored optimizer's updates do beyond one synchronous update per ``step()``.

A strategy hands a ``MirrorFeatures`` to the mirrored module and optimizer it makes: gradient
accumulation (:mod:`mirrored.replication.accumulation`), local SGD
(:mod:`mirrored.replication.local_sgd`), sharded optimizer state
(:mod:`mirrored.replication.zero_redundancy`) and gradients reduced during backward
(:mod:`mirrored.replication.gradient_reducer`), each parameter updated once by an owner
(:mod:`mirrored.replication.sharded_update`) or on a central parameter device
(:mod:`mirrored.replication.central_update`); they are planned together once
(:mod:`mirrored.replication.update_plan`). This base has none of them, which is what a
pipeline's optimizer gets; the replicated family
(:class:`mirrored.strategies.replicated.ReplicatedStrategy`) answers with its own. The mirrored
module and optimizer ask these features, never which kind of strategy made them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mirrored.replication.accumulation import AccumulationWindow
    from mirrored.replication.central_update import CentralUpdate
    from mirrored.replication.gradient_reducer import OverlappedGradientReducer
    from mirrored.replication.local_sgd import LocalSteps
    from mirrored.replication.zero_redundancy import ZeroRedundancy

__all__ = ["NO_FEATURES", "MirrorFeatures"]


class MirrorFeatures:
    """The update features of a new mirrored optimizer, asked as it is made: none here."""

    def accumulation_window(self) -> AccumulationWindow | None:
        """A new mirrored optimizer's window of micro-steps (None: it updates at every step)."""
        return None

    def holding_gradients(self, local_replica_id: int) -> bool:
        """Whether a mirrored optimizer is inside an accumulation window on this replica."""
        return False

    def local_steps(self) -> LocalSteps | None:
        """A new mirrored optimizer's local SGD schedule (None: every update is synchronous)."""
        return None

    def zero_redundancy(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[torch.nn.Parameter]],
    ) -> ZeroRedundancy | None:
        """A new mirrored optimizer's sharding of its state (None: every replica keeps all)."""
        return None

    def owner_updates(self) -> bool:
        """Whether each parameter may be updated once, by an owner replica, and copied to the
        others: the replicas' gradients are summed in place, in slices, in every replica."""
        return False

    def central_update(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        params: Sequence[Sequence[torch.nn.Parameter]],
    ) -> CentralUpdate | None:
        """A new mirrored optimizer's update on one parameter device, its state there alone
        (None: the replicas update)."""
        return None

    def gradient_reducer(
        self,
        params: Sequence[Sequence[torch.nn.Parameter]],
        window: AccumulationWindow | None,
        local: LocalSteps | None,
    ) -> OverlappedGradientReducer | None:
        """What reduces a mirrored optimizer's gradients in backward (None: its ``step()``)."""
        return None


NO_FEATURES = MirrorFeatures()
"""Plain updates: every ``step()`` reduces all gradients and updates every replica."""
