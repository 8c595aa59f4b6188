"""LambdaCallback: plain functions as hooks, always given a logs dict; unknown hooks are refused."""

from __future__ import annotations

from typing import Any

import pytest

from mirrored.callbacks import LambdaCallback
from mirrored.callbacks.lambda_callback import HOOKS
from tests.callbacks.fakes import FakeModel, drive, fit_linear


def recorder(calls: list[tuple[Any, ...]], name: str) -> Any:
    return lambda *args: calls.append((name, *args))


def test_each_given_hook_is_called_with_its_arguments_and_a_logs_dict() -> None:
    calls: list[tuple[Any, ...]] = []
    callback = LambdaCallback(
        on_train_begin=recorder(calls, "train_begin"),
        on_epoch_begin=recorder(calls, "epoch_begin"),
        on_train_batch_begin=recorder(calls, "batch_begin"),
        on_train_batch_end=recorder(calls, "batch_end"),
        on_epoch_end=recorder(calls, "epoch_end"),
        on_train_end=recorder(calls, "train_end"),
    )
    drive(callback, FakeModel(), [{"loss": 0.5}])
    assert calls == [
        ("train_begin", {}),
        ("epoch_begin", 0, {}),
        ("batch_begin", 0, {}),
        ("batch_end", 0, {"loss": 0.5, "num_examples": 8}),
        ("epoch_end", 0, {"loss": 0.5}),
        ("train_end", {"loss": 0.5}),
    ]


def test_other_hooks_by_keyword_and_the_rest_do_nothing() -> None:
    calls: list[tuple[Any, ...]] = []
    callback = LambdaCallback(
        on_test_end=recorder(calls, "test_end"),
        on_predict_batch_end=recorder(calls, "predict_batch_end"),
    )
    callback.on_test_end({"loss": 1.0})
    callback.on_predict_batch_end(4)
    callback.on_epoch_end(0, {"loss": 1.0})
    callback.on_test_begin()
    assert calls == [("test_end", {"loss": 1.0}), ("predict_batch_end", 4, {})]


def test_an_unknown_hook_lists_the_hooks() -> None:
    with pytest.raises(TypeError, match=r"unknown hooks \['on_batch_end'\].*'on_train_batch_end'"):
        LambdaCallback(on_batch_end=print)
    assert "on_predict_end" in HOOKS and len(HOOKS) == 14


def test_a_hook_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"on_epoch_end='print' is not callable"):
        LambdaCallback(on_epoch_end="print")  # type: ignore[arg-type]


# -- in a real fit ---------------------------------------------------------------------------------
def test_fit_calls_the_functions() -> None:
    calls: list[tuple[Any, ...]] = []
    callback = LambdaCallback(
        on_train_begin=lambda logs: calls.append(("train_begin",)),
        on_epoch_end=lambda epoch, logs: calls.append(("epoch_end", epoch, round(logs["loss"], 6))),
        on_train_batch_end=lambda batch, logs: calls.append(("batch_end", batch)),
        on_test_end=lambda logs: calls.append(("test_end", round(logs["loss"], 6))),
        on_train_end=lambda logs: calls.append(("train_end",)),
    )
    _, history = fit_linear([callback], epochs=2, num_replicas=2)
    loss, val_loss = history.history["loss"], history.history["val_loss"]
    batches = [("batch_end", b) for b in range(4)]
    assert calls == [
        ("train_begin",),
        *batches,
        ("test_end", round(val_loss[0], 6)),
        ("epoch_end", 0, round(loss[0], 6)),
        *batches,
        ("test_end", round(val_loss[1], 6)),
        ("epoch_end", 1, round(loss[1], 6)),
        ("train_end",),
    ]
