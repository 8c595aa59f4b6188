"""The ``mirrored`` command."""

from __future__ import annotations

import importlib
import sys

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


@pytest.mark.parametrize("example", list(cli.EXAMPLES))
def test_every_examples_help_names_it_and_describes_it_whole(
    example: str, capsys: pytest.CaptureFixture[str]
) -> None:
    command_line = list(sys.argv)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", example, "--help"])
    assert exit_info.value.code == 0
    assert sys.argv == command_line  # given back after the example ran
    out = capsys.readouterr().out
    assert out.startswith(f"usage: mirrored train {example} [-h]"), out
    doc = importlib.import_module(f"mirrored.examples.{example}").__doc__
    first_paragraph = " ".join(doc.split("\n\n")[0].replace("``", "").split())
    assert first_paragraph.endswith((".", ")")), first_paragraph
    assert first_paragraph in " ".join(out.split())


def test_a_usage_error_names_the_example(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "mobilenet", "--epochs", "many"])
    assert capsys.readouterr().err.startswith("usage: mirrored train mobilenet [-h]")
