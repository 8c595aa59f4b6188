"""Uneven devices: each global batch split by the measured speed of each replica.

Replicas meet at every sync point, so a step lasts as long as its slowest replica: with one
device twice as slow as the others, an even split leaves the others waiting half the step. With
``MirroredStrategy(..., load_balancing=LoadBalancing())`` the strategy measures, for every run
on a distributed batch, how long each replica computed before its first sync point (the forward
and backward of ``optimizer.step()``'s step) and how many examples it had, keeps a running
estimate of each replica's seconds per example, and every ``every_steps`` runs splits the next
global batches in proportion to the replicas' speeds.

The split never changes the result: ``compute_average_loss`` divides every shard's loss by the
global batch size, so shards of any sizes add up to the single-device gradient (BatchNorm's
per-replica statistics aside; ``sync_batch_norm=True`` is exact at any split). Every replica
keeps at least one example of a batch at least as large as the replica count, so that its speed
stays measured.

Timing is the host's: right for CPU devices; on CUDA, where kernels run asynchronously, the
time to the first sync point measures only what the host waited for.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

__all__ = ["LoadBalancing", "ReplicaSpeeds"]


@dataclasses.dataclass(frozen=True)
class LoadBalancing:
    """Splitting global batches by measured replica speed (a MirroredStrategy option).

    Args:
        every_steps: runs measured between two re-estimates of the split.
        smoothing: the weight of the newest ``every_steps`` runs in the running estimate of
            each replica's seconds per example (1: only the newest).
    """

    every_steps: int = 10
    smoothing: float = 0.5

    def __post_init__(self) -> None:
        steps = self.every_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"LoadBalancing(every_steps={steps!r}): expected a whole number >= 1")
        if not 0 < self.smoothing <= 1:
            raise ValueError(
                f"LoadBalancing(smoothing={self.smoothing!r}): expected a number in (0, 1]"
            )


class ReplicaSpeeds:
    """Each replica's measured seconds per example, and the batch split they give."""

    def __init__(self, options: LoadBalancing, num_replicas: int) -> None:
        self.options = options
        self.num_replicas = num_replicas
        self.seconds_per_example: list[float | None] = [None] * num_replicas
        self.shares = [1.0 / num_replicas] * num_replicas
        self._window_seconds = [0.0] * num_replicas
        self._window_examples = [0] * num_replicas
        self._window_runs = 0

    def record(self, seconds: Sequence[float], examples: Sequence[int]) -> None:
        """One run: each replica's compute seconds and its examples."""
        for r in range(self.num_replicas):
            if examples[r]:
                self._window_seconds[r] += seconds[r]
                self._window_examples[r] += examples[r]
        self._window_runs += 1
        if self._window_runs == self.options.every_steps:
            self._estimate()

    def _estimate(self) -> None:
        smoothing = self.options.smoothing
        for r in range(self.num_replicas):
            if not self._window_examples[r]:
                continue  # not measured this window: keep the last estimate
            newest = self._window_seconds[r] / self._window_examples[r]
            last = self.seconds_per_example[r]
            self.seconds_per_example[r] = (
                newest if last is None else smoothing * newest + (1 - smoothing) * last
            )
        known = [s for s in self.seconds_per_example if s]
        if len(known) == self.num_replicas:
            speeds = [1.0 / s for s in known]
            self.shares = [speed / sum(speeds) for speed in speeds]
        self._window_seconds = [0.0] * self.num_replicas
        self._window_examples = [0] * self.num_replicas
        self._window_runs = 0

    def sizes(self, batch_size: int) -> list[int]:
        """``batch_size`` split by the current shares (largest remainders, ties to the lower
        replica); at least one example each when there are enough, taken from the largest."""
        exact = [share * batch_size for share in self.shares]
        sizes = [math.floor(x) for x in exact]
        left = batch_size - sum(sizes)
        by_remainder = sorted(range(self.num_replicas), key=lambda r: (-(exact[r] % 1), r))
        for r in by_remainder[:left]:
            sizes[r] += 1
        if batch_size >= self.num_replicas:
            for r in range(self.num_replicas):
                if not sizes[r]:
                    sizes[max(range(self.num_replicas), key=lambda q: (sizes[q], -q))] -= 1
                    sizes[r] = 1
        return sizes
