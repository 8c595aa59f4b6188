"""SIGTERM during fit with BackupAndRestore: a backup at the next step boundary, a clean exit
with code 143, and a resume that loses no step."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import mirrored
from mirrored import checkpoint
from tests.callbacks.test_backup_and_restore import AfterBatches, assert_identical, run

ROOT = Path(__file__).resolve().parents[2]


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class SigtermAt(AfterBatches):
    """Sends this process SIGTERM at the end of the given training batch, as a scheduler
    would."""

    def __init__(self, after_batches: int) -> None:
        super().__init__(after_batches, _terminate)


@pytest.mark.parametrize(("save_freq", "after"), [("epoch", 17), (4, 29)])
def test_sigterm_backs_up_at_the_next_step_and_the_resume_loses_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], save_freq: Any, after: int
) -> None:
    expected, expected_history = run(2, "arrays", [])
    handler = signal.getsignal(signal.SIGTERM)
    backup = mirrored.callbacks.BackupAndRestore(tmp_path, save_freq=save_freq)
    with pytest.raises(mirrored.Preempted) as raised:
        run(2, "arrays", [SigtermAt(after), backup])
    assert raised.value.code == mirrored.Preempted.EXIT_CODE == 143
    assert signal.getsignal(signal.SIGTERM) is handler  # torch's, pytest's: as it was
    saved = checkpoint.load(backup.path)["progress"]
    assert (saved["epoch"], saved["step"]) == divmod(after, 13)  # 13 batches an epoch
    where = (
        f"backed up to {str(backup.path)!r} at epoch {saved['epoch'] + 1}, batch {saved['step']}"
    )
    assert where in capsys.readouterr().err
    actual, history = run(2, "arrays", [backup])
    assert_identical(expected, actual)
    assert history == expected_history


def test_without_a_backup_sigterm_ends_the_program_as_usual(tmp_path: Path) -> None:
    """Nothing would back up: fit does not hold the signal back."""
    program = textwrap.dedent(
        """
        import sys
        sys.path[:0] = [sys.argv[1]]
        from tests.callbacks.test_backup_and_restore import run
        from tests.callbacks.test_preemption import SigtermAt
        run(1, "arrays", [SigtermAt(3)])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program, str(ROOT)], cwd=ROOT, timeout=120, capture_output=True
    )
    assert done.returncode == -signal.SIGTERM, done.stderr.decode()[-2000:]


def test_a_custom_loop_watches_with_the_same_flag() -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with (
        mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy,
        mirrored.PreemptionWatcher() as watcher,
    ):
        assert not watcher.requested(strategy)
        os.kill(os.getpid(), signal.SIGTERM)
        assert watcher.requested(strategy)
        assert watcher.received is signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler
