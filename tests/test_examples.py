"""The examples run as users run them: as scripts, in a fresh process."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_custom_training_loop_learns_the_digits():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "custom_training_loop.py"),
            "--devices",
            "3",
            "--epochs",
            "4",
            "--batch-size",
            "50",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    epochs = re.findall(
        r"train loss ([\d.]+) acc ([\d.]+)  test loss ([\d.]+) acc ([\d.]+)", result.stdout
    )
    assert len(epochs) == 4, result.stdout
    losses = [float(e[0]) for e in epochs]
    assert losses == sorted(losses, reverse=True), "training loss must fall every epoch"
    assert float(epochs[-1][3]) > 0.85, result.stdout


def test_custom_training_loop_rejects_bad_arguments():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "custom_training_loop.py"), "--devices", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--devices: 0: expected a positive integer" in result.stderr


def test_an_example_run_as_a_script_is_named_by_its_file():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "mobilenet.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert result.stdout.startswith("usage: mobilenet.py [-h]"), result.stdout


def test_the_quick_start_runs_as_written():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    quick_start = page.split("## Quick start", 1)[1]
    snippet = quick_start.split("```python\n", 1)[1].split("```", 1)[0]
    result = subprocess.run(
        [sys.executable, "-c", snippet], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["epoch 1", "epoch 2", "epoch 3"], lines
    assert all(re.fullmatch(r"epoch \d: last batch's loss \d\.\d{4}", line) for line in lines)
