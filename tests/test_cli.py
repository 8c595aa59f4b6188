"""The ``mirrored`` command."""

from __future__ import annotations

import pytest

from mirrored import cli


def test_devices_lists_physical_and_logical(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "physical  /physical_device:CPU:0" in out or "physical" in out
    assert out.count("logical   /device:CPU:") == 4  # the test session's four logical CPUs


def test_train_an_unknown_example(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "resnet"]) == 2
    assert "unknown example 'resnet'" in capsys.readouterr().err


def test_train_passes_flags_to_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "mnist_mlp", "--help"])
    assert exit_info.value.code == 0
    assert "--logical-devices" in capsys.readouterr().out


def test_train_runs_mnist_mlp(capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(["train", "mnist_mlp", "--logical-devices", "2", "--epochs", "1", "--verbose", "0"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("test loss: ") and " - test accuracy: " in last
