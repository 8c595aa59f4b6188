"""Keras's learning-rate schedules: the learning rate as a function of the optimizer step.

A schedule is given as an optimizer spec's ``learning_rate``; the training loop asks it for the
rate of every update (step 0 is the first update, as Keras's ``optimizer.iterations``). The
formulas are Keras 3's (``keras/src/optimizers/schedules/learning_rate_schedule.py``), computed
in Python floats (float64) where Keras computes in the dtype of ``initial_learning_rate``
(float32): the values agree to float32 rounding.

Torch's own LR schedulers are stateful objects attached to one optimizer; they go to
``Model.compile(lr_scheduler=...)`` instead.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

from mirrored.optimizers._checks import boolean, non_negative, positive, real

__all__ = [
    "CosineDecay",
    "ExponentialDecay",
    "LearningRateSchedule",
    "PiecewiseConstantDecay",
    "PolynomialDecay",
    "deserialize",
    "serialize",
]


def _step(owner: str, step: Any) -> float:
    if isinstance(step, bool) or not isinstance(step, numbers.Real):
        raise TypeError(f"{owner}: step={step!r}; expected the optimizer step as an int >= 0")
    if step < 0:
        raise ValueError(f"{owner}: step={step!r}; expected the optimizer step as an int >= 0")
    return float(step)


class LearningRateSchedule:
    """Base class: ``schedule(step)`` is the learning rate of update ``step`` (0-based).

    Subclasses implement ``__call__`` and ``get_config`` (the constructor's arguments, so that
    ``type(s).from_config(s.get_config())`` rebuilds ``s``).
    """

    def __call__(self, step: int) -> float:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(step)")

    def get_config(self) -> dict[str, Any]:
        raise NotImplementedError(f"{type(self).__name__} must implement get_config()")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> LearningRateSchedule:
        return cls(**config)

    def __repr__(self) -> str:
        try:
            arguments = ", ".join(f"{k}={v!r}" for k, v in self.get_config().items())
        except NotImplementedError:
            return f"{type(self).__name__}()"
        return f"{type(self).__name__}({arguments})"


class PolynomialDecay(LearningRateSchedule):
    """From ``initial_learning_rate`` to ``end_learning_rate`` in ``decay_steps``:
    ``(initial - end) * (1 - step / decay_steps) ** power + end``, with ``step`` held at
    ``decay_steps`` afterwards; or, with ``cycle``, ``decay_steps`` stretched to the first
    multiple of itself that is >= ``step`` (so the rate jumps back up and decays again)."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        end_learning_rate: float = 0.0001,
        power: float = 1.0,
        cycle: bool = False,
    ) -> None:
        owner = type(self).__name__
        self.initial_learning_rate = non_negative(
            owner, "initial_learning_rate", initial_learning_rate
        )
        self.decay_steps = positive(owner, "decay_steps", decay_steps)
        self.end_learning_rate = non_negative(owner, "end_learning_rate", end_learning_rate)
        self.power = non_negative(owner, "power", power)
        self.cycle = boolean(owner, "cycle", cycle)

    def __call__(self, step: int) -> float:
        position = _step(type(self).__name__, step)
        decay_steps = self.decay_steps
        if self.cycle:
            # The first multiple of decay_steps that is >= step (1 at step 0).
            decay_steps *= 1.0 if position == 0 else math.ceil(position / decay_steps)
        else:
            position = min(position, decay_steps)
        remaining = 1.0 - position / decay_steps
        span = self.initial_learning_rate - self.end_learning_rate
        return span * remaining**self.power + self.end_learning_rate

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "cycle": self.cycle,
        }


class ExponentialDecay(LearningRateSchedule):
    """``initial_learning_rate * decay_rate ** (step / decay_steps)``; with ``staircase`` the
    exponent is floored, so the rate drops every ``decay_steps`` steps."""

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        decay_rate: float,
        staircase: bool = False,
    ) -> None:
        owner = type(self).__name__
        self.initial_learning_rate = non_negative(
            owner, "initial_learning_rate", initial_learning_rate
        )
        self.decay_steps = positive(owner, "decay_steps", decay_steps)
        self.decay_rate = non_negative(owner, "decay_rate", decay_rate)
        self.staircase = boolean(owner, "staircase", staircase)

    def __call__(self, step: int) -> float:
        exponent = _step(type(self).__name__, step) / self.decay_steps
        if self.staircase:
            exponent = math.floor(exponent)
        return self.initial_learning_rate * self.decay_rate**exponent

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "decay_rate": self.decay_rate,
            "staircase": self.staircase,
        }


class CosineDecay(LearningRateSchedule):
    """Cosine decay (Loshchilov & Hutter, SGDR, arXiv:1608.03983) with an optional linear warmup
    (Goyal et al., arXiv:1706.02677).

    Without ``warmup_target``: ``initial * ((1 - alpha) * 0.5 * (1 + cos(pi * t)) + alpha)`` with
    ``t = min(step, decay_steps) / decay_steps``. With it: a straight line from
    ``initial_learning_rate`` (step 0) to ``warmup_target`` (step ``warmup_steps``), then the same
    decay of ``warmup_target`` over the next ``decay_steps`` steps, ending at
    ``alpha * warmup_target``.
    """

    def __init__(
        self,
        initial_learning_rate: float,
        decay_steps: float,
        alpha: float = 0.0,
        warmup_target: float | None = None,
        warmup_steps: float = 0,
    ) -> None:
        owner = type(self).__name__
        self.initial_learning_rate = non_negative(
            owner, "initial_learning_rate", initial_learning_rate
        )
        self.decay_steps = positive(owner, "decay_steps", decay_steps)
        self.alpha = non_negative(owner, "alpha", alpha)
        self.warmup_target = (
            None if warmup_target is None else non_negative(owner, "warmup_target", warmup_target)
        )
        self.warmup_steps = non_negative(owner, "warmup_steps", warmup_steps)
        if self.warmup_target is None and self.warmup_steps > 0:
            # Keras ignores warmup_steps here; a warmup that silently never happens is a bug.
            raise ValueError(
                f"{owner}: warmup_steps={warmup_steps!r} but warmup_target=None; pass "
                "warmup_target (the learning rate at the end of the warmup) or drop warmup_steps"
            )

    def _decayed(self, position: float, decay_from: float) -> float:
        cosine = 0.5 * (1.0 + math.cos(math.pi * position / self.decay_steps))
        return decay_from * ((1.0 - self.alpha) * cosine + self.alpha)

    def __call__(self, step: int) -> float:
        position = _step(type(self).__name__, step)
        if self.warmup_target is None:
            return self._decayed(min(position, self.decay_steps), self.initial_learning_rate)
        position = min(position, self.decay_steps + self.warmup_steps)
        if position < self.warmup_steps:
            rise = self.warmup_target - self.initial_learning_rate
            return rise * position / self.warmup_steps + self.initial_learning_rate
        return self._decayed(position - self.warmup_steps, self.warmup_target)

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_steps": self.decay_steps,
            "alpha": self.alpha,
            "warmup_target": self.warmup_target,
            "warmup_steps": self.warmup_steps,
        }


class PiecewiseConstantDecay(LearningRateSchedule):
    """``values[0]`` while ``step <= boundaries[0]``, ``values[i]`` while
    ``boundaries[i - 1] < step <= boundaries[i]``, ``values[-1]`` after the last boundary."""

    def __init__(self, boundaries: Sequence[float], values: Sequence[float]) -> None:
        owner = type(self).__name__
        for name, sequence in (("boundaries", boundaries), ("values", values)):
            if isinstance(sequence, (str, bytes)) or not isinstance(sequence, Sequence):
                raise TypeError(f"{owner}: {name}={sequence!r}; expected a list of numbers")
        if len(values) != len(boundaries) + 1:
            raise ValueError(
                f"{owner}: {len(boundaries)} boundaries and {len(values)} values "
                f"(boundaries={list(boundaries)!r}, values={list(values)!r}); expected one more "
                "value than boundaries: values[i] applies up to boundaries[i], values[-1] after"
            )
        self.boundaries = [real(owner, f"boundaries[{i}]", b) for i, b in enumerate(boundaries)]
        self.values = [non_negative(owner, f"values[{i}]", v) for i, v in enumerate(values)]
        for i in range(1, len(self.boundaries)):
            if self.boundaries[i] <= self.boundaries[i - 1]:
                raise ValueError(
                    f"{owner}: boundaries={list(boundaries)!r}; expected strictly increasing "
                    "numbers"
                )

    def __call__(self, step: int) -> float:
        position = _step(type(self).__name__, step)
        for boundary, value in zip(self.boundaries, self.values, strict=False):
            if position <= boundary:
                return value
        return self.values[-1]

    def get_config(self) -> dict[str, Any]:
        return {"boundaries": list(self.boundaries), "values": list(self.values)}


_BUILT_IN: dict[str, type[LearningRateSchedule]] = {
    cls.__name__: cls
    for cls in (PolynomialDecay, ExponentialDecay, CosineDecay, PiecewiseConstantDecay)
}


def serialize(schedule: LearningRateSchedule) -> dict[str, Any]:
    """``{"class_name": ..., "config": ...}``, JSON-able (Keras's form, less its module keys)."""
    if not isinstance(schedule, LearningRateSchedule):
        raise TypeError(
            f"schedule={schedule!r}: expected a mirrored.optimizers.schedules.LearningRateSchedule"
        )
    return {"class_name": type(schedule).__name__, "config": schedule.get_config()}


def deserialize(
    config: dict[str, Any], custom_objects: dict[str, type[LearningRateSchedule]] | None = None
) -> LearningRateSchedule:
    """The schedule ``serialize`` described; schedules of your own are found in
    ``custom_objects`` (class name -> class)."""
    if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
        raise ValueError(
            f"config={config!r}: expected {{'class_name': ..., 'config': {{...}}}} as written by "
            "mirrored.optimizers.schedules.serialize"
        )
    known = {**_BUILT_IN, **(custom_objects or {})}
    cls = known.get(config["class_name"])
    if cls is None:
        raise ValueError(
            f"class_name={config['class_name']!r} is not a known schedule ({sorted(known)}); "
            "pass your own schedule classes as custom_objects={name: class}"
        )
    return cls.from_config(config["config"])
