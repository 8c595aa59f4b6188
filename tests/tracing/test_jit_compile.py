"""``Model.compile(jit_compile=True)``: fit, evaluate and predict with each replica's step
traced give what they give eagerly."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import mirrored
from tests.reference_loops import assert_same_parameters
from tests.tracing.traces import replays

pytestmark = pytest.mark.usefixtures("float64")


def data(examples: int = 44) -> tuple[np.ndarray, np.ndarray]:
    generator = np.random.default_rng(4)
    x = generator.standard_normal((examples, 6))
    return x, generator.integers(0, 3, examples)


def fitted(jit_compile: bool, **compile_options: Any) -> tuple[mirrored.Model, Any]:
    """A model fitted for two epochs of 44 examples in batches of 16 (a ragged last batch),
    with dropout and a schedule of the learning rate, on two replicas."""
    torch.manual_seed(2)
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mirrored.Model(
            nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Dropout(0.25), nn.Linear(12, 3))
        )
        schedule = mirrored.optimizers.schedules.ExponentialDecay(0.1, 3, 0.5)
        model.compile(
            optimizer=mirrored.optimizers.SGD(learning_rate=schedule, momentum=0.9),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=jit_compile,
            **compile_options,
        )
    x, y = data()
    history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    return model, history


def test_fit_evaluate_and_predict_traced_match_eager() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no step may fall back
        traced, traced_history = fitted(jit_compile=True)
        x, y = data(20)
        traced_eval = traced.evaluate(x, y, batch_size=8, verbose=0)
        traced_predictions = traced.predict(x, batch_size=8, verbose=0)
    eager, eager_history = fitted(jit_compile=False)
    assert_same_parameters(eager.module, traced.module)
    for name, values in eager_history.history.items():
        np.testing.assert_allclose(traced_history.history[name], values, rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(
        traced_eval, eager.evaluate(x, y, batch_size=8, verbose=0), rtol=1e-12
    )
    np.testing.assert_allclose(
        traced_predictions, eager.predict(x, batch_size=8, verbose=0), rtol=1e-12
    )
    # Two batch signatures (16 and the last 12), on two replicas, for fit's step.
    learn = traced._compiled()._traced["learn"]
    assert learn.experimental_get_tracing_count() == 4
    assert replays(learn)  # TorchScript ran every piece (fit's default loss included)


def test_a_torch_scheduler_steps_outside_the_traced_step() -> None:
    def scheduled(jit_compile: bool) -> mirrored.Model:
        torch.manual_seed(2)
        strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
        with strategy.scope():
            module = nn.Linear(6, 3)
            model = mirrored.Model(module)
            optimizer = torch.optim.SGD(module.parameters(), lr=0.2)
            model.compile(
                optimizer=optimizer,
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
                jit_compile=jit_compile,
            )
        x, y = data()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        return model

    assert_same_parameters(scheduled(False).module, scheduled(True).module)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_losses_checks_of_their_inputs_hold_when_traced(jit_compile: bool) -> None:
    """Checks that read values on the host run at each replay, as eagerly."""
    strategy = mirrored.MirroredStrategy(["cpu:0", "cpu:1"])
    with strategy.scope():
        model = mirrored.Model(nn.Linear(6, 3))
        model.compile(loss="sparse_categorical_crossentropy", jit_compile=jit_compile)
    x, y = data(16)
    with pytest.raises(ValueError, match="from_logits=False but y_pred got values outside"):
        model.fit(x, y, batch_size=16, verbose=0)
    with strategy.scope():
        model.compile(
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    model.fit(x, y, batch_size=16, verbose=0)
    # Eagerly, torch's refusal is explained; a replay raises torch's own (no host check per step).
    with pytest.raises(
        (ValueError, IndexError, RuntimeError), match=r"class id 7 but|Target 7 is out"
    ):
        model.fit(x, np.full(16, 7), batch_size=16, verbose=0)


def test_jit_compile_must_be_a_bool() -> None:
    with mirrored.MirroredStrategy(["cpu:0"]).scope():
        model = mirrored.Model(nn.Linear(2, 2))
        with pytest.raises(TypeError, match="jit_compile='yes': expected True or False"):
            model.compile(loss="mse", jit_compile="yes")  # type: ignore[arg-type]
