"""``compile(input_options=InputOptions(batch_dim=1))``: fit, evaluate and predict of a
sequence-first model (``nn.LSTM``'s default layout) split every batch along dim 1, and end where
the same model fit batch-first on one device ends, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.training import parameter_server_fit
from mirrored.training.loop import FitRequest
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

SEQ, EXAMPLES, BATCH, VOCAB, HIDDEN = 5, 23, 8, 7, 6  # 23 = 2 * 8 + 7: a ragged last batch


class SequenceFirst(nn.Module):
    """A tagger on ``[seq, batch]`` token ids, returning ``[seq, batch, vocab]`` logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.rnn = nn.LSTM(HIDDEN, HIDDEN)
        self.out = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(self.rnn(self.embed(tokens))[0])


class BatchFirst(nn.Module):
    """The same model on ``[batch, seq]`` data: the reference, on one device."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SequenceFirst()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.inner(tokens.t()).transpose(0, 1)


def sequence_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, next tokens and per-token weights, ``[seq, examples]``."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SEQ, EXAMPLES), generator=generator)
    targets = torch.randint(0, VOCAB, (SEQ, EXAMPLES), generator=generator)
    weights = torch.rand(SEQ, EXAMPLES, generator=generator)
    return tokens, targets, weights


def compile_model(
    module: nn.Module, strategy: mirrored.Strategy, batch_dim: int, steps_per_execution: int = 1
) -> mirrored.Model:
    with strategy.scope():
        model = mirrored.Model(module)
        model.compile(
            optimizer=torch.optim.Adam(module.parameters(), lr=0.05),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["sparse_categorical_accuracy"],
            weighted_metrics=["sparse_categorical_accuracy"],
            steps_per_execution=steps_per_execution,
            input_options=mirrored.InputOptions(batch_dim=batch_dim),
        )
    return model


def reference(
    batch: int,
) -> tuple[mirrored.Model, dict[str, float], dict[str, float], torch.Tensor]:
    """Fit, evaluate and predict batch-first on the default strategy."""
    tokens, targets, weights = sequence_data()
    model = compile_model(BatchFirst(), mirrored.get_strategy(), batch_dim=0)
    torch.manual_seed(5)
    history = model.fit(
        tokens.t(), targets.t(), batch, 2, 0, sample_weight=weights.t(), shuffle=True
    )
    logs = model.evaluate(tokens.t(), targets.t(), batch, 0, weights.t(), return_dict=True)
    return model, history.history, logs, model.predict(tokens.t(), batch, 0)


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
@pytest.mark.parametrize("source", ["arrays", "batches", "executions-of-3", "tiny-batches"])
def test_sequence_first_fit_evaluate_predict_equal_batch_first(
    num_replicas: int, source: str
) -> None:
    """Arrays and lists of batches, three batches per ``strategy.run``, and batches of two
    examples (an empty shard on the third replica) all end where batch-first data ends."""
    tokens, targets, weights = sequence_data()
    batch = 2 if source == "tiny-batches" else BATCH
    expected_model, expected_history, expected_logs, expected_predictions = reference(batch)
    per_execution = 3 if source == "executions-of-3" else 1
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        model = compile_model(SequenceFirst(), strategy, 1, per_execution)
        torch.manual_seed(5)
        if source == "batches":  # fit's own draws of the order, epoch by epoch
            for order in [torch.randperm(EXAMPLES) for _ in range(2)]:
                epoch = [(tokens[:, i], targets[:, i], weights[:, i]) for i in order.split(batch)]
                history = model.fit(epoch, epochs=1, verbose=0)
            for name, values in expected_history.items():
                assert history.history[name] == pytest.approx(values[-1:], rel=1e-12), name
        else:
            history = model.fit(tokens, targets, batch, 2, 0, sample_weight=weights, shuffle=True)
            for name, values in expected_history.items():
                assert history.history[name] == pytest.approx(values, rel=1e-12), name
        assert_same_parameters(model.module, expected_model.module.inner)
        assert_replicas_identical(model._mirrored_module())
        logs = model.evaluate(tokens, targets, batch, 0, weights, return_dict=True)
        assert logs == pytest.approx(expected_logs, rel=1e-12)
        predictions = model.predict(tokens, batch, 0)
    assert predictions.shape == (SEQ, EXAMPLES, VOCAB)  # the batch stays in dim 1
    torch.testing.assert_close(predictions, expected_predictions.transpose(0, 1))


class OwnLoss(SequenceFirst):
    """A sequence-first model that computes its own loss, returned in a mapping without
    logits (``compile(loss=None)``)."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = super().forward(tokens)
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten())}


def test_a_model_s_own_loss_trains_on_sequence_first_data() -> None:
    """Its mean over a shard's elements, weighted to the global batch's mean: the same
    parameters as one device on the whole batch."""
    tokens, targets, _ = sequence_data()
    x = {"tokens": tokens, "labels": targets}
    trained = []
    for devices in (["cpu:0"], ["cpu:0", "cpu:1"]):
        with mirrored.MirroredStrategy(devices) as strategy, strategy.scope():
            model = mirrored.Model(OwnLoss())
            model.compile(
                torch.optim.SGD(model.parameters(), lr=0.5),
                loss=None,
                input_options=mirrored.InputOptions(batch_dim=1),
            )
            model.fit(x, batch_size=EXAMPLES, epochs=2, shuffle=False, verbose=0)
            trained.append(model.module)
    assert_same_parameters(trained[1], trained[0])


def test_compile_refuses_reading_ahead() -> None:
    with mirrored.MirroredStrategy(["cpu:0"]).scope():
        model = mirrored.Model(SequenceFirst())
        options = mirrored.InputOptions(experimental_per_replica_buffer_size=2)
        with pytest.raises(ValueError, match="read ahead in the data instead"):
            model.compile("sgd", "mse", input_options=options)


def test_validation_data_is_split_along_the_same_dimension() -> None:
    tokens, targets, _ = sequence_data()
    expected = compile_model(BatchFirst(), mirrored.get_strategy(), batch_dim=0)
    expected_logs = expected.fit(
        tokens.t(), targets.t(), 4, 1, 0, validation_data=(tokens.t(), targets.t())
    ).history
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = compile_model(SequenceFirst(), strategy, 1)
        logs = model.fit(tokens, targets, 4, 1, 0, validation_data=(tokens, targets)).history
    for name, values in expected_logs.items():
        assert logs[name] == pytest.approx(values, rel=1e-12), name


def test_targets_without_the_batch_dimension_are_refused() -> None:
    tokens, targets, _ = sequence_data()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = compile_model(SequenceFirst(), strategy, 1)
        with pytest.raises(ValueError, match=r"dim 1.*batch_dim.*y\(23,\)"):
            model.fit(tokens, targets[0], BATCH, 1, 0)  # arrays
        with pytest.raises(ValueError, match=r"batch_dim=1.*shape \[23\]"):
            model.fit([(tokens, targets[0])], verbose=0)  # batches


def test_predictions_that_are_batch_first_are_refused() -> None:
    """A model that returns ``[batch, ...]`` from sequence-first inputs would have its
    predictions read along the wrong dimension: refused, naming the shapes."""

    class LastStep(SequenceFirst):
        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return super().forward(tokens)[-1]  # [batch, vocab]

    tokens, targets, _ = sequence_data()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = compile_model(LastStep(), strategy, 1)
        with pytest.raises(ValueError, match=r"batch_dim=1.*shape \[1[12], 7\]"):
            model.fit(tokens, targets, 24, 1, 0)


def test_compile_refuses_what_is_not_input_options() -> None:
    with mirrored.MirroredStrategy(["cpu:0"]).scope():
        model = mirrored.Model(SequenceFirst())
        with pytest.raises(TypeError, match="InputOptions"):
            model.compile("sgd", "mse", input_options={"batch_dim": 1})


def test_fit_on_parameter_servers_refuses_another_batch_dimension() -> None:
    """Its workers batch their own data batch-first; refused before anything is scheduled."""
    request = FitRequest(
        x=torch.zeros(SEQ, EXAMPLES),
        y=torch.zeros(SEQ, EXAMPLES),
        sample_weight=None,
        batch_size=BATCH,
        batch_dim=1,
        shuffle=False,
        epochs=1,
        initial_epoch=0,
        steps_per_epoch=2,
        verbose=0,
        callbacks=None,
        validation=None,
        validate_at=lambda epoch: False,
    )
    with pytest.raises(ValueError, match=r"batch_dim=1.*ParameterServerStrategy reads batch-first"):
        parameter_server_fit.check_fit(request)
