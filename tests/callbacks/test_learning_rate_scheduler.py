"""LearningRateScheduler: the rate at each epoch's start from schedule(epoch, lr), a float or an
error that shows what the schedule returned, and no double step after a restart."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from mirrored.callbacks import BackupAndRestore, LearningRateScheduler
from tests.callbacks.fakes import Crash, CrashAt, FakeModel, drive, fit_linear


def test_sets_the_rate_from_the_epoch_and_the_current_rate() -> None:
    model = FakeModel(learning_rate=0.1)
    seen: list[tuple[int, float]] = []

    def halve(epoch: int, lr: float) -> float:
        seen.append((epoch, lr))
        return lr / 2

    callback = LearningRateScheduler(halve)
    logs = [{"loss": 1.0}, {"loss": 1.0}, {"loss": 1.0}]
    drive(callback, model, logs)
    assert seen == [(0, 0.1), (1, 0.05), (2, 0.025)]
    assert model.learning_rate == 0.0125


def test_the_epoch_end_logs_get_the_rate() -> None:
    model = FakeModel()
    callback = LearningRateScheduler(lambda epoch, lr: 0.5 ** (epoch + 1))
    callback.set_model(model)  # type: ignore[arg-type]
    callback.on_train_begin()
    for epoch in range(2):
        callback.on_epoch_begin(epoch)
        logs: dict[str, float] = {"loss": 1.0}
        callback.on_epoch_end(epoch, logs)
        assert logs["learning_rate"] == 0.5 ** (epoch + 1)


def test_a_schedule_of_the_epoch_alone_works_as_in_keras() -> None:
    model = FakeModel()
    drive(LearningRateScheduler(lambda epoch: 0.01 * (epoch + 1)), model, [{"loss": 1.0}] * 3)
    assert model.learning_rate == pytest.approx(0.03)


def test_numpy_floats_are_floats() -> None:
    model = FakeModel()
    drive(LearningRateScheduler(lambda epoch, lr: np.float32(0.25)), model, [{"loss": 1.0}])
    assert model.learning_rate == 0.25 and type(model.learning_rate) is float


def test_a_result_that_is_not_a_float_is_shown_in_the_error() -> None:
    cases = [
        (1, r"returned 1 \(int\)"),
        (torch.tensor(0.1), r"returned tensor\(0.1000\) \(Tensor\)"),
        (None, r"returned None \(NoneType\)"),
        ("0.1", r"returned '0.1' \(str\)"),
    ]
    for returned, shown in cases:
        model = FakeModel(learning_rate=0.5)
        schedule = LearningRateScheduler(lambda epoch, lr, returned=returned: returned)
        with pytest.raises(
            ValueError, match=rf"schedule\(0, ...\) {shown}; it must return a float"
        ):
            drive(schedule, model, [{"loss": 1.0}])
        assert model.learning_rate == 0.5


def test_verbose_prints_the_new_rate(capsys: pytest.CaptureFixture[str]) -> None:
    drive(LearningRateScheduler(lambda e, lr: 0.5, verbose=1), FakeModel(), [{"loss": 1.0}])
    assert "Epoch 1: LearningRateScheduler setting learning rate to 0.5." in capsys.readouterr().out


def test_a_schedule_that_takes_neither_form_or_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"takes neither \(epoch, lr\) nor \(epoch\)"):
        LearningRateScheduler(lambda: 0.1)
    with pytest.raises(TypeError, match=r"takes neither"):
        LearningRateScheduler(lambda a, b, c: 0.1)
    with pytest.raises(TypeError, match=r"schedule=0.1 is not callable"):
        LearningRateScheduler(0.1)  # type: ignore[arg-type]


def test_a_restart_in_the_middle_of_an_epoch_does_not_step_it_twice() -> None:
    model = FakeModel(learning_rate=1.0)
    first = LearningRateScheduler(lambda epoch, lr: lr / 2)
    first.set_model(model)  # type: ignore[arg-type]
    first.on_train_begin()
    first.on_epoch_begin(0)
    state = first.state_dict()  # backed up mid-epoch 0, with the optimizer at lr 0.5
    assert model.learning_rate == 0.5

    second = LearningRateScheduler(lambda epoch, lr: lr / 2)
    second.set_model(model)  # type: ignore[arg-type]
    second.on_train_begin()
    second.load_state_dict(state)
    second.on_epoch_begin(0)  # fit starts again in epoch 0
    assert model.learning_rate == 0.5
    second.on_epoch_begin(1)
    assert model.learning_rate == 0.25


# -- in a real fit ---------------------------------------------------------------------------------
def test_fit_uses_the_scheduled_rates() -> None:
    callback = LearningRateScheduler(lambda epoch, lr: 0.1 * 0.5**epoch)
    model, history = fit_linear([callback], epochs=3, num_replicas=2)
    assert history.history["learning_rate"] == pytest.approx([0.1, 0.05, 0.025])
    assert model.optimizer is not None
    assert model.optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_fit_a_zero_rate_leaves_the_weights_alone() -> None:
    callback = LearningRateScheduler(lambda epoch, lr: 0.0)
    model, _ = fit_linear([callback], epochs=1)
    torch.manual_seed(0)
    untouched = torch.nn.Linear(4, 1)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, untouched.state_dict()[name])


def test_fit_resumed_mid_epoch_by_backup_and_restore_keeps_the_schedule(tmp_path: Path) -> None:
    def halve(epoch: int, lr: float) -> float:
        return lr / 2  # applied twice in one epoch, the rate would show it

    expected_model, expected = fit_linear([LearningRateScheduler(halve)], epochs=3)
    backup = BackupAndRestore(tmp_path, save_freq=1)
    with pytest.raises(Crash):  # in epoch 1, after its second batch
        fit_linear([LearningRateScheduler(halve), CrashAt(6), backup], epochs=3)
    model, history = fit_linear([LearningRateScheduler(halve), backup], epochs=3)
    assert history.history["learning_rate"] == pytest.approx([0.025, 0.0125, 0.00625])
    assert history.history == expected.history
    for name, value in expected_model.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value)
