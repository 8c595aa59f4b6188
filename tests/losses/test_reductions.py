"""A loss object's ``reduction`` means what Keras 3's does, and in a replica the reduction stays
exact: per-example losses then ``compute_average_loss`` (TensorFlow's custom-loop pattern) give
the single-device gradient, and a mean over the shard is refused at ``loss.backward()``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mirrored
from mirrored import losses
from tests import seeded_inputs as seeded


@pytest.mark.parametrize("none", [None, "none", losses.Reduction.NONE])
def test_none_gives_the_weighted_losses_of_each_example(none):
    logits, labels = seeded.logits(8, 5), seeded.ids(8, classes=5)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, reduction=none)
    expected = F.cross_entropy(logits, labels, reduction="none")
    assert_close(loss(labels, logits), expected)
    weights = seeded.uniform(8)
    assert_close(loss(labels, logits, sample_weight=weights), expected * weights)
    per_token = losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=0, reduction=none
    )
    ids = seeded.ids(3, 4, classes=5)
    values = per_token(ids, seeded.logits(3, 4, 5))
    assert values.shape == (3, 4) and (values[ids == 0] == 0).all()


def test_sum_mean_and_the_default_reduce_as_keras_does():
    y_true, y_pred = seeded.uniform(6, 3), seeded.logits(6, 3)
    per_example = (y_pred - y_true).square().mean(-1)
    weights = torch.tensor([1.0, 0.0, 2.0, 0.5, 1.0, 0.0])
    for reduction, expected, weighted in (
        ("sum", per_example.sum(), (per_example * weights).sum()),
        (losses.Reduction.SUM, per_example.sum(), (per_example * weights).sum()),
        ("sum_over_batch_size", per_example.mean(), (per_example * weights).sum() / 6),
        (
            losses.Reduction.SUM_OVER_BATCH_SIZE,
            per_example.mean(),
            (per_example * weights).sum() / 6,
        ),
        ("mean", per_example.mean(), (per_example * weights).sum() / 6),
        ("auto", per_example.mean(), (per_example * weights).sum() / 6),
        ("mean_with_sample_weight", per_example.mean(), (per_example * weights).sum() / 4.5),
    ):
        loss = losses.MeanSquaredError(reduction=reduction)
        assert_close(loss(y_true, y_pred), expected)
        assert_close(loss(y_true, y_pred, sample_weight=weights), weighted)
    assert losses.MeanSquaredError().reduction == "sum_over_batch_size"
    nothing = losses.MeanSquaredError(reduction="mean_with_sample_weight")
    assert nothing(y_true, y_pred, sample_weight=torch.zeros(6)).item() == 0.0


def test_every_loss_takes_a_reduction_in_keras_order():
    logits, labels = seeded.logits(4, 3), seeded.ids(4, classes=3)
    one_hot = F.one_hot(labels, 3).float()
    for loss, y_true in (
        (losses.SparseCategoricalCrossentropy(True, None, "sum"), labels),
        (losses.CategoricalCrossentropy(True, 0.0, "sum"), one_hot),
        (losses.BinaryCrossentropy(True, 0.0, "sum"), one_hot),
        (losses.MeanSquaredError("sum"), one_hot),
        (losses.MeanAbsoluteError("sum"), one_hot),
        (losses.LossFunctionWrapper(losses.mse, "sum"), one_hot),
    ):
        assert_close(loss(y_true, logits), loss.call(y_true, logits).sum())
        assert "reduction='sum'" in repr(loss)


def test_ignored_positions_do_not_count_in_the_mean():
    logits, ids = seeded.logits(2, 5, 4), seeded.ids(2, 5, classes=4)
    ids[0, :2] = -1
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)
    assert_close(loss(ids, logits), F.cross_entropy(logits.transpose(1, 2), ids, ignore_index=-1))
    with_weight = losses.SparseCategoricalCrossentropy(
        from_logits=True, ignore_class=-1, reduction="mean_with_sample_weight"
    )
    weights = torch.tensor([2.0, 1.0])
    per_token = F.cross_entropy(logits.transpose(1, 2), ids, ignore_index=-1, reduction="none")
    expected = (per_token * weights[:, None]).sum() / (2.0 * 3 + 1.0 * 5)
    assert_close(with_weight(ids, logits, sample_weight=weights), expected)


@pytest.mark.parametrize("reduction", ["SUM", "weighted_mean", 0, "sum_over_nonzero_weights"])
def test_an_unknown_reduction_is_refused_with_the_accepted_ones(reduction):
    with pytest.raises(ValueError, match=rf"reduction={reduction!r}.*'sum_over_batch_size', 'sum'"):
        losses.SparseCategoricalCrossentropy(reduction=reduction)
    with pytest.raises(ValueError, match="expected one of"):
        losses.Reduction.validate(reduction)
    assert set(losses.Reduction.all()) == {"auto", "none", "sum", "sum_over_batch_size"}


def test_an_already_reduced_loss_is_refused_and_the_message_says_what_works():
    logits, labels = seeded.logits(8, 5), seeded.ids(8, classes=5)
    reduced = losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits)
    with pytest.raises(ValueError, match="reduction='none'") as refused:
        mirrored.compute_average_loss(reduced, global_batch_size=8)
    assert "reduction='none'" in str(refused.value)
    # What the message says, done with our own loss, works.
    per_example = losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    assert_close(
        mirrored.compute_average_loss(per_example(labels, logits), global_batch_size=8), reduced
    )


def _train(reduction: str | None, devices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One SGD step on 12 examples, TensorFlow's custom-loop pattern; the weights after it."""
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 3).double()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    x, y = seeded.logits(12, 4).double(), seeded.ids(12, classes=3)
    loss_object = losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) as strategy:
        model, mirrored_optimizer = strategy.mirror(module, optimizer)

        def step(features, labels):
            per_example = loss_object(labels, model(features))
            if reduction in (None, "none"):
                loss = mirrored.compute_average_loss(per_example, global_batch_size=12)
            else:
                loss = per_example  # the loss object's own reduction
            loss.backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        (batch,) = list(strategy.experimental_distribute_dataset([(x, y)]))
        strategy.run(step, args=batch)
    return module.weight.detach().clone(), module.bias.detach().clone()


@pytest.mark.parametrize("none", [None, "none"])
@pytest.mark.parametrize("devices", [2, 4])
def test_per_example_losses_then_compute_average_loss_give_the_single_device_step(none, devices):
    single = _train(None, 1)
    assert_close(_train(none, devices), single, rtol=0, atol=1e-12)
    assert_close(_train("sum_over_batch_size", 1), single, rtol=0, atol=1e-12)


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "mean", "mean_with_sample_weight"])
def test_a_mean_over_the_shard_is_refused_in_a_replica(reduction):
    with pytest.raises(ValueError, match=r"mean over this replica's shard.*compute_average_loss"):
        _train(reduction, 2)
