"""Hugging Face models in Model.fit: their own loss (compile(loss=None)) scaled to the global mean,
ModelOutput logits for compiled losses and metrics, data without y; N replicas == the plain loop."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

import mirrored
from mirrored.training.targets import shifts_labels, targets_of
from tests.exactness import (
    assert_values_within_reordering,
    assert_within_reordering,
    reversed_examples,
)
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

transformers = pytest.importorskip("transformers")

VOCAB, SEQUENCE, NUM_EXAMPLES, BATCH = 40, 8, 22, 8  # batches of 8, 8, 6: uneven shards
# SGD, not Adam: an attention key bias has a gradient of 0 up to rounding, which Adam's
# normalisation would blow up to full-size steps in directions rounding decides.
LEARNING_RATE = 0.5


def tiny_bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=SEQUENCE,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertForMaskedLM(config)


def tiny_gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=SEQUENCE,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config)


def masked_lm_inputs() -> dict[str, torch.Tensor]:
    """Token ids whose labels are -100 except at about 30% of the positions, so that the shards
    hold different numbers of labels."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (NUM_EXAMPLES, SEQUENCE), generator=generator)
    chosen = torch.rand(NUM_EXAMPLES, SEQUENCE, generator=generator) < 0.3
    labels = torch.where(chosen, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def causal_lm_batches() -> DataLoader[dict[str, torch.Tensor]]:
    """What a language-modelling collator yields: dicts of batches, labels = input ids."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (NUM_EXAMPLES, SEQUENCE), generator=generator)
    examples = [{"input_ids": row, "labels": row} for row in ids]
    return DataLoader(examples, batch_size=BATCH)  # type: ignore[arg-type]


def batches_of(inputs: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    for start in range(0, NUM_EXAMPLES, BATCH):
        yield {k: v[start : start + BATCH] for k, v in inputs.items()}


def plain_loop(
    module: nn.Module, batches: Callable[[], Iterator[dict[str, torch.Tensor]]], epochs: int
) -> list[float]:
    """The Hugging Face training loop on one device: backward from out.loss. Returns each
    epoch's loss, the mean over every label that is not -100."""
    optimizer = torch.optim.SGD(module.parameters(), lr=LEARNING_RATE)
    epoch_losses = []
    for _ in range(epochs):
        total, count = 0.0, 0
        for batch in batches():
            out = module(**batch)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            labels = int((batch["labels"] != -100).sum())
            total, count = total + out.loss.item() * labels, count + labels
        epoch_losses.append(total / count)
    return epoch_losses


def strategy_for(num_replicas: int) -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)])


def own_loss_model(strategy: mirrored.Strategy, module: nn.Module, **kwargs: Any) -> mirrored.Model:
    with strategy.scope():
        model = mirrored.Model(module)
        optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
        model.compile(optimizer=optimizer, loss=None, **kwargs)
    return model


# transformers computes a model's own loss in float32 (it casts the logits), even in a float64
# model: the tests of a model's own loss compare against the plain loop's own rounding, the
# plain loop again on batches whose examples are reversed (tests/exactness.py).


@pytest.mark.filterwarnings("error::mirrored.LossScalingWarning")
@pytest.mark.parametrize("num_replicas", [1, 2, 3, 4])
def test_a_masked_lm_fits_on_its_own_loss_as_on_one_device(num_replicas: int) -> None:
    inputs = masked_lm_inputs()
    reference = tiny_bert()
    module, reordered = copy.deepcopy(reference), copy.deepcopy(reference)
    expected_losses = plain_loop(reference, lambda: batches_of(inputs), epochs=2)
    reordered_losses = plain_loop(
        reordered, lambda: map(reversed_examples, batches_of(inputs)), epochs=2
    )
    with strategy_for(num_replicas) as strategy:
        model = own_loss_model(strategy, module)
        # Dict arrays without y: the labels travel in x.
        history = model.fit(inputs, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert_within_reordering(reference, model.module, reordered)
        if num_replicas > 1:
            assert_replicas_identical(model._replicas)
    # The logged loss is the mean over the epoch's labels, what one device reports.
    assert_values_within_reordering(history.history["loss"], expected_losses, reordered_losses)


@pytest.mark.filterwarnings("error::mirrored.LossScalingWarning")
@pytest.mark.parametrize("num_replicas", [2, 4])
def test_a_causal_lm_fits_from_dict_batches_as_on_one_device(num_replicas: int) -> None:
    reference = tiny_gpt2()
    module, reordered = copy.deepcopy(reference), copy.deepcopy(reference)
    expected_losses = plain_loop(reference, lambda: iter(causal_lm_batches()), epochs=2)
    reordered_losses = plain_loop(
        reordered, lambda: map(reversed_examples, causal_lm_batches()), epochs=2
    )
    with strategy_for(num_replicas) as strategy:
        model = own_loss_model(strategy, module)
        history = model.fit(causal_lm_batches(), epochs=2, verbose=0)  # batches are dicts
        assert_within_reordering(reference, model.module, reordered)
    assert_values_within_reordering(history.history["loss"], expected_losses, reordered_losses)


def padded_causal_lm_batch() -> dict[str, torch.Tensor]:
    """One batch of 8 right-padded sequences: the first half padded a lot (their labels -100
    there), the second half not at all, so the shards hold different numbers of labels."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB, (BATCH, SEQUENCE), generator=generator)
    lengths = torch.tensor([2, 3, 3, 4, 8, 8, 7, 8])
    padding = torch.arange(SEQUENCE) >= lengths[:, None]
    labels = ids.masked_fill(padding, -100)
    return {"input_ids": ids.masked_fill(padding, 0), "labels": labels}


@pytest.mark.filterwarnings("error::mirrored.LossScalingWarning")
@pytest.mark.parametrize("num_replicas", [2, 4])
def test_a_causal_lm_s_own_loss_counts_its_shifted_labels(num_replicas: int) -> None:
    """A causal LM averages its loss over labels[..., 1:] (token t+1 predicted at t): with
    padding that differs between shards, each shard's share must count those."""
    batch = padded_causal_lm_batch()
    reference = tiny_gpt2()
    module, reordered = copy.deepcopy(reference), copy.deepcopy(reference)
    expected_loss = plain_loop(reference, lambda: iter([batch]), epochs=1)
    reordered_loss = plain_loop(reordered, lambda: iter([reversed_examples(batch)]), epochs=1)
    with strategy_for(num_replicas) as strategy:
        model = own_loss_model(strategy, module)
        history = model.fit(batch, batch_size=BATCH, shuffle=False, verbose=0)
        assert_within_reordering(reference, model.module, reordered)
    assert_values_within_reordering(history.history["loss"], expected_loss, reordered_loss)


def test_a_causal_lm_s_metrics_and_compiled_loss_compare_logits_with_the_next_token() -> None:
    """Without y, the targets of a causal LM's logits at position t are x["labels"] at t + 1."""
    batch = padded_causal_lm_batch()
    module = tiny_gpt2().eval()
    with torch.no_grad():
        logits = module(**batch).logits[:, :-1]
    targets = batch["labels"][:, 1:]
    valid = targets != -100
    correct = (logits.argmax(-1) == targets)[valid].double().mean()
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    expected_loss = per_token.sum() / batch["labels"].numel()  # every position counts
    with strategy_for(2) as strategy:
        model = own_loss_model(strategy, copy.deepcopy(module), metrics=["accuracy"])
        results = model.evaluate(batch, batch_size=BATCH, verbose=0, return_dict=True)
        with strategy.scope():
            compiled = mirrored.Model(module)
            compiled.compile(loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
        loss = compiled.evaluate(batch, batch_size=BATCH, verbose=0)
    assert results["accuracy"] == pytest.approx(correct.item(), rel=1e-12)
    assert loss == pytest.approx(expected_loss.item(), rel=1e-6)


def test_only_causal_lms_compare_position_t_with_the_label_of_t_plus_1() -> None:
    t5 = transformers.T5Config(
        num_layers=1, d_model=8, num_heads=2, d_ff=8, d_kv=4, vocab_size=VOCAB
    )
    assert shifts_labels(tiny_gpt2())
    assert not shifts_labels(tiny_bert())  # a masked LM: each position its own label
    assert not shifts_labels(transformers.T5ForConditionalGeneration(t5))  # encoder-decoder
    assert not shifts_labels(_Classifier())
    labels = torch.tensor([[5, 6, 7, -100]])
    targets = targets_of({"labels": labels}, None, None, shifted=True)
    assert targets.y.tolist() == [[6, 7, 0, 0]] and targets.mask.tolist() == [[1, 1, 0, 0]]
    given = torch.tensor([[9, -100, 8, -100]])  # a collator's own shifted labels are taken
    targets = targets_of({"labels": labels, "shift_labels": given}, None, None, shifted=True)
    assert targets.y.tolist() == [[9, 0, 8, 0]] and targets.mask.tolist() == [[1, 0, 1, 0]]


def test_evaluate_reports_the_mean_over_labels_and_metrics_skip_the_ignored_ones() -> None:
    inputs = masked_lm_inputs()
    module = tiny_bert()
    with torch.no_grad():
        out = module(**inputs)  # the whole data set as one batch
    valid = inputs["labels"] != -100
    correct = (out.logits.argmax(-1) == inputs["labels"])[valid].double().mean()
    with strategy_for(3) as strategy:
        model = own_loss_model(strategy, module, metrics=["accuracy"])
        results = model.evaluate(inputs, batch_size=BATCH, verbose=0, return_dict=True)
        predicted = model.predict(inputs, batch_size=BATCH, verbose=0)
    assert results["loss"] == pytest.approx(out.loss.item(), rel=1e-6)
    assert results["accuracy"] == pytest.approx(correct.item(), rel=1e-12)
    # predict returns the per-example outputs as a dict, without the model's mean loss.
    assert set(predicted) == {"logits"}
    torch.testing.assert_close(predicted["logits"], out.logits)


def test_a_compiled_loss_takes_the_logits_and_the_labels_of_x() -> None:
    """Without y, the targets are x["labels"], their -100 positions weighted 0: Keras's
    sum_over_batch_size divides by every position of the global batch."""
    inputs = masked_lm_inputs()
    module = tiny_bert()
    with torch.no_grad():
        logits = module(**inputs).logits
    labels = inputs["labels"]
    per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    expected = per_token.sum() / labels.numel()  # cross_entropy gives 0 at -100
    with strategy_for(3) as strategy, strategy.scope():
        model = mirrored.Model(module)
        model.compile(loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
        loss = model.evaluate(inputs, batch_size=BATCH, verbose=0)
    assert loss == pytest.approx(expected.item(), rel=1e-6)


class _Classifier(nn.Module):
    """A module that returns a mapping with logits, as a Hugging Face classifier does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))

    def forward(self, features: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"logits": self.body(features)}


def test_a_mapping_output_with_y_trains_on_its_logits_as_the_plain_loop() -> None:
    generator = torch.Generator().manual_seed(2)
    x, y = torch.randn(30, 6, generator=generator), torch.randint(0, 3, (30,), generator=generator)
    reference = _Classifier()
    module = copy.deepcopy(reference)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for start in range(0, 30, BATCH):
        logits = reference(x[start : start + BATCH])["logits"]
        F.cross_entropy(logits, y[start : start + BATCH]).backward()
        optimizer.step()
        optimizer.zero_grad()
    with strategy_for(3) as strategy, strategy.scope():
        model = mirrored.Model(module)
        model.compile(
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        history = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    assert_same_parameters(reference, model.module)
    assert set(history.history) == {"loss", "accuracy", "learning_rate"}


class TestMistakes:
    def test_own_loss_without_labels_names_the_fix(self) -> None:
        inputs = masked_lm_inputs()
        del inputs["labels"]
        model = own_loss_model(mirrored.get_strategy(), tiny_bert())
        with pytest.raises(ValueError, match=r"loss=None.*without a 'loss'.*labels"):
            model.fit(inputs, batch_size=BATCH, verbose=0)

    def test_a_compiled_loss_without_targets_names_the_fix(self) -> None:
        inputs = masked_lm_inputs()
        del inputs["labels"]
        model = mirrored.Model(tiny_bert())
        model.compile(loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True))
        with pytest.raises(ValueError, match=r"no targets.*'labels'.*loss=None"):
            model.evaluate(inputs, batch_size=BATCH, verbose=0)

    def test_metrics_without_targets_name_the_fix(self) -> None:
        generator = torch.Generator().manual_seed(3)
        ids = torch.randint(0, VOCAB, (4, SEQUENCE), generator=generator)
        model = own_loss_model(mirrored.get_strategy(), _OwnLoss(), metrics=["accuracy"])
        with pytest.raises(ValueError, match=r"metrics.*pass y, or x as a dict carrying"):
            model.evaluate({"ids": ids}, batch_size=4, verbose=0)

    def test_a_mapping_without_logits_names_its_keys(self) -> None:
        x = torch.zeros(4, 6)
        model = mirrored.Model(_Scores())
        model.compile(loss="mse")
        with pytest.raises(TypeError, match=r"keys \['scores'\].*'logits'"):
            model.evaluate(x, torch.zeros(4, 3), verbose=0)


class _OwnLoss(nn.Module):
    """A model that computes its own loss from its inputs alone (no labels)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCAB, 4)

    def forward(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        embedded = self.embedding(ids)
        return {"loss": embedded.square().mean(), "logits": embedded}


class _Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"scores": self.linear(x)}
