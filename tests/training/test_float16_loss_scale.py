"""LossScale: halves on overflow, doubles after growth_interval good steps."""

from __future__ import annotations

from mirrored.training.float16_loss_scale import LossScale


def test_overflow_halves_and_resets_the_count() -> None:
    state = LossScale(scale=1024.0, good_steps=5)
    assert state.after_step(True) == LossScale(scale=512.0, good_steps=0)


def test_growth_after_the_interval() -> None:
    state = LossScale(scale=8.0, growth_interval=3)
    for _ in range(2):
        state = state.after_step(False)
    assert state.scale == 8.0 and state.good_steps == 2
    assert state.after_step(False) == LossScale(scale=16.0, good_steps=0, growth_interval=3)


def test_the_scale_never_drops_below_one() -> None:
    assert LossScale(scale=1.0).after_step(True).scale == 1.0
