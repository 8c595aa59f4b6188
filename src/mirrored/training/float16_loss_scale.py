"""Dynamic loss scaling for float16 mixed precision (``precision="16-mixed"``).

float16 gradients underflow to zero below about 6e-8, so the loss is multiplied by a large scale
before backward and the gradients divided by it before the update. When any replica sees an
inf or NaN gradient, every replica skips the update and the scale halves; after
``growth_interval`` good steps it doubles (the defaults of ``torch.amp.GradScaler`` and Keras's
``LossScaleOptimizer``).

The state is an immutable value: each replica advances its own copy identically from the same
all-reduced overflow flag, so replicas never share a mutable scaler across threads.
"""

from __future__ import annotations

import dataclasses

__all__ = ["LossScale"]


@dataclasses.dataclass(frozen=True)
class LossScale:
    """The current scale and the number of good steps since it last changed."""

    scale: float = 2.0**15
    good_steps: int = 0
    growth_interval: int = 2000

    def after_step(self, found_nonfinite: bool) -> LossScale:
        """The state for the next step."""
        if found_nonfinite:
            return dataclasses.replace(self, scale=max(self.scale / 2, 1.0), good_steps=0)
        if self.good_steps + 1 >= self.growth_interval:
            return dataclasses.replace(self, scale=self.scale * 2, good_steps=0)
        return dataclasses.replace(self, good_steps=self.good_steps + 1)
