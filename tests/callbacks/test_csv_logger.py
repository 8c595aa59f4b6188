"""CSVLogger: Keras's file (epoch + sorted log names), one flushed row per epoch, appending, late
columns, and no repeated rows after a restart."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from mirrored import checkpoint
from mirrored.callbacks import BackupAndRestore, CSVLogger
from tests.callbacks.fakes import Crash, CrashAt, FakeModel, attach, drive, fit_linear


def epoch_logs(*losses: float) -> list[dict[str, float]]:
    return [{"loss": loss, "accuracy": 1 - loss, "learning_rate": 0.01} for loss in losses]


def rows(path: Path, separator: str = ",") -> list[dict[str, str]]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file, delimiter=separator))


def test_header_is_epoch_and_sorted_names_and_one_row_per_epoch(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    drive(CSVLogger(path), FakeModel(), epoch_logs(0.5, 0.25, 0.125))
    lines = path.read_text().splitlines()
    assert lines[0] == "epoch,accuracy,learning_rate,loss"
    assert lines[1:] == [
        "0,0.5,0.01,0.5",
        "1,0.75,0.01,0.25",
        "2,0.875,0.01,0.125",
    ]


def test_each_row_is_on_disk_when_its_epoch_ends(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    callback = CSVLogger(path)
    attach(callback, FakeModel())
    callback.on_train_begin()
    for epoch, logs in enumerate(epoch_logs(0.5, 0.25)):
        callback.on_epoch_end(epoch, logs)
        assert [row["loss"] for row in rows(path)] == ["0.5", "0.25"][: epoch + 1]
    callback.on_train_end()
    assert callback._file is None


def test_append_continues_a_file_under_its_header(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    drive(CSVLogger(path), FakeModel(), epoch_logs(0.5, 0.25))
    drive(CSVLogger(path, append=True), FakeModel(), epoch_logs(0.125), initial_epoch=2)
    assert [row["epoch"] for row in rows(path)] == ["0", "1", "2"]
    assert path.read_text().count("epoch") == 1
    drive(CSVLogger(path), FakeModel(), epoch_logs(0.0625))  # append=False starts anew
    assert [row["loss"] for row in rows(path)] == ["0.0625"]


def test_append_to_a_missing_file_writes_the_header(tmp_path: Path) -> None:
    path = tmp_path / "new" / "log.csv"
    path.parent.mkdir()
    drive(CSVLogger(path, append=True), FakeModel(), epoch_logs(0.5))
    assert path.read_text().splitlines()[0] == "epoch,accuracy,learning_rate,loss"


def test_separator(tmp_path: Path) -> None:
    path = tmp_path / "log.tsv"
    drive(CSVLogger(path, separator="\t"), FakeModel(), [{"loss": 0.5, "val_loss": 0.75}])
    assert path.read_text() == "epoch\tloss\tval_loss\n0\t0.5\t0.75\n"


def test_a_log_that_appears_later_adds_its_column(tmp_path: Path) -> None:
    # validation_freq=2: val_loss only at odd epochs
    path = tmp_path / "log.csv"
    logs = [{"loss": 0.5}, {"loss": 0.25, "val_loss": 0.3}, {"loss": 0.125}]
    drive(CSVLogger(path), FakeModel(), logs)
    assert path.read_text().splitlines() == [
        "epoch,loss,val_loss",
        "0,0.5,NA",
        "1,0.25,0.3",
        "2,0.125,NA",
    ]


def test_a_restart_drops_the_rows_of_the_epochs_it_repeats(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    first = CSVLogger(path)
    model = FakeModel()
    drive(first, model, epoch_logs(0.5, 0.25), end=False)
    checkpoint.save(first.state_dict(), tmp_path / "backup.pt")  # backed up after epoch 1
    drive(first, model, epoch_logs(0.2), initial_epoch=2, begin=False, end=False)  # then killed
    first._close()
    assert len(rows(path)) == 3

    second = CSVLogger(path)
    attach(second, model)
    second.on_train_begin()
    second.load_state_dict(torch.load(tmp_path / "backup.pt", weights_only=True))
    drive(second, model, epoch_logs(0.125, 0.0625), initial_epoch=2, begin=False)
    assert [row["epoch"] for row in rows(path)] == ["0", "1", "2", "3"]
    assert [row["loss"] for row in rows(path)] == ["0.5", "0.25", "0.125", "0.0625"]


def test_a_restart_before_the_first_row_keeps_an_appended_file(tmp_path: Path) -> None:
    path = tmp_path / "log.csv"
    drive(CSVLogger(path), FakeModel(), epoch_logs(0.5))
    first = CSVLogger(path, append=True)
    attach(first, FakeModel())
    first.on_train_begin()
    state = first.state_dict()  # backed up in the middle of the first epoch
    second = CSVLogger(path, append=True)
    attach(second, FakeModel())
    second.on_train_begin()
    second.load_state_dict(state)
    drive(second, FakeModel(), epoch_logs(0.25), initial_epoch=1, begin=False)
    assert [row["loss"] for row in rows(path)] == ["0.5", "0.25"]


def test_only_the_process_that_writes_checkpoints_writes(tmp_path: Path) -> None:
    drive(CSVLogger(tmp_path / "log.csv"), FakeModel(should_checkpoint=False), epoch_logs(0.5))
    assert not (tmp_path / "log.csv").exists()


def test_bad_arguments_are_named() -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"filename": ""}, r"filename is empty"),
        ({"filename": "x.csv", "separator": ";;"}, r"separator=';;'"),
    ]
    for arguments, message in cases:
        with pytest.raises(ValueError, match=message):
            CSVLogger(**arguments)  # type: ignore[arg-type]


# -- in a real fit ---------------------------------------------------------------------------------
@pytest.mark.parametrize("num_replicas", [1, 2])
def test_fit_writes_what_history_has(tmp_path: Path, num_replicas: int) -> None:
    path = tmp_path / "training.csv"
    _, history = fit_linear([CSVLogger(path)], epochs=3, num_replicas=num_replicas)
    written = rows(path)
    assert list(written[0]) == ["epoch", "learning_rate", "loss", "mae", "val_loss", "val_mae"]
    assert [int(row["epoch"]) for row in written] == history.epoch == [0, 1, 2]
    for name, values in history.history.items():
        assert [float(row[name]) for row in written] == values


def test_fit_with_validation_every_other_epoch(tmp_path: Path) -> None:
    path = tmp_path / "training.csv"
    fit_linear([CSVLogger(path)], epochs=3, validation_freq=2)
    assert [row["val_loss"] == "NA" for row in rows(path)] == [True, False, True]


def test_fit_resumed_by_backup_and_restore_logs_each_epoch_once(tmp_path: Path) -> None:
    path = tmp_path / "training.csv"
    _, expected = fit_linear([CSVLogger(path)], epochs=3)
    expected_rows = path.read_text()
    path.unlink()
    backup = BackupAndRestore(tmp_path / "backup", save_freq=3)
    logger = CSVLogger(path)
    # 4 batches an epoch; the crash after batch 10 (epoch 2) comes after the backup of batch 9
    with pytest.raises(Crash):
        fit_linear([logger, CrashAt(10), backup], epochs=3)
    logger.on_train_end()  # the file a killed process would have left open
    assert [row["epoch"] for row in rows(path)] == ["0", "1"]
    _, history = fit_linear([CSVLogger(path), backup], epochs=3)
    assert path.read_text() == expected_rows
    assert history.history == expected.history
