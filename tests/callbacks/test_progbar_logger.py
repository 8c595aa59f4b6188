"""ProgbarLogger: Keras's progress lines, a live bar only on terminals; nothing at verbose=0."""

from __future__ import annotations

import io
import os
import re
import struct
import sys
import types
from collections.abc import Callable, Iterator

import pytest
import torch

import mirrored
from mirrored.callbacks.progbar_logger import format_logs
from tests.reference_loops import make_mlp

# 100 examples in batches of 16: 7 steps an epoch.
EPOCH_LINE = r"7/7 \[={30}\] - \d+s \d+(ms|us)/step - loss: \d\.\d{4} - accuracy: \d\.\d{4}"
FULL_EPOCH_LINE = EPOCH_LINE + r" - val_loss: \d\.\d{4} - val_accuracy: \d\.\d{4} - learning_rate: "


def fit(verbose: int, evaluate: bool = True) -> None:
    x, y = torch.randn(100, 12), torch.randint(0, 5, (100,))
    model = mirrored.Model(make_mlp())
    model.compile(
        optimizer="adam",
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=verbose, validation_data=(x, y))
    if evaluate:
        model.evaluate(x, y, batch_size=16, verbose=verbose)


class FakeTerminal(io.StringIO):
    """Keeps what is written; says it is a terminal, whose size is that of ``tty`` (a
    pseudo-terminal the test sized), for every way of asking (ioctl, os.get_terminal_size)."""

    def __init__(self, tty: int) -> None:
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._tty


@pytest.fixture
def terminal(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[int, int], FakeTerminal]]:
    """``terminal(columns, lines)`` makes sys.stdout a terminal of that size."""
    termios = pytest.importorskip("termios")
    fcntl = pytest.importorskip("fcntl")
    opened: list[int] = []

    def make(columns: int, lines: int) -> FakeTerminal:
        controller, tty = os.openpty()
        opened.extend((controller, tty))
        fcntl.ioctl(tty, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        stream = FakeTerminal(tty)
        monkeypatch.setattr(sys, "stdout", stream)
        return stream

    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    yield make
    for fd in opened:
        os.close(fd)


def shown_lines(written: str) -> list[str]:
    """The lines a terminal ends up showing: each line as its last ``\\r`` redraw left it."""
    return [line.split("\r")[-1].rstrip() for line in written.split("\n")]


def overdrawn(written: str) -> list[str]:
    """The live states of lines, each drawn over by a later ``\\r``."""
    return [piece for line in written.split("\n") for piece in line.split("\r")[:-1] if piece]


def test_verbose_2_prints_one_line_per_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    fit(2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    pattern = r"7/7 - \d+s \d+(ms|us)/step - loss: \d\.\d{4} - accuracy: \d\.\d{4} - val_loss: "
    assert re.match(pattern, lines[1]), lines[1]
    assert "learning_rate: 1.0000e-03" in lines[1]
    assert re.match(r"7/7 - \d+s .* - loss: \d\.\d{4} - accuracy: ", lines[4]), lines[4]
    assert len(lines) == 5


def test_verbose_1_into_a_pipe_prints_one_line_per_epoch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Keras's rule where the output is not a terminal: no ``\\r``, no partial bars."""
    pipe = io.StringIO()
    monkeypatch.setattr(sys, "stdout", pipe)
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    fit(1)
    written = pipe.getvalue()
    assert "\r" not in written
    lines = written.splitlines()
    assert len(lines) == 5, lines
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    for line in (lines[1], lines[3]):
        assert re.fullmatch(FULL_EPOCH_LINE + r"1\.0000e-03", line), line
    assert re.fullmatch(EPOCH_LINE, lines[4]), lines[4]


def test_a_notebook_redraws_its_bar(monkeypatch: pytest.MonkeyPatch) -> None:
    """Jupyter's stdout is no terminal but honours ``\\r`` (Keras draws bars there too)."""
    notebook = io.StringIO()
    monkeypatch.setattr(sys, "stdout", notebook)
    monkeypatch.setitem(sys.modules, "ipykernel", types.ModuleType("ipykernel"))
    fit(1, evaluate=False)
    assert "\r" in notebook.getvalue()
    assert re.fullmatch(FULL_EPOCH_LINE + r".*", shown_lines(notebook.getvalue())[-2])


def test_on_a_terminal_the_epoch_line_is_never_cut(
    terminal: Callable[[int, int], FakeTerminal],
) -> None:
    """Only the live bar is fitted to the width; the epoch's line is printed whole."""
    screen = terminal(120, 40)
    fit(1, evaluate=False)
    written = screen.getvalue()
    lines = [line for line in shown_lines(written) if line]
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    assert len(lines) == 4, lines
    for line in (lines[1], lines[3]):
        assert len(line) > 120
        assert re.fullmatch(FULL_EPOCH_LINE + r"1\.0000e-03", line), line
    live = overdrawn(written)
    assert live and all(len(piece) <= 120 for piece in live), live


def test_a_terminal_that_reports_no_size_gets_80_columns(
    terminal: Callable[[int, int], FakeTerminal],
) -> None:
    """A pseudo-terminal never sized (0 x 0: `script`, some CI runners and containers)."""
    screen = terminal(0, 0)
    fit(1, evaluate=False)
    written = screen.getvalue()
    live = overdrawn(written)
    assert any(piece.startswith("0/7 [" + "." * 30 + "]") for piece in live), live
    assert all(len(piece) <= 80 for piece in live), live
    lines = [line for line in shown_lines(written) if line]
    assert re.fullmatch(FULL_EPOCH_LINE + r"1\.0000e-03", lines[1]), lines


def test_without_tqdm_a_terminal_gets_a_line_per_epoch(
    terminal: Callable[[int, int], FakeTerminal], monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = terminal(120, 40)
    monkeypatch.setitem(sys.modules, "tqdm", None)
    with pytest.warns(UserWarning, match="mirrored\\[progress\\]") as warned:
        fit(1, evaluate=False)
    assert len(warned) == 1  # once, not every epoch
    written = screen.getvalue()
    assert "\r" not in written
    lines = written.splitlines()
    assert len(lines) == 4, lines
    assert re.fullmatch(FULL_EPOCH_LINE + r"1\.0000e-03", lines[3]), lines[3]


def test_verbose_0_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    fit(0)
    assert capsys.readouterr().out == ""


def test_format_logs_as_keras() -> None:
    assert format_logs({"loss": 1.41, "lr": 1e-5, "num_examples": 64}) == (
        " - loss: 1.4100 - lr: 1.0000e-05"
    )
