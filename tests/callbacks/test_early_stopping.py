"""EarlyStopping: Keras's patience, min_delta, mode, baseline, warm-up and best-weights rules, and
a state that survives a restart."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from mirrored import checkpoint
from mirrored.callbacks import Callback, EarlyStopping
from tests.callbacks.fakes import FakeModel, drive, fit_linear


def losses(*values: float, name: str = "val_loss") -> list[dict[str, float]]:
    return [{"loss": 1.0, name: v} for v in values]


def test_stops_after_patience_epochs_without_improvement() -> None:
    model, callback = FakeModel(), EarlyStopping(patience=2)
    ran = drive(callback, model, losses(1.0, 0.9, 0.95, 0.96, 0.97, 0.5))
    assert ran == [0, 1, 2, 3]
    assert model.stop_training and callback.stopped_epoch == 3
    assert callback.best == 0.9 and callback.best_epoch == 1 and callback.wait == 2


def test_patience_zero_stops_at_the_first_epoch_without_improvement_but_never_at_epoch_0() -> None:
    assert drive(EarlyStopping(patience=0), FakeModel(), losses(1.0, 0.5, 0.6, 0.1)) == [0, 1, 2]
    # no stop at epoch 0, even without an improvement
    nan = float("nan")
    assert drive(EarlyStopping(patience=0), FakeModel(), losses(nan, nan)) == [0, 1]


def test_min_delta_is_the_smallest_change_that_counts() -> None:
    model = FakeModel()
    assert drive(EarlyStopping(patience=1, min_delta=0.05), model, losses(1.0, 0.99, 0.5)) == [0, 1]
    # the sign of min_delta is ignored, as in Keras
    assert drive(EarlyStopping(patience=1, min_delta=-0.05), FakeModel(), losses(1.0, 0.99)) == [
        0,
        1,
    ]
    assert drive(EarlyStopping(patience=1, min_delta=0.005), FakeModel(), losses(1.0, 0.99, 2)) == [
        0,
        1,
        2,
    ]


DIRECTIONS = [
    ("val_loss", "auto", False),
    ("val_accuracy", "auto", True),
    ("sparse_categorical_accuracy", "auto", True),
    ("val_acc", "auto", True),
    ("val_auc", "auto", True),
    ("precision", "auto", True),
    ("val_recall", "auto", True),
    ("val_mae", "auto", False),
    ("val_accuracy", "min", False),
    ("val_loss", "max", True),
]


def test_mode_decides_the_direction() -> None:
    for monitor, mode, higher_is_better in DIRECTIONS:
        callback = EarlyStopping(monitor=monitor, mode=mode, patience=1)
        assert callback.higher_is_better is higher_is_better, (monitor, mode)
        values = (0.5, 0.6, 0.7) if higher_is_better else (0.7, 0.6, 0.5)
        assert drive(callback, FakeModel(), losses(*values, name=monitor)) == [0, 1, 2]
        assert callback.best == values[-1]
        worse = (0.5, 0.4) if higher_is_better else (0.5, 0.6)
        assert drive(callback, FakeModel(), losses(*worse, name=monitor)) == [0, 1]


def test_baseline_improvements_that_do_not_beat_it_still_use_up_patience() -> None:
    # Keras 3: 0.9 and 0.8 improve on the best but not on the baseline, so they count
    values = losses(0.9, 0.8, 0.85, 0.84)
    assert drive(EarlyStopping(patience=2, baseline=0.5), FakeModel(), values) == [0, 1, 2]
    assert drive(EarlyStopping(patience=2), FakeModel(), values) == [0, 1, 2, 3]
    # beating the baseline restarts patience
    values = losses(0.9, 0.4, 0.45, 0.46, 0.47)
    assert drive(EarlyStopping(patience=2, baseline=0.5), FakeModel(), values) == [0, 1, 2, 3]


def test_restore_best_weights_loads_the_best_epoch_at_train_end(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = FakeModel()
    callback = EarlyStopping(patience=2, restore_best_weights=True, verbose=1)
    ran = drive(callback, model, losses(1.0, 0.5, 0.7, 0.8, 0.1))
    assert ran == [0, 1, 2, 3]
    assert model.weight() == 1.0  # drive sets the weight to the epoch number; epoch 1 was best
    out = capsys.readouterr().out
    assert "Epoch 4: early stopping" in out
    assert "Restoring model weights from the end of the best epoch: 2." in out
    assert all(t.device.type == "cpu" for t in callback.best_weights.values())  # type: ignore[union-attr]


def test_best_weights_are_a_copy_not_a_view_of_the_model() -> None:
    model = FakeModel()
    callback = EarlyStopping(monitor="loss", restore_best_weights=True, patience=5)
    drive(callback, model, [{"loss": 1.0}], end=False)
    model.set_weight(42.0)
    assert callback.best_weights is not None
    assert float(callback.best_weights["weight"][0, 0]) == 0.0


def test_restores_when_training_ends_without_stopping_and_not_without_the_option() -> None:
    model = FakeModel()
    drive(EarlyStopping(patience=5, restore_best_weights=True), model, losses(0.3, 0.5, 0.6))
    assert model.weight() == 0.0 and not model.stop_training
    model = FakeModel()
    drive(EarlyStopping(patience=1), model, losses(0.3, 0.5, 0.6))
    assert model.weight() == 1.0  # the last epoch's


def test_restore_best_weights_without_any_monitored_epoch_leaves_the_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    model = FakeModel()
    with pytest.warns(UserWarning):
        drive(EarlyStopping(restore_best_weights=True, verbose=1), model, [{"loss": 1.0}] * 2)
    assert model.weight() == 1.0
    assert "Restoring" not in capsys.readouterr().out


def test_start_from_epoch_ignores_the_warm_up_epochs() -> None:
    callback = EarlyStopping(patience=1, start_from_epoch=2, restore_best_weights=True)
    model = FakeModel()
    ran = drive(callback, model, losses(0.1, 0.2, 0.9, 0.95, 0.99))
    assert ran == [0, 1, 2, 3]
    assert callback.best == 0.9 and callback.best_epoch == 2 and model.weight() == 2.0


def test_a_missing_monitor_warns_with_the_available_logs_and_never_stops() -> None:
    with pytest.warns(UserWarning, match=r"'val_loss'.*available: accuracy, loss"):
        ran = drive(EarlyStopping(patience=0), FakeModel(), [{"loss": 1.0, "accuracy": 0.5}] * 3)
    assert ran == [0, 1, 2]


def test_nan_is_never_an_improvement() -> None:
    callback = EarlyStopping(patience=1)
    assert drive(callback, FakeModel(), losses(1.0, float("nan"), 0.5)) == [0, 1]
    assert callback.best == 1.0


def test_state_survives_a_weights_only_checkpoint_and_resumes_the_count(tmp_path: Path) -> None:
    values = losses(1.0, 0.5, 0.6, 0.7, 0.8, 0.9)
    uninterrupted = drive(EarlyStopping(patience=3, restore_best_weights=True), FakeModel(), values)
    assert uninterrupted == [0, 1, 2, 3, 4]

    first, model = EarlyStopping(patience=3, restore_best_weights=True), FakeModel()
    drive(first, model, values[:3], end=False)  # "killed" after epoch 2
    checkpoint.save(first.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state["wait"] == 1 and state["best"] == 0.5 and state["best_epoch"] == 1

    second, model = EarlyStopping(patience=3, restore_best_weights=True), FakeModel()
    second.set_model(model)  # type: ignore[arg-type]
    second.on_train_begin()  # fit resets, then BackupAndRestore loads the saved state
    second.load_state_dict(state)
    resumed = drive(second, model, values[3:], initial_epoch=3, begin=False)
    assert resumed == [3, 4] and second.stopped_epoch == 4
    assert model.weight() == 1.0  # the best weights came through the file


def test_a_reused_instance_starts_afresh() -> None:
    callback = EarlyStopping(patience=1)
    drive(callback, FakeModel(), losses(0.1, 0.2))
    assert callback.stopped_epoch == 1
    assert drive(callback, FakeModel(), losses(5.0, 4.0, 3.0)) == [0, 1, 2]
    assert callback.best == 3.0 and callback.stopped_epoch == 0


def test_bad_arguments_are_named() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"mode": "maximum"}, r"mode='maximum'.*\['auto', 'min', 'max'\]"),
        ({"patience": -1}, r"patience=-1"),
        ({"patience": 1.5}, r"patience=1.5"),
        ({"start_from_epoch": -2}, r"start_from_epoch=-2"),
        ({"monitor": ""}, r"monitor=''"),
        ({"min_delta": "0.1"}, r"min_delta='0.1'"),
        ({"baseline": "low"}, r"baseline='low'"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            EarlyStopping(**arguments)  # type: ignore[arg-type]


def test_without_a_model_the_error_says_how_to_use_it() -> None:
    callback = EarlyStopping(monitor="loss")
    with pytest.raises(RuntimeError, match=r"model.fit\(callbacks="):
        callback.on_train_end()


# -- in a real fit ---------------------------------------------------------------------------------
class Snapshots(Callback):
    """The model's weights at every epoch end."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[dict[str, torch.Tensor]] = []

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        assert self.model is not None
        self.states.append({k: v.clone() for k, v in self.model.state_dict().items()})


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_fit_stops_early_and_restores_the_best_epoch(num_replicas: int) -> None:
    # The loss falls every epoch, so monitoring it for a maximum stops after patience epochs and
    # epoch 0 (the highest loss) is the best.
    snapshots = Snapshots()
    early = EarlyStopping(monitor="loss", mode="max", patience=2, restore_best_weights=True)
    model, history = fit_linear([snapshots, early], epochs=10, num_replicas=num_replicas)
    assert history.epoch == [0, 1, 2]
    assert early.stopped_epoch == 2 and early.best_epoch == 0
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, snapshots.states[0][name])
        assert not torch.equal(value, snapshots.states[-1][name])


def test_fit_val_loss_patience_runs_all_epochs_while_improving() -> None:
    early = EarlyStopping(patience=1)
    _, history = fit_linear([early], epochs=4)
    losses_seen = history.history["val_loss"]
    assert len(losses_seen) == 4 and losses_seen == sorted(losses_seen, reverse=True)
    assert early.best == losses_seen[-1] and early.stopped_epoch == 0
