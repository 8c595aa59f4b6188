"""ProgbarLogger: Keras's progress lines, drawn by tqdm; nothing at verbose=0."""

from __future__ import annotations

import re

import pytest
import torch

import mirrored
from mirrored.callbacks.progbar_logger import format_logs
from tests.reference_loops import make_mlp


def fit(verbose: int) -> None:
    x, y = torch.randn(100, 12), torch.randint(0, 5, (100,))
    model = mirrored.Model(make_mlp())
    model.compile(
        optimizer="adam",
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    model.fit(x, y, batch_size=16, epochs=2, verbose=verbose, validation_data=(x, y))
    model.evaluate(x, y, batch_size=16, verbose=verbose)


def test_verbose_2_prints_one_line_per_epoch(capsys: pytest.CaptureFixture[str]) -> None:
    fit(2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Epoch 1/2" and lines[2] == "Epoch 2/2"
    pattern = r"7/7 - \d+s \d+(ms|us)/step - loss: \d\.\d{4} - accuracy: \d\.\d{4} - val_loss: "
    assert re.match(pattern, lines[1]), lines[1]
    assert "learning_rate: 1.0000e-03" in lines[1]
    assert re.match(r"7/7 - \d+s .* - loss: \d\.\d{4} - accuracy: ", lines[4]), lines[4]
    assert len(lines) == 5


def test_verbose_1_draws_a_bar(capsys: pytest.CaptureFixture[str]) -> None:
    fit(1)
    out = capsys.readouterr().out
    assert "Epoch 1/2" in out
    assert re.search(r"7/7 \[=+\] - \d+s \d+(ms|us)/step - loss: \d\.\d{4}", out), out


def test_verbose_0_prints_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    fit(0)
    assert capsys.readouterr().out == ""


def test_format_logs_as_keras() -> None:
    assert format_logs({"loss": 1.41, "lr": 1e-5, "num_examples": 64}) == (
        " - loss: 1.4100 - lr: 1.0000e-05"
    )
