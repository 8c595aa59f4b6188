"""The callback base: a callback that needs the model being fit says how to give it one."""

from __future__ import annotations

import pytest

import mirrored


@pytest.mark.parametrize(
    "callback",
    [
        mirrored.callbacks.TerminateOnNaN(raise_error=False),
        mirrored.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True),
        mirrored.callbacks.LearningRateScheduler(lambda epoch: 0.1),
    ],
    ids=lambda callback: type(callback).__name__,
)
def test_a_callback_used_outside_fit_names_the_fix(callback):
    with pytest.raises(RuntimeError, match=r"has no model; pass it to model\.fit\(callbacks="):
        callback.fit_model()


def test_fit_model_is_the_model_fit_gave():
    callback = mirrored.callbacks.Callback()
    model = object()
    callback.set_model(model)  # type: ignore[arg-type]
    assert callback.fit_model() is model
