"""compute_average_loss divides by the global batch size; the Keras-named losses compute what
Keras does (checked against torch's own functions and hand computations)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import mirrored
from mirrored import losses
from mirrored.losses import functions as loss_functions
from tests import seeded_inputs as seeded


def test_outside_a_strategy_it_is_the_plain_mean():
    losses = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert mirrored.compute_average_loss(losses).item() == 3.0
    weights = torch.tensor([1.0, 0.0, 1.0, 0.5])
    assert mirrored.compute_average_loss(losses, sample_weight=weights).item() == 7.0 / 4
    assert mirrored.compute_average_loss(losses, global_batch_size=8).item() == 1.5


def test_inside_a_run_it_uses_the_distributed_batch_size_or_counts_examples():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        data = torch.arange(7.0)
        (batch,) = list(strategy.experimental_distribute_dataset([data]))
        from_batch = strategy.run(mirrored.compute_average_loss, args=(batch,))
        assert strategy.reduce("sum", from_batch, axis=None).item() == pytest.approx(3.0)
        # A hand-made PerReplica carries no batch size: the replicas count their examples.
        manual = mirrored.PerReplica([data[:3], data[3:5], data[5:]])
        counted = strategy.run(mirrored.compute_average_loss, args=(manual,))
        assert strategy.reduce("sum", counted, axis=None).item() == pytest.approx(3.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="reduction='none'"):
        mirrored.compute_average_loss(torch.tensor(1.0))
    with pytest.raises(ValueError, match="global_batch_size=0"):
        mirrored.compute_average_loss(torch.ones(2), global_batch_size=0)


# -- Keras-named loss objects ----------------------------------------------------------------------


def test_sparse_categorical_crossentropy_from_logits_is_torchs_cross_entropy():
    logits, labels = seeded.logits(8, 5), seeded.ids(8, classes=5)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = F.cross_entropy(logits, labels, reduction="none")
    assert_close(loss.call(labels, logits), expected)
    assert_close(loss(labels, logits), expected.mean())
    assert_close(loss(labels[:, None], logits), expected.mean())  # a trailing 1 is squeezed
    weights = seeded.uniform(8)
    assert_close(loss(labels, logits, sample_weight=weights), (expected * weights).sum() / 8)
    assert loss.name == "sparse_categorical_crossentropy" and loss.from_logits


def test_sparse_categorical_crossentropy_of_probabilities_renormalises_and_clips_like_keras():
    logits, labels = seeded.logits(6, 4), seeded.ids(6, classes=4)
    probabilities = logits.softmax(dim=-1)
    loss = losses.SparseCategoricalCrossentropy()
    expected = F.cross_entropy(logits, labels, reduction="none")
    assert_close(loss.call(labels, probabilities), expected)
    # Probabilities that do not sum to 1 are renormalised first, as Keras does.
    assert_close(loss.call(labels, probabilities * 0.5), expected)
    # A zero probability on the true class is clipped to 1e-7 rather than giving inf.
    one_hot_wrong = F.one_hot((labels + 1) % 4, 4).float()
    assert_close(loss.call(labels, one_hot_wrong), torch.full((6,), -math.log(1e-7)))


def test_sparse_categorical_crossentropy_on_sequences_with_weights():
    batch, steps, vocab = 3, 5, 7
    logits, labels = seeded.logits(batch, steps, vocab), seeded.ids(batch, steps, classes=vocab)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    per_token = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1), reduction="none")
    per_token = per_token.reshape(batch, steps)
    assert_close(loss.call(labels, logits), per_token)
    token_weights = seeded.uniform(batch, steps)
    assert_close(
        loss(labels, logits, sample_weight=token_weights),
        (per_token * token_weights).sum() / (batch * steps),
    )
    example_weights = torch.tensor([1.0, 0.0, 2.0])
    assert_close(
        loss(labels, logits, sample_weight=example_weights),
        (per_token * example_weights[:, None]).sum() / (batch * steps),
    )


def test_ignore_class_gives_zero_loss_and_averages_over_the_rest():
    logits, labels = seeded.logits(4, 6, 5), seeded.ids(4, 6, classes=5)
    labels[0, :3] = -1
    labels[2, 4:] = -1
    for from_logits in (True, False):
        predictions = logits if from_logits else logits.softmax(dim=-1)
        loss = losses.SparseCategoricalCrossentropy(from_logits=from_logits, ignore_class=-1)
        values = loss.call(labels, predictions)
        assert values.shape == (4, 6)
        assert (values[labels == -1] == 0).all() and (values[labels != -1] > 0).all()
        assert_close(loss.valid_mask(labels, predictions), labels != -1)
        # Keras divides by the positions that count, like torch's ignore_index.
        expected = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-1)
        assert_close(loss(labels, predictions), expected)
    everything_ignored = torch.full((2, 3), 4)
    loss = losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=4)
    assert loss(everything_ignored, seeded.logits(2, 3, 5)).item() == 0.0


def test_categorical_crossentropy_matches_torch_with_probability_targets_and_smoothing():
    logits = seeded.logits(8, 5)
    targets = F.one_hot(seeded.ids(8, classes=5), 5).float()
    soft_targets = seeded.uniform(8, 5).softmax(dim=-1)
    for y_true in (targets, soft_targets):
        for smoothing in (0.0, 0.2):
            expected = F.cross_entropy(logits, y_true, label_smoothing=smoothing, reduction="none")
            from_logits = losses.CategoricalCrossentropy(
                from_logits=True, label_smoothing=smoothing
            )
            assert_close(from_logits.call(y_true, logits), expected)
            from_probabilities = losses.CategoricalCrossentropy(label_smoothing=smoothing)
            assert_close(from_probabilities.call(y_true, logits.softmax(dim=-1)), expected)
    integer_targets = F.one_hot(seeded.ids(8, classes=5), 5)
    loss = losses.CategoricalCrossentropy(from_logits=True)
    assert_close(loss.call(integer_targets, logits), loss.call(integer_targets.float(), logits))
    assert loss.name == "categorical_crossentropy"


def test_binary_crossentropy_averages_the_last_dim_and_aligns_a_trailing_one():
    logits, targets = seeded.logits(6, 3), (seeded.uniform(6, 3) > 0.5).float()
    expected = F.binary_cross_entropy_with_logits(logits, targets, reduction="none").mean(-1)
    assert_close(losses.BinaryCrossentropy(from_logits=True).call(targets, logits), expected)
    probabilities = logits.sigmoid()
    clipped = probabilities.clamp(1e-7, 1 - 1e-7)
    expected = F.binary_cross_entropy(clipped, targets, reduction="none").mean(-1)
    assert_close(losses.BinaryCrossentropy().call(targets, probabilities), expected)
    # The common case: y_true [batch] and y_pred [batch, 1] give one loss per example.
    column, labels = seeded.logits(6, 1), targets[:, 0]
    values = losses.BinaryCrossentropy(from_logits=True).call(labels, column)
    assert values.shape == (6,)
    assert_close(values, F.binary_cross_entropy_with_logits(column[:, 0], labels, reduction="none"))
    assert_close(
        losses.BinaryCrossentropy(from_logits=True).call(labels[:, None], column[:, 0]), values
    )
    # [batch] with [batch] stays per example (Keras would average it to one number).
    assert losses.BinaryCrossentropy(from_logits=True).call(labels, column[:, 0]).shape == (6,)


def test_binary_crossentropy_label_smoothing_pulls_targets_to_one_half():
    logits, targets = seeded.logits(5, 2), (seeded.uniform(5, 2) > 0.5).float()
    smoothed = targets * 0.8 + 0.1
    expected = F.binary_cross_entropy_with_logits(logits, smoothed, reduction="none").mean(-1)
    loss = losses.BinaryCrossentropy(from_logits=True, label_smoothing=0.2)
    assert_close(loss.call(targets, logits), expected)


def test_mean_squared_and_absolute_error_average_the_last_dim():
    y_true, y_pred = seeded.uniform(7, 3), seeded.logits(7, 3)
    assert_close(
        losses.MeanSquaredError().call(y_true, y_pred),
        F.mse_loss(y_pred, y_true, reduction="none").mean(-1),
    )
    assert_close(
        losses.MeanAbsoluteError().call(y_true, y_pred),
        F.l1_loss(y_pred, y_true, reduction="none").mean(-1),
    )
    assert_close(losses.MeanSquaredError()(y_true, y_pred), F.mse_loss(y_pred, y_true))
    # y_true [batch] against y_pred [batch, 1]: per example, not broadcast to [batch, batch].
    values = losses.MeanAbsoluteError().call(y_true[:, 0], y_pred[:, :1])
    assert_close(values, (y_pred[:, 0] - y_true[:, 0]).abs())
    assert losses.MeanSquaredError().name == "mean_squared_error"
    assert losses.MeanAbsoluteError().name == "mean_absolute_error"


def test_sample_weight_shapes():
    y_true, y_pred = seeded.uniform(4, 3, 2), seeded.logits(4, 3, 2)
    loss = losses.MeanSquaredError()
    per_element = loss.call(y_true, y_pred)  # [4, 3]
    for weight, broadcast in (
        (torch.tensor([1.0, 2.0, 0.0, 3.0]), torch.tensor([1.0, 2.0, 0.0, 3.0])[:, None]),
        (torch.tensor([[1.0], [2.0], [0.0], [3.0]]), torch.tensor([1.0, 2.0, 0.0, 3.0])[:, None]),
        (seeded.uniform(4, 3), seeded.uniform(4, 3)),
        (seeded.uniform(4, 3)[..., None], seeded.uniform(4, 3)),
        (torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[1.0, 0.0, 2.0]])),
        (0.5, torch.tensor(0.5)),
    ):
        expected = (per_element * broadcast).sum() / 12
        assert_close(loss(y_true, y_pred, sample_weight=weight), expected)
    with pytest.raises(ValueError, match=r"sample_weight has shape \[3\].*shape \[4, 3\]"):
        loss(y_true, y_pred, sample_weight=torch.ones(3))
    with pytest.raises(ValueError, match=r"sample_weight has shape \[4, 2\]"):
        loss(y_true, y_pred, sample_weight=torch.ones(4, 2))
    with pytest.raises(ValueError, match=r"sample_weight has shape \[4, 3, 2\]"):
        loss(y_true, y_pred, sample_weight=torch.ones(4, 3, 2))
    weight = losses.broadcast_weight(torch.ones(4), per_element)
    assert weight.shape == (4, 1) and weight.dtype == per_element.dtype


def test_an_empty_batch_has_loss_zero():
    loss = losses.SparseCategoricalCrossentropy(from_logits=True)
    empty = loss(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3))
    assert empty.item() == 0.0
    probabilities = losses.SparseCategoricalCrossentropy()
    assert probabilities(torch.zeros(0, dtype=torch.long), torch.zeros(0, 3)).item() == 0.0
    assert not probabilities._probabilities_checked  # an empty first shard checks nothing


def test_half_precision_predictions_are_computed_in_float32():
    logits, labels = seeded.logits(16, 10).bfloat16(), seeded.ids(16, classes=10)
    values = losses.SparseCategoricalCrossentropy(from_logits=True).call(labels, logits)
    assert values.dtype == torch.float32
    assert_close(values, F.cross_entropy(logits.float(), labels, reduction="none"))
    half = losses.BinaryCrossentropy(from_logits=True).call(
        seeded.uniform(4, 2), seeded.logits(4, 2).half()
    )
    assert half.dtype == torch.float32


def test_gradients_match_torchs_cross_entropy():
    logits, labels = seeded.logits(5, 4).requires_grad_(), seeded.ids(5, classes=4)
    losses.SparseCategoricalCrossentropy(from_logits=True)(labels, logits).backward()
    reference = logits.detach().clone().requires_grad_()
    F.cross_entropy(reference, labels).backward()
    assert_close(logits.grad, reference.grad)


def test_shape_errors_name_both_shapes():
    sparse = losses.SparseCategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match=r"y_true has shape \[4\] and y_pred \[4\]"):
        sparse(torch.zeros(4, dtype=torch.long), torch.zeros(4))  # no class dim
    with pytest.raises(ValueError, match=r"y_true has shape \[3\] and y_pred \[4, 5\]"):
        sparse(torch.zeros(3, dtype=torch.long), torch.zeros(4, 5))  # batch sizes differ
    with pytest.raises(ValueError, match="use CategoricalCrossentropy"):
        sparse(torch.zeros(4, 5), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"class id 5 but y_pred has 5 classes"):
        sparse(torch.tensor([0, 5]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"class id -2"):
        sparse(torch.tensor([0, -2]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"class id -100"):  # torch's ignore_index: not ignored
        sparse(torch.tensor([0, -100]), torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"class id 5 but y_pred has 5 classes"):
        losses.SparseCategoricalCrossentropy()(torch.tensor([0, 5]), torch.full((2, 5), 0.2))
    categorical = losses.CategoricalCrossentropy(from_logits=True)
    with pytest.raises(ValueError, match="use SparseCategoricalCrossentropy"):
        categorical(torch.zeros(4, dtype=torch.long), torch.zeros(4, 5))
    with pytest.raises(ValueError, match=r"y_true has shape \[4, 3\] and y_pred \[4, 5\]"):
        categorical(torch.zeros(4, 3), torch.zeros(4, 5))
    for loss in (losses.BinaryCrossentropy(from_logits=True), losses.MeanSquaredError()):
        with pytest.raises(ValueError, match=r"y_true has shape \[4, 3\] and y_pred \[4, 2\]"):
            loss(torch.zeros(4, 3), torch.zeros(4, 2))
        with pytest.raises(ValueError, match=r"y_true has shape \[\] and y_pred \[\]"):
            loss(torch.tensor(1.0), torch.tensor(1.0))
    with pytest.raises(TypeError, match="y_pred is a object"):
        losses.MeanSquaredError()(torch.zeros(2), object())


def test_logits_given_as_probabilities_are_refused_on_the_first_call_only():
    logits, labels = seeded.logits(6, 4), seeded.ids(6, classes=4)
    one_hot = F.one_hot(labels, 4).float()
    for loss, y_true, y_pred in (
        (losses.SparseCategoricalCrossentropy(), labels, logits),
        (losses.CategoricalCrossentropy(), one_hot, logits),
        (losses.BinaryCrossentropy(), one_hot, logits),
    ):
        with pytest.raises(ValueError, match=r"outside \[0, 1\].*from_logits=True"):
            loss(y_true, y_pred)
    loss = losses.SparseCategoricalCrossentropy()
    loss(labels, logits.softmax(dim=-1))
    assert loss._probabilities_checked
    loss(labels, logits.softmax(dim=-1) * 1.5)  # checked once per object: no second host sync


def test_bad_constructor_arguments():
    with pytest.raises(ValueError, match=r"label_smoothing=1\.5"):
        losses.CategoricalCrossentropy(label_smoothing=1.5)
    with pytest.raises(TypeError, match="label_smoothing='a'"):
        losses.BinaryCrossentropy(label_smoothing="a")
    with pytest.raises(TypeError, match="ignore_class='x'"):
        losses.SparseCategoricalCrossentropy(ignore_class="x")
    with pytest.raises(TypeError, match="name=3"):
        losses.MeanSquaredError(name=3)
    with pytest.raises(TypeError, match="fn=3"):
        losses.LossFunctionWrapper(3)
    # The old order was (fn, name): a name in reduction's place says how to pass it.
    with pytest.raises(ValueError, match=r"'my_loss' is not a loss reduction.*pass name=\.\.\."):
        losses.LossFunctionWrapper(losses.mse, "my_loss")
    with pytest.raises(ValueError, match=r"reduction=3 is not a loss reduction") as error:
        losses.LossFunctionWrapper(losses.mse, 3)
    assert "name=" not in str(error.value)
    assert losses.LossFunctionWrapper(losses.mse, name="my_loss").name == "my_loss"


def test_get_resolves_names_classes_instances_and_functions():
    loss = losses.BinaryCrossentropy(from_logits=True)
    assert losses.get(loss) is loss
    expected = {
        "sparse_categorical_crossentropy": losses.SparseCategoricalCrossentropy,
        "Categorical_Crossentropy": losses.CategoricalCrossentropy,
        "binary_crossentropy": losses.BinaryCrossentropy,
        "mse": losses.MeanSquaredError,
        "MEAN_SQUARED_ERROR": losses.MeanSquaredError,
        "MeanAbsoluteError": losses.MeanAbsoluteError,
        "mae": losses.MeanAbsoluteError,
    }
    for name, cls in expected.items():
        assert type(losses.get(name)) is cls
    assert type(losses.get(losses.MeanAbsoluteError)) is losses.MeanAbsoluteError
    with pytest.raises(ValueError, match=r"'hinge' is not a known loss.*sparse_categorical"):
        losses.get("hinge")
    with pytest.raises(TypeError, match="loss=3"):
        losses.get(3)


def test_a_function_is_wrapped_and_must_return_one_loss_per_example():
    def squared(y_true, y_pred):
        return (y_true - y_pred) ** 2

    wrapped = losses.get(squared)
    assert isinstance(wrapped, losses.LossFunctionWrapper) and wrapped.name == "squared"
    y_true, y_pred = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[1.0], [0.0], [5.0]])
    # Aligned as Keras does: [3] against [3, 1] does not broadcast to [3, 3].
    assert_close(wrapped.call(y_true, y_pred), torch.tensor([[0.0], [4.0], [4.0]]))
    assert_close(wrapped(y_true, y_pred), torch.tensor(8.0 / 3))
    scalar = losses.get(lambda y_true, y_pred: ((y_true - y_pred) ** 2).mean())
    with pytest.raises(ValueError, match=r"0-dim tensor.*reduction='none'"):
        scalar(y_true, y_pred)
    with pytest.raises(ValueError, match=r"returned 1.0.*reduction='none'"):
        losses.get(lambda y_true, y_pred: 1.0)(y_true, y_pred)
    torch_loss = losses.get(torch.nn.MSELoss(reduction="none"))
    assert torch_loss.name == "MSELoss"
    assert_close(torch_loss.call(y_true, y_pred), torch.tensor([[0.0], [4.0], [4.0]]))


def test_keras_function_forms_give_one_loss_per_example():
    logits, ids = seeded.logits(2, 5, 4), seeded.ids(2, 5, classes=4)
    expected = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none")  # [2, 5]
    sparse = losses.sparse_categorical_crossentropy
    assert_close(sparse(ids, logits, from_logits=True), expected)
    assert_close(sparse(ids, logits.softmax(-1)), expected)
    ignored = sparse(ids, logits, from_logits=True, ignore_class=0)
    assert_close(ignored, expected.masked_fill(ids == 0, 0.0))
    one_hot = F.one_hot(ids, 4).float()
    assert_close(losses.categorical_crossentropy(one_hot, logits, from_logits=True), expected)
    smoothed = losses.CategoricalCrossentropy(from_logits=True, label_smoothing=0.2)
    assert_close(
        losses.categorical_crossentropy(one_hot, logits, from_logits=True, label_smoothing=0.2),
        smoothed.call(one_hot, logits),
    )
    targets, scores = seeded.uniform(6, 3).round(), seeded.logits(6, 3)
    assert_close(
        losses.binary_crossentropy(targets, scores, from_logits=True),
        F.binary_cross_entropy_with_logits(scores, targets, reduction="none").mean(-1),
    )
    predictions = seeded.uniform(6, 3)
    assert losses.mse is losses.mean_squared_error and losses.mae is losses.mean_absolute_error
    assert_close(losses.mse(targets, predictions), (targets - predictions).square().mean(-1))
    assert_close(losses.mae(targets, predictions), (targets - predictions).abs().mean(-1))


def test_keras_function_forms_check_probabilities_and_refuse_another_axis():
    logits, ids = seeded.logits(6, 4), seeded.ids(6, classes=4)
    # The check runs on the first call of each argument combination (one host sync): forget
    # the calls of earlier tests.
    loss_functions._LOSS_OBJECTS.clear()
    with pytest.raises(ValueError, match="from_logits=False"):
        losses.sparse_categorical_crossentropy(ids, logits)
    with pytest.raises(ValueError, match=r"axis=1.*movedim\(1, -1\)"):
        losses.categorical_crossentropy(logits, logits, axis=1)
    with pytest.raises(TypeError, match=r"ignore_class=\[0\]"):
        losses.sparse_categorical_crossentropy(ids, logits, ignore_class=[0])


def test_a_partial_function_is_named_after_its_function():
    import functools

    from_logits = functools.partial(losses.sparse_categorical_crossentropy, from_logits=True)
    assert losses.get(from_logits).name == "sparse_categorical_crossentropy"
    assert losses.get(losses.mse).name == "mean_squared_error"


@pytest.mark.cuda
def test_on_cuda_calls_after_the_first_never_wait_for_the_device():
    logits, labels = seeded.logits(8, 6, 5).cuda(), seeded.ids(8, 6, classes=5).cuda()
    weights = seeded.uniform(8).cuda()
    checked = [
        losses.SparseCategoricalCrossentropy(),
        losses.CategoricalCrossentropy(),
        losses.BinaryCrossentropy(),
    ]
    one_hot = F.one_hot(labels, 5).float()
    inputs = [
        (labels, logits.softmax(-1)),
        (one_hot, logits.softmax(-1)),
        (one_hot, logits.sigmoid()),
    ]
    for loss, (y_true, y_pred) in zip(checked, inputs, strict=True):
        loss(y_true, y_pred)  # the one probabilities check
    torch.cuda.set_sync_debug_mode("error")
    try:
        for loss, (y_true, y_pred) in zip(checked, inputs, strict=True):
            loss(y_true, y_pred, sample_weight=weights)
        losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=0)(labels, logits)
        losses.MeanSquaredError()(one_hot, logits, sample_weight=weights)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("returned", [torch.tensor(1.5), 1.5], ids=["0-dim", "float"])
def test_a_loss_function_that_does_not_give_one_loss_per_example_is_refused(returned):
    wrapped = losses.LossFunctionWrapper(lambda y_true, y_pred: returned, name="mean_loss")
    with pytest.raises(ValueError, match=r"loss function 'mean_loss' returned .*one loss per"):
        wrapped(torch.ones(4, 2), torch.zeros(4, 2))
