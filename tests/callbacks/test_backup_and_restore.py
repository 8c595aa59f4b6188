"""BackupAndRestore: a run killed at any moment and started again ends with exactly the weights of
an uninterrupted run."""

from __future__ import annotations

import copy
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored import checkpoint
from tests.multiprocess.spawn import (
    Worker,
    assert_all_succeeded,
    program_env,
    start_process,
    wait_workers,
)

JOB = Path(__file__).with_name("backup_job.py")


class Crash(Exception):
    pass


class AfterBatches(mirrored.callbacks.Callback):
    """Calls ``action`` at the end of the given training batch (counted across epochs)."""

    def __init__(self, after_batches: int, action: Callable[[], None]) -> None:
        super().__init__()
        self.remaining = after_batches
        self.action = action

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            self.action()


def _crash() -> None:
    raise Crash


class CrashAt(AfterBatches):
    """Raises ``Crash`` after the given number of training batches."""

    def __init__(self, after_batches: int) -> None:
        super().__init__(after_batches, _crash)


def dataset() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(203, 12, generator=generator), torch.randint(
        0, 5, (203,), generator=generator
    )


def run(
    num_replicas: int,
    data: str,
    callbacks: list[mirrored.callbacks.Callback],
    steps_per_execution: int = 1,
) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """A fresh 'process': same seed, same model init, then fit for 3 epochs."""
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))
    x, y = dataset()
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        with strategy.scope():
            model = mirrored.Model(module)
            model.compile(
                optimizer=mirrored.optimizers.Adam(
                    mirrored.optimizers.schedules.PolynomialDecay(1e-2, 39, 1e-4)
                ),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=steps_per_execution,
            )
        early = mirrored.callbacks.EarlyStopping(monitor="loss", patience=5)
        if data == "arrays":
            history = model.fit(
                x, y, batch_size=16, epochs=3, verbose=0, callbacks=[early, *callbacks]
            )
        elif data == "loader":
            loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
            history = model.fit(loader, epochs=3, verbose=0, callbacks=[early, *callbacks])
        else:  # a one-shot generator, 10 batches per epoch

            def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
                for _ in range(3):
                    for start in range(0, 160, 16):
                        yield x[start : start + 16], y[start : start + 16]

            history = model.fit(
                batches(), steps_per_epoch=10, epochs=3, verbose=0, callbacks=[early, *callbacks]
            )
        return model.state_dict(), history.history


def assert_identical(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    for name, value in expected.items():
        assert torch.equal(actual[name], value), f"{name} differs from the uninterrupted run"


@pytest.mark.parametrize(
    ("num_replicas", "data", "save_freq", "crash_after", "steps_per_execution"),
    [
        (2, "arrays", 1, 17, 1),  # mid-epoch (13 batches per epoch)
        (2, "loader", 4, 30, 1),  # shuffling DataLoader, backup a few batches back
        (1, "arrays", "epoch", 20, 1),  # epoch backups: redo part of an epoch
        (3, "arrays", 2, 10, 2),  # several batches per execution (7 hooks an epoch)
        (2, "generator", 3, 14, 1),  # a one-shot iterator continues across epochs
    ],
)
def test_resume_after_a_crash_gives_the_uninterrupted_weights(
    tmp_path: Path,
    num_replicas: int,
    data: str,
    save_freq: Any,
    crash_after: int,
    steps_per_execution: int,
) -> None:
    expected, expected_history = run(num_replicas, data, [], steps_per_execution)
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=save_freq)
    with pytest.raises(Crash):
        run(num_replicas, data, [CrashAt(crash_after), backup], steps_per_execution)
    assert backup.path.exists()
    actual, history = run(num_replicas, data, [backup], steps_per_execution)
    assert_identical(expected, actual)
    assert history == expected_history  # History and the epoch's metrics were restored too
    assert not backup.path.exists(), "a finished run deletes its backup"


def test_backups_restore_with_another_replica_count(tmp_path: Path) -> None:
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(3, "arrays", [CrashAt(20), backup])
    saved = checkpoint.load(backup.path)
    # The crash came after the 20th batch, before its backup: 13 + 6 batches are backed up.
    assert saved["progress"] == {"epoch": 1, "step": 6, "consumed": 0}
    weights, history = run(2, "arrays", [backup])  # resumes on 2 replicas
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert len(history["loss"]) == 3  # epoch 1 was finished, not restarted or skipped


def test_a_failed_write_keeps_the_last_backup(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(2, "arrays", [CrashAt(5), backup])
    before = backup.path.read_bytes()

    def broken_save(obj: Any, file: Any) -> None:
        file.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        run(2, "arrays", [backup])
    assert backup.path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["backup.pt"], "temporary file left"


def test_a_backup_of_something_else_is_refused(tmp_path: Path) -> None:
    torch.save({"weights": torch.zeros(1)}, tmp_path / "backup.pt")
    with pytest.raises(ValueError, match="not a mirrored backup"):
        run(1, "arrays", [mirrored.callbacks.BackupAndRestore(tmp_path)])


def test_a_damaged_backup_is_refused_naming_the_part(tmp_path: Path) -> None:
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(1, "arrays", [CrashAt(3), backup])
    saved = checkpoint.load(backup.path)
    saved["progress"] = {"epoch": 0}
    checkpoint.save(saved, backup.path)
    with pytest.raises(ValueError, match=r"damaged backup: \['progress'\]"):
        run(1, "arrays", [backup])


def _damage(saved: dict[str, Any], part: str) -> None:
    """Break one part of a backup the way a bad disk or an edited file would."""
    if part == "weights":
        saved["training"]["model"]["0.weight"] = torch.zeros(3, 3)
    elif part == "optimizer":
        saved["training"]["optimizer"]["param_groups"][0]["nesterov"] = True
    elif part == "optimizer-kind":
        for group in saved["training"]["optimizer"]["param_groups"]:  # as SGD would save it
            del group["betas"], group["eps"]
    elif part in ("rng", "epoch_rng"):
        del saved[part]["python"]["version"]
    elif part == "metrics":
        saved["metrics"] = saved["metrics"][:1]
    elif part == "callbacks":
        saved["callbacks"][1]["state"] = {"best": "a string"}


@pytest.mark.parametrize(
    ("part", "named"),
    [
        ("weights", "0.weight"),
        ("optimizer", "nesterov"),
        ("optimizer-kind", "group 0 has no ['betas', 'eps']"),
        ("rng", "'rng' is a damaged random state"),
        ("epoch_rng", "'epoch_rng' is a damaged random state"),
        ("metrics", "'metrics' does not fit"),
        ("callbacks", "EarlyStopping"),
    ],
)
def test_each_damaged_part_of_a_backup_restores_nothing(
    tmp_path: Path, part: str, named: str
) -> None:
    """Every part is checked before anything changes (a model that does not fit the backup
    too): the weights, the optimizer, the step count, the callbacks' states and torch's random
    state stay as they were."""
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(2, "arrays", [CrashAt(20), backup])  # mid-epoch: an epoch_rng is saved
    saved = checkpoint.load(backup.path)
    assert saved["callbacks"][1]["state"]["best"] is not None  # EarlyStopping's, after History
    _damage(saved, part)
    checkpoint.save(saved, backup.path)
    torch.manual_seed(1)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    early = mirrored.callbacks.EarlyStopping(monitor="loss", patience=5)
    fresh = early.state_dict()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        with strategy.scope():
            model = mirrored.Model(module)
            model.compile(
                optimizer="adam",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        optimizer = copy.deepcopy(model.optimizer.state_dict())
        random_state = torch.get_rng_state()
        with pytest.raises(ValueError, match=re.escape(named)):
            model.fit(*dataset(), batch_size=16, verbose=0, callbacks=[early, backup])
        assert early.state_dict() == fresh
        assert_identical(weights, model.state_dict())
        assert model.optimizer.state_dict() == optimizer
        assert model._progress.iterations == 0
        assert torch.equal(torch.get_rng_state(), random_state)


def test_a_restore_removes_what_a_write_killed_with_the_last_run_left(tmp_path: Path) -> None:
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(1, "arrays", [CrashAt(3), backup])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    machine = checkpoint._machine()
    (tmp_path / f".backup.pt.{machine}.{ended.pid}.0a1b2c3d.tmp").write_bytes(b"half a backup")

    listings: list[list[str]] = []

    class Listing(mirrored.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            listings.append(sorted(p.name for p in tmp_path.iterdir()))

    run(1, "arrays", [Listing(), backup])
    assert listings[0] == ["backup.pt"]  # restored, before any new backup was written


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="save_freq"):
        mirrored.callbacks.BackupAndRestore("x", save_freq=0)
    with pytest.raises(ValueError, match="save_freq"):
        mirrored.callbacks.BackupAndRestore("x", save_freq="batch")
    with pytest.raises(ValueError, match="backup_dir"):
        mirrored.callbacks.BackupAndRestore("")


def _job(backup_dir: Path, out: Path) -> Worker:
    return start_process([sys.executable, str(JOB), str(backup_dir), str(out), "2"], program_env())


@pytest.mark.slow
def test_sigkill_at_any_moment_then_rerun_ends_with_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    reference = tmp_path / "reference.pt"
    assert_all_succeeded(wait_workers([_job(tmp_path / "reference_backup", reference)], 240))

    backup_dir, out = tmp_path / "backup", tmp_path / "resumed.pt"
    backup_file = backup_dir / "backup.pt"
    chooser = random.Random(0)
    kills = 0
    for _ in range(3):
        last_backup = backup_file.stat().st_mtime_ns if backup_file.exists() else None
        job = _job(backup_dir, out)
        deadline = time.monotonic() + 120
        # Wait until this run has written a backup of its own (it has made progress).
        while job.process.poll() is None and time.monotonic() < deadline:
            if backup_file.exists() and backup_file.stat().st_mtime_ns != last_backup:
                break
            time.sleep(0.01)
        time.sleep(chooser.uniform(0.0, 0.4))  # mid-epoch, mid-step or mid-backup
        if job.process.poll() is None:
            os.kill(job.process.pid, signal.SIGKILL)
            kills += 1
        wait_workers([job], timeout=60)
    assert kills >= 2, "the job finished before it could be killed; slow it down"
    assert backup_file.exists()
    assert_all_succeeded(wait_workers([_job(backup_dir, out)], 240))

    expected = torch.load(reference, weights_only=True)
    actual = torch.load(out, weights_only=True)
    assert_identical(expected["weights"], actual["weights"])
    assert actual["history"] == expected["history"]
    assert not backup_file.exists()
    assert list(backup_dir.iterdir()) == [], "a killed write's temporary file was left"


def test_save_freq_counts_batches_not_executions(tmp_path: Path) -> None:
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=4, delete_checkpoint=False)
    with pytest.raises(Crash):
        run(2, "arrays", [CrashAt(3), backup], steps_per_execution=4)  # 3 executions: 12 batches
    assert checkpoint.load(backup.path)["progress"]["step"] == 8


def test_weights_that_are_not_finite_are_never_backed_up(tmp_path: Path) -> None:
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    model = mirrored.Model(nn.Linear(4, 1))
    model.compile(optimizer=mirrored.optimizers.SGD(learning_rate=1e38), loss="mse")
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=1)
    with pytest.warns(UserWarning, match="not finite"):
        model.fit(x * 1e3, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    if backup.path.exists():
        assert checkpoint.all_finite(checkpoint.load(backup.path)["training"]["model"])
