"""fit's batch logs: the metrics' results only when a callback reads them, nothing else changed."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored.callbacks import Callback
from mirrored.metrics import Metric

NUM_EXAMPLES, BATCH = 96, 16
STEPS = NUM_EXAMPLES // BATCH


def _model(num_replicas: int, **compile_kwargs: Any) -> tuple[mirrored.Model, mirrored.Strategy]:
    strategy = mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
    torch.manual_seed(0)
    with strategy.scope():
        model = mirrored.Model(nn.Linear(6, 3))
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            **({"metrics": ["accuracy"]} | compile_kwargs),
        )
    return model, strategy


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_EXAMPLES, 6, generator=generator)
    weight = torch.rand(NUM_EXAMPLES, generator=generator)
    return x, torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator), weight


def _fit(model: mirrored.Model, strategy: mirrored.Strategy, callbacks: list[Callback]) -> Any:
    x, y, weight = _data()
    with strategy:
        return model.fit(
            x,
            y,
            sample_weight=weight,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )


class _Reads(Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen.append(dict(logs))


class _Times(_Reads):
    def reads_batch_logs(self, hook: str) -> bool:
        return False


def _count_results(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    result = mirrored.metrics.Mean.result  # the loss's and the accuracy's (weighted means)

    def counted(self: Metric) -> float:
        calls.append(self.name)
        return result(self)

    for cls in (mirrored.metrics.Mean, mirrored.metrics.MeanMetricWrapper):
        monkeypatch.setattr(cls, "result", counted)
    return calls


def test_batches_whose_logs_nobody_reads_compute_no_results(monkeypatch) -> None:
    calls = _count_results(monkeypatch)
    timer = _Times()
    history = _fit(*_model(2), [timer])
    # Only each epoch's logs: the loss and the accuracy, two epochs.
    assert sorted(calls) == sorted(["loss", "accuracy"] * 2)
    assert len(history.history["loss"]) == 2
    assert timer.seen == [{"num_examples": BATCH}] * (2 * STEPS)


def test_a_callback_that_overrides_the_hook_gets_every_batch_s_results(monkeypatch) -> None:
    calls = _count_results(monkeypatch)
    reader = _Reads()
    _fit(*_model(2), [reader])
    assert len(calls) == 2 * (2 * STEPS + 2)
    losses = [logs["loss"] for logs in reader.seen]
    assert len(set(losses)) > 1 and all(logs["num_examples"] == BATCH for logs in reader.seen)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_reading_the_logs_or_not_gives_bit_identical_epoch_logs(num_replicas: int) -> None:
    quiet = _fit(*_model(num_replicas), [_Times()]).history
    read = _fit(*_model(num_replicas), [_Reads()]).history
    assert quiet == read  # exact floats, not close


def test_a_compiled_metric_instance_is_current_at_every_batch() -> None:
    accuracy = mirrored.metrics.SparseCategoricalAccuracy(name="acc")
    seen: list[tuple[float, float]] = []

    class Compare(Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            seen.append((accuracy.result(), logs["acc"]))

    model, strategy = _model(2, metrics=[accuracy])
    _fit(model, strategy, [Compare()])
    assert len(seen) == 2 * STEPS
    assert all(own == logged for own, logged in seen)
    assert len({own for own, _ in seen}) > 1


def test_a_model_with_its_own_loss_and_no_logits_trains_on_labels_in_x() -> None:
    class OwnLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(6, 3)

        def forward(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
            return {"loss": nn.functional.cross_entropy(self.linear(features), labels)}

    x, y, _ = _data()
    model = mirrored.Model(OwnLoss())
    model.compile(optimizer=torch.optim.SGD(model.parameters(), lr=0.1), loss=None)
    history = model.fit({"features": x, "labels": y}, batch_size=BATCH, epochs=2, verbose=0)
    assert history.history["loss"][1] < history.history["loss"][0]


def test_which_callbacks_read_batch_logs() -> None:
    callbacks = mirrored.callbacks
    assert not Callback().reads_batch_logs("on_train_batch_end")
    assert _Reads().reads_batch_logs("on_train_batch_end")
    assert not _Reads().reads_batch_logs("on_test_batch_end")
    assert not _Times().reads_batch_logs("on_train_batch_end")
    lam = callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: None)
    assert lam.reads_batch_logs("on_train_batch_end")
    assert not callbacks.LambdaCallback(on_epoch_end=print).reads_batch_logs("on_train_batch_end")
    assert callbacks.TerminateOnNaN().reads_batch_logs("on_train_batch_end")
    assert not callbacks.TensorBoard("/tmp/unused").reads_batch_logs("on_train_batch_end")
    assert callbacks.TensorBoard("/tmp/unused", update_freq=5).reads_batch_logs(
        "on_train_batch_end"
    )
    assert not callbacks.ModelCheckpoint("/tmp/m.pt").reads_batch_logs("on_train_batch_end")
    assert callbacks.ModelCheckpoint("/tmp/m.pt", save_freq=3).reads_batch_logs(
        "on_train_batch_end"
    )
    listed = mirrored.callbacks.CallbackList([_Times(), callbacks.History()])
    assert not listed.reads_batch_logs("on_train_batch_end")
    assert mirrored.callbacks.CallbackList([_Times(), _Reads()]).reads_batch_logs(
        "on_train_batch_end"
    )
