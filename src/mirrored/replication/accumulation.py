"""Gradient accumulation: k micro-steps, one reduction, one update.

With ``gradient_accumulation_steps=k`` a strategy makes each ``optimizer.step()`` of a mirrored
optimizer a micro-step of a window of k. The first k-1 only keep each replica's gradients:
``param.grad`` goes on accumulating them, nothing crosses devices or processes, and
``zero_grad()`` keeps them. The k-th micro-step reduces the sum over replicas and micro-steps
once, divides it by k and updates. k micro-steps on global batches of B examples (each loss
divided by B, as ``compute_average_loss`` does) then equal one step on all kB examples: the
parameters of the single-device run on the k-times larger batch, with k-times less
communication, and activations of only B examples at a time.

The window counts per local replica because every replica calls ``step()`` once per micro-step.
A failed run discards the window (``reset``): the replicas are resynced from replica 0 and the
gradients of an unfinished window dropped, never half applied.
"""

from __future__ import annotations

__all__ = ["AccumulationWindow", "check_accumulation_steps"]


def check_accumulation_steps(steps: object) -> int:
    """``steps`` as a validated window length, or a ValueError that says what to pass."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps={steps!r}: expected a whole number >= 1 (1 updates at "
            "every optimizer.step(); k reduces and updates once every k steps)"
        )
    return steps


class AccumulationWindow:
    """Where each local replica is in the current window of ``steps`` micro-steps."""

    def __init__(self, steps: int, num_replicas: int) -> None:
        self.steps = check_accumulation_steps(steps)
        self._done = [0] * num_replicas  # micro-steps of the current window taken, per replica

    @property
    def scale(self) -> float:
        """What the summed gradient of a window is multiplied by: the mean over micro-steps."""
        return 1.0 / self.steps

    def holding(self, replica: int) -> bool:
        """Whether ``replica``'s gradients hold the unreduced sum of earlier micro-steps."""
        return self._done[replica] > 0

    def final(self, replica: int) -> bool:
        """Whether ``replica``'s current micro-step ends the window (reduces and updates)."""
        return self._done[replica] == self.steps - 1

    def advance(self, replica: int) -> None:
        """Count one ``step()`` of ``replica``; after the final one a new window begins."""
        self._done[replica] = 0 if self.final(replica) else self._done[replica] + 1

    def reset(self) -> None:
        """Begin a new window on every replica (after a failed run)."""
        self._done = [0] * len(self._done)
