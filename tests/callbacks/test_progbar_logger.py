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


def unwrapped(lines: list[str], width: int = 100) -> list[str]:
    """The lines as one line per epoch: a finished line that would pass ``width`` goes on in
    indented lines, each starting with a whole `` - name: value`` field."""
    assert all(len(line) <= width for line in lines), [line for line in lines if len(line) > width]
    joined: list[str] = []
    for line in lines:
        if re.match(r" +- ", line):
            joined[-1] += line[line.index(" - ") :]
        else:
            joined.append(line)
    return joined


def test_verbose_2_prints_one_line_per_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    fit(2)
    lines = unwrapped(capsys.readouterr().out.splitlines())
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
    lines = unwrapped(written.splitlines())
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
    lines = unwrapped([line for line in shown_lines(notebook.getvalue()) if line])
    assert re.fullmatch(FULL_EPOCH_LINE + r".*", lines[-1]), lines


def test_on_a_terminal_the_epoch_line_is_never_cut(
    terminal: Callable[[int, int], FakeTerminal],
) -> None:
    """The live bar is cut to the width; the epoch's line is printed whole, in lines of at
    most 100 columns broken between fields."""
    screen = terminal(120, 40)
    fit(1, evaluate=False)
    written = screen.getvalue()
    shown = [line for line in shown_lines(written) if line]
    lines = unwrapped(shown)
    assert len(shown) > len(lines)  # the 154 columns went on in a second line
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    assert len(lines) == 4, lines
    for line in (lines[1], lines[3]):
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
    lines = unwrapped([line for line in shown_lines(written) if line], width=80)
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
    lines = unwrapped(written.splitlines())
    assert len(lines) == 4, lines
    assert re.fullmatch(FULL_EPOCH_LINE + r"1\.0000e-03", lines[3]), lines[3]


def test_verbose_0_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    fit(0)
    assert capsys.readouterr().out == ""


def test_format_logs_as_keras() -> None:
    assert format_logs({"loss": 1.41, "lr": 1e-5, "num_examples": 64}) == (
        " - loss: 1.4100 - lr: 1.0000e-05"
    )


LONG_LOGS = {
    "loss": 1.0678,
    "accuracy": 0.6399,
    "top_5_accuracy": 0.9512,
    "val_loss": 0.6015,
    "val_accuracy": 0.8210,
    "val_top_5_accuracy": 0.9876,
    "learning_rate": 1e-4,
    "a_metric_whose_name_alone_is_wider_than_a_hundred_columns_" * 2: 0.5,
    "num_examples": 64,
}


def epoch_of(logs: dict[str, float], verbose: int = 2) -> str:
    """What a ProgbarLogger prints for one epoch of 226 steps ending with ``logs``."""
    logger = mirrored.callbacks.ProgbarLogger()
    logger.set_params({"verbose": verbose, "epochs": 1, "steps": 226})
    logger.on_epoch_begin(0)
    for batch in range(226):
        logger.on_train_batch_end(batch, {"loss": 1.0})
    logger.on_epoch_end(0, dict(logs))
    assert isinstance(sys.stdout, io.StringIO)
    return sys.stdout.getvalue()


@pytest.mark.parametrize("verbose", [1, 2])
def test_a_long_epoch_line_breaks_between_fields(
    verbose: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Lines of at most 100 columns, each after the first starting with a whole field under
    the bar; a field wider than that alone, whole, on its line."""
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.delitem(sys.modules, "ipykernel", raising=False)
    header, *lines = epoch_of(LONG_LOGS, verbose).splitlines()
    assert header == "Epoch 1/1"
    head = "226/226 [" + "=" * 30 + "]" if verbose == 1 else "226/226"
    fields = re.findall(r" - [^ ]+: [^ ]+", format_logs(LONG_LOGS))
    assert len(fields) == 8
    assert lines[0].startswith(head + " - ")
    widest = max(fields, key=len)
    for line in lines:
        assert len(line) <= 100 or line == " " * 7 + widest, line
    for line in lines[1:]:
        assert line.startswith(" " * 7 + " - "), line
    pieces = [piece for line in lines for piece in re.findall(r" - [^ ]+: [^ ]+", line)]
    assert pieces == fields  # every field whole, in order
    assert len(lines) >= 3
    (whole,) = unwrapped(lines, width=1000)
    timing = r" - \d+s \d+(ms|us)/step"
    assert re.fullmatch(re.escape(head) + timing + re.escape("".join(fields)), whole), whole


def test_a_narrow_terminal_gets_the_line_at_its_width(
    terminal: Callable[[int, int], FakeTerminal],
) -> None:
    screen = terminal(60, 40)
    logs = {k: v for k, v in LONG_LOGS.items() if len(k) < 30}
    epoch_of(logs, verbose=1)
    lines = [line for line in shown_lines(screen.getvalue()) if line]
    assert lines[0] == "Epoch 1/1"
    assert len(lines) > 3 and all(len(line) <= 60 for line in lines), lines
    assert unwrapped(lines[1:], 60)[0].endswith(format_logs(logs))


def test_a_callbacks_prints_come_after_the_epochs_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """As in tf.keras (TensorFlow's tutorial's PrintLR): "Epoch 1/2", what callbacks print as
    the epoch begins, the epoch's line, then what they print at its end."""

    def at_end(epoch: int, logs: dict[str, float]) -> None:
        print(f"Learning rate for epoch {epoch + 1} is {logs['learning_rate']}")

    print_lr = mirrored.callbacks.LambdaCallback(
        on_epoch_begin=lambda epoch, logs: print(f"begin {epoch + 1}"), on_epoch_end=at_end
    )
    x, y = torch.randn(100, 12), torch.randint(0, 5, (100,))
    model = mirrored.Model(make_mlp())
    model.compile(
        optimizer="adam",
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=2, callbacks=[print_lr])
    lines = unwrapped(capsys.readouterr().out.splitlines())
    for epoch in (1, 2):
        at = lines.index(f"Epoch {epoch}/2")
        assert lines[at + 1] == f"begin {epoch}", lines
        assert re.match(r"7/7 - \d+s .* - loss: ", lines[at + 2]), lines
        assert lines[at + 3] == f"Learning rate for epoch {epoch} is 0.001", lines
    assert len(lines) == 8, lines


def test_on_a_terminal_the_live_bar_starts_after_what_callbacks_print_as_an_epoch_begins(
    terminal: Callable[[int, int], FakeTerminal],
) -> None:
    """Keras's ``Epoch 1/2``, then ``Epoch 1: LearningRateScheduler setting ...``, then the bar,
    not a bar left half drawn above the callback's line."""
    screen = terminal(120, 40)
    x, y = torch.randn(100, 12), torch.randint(0, 5, (100,))
    model = mirrored.Model(make_mlp())
    model.compile(
        optimizer="sgd", loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    scheduler = mirrored.callbacks.LearningRateScheduler(lambda epoch, lr: lr, verbose=1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=1, callbacks=[scheduler])
    written = screen.getvalue()
    begins = written.index("Epoch 1: LearningRateScheduler setting learning rate")
    assert written.index("Epoch 1/1") < begins < written.index("0/7 [")
