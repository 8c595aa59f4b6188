"""The ``mirrored`` command."""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import sys
from collections.abc import Callable, Iterator
from importlib import metadata

import pytest

import mirrored
from mirrored import cli
from mirrored.launch import launcher


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


def test_version_is_the_installed_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"mirrored {mirrored.__version__}\n"
    assert mirrored.__version__ == metadata.version("mirrored")


@pytest.mark.parametrize("command", [[], ["devices"], ["train"], ["launch"]])
def test_help_is_plain_text(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """No reStructuredText markup from a docstring."""
    with pytest.raises(SystemExit):
        cli.main([*command, "--help"])
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {' '.join(['mirrored', *command])} [-h]"), out
    assert "``" not in out and ":func:" not in out, out


def test_train_help_lists_the_examples_one_per_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["train", "--help"])
    lines = capsys.readouterr().out.splitlines()
    listed = lines[lines.index("examples:") + 1 :]
    assert [line.split(maxsplit=1) for line in listed] == [
        [name, description] for name, description in cli.EXAMPLES.items()
    ]
    assert all(len(line) <= 100 for line in listed), listed


class _Parsed(Exception):
    """Raised instead of parsing, with the parser that was asked to parse."""


def _parser_of(
    call: Callable[[], object], monkeypatch: pytest.MonkeyPatch
) -> argparse.ArgumentParser:
    def capture(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise _Parsed(self)

    with monkeypatch.context() as patch:
        patch.setattr(argparse.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Parsed) as caught:
            call()
    parser = caught.value.args[0]
    assert isinstance(parser, argparse.ArgumentParser)
    return parser


def _with_subcommands(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subcommand in action.choices.values():
                yield from _with_subcommands(subcommand)


def _shows_value(shown: str, value: str) -> bool:
    """``value`` after the word "default", whole: "(default: 3)" does not show 30, 0.3 or 3.5."""
    return (
        re.search(rf"(?i:\bdefault\b).*?(?<![\w.]){re.escape(value)}(?!\w|\.\d)", shown, re.S)
        is not None
    )


def _undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """Options whose help is missing or, as ``--help`` shows it, does not give the default.

    An option with a value by default shows that value as ``%(default)s`` prints it; a flag, or
    an option without a value by default, says in words what happens without it.
    """
    formatter = parser._get_formatter()
    problems = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        name = "/".join(action.option_strings) or action.dest
        if not action.help:
            problems.append(f"{name}: no help")
            continue
        if not action.option_strings:
            continue
        shown = formatter._expand_help(action)
        default = action.default
        if default is None or default is False or default == argparse.SUPPRESS:
            if "default" not in shown.lower():
                problems.append(f"{name}: does not say what happens without it: {shown!r}")
        elif not _shows_value(shown, str(default)):
            problems.append(f"{name}: default {str(default)!r} not shown in {shown!r}")
    return problems


def test_every_option_has_help_that_shows_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``mirrored``, its subcommands, the launcher's own command and every example's flags."""
    parsers = {
        parser.prog: parser
        for parser in _with_subcommands(_parser_of(lambda: cli.main(["devices"]), monkeypatch))
    }
    parsers["python -m mirrored.launch.launcher"] = _parser_of(
        lambda: launcher.main([]), monkeypatch
    )
    for example in cli.EXAMPLES:
        module = importlib.import_module(f"mirrored.examples.{example}")
        parser = _parser_of(functools.partial(module.parse_args, []), monkeypatch)
        parsers[f"mirrored train {example}"] = parser
    assert len(parsers) == 5 + len(cli.EXAMPLES)
    assert sum(len(parser._actions) for parser in parsers.values()) > 100
    problems = [f"{name}: {p}" for name, parser in parsers.items() for p in _undocumented(parser)]
    assert not problems, "\n".join(problems)
