"""A worker killed with SIGKILL under ``mirrored launch --max-restarts``: the job restarts,
BackupAndRestore resumes it, and it ends with exactly the weights of an uninterrupted run."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multiprocess.spawn import (
    REPO,
    assert_all_succeeded,
    run_workers,
    start_process,
    worker_env,
)

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _launch(out: Path, backup_dir: Path) -> subprocess.Popen[str]:
    env = worker_env(0, 1, 0, 1, "torchrun")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name)
    command = [sys.executable, "-m", "mirrored.launch.launcher", "--nproc-per-node", "2"]
    command += ["--max-restarts", "3", str(REPO / "tests" / "multiprocess" / "jobs.py")]
    return start_process([*command, "backup", str(out), str(backup_dir)], env).process


def _pid_once_started(marker: Path, launcher: subprocess.Popen[str]) -> int:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and launcher.poll() is None:
        if marker.exists() and (text := marker.read_text()):
            return int(text)
        time.sleep(0.02)
    raise AssertionError(f"{marker.name} never appeared; launcher exited {launcher.poll()}")


def test_sigkill_under_the_launcher_resumes_to_the_uninterrupted_weights(tmp_path: Path) -> None:
    reference_dir = tmp_path / "reference"
    reference_dir.mkdir()
    assert_all_succeeded(
        run_workers("backup", reference_dir, args=[str(tmp_path / "reference_backup")])
    )
    out, backup_dir = tmp_path / "resumed", tmp_path / "backup"
    out.mkdir()
    launcher = _launch(out, backup_dir)
    try:
        chooser = random.Random(0)
        for attempt in range(2):  # kill worker 1, then worker 0, each mid-epoch
            rank = 1 - attempt
            pid = _pid_once_started(out / f"started{rank}.{attempt}", launcher)
            time.sleep(chooser.uniform(0.0, 0.3))
            os.kill(pid, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    assert launcher.returncode == 0, output
    assert (out / "started0.2").exists(), "the job was not restarted twice"
    expected = torch.load(reference_dir / "rank0.pt", weights_only=True)
    for rank in range(2):
        actual = torch.load(out / f"rank{rank}.pt", weights_only=True)
        for name, value in expected["weights"].items():
            assert torch.equal(actual["weights"][name], value), name
        assert actual["history"] == expected["history"]
    assert not (backup_dir / "backup.pt").exists()


def test_sigterm_on_one_worker_backs_up_every_worker_at_the_same_step(tmp_path: Path) -> None:
    """Any worker's SIGTERM counts for all: both back up after the same step and exit 143;
    started again, they end with the uninterrupted run's weights."""
    args = [str(tmp_path / "uninterrupted"), "1", "0"]
    assert_all_succeeded(run_workers("preempted", tmp_path, 2, args=args, timeout=120))
    expected = torch.load(tmp_path / "rank0.pt", weights_only=True)
    backup_dir = tmp_path / "backup"
    workers = run_workers("preempted", tmp_path, 2, args=[str(backup_dir), "1", "17"], timeout=120)
    assert [w.returncode for w in workers] == [143, 143], [w.output[-1500:] for w in workers]
    assert "backed up to" in workers[0].output and "at epoch 2, batch 4" in workers[0].output
    assert_all_succeeded(
        run_workers("preempted", tmp_path, 2, args=[str(backup_dir), "1", "0"], timeout=120)
    )
    for rank in (0, 1):
        resumed = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        for name, value in expected["weights"].items():
            assert torch.equal(resumed["weights"][name], value), (rank, name)
        assert resumed["history"] == expected["history"]
