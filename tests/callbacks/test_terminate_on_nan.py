"""TerminateOnNaN: stop (or raise) at the first training batch whose loss is NaN or infinite."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mirrored
from mirrored.callbacks import Callback, TerminateOnNaN
from tests.callbacks.fakes import FakeModel, attach, fit_linear, linear_data


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_invalid_loss_stops_training(bad: float, capsys: pytest.CaptureFixture[str]) -> None:
    model = FakeModel()
    callback = TerminateOnNaN()
    attach(callback, model)
    callback.on_train_batch_end(2, {"loss": 1.0})
    assert not model.stop_training
    callback.on_train_batch_end(3, {"loss": bad})
    assert model.stop_training
    assert capsys.readouterr().out == "Batch 3: Invalid loss, terminating training\n"


def test_logs_without_a_loss_are_ignored() -> None:
    model = FakeModel()
    callback = TerminateOnNaN()
    attach(callback, model)
    callback.on_train_batch_end(0, {"accuracy": float("nan")})
    callback.on_train_batch_end(1, None)
    assert not model.stop_training


def test_raise_error_names_the_batch_and_the_value() -> None:
    model = FakeModel()
    callback = TerminateOnNaN(raise_error=True)
    attach(callback, model)
    with pytest.raises(FloatingPointError, match=r"the loss is nan at batch 7"):
        callback.on_train_batch_end(7, {"loss": float("nan")})
    assert not model.stop_training


# -- in a real fit ---------------------------------------------------------------------------------
class CountBatches(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self.batches += 1


def poisoned_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = linear_data()
    x[40] = float("nan")  # in the third batch of 16
    return x, y


def test_fit_stops_at_the_first_nan_batch() -> None:
    count = CountBatches()
    _, history = fit_linear(
        [count, TerminateOnNaN()],
        epochs=5,
        num_replicas=2,
        data=poisoned_data(),
        shuffle=False,
    )
    assert count.batches == 3
    assert history.epoch == [0]


def test_fit_raise_error_propagates() -> None:
    with pytest.raises(FloatingPointError, match=r"the loss is nan at batch 2"):
        fit_linear(
            [TerminateOnNaN(raise_error=True)], epochs=5, data=poisoned_data(), shuffle=False
        )


@pytest.mark.parametrize("raise_error", [False, True])
def test_a_nan_leaves_the_last_good_files_on_disk(tmp_path: Path, raise_error: bool) -> None:
    """Backups and checkpoints are never written with a NaN loss; the last good backup stays."""
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    x[40:] = float("nan")  # batches 5.. of each epoch are poisoned
    backup = tmp_path / "backup"
    model = mirrored.Model(torch.nn.Linear(4, 1))
    model.compile(optimizer="sgd", loss="mse")
    callbacks = [
        TerminateOnNaN(raise_error=raise_error),
        mirrored.callbacks.ModelCheckpoint(tmp_path / "weights.pt", monitor="loss"),
        mirrored.callbacks.BackupAndRestore(backup, save_freq=2),
    ]
    if raise_error:
        with pytest.raises(FloatingPointError):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    else:
        with pytest.warns(UserWarning, match="the last good"):
            model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    assert not (tmp_path / "weights.pt").exists()  # the epoch never ended with a finite loss
    saved = torch.load(backup / "backup.pt", weights_only=True)
    assert saved["progress"]["step"] == 4  # the backup after batch 4, before the first NaN
    assert all(torch.isfinite(v).all() for v in saved["training"]["model"].values())
    assert sorted(p.name for p in backup.iterdir()) == ["backup.pt"]
