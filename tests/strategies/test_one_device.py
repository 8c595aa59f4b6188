"""OneDeviceStrategy: TensorFlow's first step of a port, the program on one named device, exact
against the plain loop."""

from __future__ import annotations

import threading

import pytest
import torch

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


@pytest.mark.parametrize("device", ["cpu:0", "/cpu:0", "/device:CPU:0"])
def test_a_custom_loop_equals_the_plain_loop(device: str) -> None:
    batches = make_batches()
    reference = make_mlp()
    expected = train_plain(reference, OPTIMIZERS["adam"](reference), batches)
    with mirrored.OneDeviceStrategy(device) as strategy:
        assert strategy.num_replicas_in_sync == 1
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["adam"](model)
        _, _, losses = train_mirrored(strategy, model, optimizer, batches)
    assert_same_parameters(reference, model)
    assert_close_float64(torch.tensor(losses), torch.tensor(expected))


def test_the_step_runs_on_the_caller_s_thread_and_results_are_plain_values() -> None:
    with mirrored.OneDeviceStrategy("cpu:0") as strategy:
        seen = strategy.run(lambda: threading.current_thread())
        assert seen is threading.current_thread()
        assert strategy.reduce("sum", strategy.run(lambda: torch.ones(2)), axis=None).tolist() == [
            1.0,
            1.0,
        ]
        assert repr(strategy) == "OneDeviceStrategy(device='cpu:0')"


def test_fit_trains_as_on_the_default_strategy() -> None:
    x, y = torch.randn(64, 12), torch.randint(0, 5, (64,))
    trained = []
    for strategy in (mirrored.get_strategy(), mirrored.OneDeviceStrategy("cpu:0")):
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            model.compile("sgd", mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
        torch.manual_seed(0)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        trained.append(model.module)
    assert_same_parameters(trained[0], trained[1])


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (["cpu:0", "cpu:1"], "OneDeviceStrategy takes one device"),
        ("cpu:9", "device 'cpu:9' does not exist"),
    ],
)
def test_bad_devices_are_refused(device: object, message: str) -> None:
    with pytest.raises((TypeError, ValueError), match=message):
        mirrored.OneDeviceStrategy(device)  # type: ignore[arg-type]
