"""TerminateOnNaN: stop (or raise) at the first training batch whose loss is NaN or infinite."""

from __future__ import annotations

import pytest
import torch

from mirrored.callbacks import Callback, TerminateOnNaN
from tests.callbacks.fakes import FakeModel, attach, fit_linear, linear_data


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_an_invalid_loss_stops_training(bad: float, capsys: pytest.CaptureFixture[str]) -> None:
    model = FakeModel()
    callback = TerminateOnNaN()
    attach(callback, model)
    callback.on_train_batch_end(2, {"loss": 1.0})
    assert not model.stop_training
    callback.on_train_batch_end(3, {"loss": bad})
    assert model.stop_training
    assert capsys.readouterr().out == "Batch 3: Invalid loss, terminating training\n"


def test_logs_without_a_loss_are_ignored() -> None:
    model = FakeModel()
    callback = TerminateOnNaN()
    attach(callback, model)
    callback.on_train_batch_end(0, {"accuracy": float("nan")})
    callback.on_train_batch_end(1, None)
    assert not model.stop_training


def test_raise_error_names_the_batch_and_the_value() -> None:
    model = FakeModel()
    callback = TerminateOnNaN(raise_error=True)
    attach(callback, model)
    with pytest.raises(FloatingPointError, match=r"the loss is nan at batch 7"):
        callback.on_train_batch_end(7, {"loss": float("nan")})
    assert not model.stop_training


# -- in a real fit ---------------------------------------------------------------------------------
class CountBatches(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, float] | None = None) -> None:
        self.batches += 1


def poisoned_data() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = linear_data()
    x[40] = float("nan")  # in the third batch of 16
    return x, y


def test_fit_stops_at_the_first_nan_batch() -> None:
    count = CountBatches()
    _, history = fit_linear(
        [count, TerminateOnNaN()],
        epochs=5,
        num_replicas=2,
        data=poisoned_data(),
        shuffle=False,
    )
    assert count.batches == 3
    assert history.epoch == [0]


def test_fit_raise_error_propagates() -> None:
    with pytest.raises(FloatingPointError, match=r"the loss is nan at batch 2"):
        fit_linear(
            [TerminateOnNaN(raise_error=True)], epochs=5, data=poisoned_data(), shuffle=False
        )
