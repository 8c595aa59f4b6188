"""Local SGD: replicas that train apart and meet every few updates.

Synchronous data parallelism all-reduces the gradients at every update. With
``local_sgd=LocalSGD(period=H, warmup_steps=W)`` a strategy does that for the first W updates
(training is most sensitive early on; "post-local SGD", Lin et al., 2020), then lets every replica
update its own parameters with the gradient of its own shard and its own optimizer state, and
averages the parameters (and the floating-point buffers, such as BatchNorm's running statistics)
over all replicas every H updates: one all-reduce of the parameters per H updates instead of one
of the gradients per update.

A replica's gradient in a local update is that of its shard's mean loss: its share of the
global-batch loss (``compute_average_loss``) times the number of replicas, so the learning rate
keeps its meaning. With plain SGD and ``period=1`` that is exactly synchronous training (the
mean of the replicas' updates is the update of the summed gradient); otherwise the run converges
without being the single-device run: the replicas drift apart between averages, more with a
longer period or a larger learning rate. Optimizer state (momentum, Adam's moments) stays each
replica's own and is not averaged.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LocalSGD", "LocalSteps"]


def _check_whole(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"LocalSGD({name}={value!r}): expected a whole number >= {least}")


@dataclasses.dataclass(frozen=True)
class LocalSGD:
    """Periodic parameter averaging (a strategy's ``local_sgd`` option).

    Args:
        period: updates between two averages of the parameters (1: average after every one).
        warmup_steps: updates at the start that all-reduce the gradients as usual.
    """

    period: int
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        _check_whole("period", self.period, 1)
        _check_whole("warmup_steps", self.warmup_steps, 0)


class LocalSteps:
    """Where each local replica of one mirrored optimizer is in its local SGD schedule."""

    def __init__(self, options: LocalSGD, num_replicas: int) -> None:
        self.options = options
        self._updates = [0] * num_replicas  # updates taken, per replica

    def local(self, replica: int) -> bool:
        """Whether ``replica``'s next update uses only its own gradient (warm-up is over)."""
        return self._updates[replica] >= self.options.warmup_steps

    def averages(self, replica: int) -> bool:
        """Whether ``replica``'s next update, a local one, is followed by an average."""
        local_updates = self._updates[replica] - self.options.warmup_steps + 1
        return self.local(replica) and local_updates % self.options.period == 0

    def advance(self, replica: int) -> None:
        """Count one update of ``replica``."""
        self._updates[replica] += 1

    def align(self) -> None:
        """Give every replica replica 0's count (after a failed run resynced them from it)."""
        self._updates = [self._updates[0]] * len(self._updates)
