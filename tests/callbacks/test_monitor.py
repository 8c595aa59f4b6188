"""MonitorCallback: the direction, min_delta and missing-log rules EarlyStopping and
ModelCheckpoint share."""

from __future__ import annotations

import math

import pytest

from mirrored.callbacks.monitor import MonitorCallback


def test_improvement_in_min_mode_needs_to_beat_the_reference_by_more_than_min_delta() -> None:
    monitor = MonitorCallback("val_loss", min_delta=0.1)
    assert not monitor.higher_is_better
    assert monitor._is_improvement(0.5, None)
    assert monitor._is_improvement(0.5, 0.65)
    assert not monitor._is_improvement(0.5, 0.6)  # by exactly min_delta: not more
    assert not monitor._is_improvement(0.5, 0.55)
    assert not monitor._is_improvement(math.nan, None)


def test_improvement_in_max_mode_and_the_sign_of_min_delta() -> None:
    monitor = MonitorCallback("val_accuracy", min_delta=-0.1)
    assert monitor.higher_is_better and monitor.min_delta == 0.1
    assert monitor._is_improvement(0.8, 0.65)
    assert not monitor._is_improvement(0.8, 0.75)
    assert not monitor._is_improvement(0.8, 0.9)


def test_the_baseline_is_the_first_best() -> None:
    assert MonitorCallback("loss", baseline=2).best == 2.0
    assert MonitorCallback("loss").best is None


def test_get_monitor_value_reads_a_float_or_warns_with_what_there_is() -> None:
    monitor = MonitorCallback("val_loss")
    assert monitor.get_monitor_value({"val_loss": 1}) == 1.0
    with pytest.warns(UserWarning, match=r"'val_loss'.*\(available: accuracy, loss\)"):
        assert monitor.get_monitor_value({"loss": 1.0, "accuracy": 0.5}) is None
    with pytest.warns(UserWarning, match=r"\(available: none\)"):
        assert monitor.get_monitor_value(None) is None


def test_a_bad_mode_is_an_error_not_a_fallback() -> None:
    with pytest.raises(ValueError, match=r"MonitorCallback: mode='auto_max'"):
        MonitorCallback("loss", mode="auto_max")
