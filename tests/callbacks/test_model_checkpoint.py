"""ModelCheckpoint: file names from the epoch and the logs, best-only saves, batch frequency, and
no file from a diverged loss or a process that does not write checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import mirrored
from mirrored.callbacks import ModelCheckpoint
from tests.callbacks.fakes import FakeModel, attach, drive, fit_linear, linear_data


def weight_in(path: Path) -> float:
    state = torch.load(path, weights_only=True)
    return float(state["weight"][0, 0])


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_saves_every_epoch_under_a_name_from_the_epoch_and_logs(tmp_path: Path) -> None:
    callback = ModelCheckpoint(
        tmp_path / "ckpt" / "w-{epoch:02d}-{val_loss:.2f}.pt", save_weights_only=True
    )
    drive(callback, FakeModel(), [{"loss": 1.0, "val_loss": v} for v in (0.5, 0.25, 0.125)])
    assert names(tmp_path / "ckpt") == ["w-01-0.50.pt", "w-02-0.25.pt", "w-03-0.12.pt"]
    # each file holds the weights at that epoch's end (drive sets the weight to the epoch)
    assert weight_in(tmp_path / "ckpt" / "w-03-0.12.pt") == 2.0


def test_save_weights_only_false_saves_the_full_state(tmp_path: Path) -> None:
    drive(ModelCheckpoint(tmp_path / "model.pt"), FakeModel(), [{"loss": 1.0}])
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    assert saved["format"] == "fake/1" and set(saved["model"]) == {"weight", "bias"}


def test_a_field_not_in_the_logs_names_it_and_the_available_ones(tmp_path: Path) -> None:
    callback = ModelCheckpoint(tmp_path / "{epoch}-{val_accuracy:.2f}.pt")
    with pytest.raises(ValueError, match=r"\{val_accuracy\}.*\(epoch, loss, val_loss\)"):
        drive(callback, FakeModel(), [{"loss": 1.0, "val_loss": 0.5}])
    with pytest.raises(ValueError, match=r"cannot be formatted.*Unknown format code 'd'"):
        drive(ModelCheckpoint(tmp_path / "{loss:02d}.pt"), FakeModel(), [{"loss": 1.0}])
    assert names(tmp_path) == []


def test_bad_filepaths_are_refused_at_once() -> None:
    cases = [
        ("ckpt-{epoch.pt", r"not a valid format string"),
        ("ckpt-{}.pt", r"positional fields"),
        ("ckpt-{0}.pt", r"positional fields"),
        ("", r"filepath is empty"),
    ]
    for filepath, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelCheckpoint(filepath)


def test_bad_save_freq() -> None:
    for save_freq in (0, -3, "batch", 2.5, True):
        with pytest.raises(ValueError, match=rf"save_freq={save_freq!r}"):
            ModelCheckpoint("x.pt", save_freq=save_freq)  # type: ignore[arg-type]


def test_save_best_only_keeps_the_best_epoch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "best.pt"
    callback = ModelCheckpoint(path, save_best_only=True, save_weights_only=True, verbose=1)
    model = FakeModel()
    attach(callback, model)
    saved_weights = []
    for epoch, val_loss in enumerate([1.0, 1.2, 0.8, 0.9]):
        model.set_weight(float(epoch))
        callback.on_epoch_end(epoch, {"loss": 1.0, "val_loss": val_loss})
        saved_weights.append(weight_in(path))
    assert saved_weights == [0.0, 0.0, 2.0, 2.0]
    assert callback.best == 0.8
    out = capsys.readouterr().out
    assert f"Epoch 1: val_loss improved from None to 1.00000, saving model to {path}" in out
    assert "Epoch 2: val_loss did not improve from 1.00000" in out
    assert "Epoch 3: val_loss improved from 1.00000 to 0.80000" in out


def test_save_best_only_in_max_mode_and_from_an_initial_threshold(tmp_path: Path) -> None:
    callback = ModelCheckpoint(
        tmp_path / "{epoch}.pt",
        monitor="val_accuracy",
        save_best_only=True,
        save_weights_only=True,
        initial_value_threshold=0.6,
    )
    logs = [{"loss": 1.0, "val_accuracy": a} for a in (0.5, 0.7, 0.65, 0.9)]
    drive(callback, FakeModel(), logs)
    assert names(tmp_path) == ["2.pt", "4.pt"]


def test_save_best_only_without_the_monitor_warns_and_keeps_the_best_file(tmp_path: Path) -> None:
    path = tmp_path / "best.pt"
    callback = ModelCheckpoint(path, save_best_only=True, save_weights_only=True)
    drive(callback, FakeModel(), [{"loss": 1.0, "val_loss": 0.5}], end=False)
    with pytest.warns(UserWarning, match=r"'val_loss'.*available: learning_rate, loss"):
        drive(callback, FakeModel(), [{"loss": 1.0, "learning_rate": 0.1}] * 2, initial_epoch=1)
    assert weight_in(path) == 0.0


def test_save_freq_counts_training_batches_across_epochs(tmp_path: Path) -> None:
    callback = ModelCheckpoint(
        tmp_path / "e{epoch}-b{batch}.pt", save_freq=2, save_weights_only=True, monitor="loss"
    )
    model = FakeModel()
    attach(callback, model, epochs=2, steps=5)
    callback.on_train_begin()
    for epoch in range(2):
        callback.on_epoch_begin(epoch)
        for batch in range(5):
            callback.on_train_batch_begin(batch)
            callback.on_train_batch_end(batch, {"loss": 1.0, "num_examples": 16})
        callback.on_epoch_end(epoch, {"loss": 1.0})
    assert names(tmp_path) == ["e1-b2.pt", "e1-b4.pt", "e2-b1.pt", "e2-b3.pt", "e2-b5.pt"]


def test_save_freq_counts_every_batch_of_an_execution(tmp_path: Path) -> None:
    # steps_per_execution=3: the hooks see batches 0..2, 3..5, 6..8
    callback = ModelCheckpoint(tmp_path / "b{batch}.pt", save_freq=4, save_weights_only=True)
    attach(callback, FakeModel())
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    for first in (0, 3, 6):
        callback.on_train_batch_begin(first)
        callback.on_train_batch_end(first + 2, {"loss": 1.0})
    assert names(tmp_path) == ["b6.pt"]  # 6 batches seen; the next save is due at 10
    assert callback.state_dict()["batches_since_save"] == 3


def test_a_nan_or_inf_loss_never_replaces_a_good_file(tmp_path: Path) -> None:
    path = tmp_path / "last.pt"
    callback = ModelCheckpoint(path, save_weights_only=True)
    model = FakeModel()
    drive(callback, model, [{"loss": 1.0}], end=False)
    before = path.read_bytes()
    for bad in (float("nan"), float("inf")):
        with pytest.warns(UserWarning, match=rf"not saving.*the loss \({bad}\)"):
            drive(callback, model, [{"loss": bad}], initial_epoch=1)
    assert path.read_bytes() == before and names(tmp_path) == ["last.pt"]


def test_only_the_process_that_writes_checkpoints_writes(tmp_path: Path) -> None:
    callback = ModelCheckpoint(tmp_path / "best.pt", save_best_only=True, save_weights_only=True)
    drive(callback, FakeModel(should_checkpoint=False), [{"loss": 1, "val_loss": 0.5}] * 2)
    assert names(tmp_path) == []
    assert callback.best == 0.5  # every process tracks the best, so all agree on it


def test_a_folder_as_filepath_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    with pytest.raises(ValueError, match=r"is an existing folder"):
        drive(ModelCheckpoint(tmp_path / "ckpt"), FakeModel(), [{"loss": 1.0}])


def test_state_round_trips_through_a_weights_only_file(tmp_path: Path) -> None:
    callback = ModelCheckpoint(tmp_path / "b.pt", save_best_only=True, save_freq=3)
    callback.load_state_dict({"best": 0.25, "batches_since_save": 2})
    mirrored.checkpoint.save(callback.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    assert state == {"best": 0.25, "batches_since_save": 2}


# -- in a real fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_fit_writes_weights_that_load_into_a_fresh_model(tmp_path: Path, num_replicas: int) -> None:
    callback = ModelCheckpoint(tmp_path / "w-{epoch:02d}-{loss:.4f}.pt", save_weights_only=True)
    model, history = fit_linear([callback], epochs=3, num_replicas=num_replicas)
    files = names(tmp_path)
    assert files == [
        f"w-{e + 1:02d}-{loss:.4f}.pt" for e, loss in enumerate(history.history["loss"])
    ]
    last = torch.load(tmp_path / files[-1], weights_only=True)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(last[name], value)
    fresh = mirrored.Model(nn.Linear(4, 1))
    fresh.load_weights(tmp_path / files[-1])
    x, _ = linear_data()
    torch.testing.assert_close(fresh(x), model(x))


def test_fit_save_best_only_full_state_loads_with_model_load(tmp_path: Path) -> None:
    path = tmp_path / "best.pt"
    callback = ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
    _, history = fit_linear([callback], epochs=3)
    val_losses = history.history["val_loss"]
    assert callback.best == min(val_losses)
    saved = torch.load(path, weights_only=True)
    assert saved["iterations"] == 4 * (val_losses.index(min(val_losses)) + 1)
    fresh = mirrored.Model(nn.Linear(4, 1))
    fresh.compile(optimizer=torch.optim.SGD(fresh.parameters(), lr=0.05), loss="mse")
    fresh.load(path)
    assert fresh.evaluate(*linear_data(32, seed=1), verbose=0) == pytest.approx(min(val_losses))


def test_fit_with_save_freq_in_batches(tmp_path: Path) -> None:
    callback = ModelCheckpoint(
        tmp_path / "e{epoch}b{batch}.pt", save_freq=3, save_weights_only=True
    )
    fit_linear([callback], epochs=2)  # 4 batches an epoch
    assert names(tmp_path) == ["e1b3.pt", "e2b2.pt"]
