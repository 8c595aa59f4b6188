"""Metrics: Keras's values, and states that add up exactly over shards of any split."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mirrored
from mirrored import losses, metrics
from tests import seeded_inputs as seeded

SHARDS = (4, 3, 3, 0, 3)  # 13 examples, a ragged split with an empty shard


def _split(value, sizes=SHARDS):
    return value.split(list(sizes)) if value is not None else [None] * len(sizes)


def _absolute(y_true, y_pred):
    return (y_true - y_pred).abs()


def _cases():
    """(metric, y_true, y_pred) on 13 examples, for every metric."""
    labels, logits = seeded.ids(13, classes=5), seeded.logits(13, 5)
    one_hot = F.one_hot(seeded.ids(13, classes=5), 5)
    binary = (seeded.uniform(13, 1) > 0.5).float()
    return [
        (metrics.SparseCategoricalAccuracy(), labels, logits),
        (
            metrics.SparseCategoricalAccuracy(),
            seeded.ids(13, 6, classes=5),
            seeded.logits(13, 6, 5),
        ),
        (metrics.CategoricalAccuracy(), one_hot, logits),
        (metrics.BinaryAccuracy(), binary[:, 0], seeded.uniform(13, 1)),
        (metrics.BinaryAccuracy(threshold=0.0), binary, seeded.logits(13, 1)),
        (metrics.MeanAbsoluteError(), seeded.uniform(13, 3), seeded.logits(13, 3)),
        (metrics.MeanSquaredError(), seeded.uniform(13, 3), seeded.logits(13, 3)),
        (metrics.AutoAccuracy(), labels, logits),
        (
            metrics.MeanMetricWrapper(lambda t, p: (t - p).abs(), "l1"),
            seeded.uniform(13, 2),
            seeded.logits(13, 2),
        ),
    ]


@pytest.mark.parametrize("weighting", ["none", "per_example", "per_element"])
def test_shard_states_add_up_to_the_whole_batch_for_every_metric(weighting):
    for metric, y_true, y_pred in _cases():
        values_shape = metric.fn(y_true, y_pred).shape if hasattr(metric, "fn") else (13,)
        weight = {
            "none": None,
            "per_example": seeded.uniform(13) * 3,
            "per_element": seeded.uniform(*values_shape),
        }[weighting]
        whole = metric.batch_state(y_true, y_pred, sample_weight=weight)
        assert whole.dtype == torch.float64 and whole.shape == (metric.num_state,)
        parts = [
            metric.batch_state(t, p, sample_weight=w)
            for t, p, w in zip(_split(y_true), _split(y_pred), _split(weight), strict=True)
        ]
        assert_close(sum(parts), whole, msg=lambda m, metric=metric: f"{metric}: {m}")
        merged = copy.deepcopy(metric)
        for part in parts:
            merged.merge_state(part)
        single = copy.deepcopy(metric)
        single.update_state(y_true, y_pred, sample_weight=weight)
        assert merged.result() == pytest.approx(single.result(), rel=1e-12)
    values, weight = seeded.logits(13, 4), seeded.uniform(13)
    mean = metrics.Mean()
    shards = zip(_split(values), _split(weight), strict=True)
    parts = [mean.batch_state(v, sample_weight=w) for v, w in shards]
    assert_close(sum(parts), mean.batch_state(values, sample_weight=weight))


def test_accuracies_equal_the_hand_computation():
    labels, logits = seeded.ids(13, classes=5), seeded.logits(13, 5)
    expected = (logits.argmax(-1) == labels).double().mean().item()
    for y_true in (labels, labels[:, None], labels.float()):
        metric = metrics.SparseCategoricalAccuracy()
        metric.update_state(y_true, logits)
        assert metric.result() == pytest.approx(expected)
    metric = metrics.SparseCategoricalAccuracy()
    metric.update_state(labels, logits.softmax(-1))  # logits or probabilities: same argmax
    assert metric.result() == pytest.approx(expected)

    one_hot = F.one_hot(labels, 5)
    metric = metrics.CategoricalAccuracy()
    metric.update_state(one_hot, logits)
    assert metric.result() == pytest.approx(expected)

    targets, probabilities = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0.7, 0.2, 0.5, 0.1])
    metric = metrics.BinaryAccuracy()
    metric.update_state(targets, probabilities[:, None])  # y_pred > 0.5 strictly, as Keras
    assert metric.result() == pytest.approx(0.5)
    assert metric.fn(targets, probabilities[:, None]).shape == (4,)
    on_logits = metrics.BinaryAccuracy(threshold=0.0)
    on_logits.update_state(targets.bool(), torch.tensor([2.0, -1.0, -0.5, 0.1]))
    assert on_logits.result() == pytest.approx(0.75)


def test_sequence_accuracy_with_token_weights():
    labels, logits = seeded.ids(3, 4, classes=5), seeded.logits(3, 4, 5)
    matches = (logits.argmax(-1) == labels).double()
    mask = (seeded.uniform(3, 4) > 0.3).double()
    metric = metrics.SparseCategoricalAccuracy()
    metric.update_state(labels, logits, sample_weight=mask)
    assert metric.result() == pytest.approx(((matches * mask).sum() / mask.sum()).item())
    example_weights = torch.tensor([1.0, 0.0, 2.0])
    metric.reset_state()
    metric.update_state(labels, logits, sample_weight=example_weights)
    expected = (matches.mean(1) * example_weights).sum() / example_weights.sum()
    assert metric.result() == pytest.approx(expected.item())


def test_regression_metrics_equal_torchs_losses():
    y_true, y_pred = seeded.uniform(13, 3), seeded.logits(13, 3)
    mae, mse = metrics.MeanAbsoluteError(), metrics.MeanSquaredError()
    mae.update_state(y_true, y_pred)
    mse.update_state(y_true, y_pred)
    assert mae.result() == pytest.approx(F.l1_loss(y_pred.double(), y_true.double()).item())
    assert mse.result() == pytest.approx(F.mse_loss(y_pred.double(), y_true.double()).item())
    assert (mae.name, mse.name) == ("mean_absolute_error", "mean_squared_error")


def test_mean_weighs_from_the_left_and_is_zero_when_empty():
    mean = metrics.Mean()
    assert mean.result() == 0.0 and mean.name == "mean"
    mean.update_state(torch.zeros(0))
    assert mean.result() == 0.0  # 0 / 0 -> 0, as Keras's divide_no_nan
    values = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    mean.update_state(values, sample_weight=torch.tensor([3.0, 1.0]))
    assert_close(mean.state, torch.tensor([24.0, 8.0], dtype=torch.float64))
    assert mean.result() == 3.0
    mean.update_state(torch.tensor([10.0]))
    assert mean.result() == pytest.approx(34.0 / 9)
    assert mean.batch_state(4.0).tolist() == [4.0, 1.0]
    with pytest.raises(ValueError, match=r"sample_weight has shape \[3\]"):
        mean.batch_state(values, sample_weight=torch.ones(3))


def test_batch_state_is_pure_detached_and_float64():
    logits = seeded.logits(4, 3).requires_grad_()
    metric = metrics.SparseCategoricalAccuracy()
    state = metric.batch_state(seeded.ids(4, classes=3), logits)
    assert not state.requires_grad and state.dtype == torch.float64
    assert metric.result() == 0.0  # batch_state left the metric alone
    mean_state = metrics.Mean().batch_state(logits * 2)
    assert not mean_state.requires_grad


def test_state_dict_round_trip_reset_and_merge_errors():
    metric = metrics.MeanSquaredError()
    metric.update_state(torch.ones(3, 2), torch.zeros(3, 2))
    saved = metric.state_dict()
    assert saved["state"].device.type == "cpu" and saved["state"].tolist() == [3.0, 3.0]
    restored = metrics.MeanSquaredError()
    restored.load_state_dict(saved)
    restored.update_state(torch.zeros(1, 2), torch.zeros(1, 2))
    assert restored.result() == pytest.approx(0.75)
    assert metric.result() == 1.0  # the saved copy is not shared
    metric.reset_state()
    assert metric.result() == 0.0 and metric.state.tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match=r"merge_state got \[3\]; expected a 1-D tensor of 2"):
        metric.merge_state(torch.zeros(3))
    with pytest.raises(ValueError, match="load_state_dict expected"):
        metric.load_state_dict({"state": torch.zeros(5)})
    with pytest.raises(ValueError, match="load_state_dict expected"):
        metric.load_state_dict({})


def test_function_metrics_must_return_one_value_per_example():
    metric = metrics.get(_absolute)
    assert isinstance(metric, metrics.MeanMetricWrapper) and metric.name == "_absolute"
    metric.update_state(torch.tensor([1.0, 2.0]), torch.tensor([2.0, 5.0]))
    assert metric.result() == 2.0
    scalar = metrics.get(lambda y_true, y_pred: (y_true - y_pred).abs().mean())
    with pytest.raises(ValueError, match=r"0-dim tensor.*one value per example"):
        scalar.update_state(torch.ones(2), torch.zeros(2))
    with pytest.raises(TypeError, match="fn=3"):
        metrics.MeanMetricWrapper(3)


def test_shape_errors():
    with pytest.raises(ValueError, match=r"y_true has shape \[4, 5\] and y_pred \[4, 5\]"):
        metrics.SparseCategoricalAccuracy().update_state(torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"y_true has shape \[3\] and y_pred \[4, 5\]"):
        metrics.SparseCategoricalAccuracy().update_state(torch.zeros(3), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"y_true has shape \[4\] and y_pred \[4, 5\]"):
        metrics.CategoricalAccuracy().update_state(torch.zeros(4), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"y_true has shape \[4, 2\] and y_pred \[4, 3\]"):
        metrics.BinaryAccuracy().update_state(torch.zeros(4, 2), torch.zeros(4, 3))
    with pytest.raises(ValueError, match=r"y_true has shape \[4, 2\] and y_pred \[4, 3\]"):
        metrics.MeanAbsoluteError().update_state(torch.zeros(4, 2), torch.zeros(4, 3))
    with pytest.raises(TypeError, match="threshold='high'"):
        metrics.BinaryAccuracy(threshold="high")
    with pytest.raises(TypeError, match="name=3"):
        metrics.Mean(name=3)


def test_get_picks_accuracy_from_the_loss():
    picks = [
        (losses.SparseCategoricalCrossentropy(from_logits=True), metrics.SparseCategoricalAccuracy),
        ("sparse_categorical_crossentropy", metrics.SparseCategoricalAccuracy),
        (losses.CategoricalCrossentropy(), metrics.CategoricalAccuracy),
        (losses.BinaryCrossentropy(), metrics.BinaryAccuracy),
        (losses.MeanSquaredError(), metrics.AutoAccuracy),
        (losses.get(lambda y_true, y_pred: y_pred), metrics.AutoAccuracy),
        (None, metrics.AutoAccuracy),
    ]
    for loss, kind in picks:
        metric = metrics.get("accuracy", loss)
        assert type(metric) is kind and metric.name == "accuracy", loss
    assert metrics.get("acc", losses.BinaryCrossentropy()).name == "acc"
    assert metrics.get("accuracy", losses.BinaryCrossentropy()).threshold == 0.5
    assert metrics.get("accuracy", losses.BinaryCrossentropy(from_logits=True)).threshold == 0.0


def test_auto_accuracy_reads_its_kind_from_the_first_batch():
    labels, logits = seeded.ids(6, classes=4), seeded.logits(6, 4)
    binary_targets = (seeded.uniform(6) > 0.5).float()
    cases = [
        (labels, logits, "sparse_categorical"),
        (labels[:, None], logits, "sparse_categorical"),
        (F.one_hot(labels, 4).float(), logits, "categorical"),
        (binary_targets, seeded.uniform(6, 1), "binary"),
        (binary_targets[:, None], seeded.uniform(6, 1), "binary"),
        (binary_targets, seeded.uniform(6), "binary"),
    ]
    for y_true, y_pred, kind in cases:
        metric = metrics.get("accuracy")
        assert metric.kind is None
        metric.update_state(y_true, y_pred)
        assert metric.kind == kind
        reference = {
            "sparse_categorical": metrics.SparseCategoricalAccuracy(),
            "categorical": metrics.CategoricalAccuracy(),
            "binary": metrics.BinaryAccuracy(),
        }[kind]
        reference.update_state(y_true, y_pred)
        assert metric.result() == reference.result()


def test_get_by_name_class_and_instance():
    names = {
        "sparse_categorical_accuracy": metrics.SparseCategoricalAccuracy,
        "categorical_accuracy": metrics.CategoricalAccuracy,
        "Binary_Accuracy": metrics.BinaryAccuracy,
        "mae": metrics.MeanAbsoluteError,
        "mean_absolute_error": metrics.MeanAbsoluteError,
        "MSE": metrics.MeanSquaredError,
        "mean_squared_error": metrics.MeanSquaredError,
    }
    for name, cls in names.items():
        metric = metrics.get(name)
        assert type(metric) is cls and metric.name == name  # logged as the user wrote it
    mean = metrics.Mean()
    assert metrics.get(mean) is mean
    assert type(metrics.get(metrics.CategoricalAccuracy)) is metrics.CategoricalAccuracy
    with pytest.raises(ValueError, match=r"'f1' is not a known metric; known names: accuracy"):
        metrics.get("f1")
    with pytest.raises(TypeError, match="metric 3"):
        metrics.get(3)


def test_keras_function_forms_give_one_value_per_example_and_log_their_names():
    logits, ids = seeded.logits(7, 4), seeded.ids(7, classes=4)
    expected = (logits.argmax(-1) == ids).float()
    assert_close(metrics.sparse_categorical_accuracy(ids, logits), expected)
    assert_close(metrics.categorical_accuracy(F.one_hot(ids, 4), logits), expected)
    targets, scores = seeded.uniform(7).round(), seeded.logits(7)
    assert_close(
        metrics.binary_accuracy(targets, scores, threshold=0.0), ((scores > 0) == targets).float()
    )
    for function in (
        metrics.sparse_categorical_accuracy,
        metrics.categorical_accuracy,
        metrics.binary_accuracy,
        losses.sparse_categorical_crossentropy,
    ):
        metric = metrics.get(function)
        assert isinstance(metric, metrics.MeanMetricWrapper)
        assert metric.name == function.__name__


@pytest.mark.cuda
def test_on_cuda_batch_state_never_waits_for_the_device():
    labels, logits = seeded.ids(13, classes=5).cuda(), seeded.logits(13, 5).cuda()
    weights = seeded.uniform(13).cuda()
    cases = [
        (metrics.SparseCategoricalAccuracy(), labels, logits),
        (metrics.CategoricalAccuracy(), F.one_hot(labels, 5), logits),
        (metrics.BinaryAccuracy(), (weights > 0.5).float(), logits[:, :1]),
        (metrics.MeanSquaredError(), F.one_hot(labels, 5), logits),
        (metrics.get("accuracy"), labels, logits),
    ]
    torch.cuda.set_sync_debug_mode("error")
    try:
        states = [m.batch_state(t, p, sample_weight=weights) for m, t, p in cases]
        mean_state = metrics.Mean().batch_state(logits, sample_weight=0.5)
        for (metric, _, _), state in zip(cases, states, strict=True):
            metric.merge_state(state)
            metric.merge_state(state)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(s.device.type == "cuda" for s in [*states, mean_state])
    metric = cases[0][0]
    assert metric.state.device.type == "cuda"
    metric.merge_state(torch.zeros(2, dtype=torch.float64))  # a CPU state joins the device's
    assert metric.state.device.type == "cuda"
    assert 0.0 <= metric.result() <= 1.0


@pytest.mark.parametrize("returned", [torch.tensor(0.5), 0.5], ids=["0-dim", "float"])
def test_a_metric_function_that_does_not_give_one_value_per_example_is_refused(returned):
    metric = metrics.MeanMetricWrapper(lambda y_true, y_pred: returned, name="mean_gap")
    with pytest.raises(ValueError, match=r"metric function 'mean_gap' returned .*one value per"):
        metric.update_state(torch.ones(4, 2), torch.zeros(4, 2))


# -- updated inside the replica function ---------------------------------------------------------


def _slow_add_sums(monkeypatch):
    """Each add of running sums gives up the GIL midway, as a busy step's threads do: a
    read-modify-write of the sums shared by the replicas then loses updates every time."""
    add_sums = metrics.add_sums

    def slow(own, state):
        time.sleep(0.0002)
        return add_sums(own, state)

    monkeypatch.setattr(metrics, "add_sums", slow)


@pytest.mark.parametrize("devices", [2, 4])
def test_update_state_inside_the_replica_function_is_exact(devices, monkeypatch):
    """TensorFlow's tutorial pattern: ``train_accuracy.update_state(labels, predictions)`` in
    the step given to ``strategy.run``, many steps: the single-device results."""
    _slow_add_sums(monkeypatch)
    steps = 40
    batches = [(seeded.ids(13, classes=5), seeded.logits(13, 5)) for _ in range(steps)]
    single = [metrics.SparseCategoricalAccuracy(), metrics.Mean()]
    for y_true, y_pred in batches:
        single[0].update_state(y_true, y_pred)
        single[1].update_state(y_pred.logsumexp(-1))
    replicated = [metrics.SparseCategoricalAccuracy(), metrics.Mean()]

    def step(y_true, y_pred):
        replicated[0].update_state(y_true, y_pred)
        replicated[1].update_state(y_pred.logsumexp(-1))

    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) as strategy:
        for number, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
            strategy.run(step, args=batch)
            if number == 0:  # read between steps: every replica's update is in
                assert replicated[0].state[1].item() == 13
    assert replicated[0].state.tolist() == single[0].state.tolist()
    assert replicated[0].result() == single[0].result()
    assert replicated[1].state[1].item() == 13 * steps
    assert_close(replicated[1].result(), single[1].result(), rtol=1e-12, atol=0)


def test_reading_a_metric_inside_the_replica_function_is_refused():
    """Inside ``strategy.run`` a metric holds only the updates merged so far: refused, with
    where to read it instead; after ``run`` it reads every replica's updates."""
    accuracy = metrics.SparseCategoricalAccuracy()
    batch = (seeded.ids(8, classes=5), seeded.logits(8, 5))

    def step(y_true, y_pred):
        accuracy.update_state(y_true, y_pred)
        return accuracy.result()

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        (shards,) = strategy.experimental_distribute_dataset([batch])
        with pytest.raises(ValueError, match=r"read result\(\) after strategy.run returns"):
            strategy.run(step, args=shards)
    assert accuracy.state[1].item() == 8
