"""fit's batch logs: computed when a callback reads them, each holding its own batch's values."""

from __future__ import annotations

import copy
import json
import pickle
from typing import Any

import pytest
import torch
from torch import nn

import mirrored
from mirrored.metrics import Metric
from mirrored.training.lazy_logs import LazyLogs

NUM_EXAMPLES, BATCH = 96, 16


def _model(num_replicas: int) -> tuple[mirrored.Model, mirrored.Strategy]:
    strategy = mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])
    torch.manual_seed(0)
    with strategy.scope():
        model = mirrored.Model(nn.Linear(6, 3))
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model, strategy


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_EXAMPLES, 6, generator=generator)
    return x, torch.randint(0, 3, (NUM_EXAMPLES,), generator=generator)


class _ReadNow(mirrored.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[dict[str, Any]] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.seen.append(dict(logs))


class _Keep(mirrored.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.kept: list[Any] = []

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.kept.append(logs)


@pytest.mark.parametrize("num_replicas", [1, 2])
def test_logs_read_after_later_batches_hold_their_own_batch_s_values(num_replicas: int) -> None:
    model, strategy = _model(num_replicas)
    now, kept = _ReadNow(), _Keep()
    with strategy:
        model.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[kept])
    # The same fit again, read at once, from the same start.
    model, strategy = _model(num_replicas)
    with strategy:
        model.fit(*_data(), batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[now])
    assert len(kept.kept) == len(now.seen) == 2 * NUM_EXAMPLES // BATCH
    assert [dict(logs) for logs in kept.kept] == now.seen
    losses = [logs["loss"] for logs in now.seen]
    assert len(set(losses)) > 1  # the running loss moves from batch to batch
    assert all(logs["num_examples"] == BATCH for logs in now.seen)


def test_batches_whose_logs_nobody_reads_compute_no_results(monkeypatch) -> None:
    calls = []
    result = mirrored.metrics.Mean.result  # the loss's and the accuracy's (weighted means)

    def counted(self: Metric) -> float:
        calls.append(self.name)
        return result(self)

    for cls in (mirrored.metrics.Mean, mirrored.metrics.MeanMetricWrapper):
        monkeypatch.setattr(cls, "result", counted)
    model, strategy = _model(2)
    with strategy:
        history = model.fit(
            *_data(), batch_size=BATCH, epochs=3, shuffle=False, verbose=0, callbacks=[_Keep()]
        )
    # Only each epoch's logs: the loss and the accuracy, three epochs.
    assert sorted(calls) == sorted(["loss", "accuracy"] * 3)
    assert len(history.history["loss"]) == 3


def test_lazy_logs_compute_once_on_first_use_and_act_as_a_dict() -> None:
    computed = []

    def compute() -> dict[str, Any]:
        computed.append(1)
        return {"loss": 0.5, "accuracy": 0.25}

    logs = LazyLogs(compute)
    assert isinstance(logs, dict) and not computed
    assert logs["loss"] == 0.5 and logs.get("accuracy") == 0.25 and "loss" in logs
    assert len(computed) == 1
    assert len(logs) == 2 and bool(logs) and sorted(logs) == ["accuracy", "loss"]
    assert dict(logs) == {**logs} == {"loss": 0.5, "accuracy": 0.25} == logs
    assert json.loads(json.dumps(logs)) == {"loss": 0.5, "accuracy": 0.25}
    assert copy.copy(logs) == pickle.loads(pickle.dumps(logs)) == logs.copy() == dict(logs)
    logs["learning_rate"] = 0.1
    assert logs == {"loss": 0.5, "accuracy": 0.25, "learning_rate": 0.1}
    assert len(computed) == 1


@pytest.mark.parametrize(
    "use",
    [
        lambda logs: logs.update(extra=1),
        lambda logs: logs.setdefault("extra", 1),
        lambda logs: list(logs.items()),
        lambda logs: repr(logs),
        lambda logs: logs | {"extra": 1},
    ],
    ids=["update", "setdefault", "items", "repr", "or"],
)
def test_any_use_of_lazy_logs_fills_them_first(use: Any) -> None:
    logs = LazyLogs(lambda: {"loss": 1.0})
    use(logs)
    assert logs["loss"] == 1.0
