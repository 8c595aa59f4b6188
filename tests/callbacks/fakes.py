"""What the callback tests share: a fake model to drive hooks by hand, and a tiny real fit.

``FakeModel`` has only what the callbacks use (``stop_training``, ``state_dict``,
``save_weights`` / ``save``, ``learning_rate``, ``strategy.should_checkpoint``), so the unit tests
check a callback's own logic; ``fit_linear`` runs it inside ``mirrored.Model.fit``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mirrored
from mirrored import checkpoint
from mirrored.callbacks.callback import Callback


class FakeStrategy:
    def __init__(self, should_checkpoint: bool) -> None:
        self.should_checkpoint = should_checkpoint


class FakeModel:
    """A linear module whose weight the test sets, a plain learning rate, saves via checkpoint."""

    def __init__(self, should_checkpoint: bool = True, learning_rate: float = 0.1) -> None:
        torch.manual_seed(0)
        self.module = nn.Linear(3, 1)
        self.strategy = FakeStrategy(should_checkpoint)
        self.stop_training = False
        self.learning_rate = learning_rate

    def set_weight(self, value: float) -> None:
        with torch.no_grad():
            self.module.weight.fill_(value)

    def weight(self) -> float:
        return float(self.module.weight[0, 0].detach())

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.load_state_dict(state_dict)

    def save_weights(self, path: str | Path) -> None:
        if self.strategy.should_checkpoint:
            checkpoint.save(self.state_dict(), path)

    def save(self, path: str | Path) -> None:
        if self.strategy.should_checkpoint:
            checkpoint.save({"format": "fake/1", "model": self.state_dict()}, path)


def attach(callback: Callback, model: FakeModel, epochs: int = 10, steps: int = 1) -> None:
    callback.set_model(model)  # type: ignore[arg-type]
    callback.set_params({"epochs": epochs, "steps": steps, "verbose": 0})


def drive(
    callback: Callback,
    model: FakeModel,
    epoch_logs: Sequence[dict[str, Any]],
    initial_epoch: int = 0,
    begin: bool = True,
    end: bool = True,
) -> list[int]:
    """Run fit's hooks for one epoch per entry of ``epoch_logs`` (one batch each, the weight set
    to the epoch number before its end); stop as fit does. Returns the epochs run."""
    attach(callback, model, epochs=initial_epoch + len(epoch_logs))
    if begin:
        model.stop_training = False
        callback.on_train_begin()
    ran = []
    logs: dict[str, Any] = {}
    for offset, logs_of_epoch in enumerate(epoch_logs):
        epoch = initial_epoch + offset
        logs = dict(logs_of_epoch)
        callback.on_epoch_begin(epoch)
        callback.on_train_batch_begin(0)
        callback.on_train_batch_end(0, {"loss": logs.get("loss", 1.0), "num_examples": 8})
        model.set_weight(float(epoch))
        callback.on_epoch_end(epoch, logs)
        ran.append(epoch)
        if model.stop_training:
            break
    if end:
        callback.on_train_end(logs)
    return ran


def linear_data(num_examples: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_examples, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(
        num_examples, 1, generator=generator
    )
    return x, y


def fit_linear(
    callbacks: Iterable[Callback],
    epochs: int = 3,
    num_replicas: int = 1,
    learning_rate: float = 0.05,
    data: tuple[torch.Tensor, torch.Tensor] | None = None,
    **fit_arguments: Any,
) -> tuple[mirrored.Model, mirrored.callbacks.History]:
    """``mirrored.Model(nn.Linear(4, 1))`` fit with SGD and MSE on 64 examples (batches of 16),
    with validation data, on ``num_replicas`` logical CPUs (1: the default strategy)."""
    x, y = linear_data() if data is None else data
    fit_arguments.setdefault("batch_size", 16)
    fit_arguments.setdefault("validation_data", linear_data(32, seed=1))
    fit_arguments.setdefault("verbose", 0)

    def build_and_fit() -> tuple[mirrored.Model, mirrored.callbacks.History]:
        torch.manual_seed(0)
        model = mirrored.Model(nn.Linear(4, 1))
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=learning_rate),
            loss="mse",
            metrics=["mae"],
        )
        history = model.fit(x, y, epochs=epochs, callbacks=list(callbacks), **fit_arguments)
        return model, history

    if num_replicas == 1:
        return build_and_fit()
    strategy = mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
    with strategy, strategy.scope():
        return build_and_fit()


class Crash(Exception):
    """Raised by ``CrashAt`` to stand for a killed process."""


class CrashAt(Callback):
    """Raises after ``after_batches`` training batches (counted across epochs)."""

    def __init__(self, after_batches: int) -> None:
        super().__init__()
        self.remaining = after_batches

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            raise Crash
