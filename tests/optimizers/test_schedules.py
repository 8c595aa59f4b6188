"""The learning-rate schedules against values worked out by hand from Keras 3's published formulas
(``keras.optimizers.schedules``; Keras is not installed here to compare against directly)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from mirrored.optimizers import schedules
from mirrored.optimizers.schedules import (
    CosineDecay,
    ExponentialDecay,
    LearningRateSchedule,
    PiecewiseConstantDecay,
    PolynomialDecay,
)

# (schedule, {step: expected learning rate}), each value computed from the formula by hand.
CASES: list[tuple[LearningRateSchedule, dict[float, float]]] = [
    # (0.1 - 0) * (1 - step / 10) ** 2, the step held at 10 after the end.
    (PolynomialDecay(0.1, 10, 0.0, power=2), {0: 0.1, 5: 0.025, 10: 0.0, 15: 0.0}),
    # cycle: decay_steps = 10 * ceil(step / 10), 1 at step 0; at 15 it is 20: 0.1 * 0.25 ** 2.
    (
        PolynomialDecay(0.1, 10, 0.0, power=2, cycle=True),
        {0: 0.1, 5: 0.025, 10: 0.0, 15: 0.00625, 20: 0.0},
    ),
    # The default end_learning_rate=0.0001, power 1: (0.1 - 0.0001) * 0.5 + 0.0001.
    (PolynomialDecay(0.1, 10), {0: 0.1, 5: 0.05005, 10: 0.0001, 99: 0.0001}),
    # 0.1 * 0.5 ** (step / 10).
    (
        ExponentialDecay(0.1, 10, 0.5),
        {0: 0.1, 5: 0.1 * math.sqrt(0.5), 10: 0.05, 25: 0.1 * 0.5**2.5},
    ),
    # staircase: 0.1 * 0.5 ** floor(step / 10).
    (ExponentialDecay(0.1, 10, 0.5, staircase=True), {0: 0.1, 9: 0.1, 10: 0.05, 25: 0.025}),
    # 0.1 * 0.5 * (1 + cos(pi * min(step, 10) / 10)).
    (CosineDecay(0.1, 10), {0: 0.1, 5: 0.05, 10: 0.0, 20: 0.0}),
    # alpha: 0.1 * (0.9 * cosine + 0.1); at 5, 0.1 * (0.45 + 0.1).
    (CosineDecay(0.1, 10, alpha=0.1), {0: 0.1, 5: 0.055, 10: 0.01, 30: 0.01}),
    # Warmup 0 -> 0.2 over 4 steps, then 0.2 * cosine over 10 steps: 0.2 * 0.5 at 4 + 5.
    (
        CosineDecay(0.0, 10, warmup_target=0.2, warmup_steps=4),
        {0: 0.0, 2: 0.1, 3: 0.15, 4: 0.2, 9: 0.1, 14: 0.0, 100: 0.0},
    ),
    # Warmup from a non-zero start: 0.1 + (0.3 - 0.1) * step / 2.
    (
        CosineDecay(0.1, 4, alpha=0.5, warmup_target=0.3, warmup_steps=2),
        {1: 0.2, 2: 0.3, 4: 0.3 * (0.5 * 0.5 + 0.5), 6: 0.15},
    ),
    # warmup_target with warmup_steps=0: the decay starts from warmup_target at once.
    (CosineDecay(0.1, 10, warmup_target=0.4), {0: 0.4, 5: 0.2}),
    # values[i] while step <= boundaries[i].
    (
        PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1]),
        {0: 1.0, 10: 1.0, 10.5: 0.5, 11: 0.5, 20: 0.5, 21: 0.1, 1000: 0.1},
    ),
    (PiecewiseConstantDecay([], [0.3]), {0: 0.3, 50: 0.3}),
]


# One test per table, not per case: the conftest's hygiene check costs ~0.1 s per test.
def test_values_match_the_formula() -> None:
    for schedule, expected in CASES:
        for step, value in expected.items():
            got = schedule(step)  # type: ignore[arg-type]
            assert isinstance(got, float)
            assert got == pytest.approx(value, rel=1e-12, abs=1e-15), f"{schedule!r} at {step}"


def test_config_round_trips_through_json() -> None:
    for schedule, expected in CASES:
        serialized = json.loads(json.dumps(schedules.serialize(schedule)))
        assert serialized["class_name"] == type(schedule).__name__
        rebuilt = schedules.deserialize(serialized)
        assert type(rebuilt) is type(schedule)
        assert rebuilt.get_config() == schedule.get_config()
        steps = list(expected)
        assert [rebuilt(s) for s in steps] == [schedule(s) for s in steps]  # type: ignore[arg-type]


def test_config_uses_keras_names() -> None:
    assert CosineDecay(0.1, 10, warmup_target=0.2, warmup_steps=3).get_config() == {
        "initial_learning_rate": 0.1,
        "decay_steps": 10.0,
        "alpha": 0.0,
        "warmup_target": 0.2,
        "warmup_steps": 3.0,
    }
    assert PiecewiseConstantDecay((5,), (0.2, 0.1)).get_config() == {
        "boundaries": [5.0],
        "values": [0.2, 0.1],
    }
    assert repr(ExponentialDecay(0.1, 10, 0.5)) == (
        "ExponentialDecay(initial_learning_rate=0.1, decay_steps=10.0, decay_rate=0.5, "
        "staircase=False)"
    )


class _Inverse(LearningRateSchedule):
    def __init__(self, scale: float) -> None:
        self.scale = scale

    def __call__(self, step: int) -> float:
        return self.scale / (step + 1)

    def get_config(self) -> dict[str, Any]:
        return {"scale": self.scale}


def test_custom_schedules_deserialize_through_custom_objects() -> None:
    config = schedules.serialize(_Inverse(0.5))
    with pytest.raises(ValueError, match=r"'_Inverse' is not a known schedule.*custom_objects"):
        schedules.deserialize(config)
    rebuilt = schedules.deserialize(config, custom_objects={"_Inverse": _Inverse})
    assert isinstance(rebuilt, _Inverse)
    assert rebuilt(1) == 0.25


def test_the_base_class_says_what_to_implement() -> None:
    base = LearningRateSchedule()
    with pytest.raises(NotImplementedError, match=r"must implement __call__"):
        base(0)
    with pytest.raises(NotImplementedError, match=r"must implement get_config"):
        base.get_config()
    assert repr(base) == "LearningRateSchedule()"


INVALID: list[tuple[Any, type[Exception], str]] = [
    (lambda: PolynomialDecay(0.1, 0), ValueError, r"decay_steps=0; expected a number > 0"),
    (lambda: PolynomialDecay(0.1, -5), ValueError, r"decay_steps=-5"),
    (lambda: PolynomialDecay(-0.1, 10), ValueError, r"initial_learning_rate=-0.1"),
    (lambda: PolynomialDecay(0.1, 10, -1e-4), ValueError, r"end_learning_rate=-0.0001"),
    (lambda: PolynomialDecay(0.1, 10, power=-1), ValueError, r"power=-1"),
    (lambda: PolynomialDecay(0.1, 10, cycle=1), TypeError, r"cycle=1; expected True or False"),
    (lambda: PolynomialDecay("0.1", 10), TypeError, r"initial_learning_rate='0.1' is a str"),
    (lambda: PolynomialDecay(0.1, math.inf), ValueError, r"decay_steps=inf; expected a finite"),
    (lambda: ExponentialDecay(0.1, 0, 0.5), ValueError, r"ExponentialDecay: decay_steps=0"),
    (lambda: ExponentialDecay(0.1, 10, -0.5), ValueError, r"decay_rate=-0.5"),
    (lambda: ExponentialDecay(0.1, 10, 0.5, staircase="no"), TypeError, r"staircase='no'"),
    (lambda: CosineDecay(0.1, 0), ValueError, r"CosineDecay: decay_steps=0"),
    (lambda: CosineDecay(-1.0, 10), ValueError, r"initial_learning_rate=-1.0"),
    (lambda: CosineDecay(0.1, 10, alpha=-0.1), ValueError, r"alpha=-0.1"),
    (lambda: CosineDecay(0.1, 10, warmup_target=-1), ValueError, r"warmup_target=-1"),
    (
        lambda: CosineDecay(0.1, 10, warmup_target=0.2, warmup_steps=-1),
        ValueError,
        r"warmup_steps=-1",
    ),
    (
        lambda: CosineDecay(0.1, 10, warmup_steps=100),
        ValueError,
        r"warmup_steps=100 but warmup_target=None; pass warmup_target",
    ),
    (
        lambda: PiecewiseConstantDecay([10, 20], [1.0, 0.5]),
        ValueError,
        r"2 boundaries and 2 values .*expected one more value than boundaries",
    ),
    (
        lambda: PiecewiseConstantDecay([10], [1.0, 0.5, 0.1]),
        ValueError,
        r"1 boundaries and 3 values",
    ),
    (
        lambda: PiecewiseConstantDecay([20, 10], [1.0, 0.5, 0.1]),
        ValueError,
        r"boundaries=\[20, 10\]; expected strictly increasing",
    ),
    (
        lambda: PiecewiseConstantDecay([10, 10], [1.0, 0.5, 0.1]),
        ValueError,
        r"strictly increasing",
    ),
    (lambda: PiecewiseConstantDecay([10], [1.0, -0.5]), ValueError, r"values\[1\]=-0.5"),
    (lambda: PiecewiseConstantDecay(["a"], [1.0, 0.5]), TypeError, r"boundaries\[0\]='a'"),
    (lambda: PiecewiseConstantDecay(10, [1.0, 0.5]), TypeError, r"boundaries=10; expected a"),
    (lambda: PiecewiseConstantDecay([10], "ab"), TypeError, r"values='ab'; expected a list"),
]


def test_invalid_arguments_are_named() -> None:
    for build, error, match in INVALID:
        with pytest.raises(error, match=match):
            build()


def test_invalid_steps_are_refused() -> None:
    for schedule in [
        PolynomialDecay(0.1, 10),
        ExponentialDecay(0.1, 10, 0.5),
        CosineDecay(0.1, 10),
        PiecewiseConstantDecay([1], [0.1, 0.01]),
    ]:
        name = type(schedule).__name__
        with pytest.raises(ValueError, match=rf"{name}: step=-1; expected the optimizer step"):
            schedule(-1)
        with pytest.raises(TypeError, match=r"step=True"):
            schedule(True)
        with pytest.raises(TypeError, match=r"step='3'"):
            schedule("3")  # type: ignore[arg-type]


def test_serialize_and_deserialize_refuse_other_things() -> None:
    with pytest.raises(TypeError, match=r"schedule=0.1: expected a mirrored"):
        schedules.serialize(0.1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expected \{'class_name'"):
        schedules.deserialize({"class_name": "CosineDecay"})
