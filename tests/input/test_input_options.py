"""InputOptions(batch_dim=...): sequence-first data split along its batch dimension."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.input import distribute_global_batches
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

VOCAB, SEQ_LEN, SEQUENCES = 13, 5, 7  # 7 sequences: a ragged split over 2 replicas


class SeqFirstLM(nn.Module):
    """pytorch/examples' word_language_model, shrunk: an LSTM over [seq, batch] tokens."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.embed = nn.Embedding(VOCAB, 6)
        self.rnn = nn.LSTM(6, 8)  # batch_first=False: [seq, batch, features]
        self.head = nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        output, _ = self.rnn(self.embed(tokens))
        return self.head(output)


def lm_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(data, targets), both [seq, batch]: targets are the next tokens, kept 2-D."""
    generator = torch.Generator().manual_seed(6)
    stream = torch.randint(0, VOCAB, (4 * SEQ_LEN + 1, SEQUENCES), generator=generator)
    return [
        (stream[i : i + SEQ_LEN], stream[i + 1 : i + 1 + SEQ_LEN])
        for i in range(0, 4 * SEQ_LEN, SEQ_LEN)
    ]


def token_loss(model: nn.Module, data: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean over every token of the global batch: per-token losses over their global
    count (the distributed batch's size counts sequences, not tokens)."""
    logits = model(data)
    per_token = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")
    return mirrored.compute_average_loss(per_token, global_batch_size=SEQ_LEN * SEQUENCES)


def train_plain(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> nn.Module:
    model = SeqFirstLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for data, targets in batches:
        token_loss(model, data, targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _through_the_input_layer(strategy, batches, options):
    return distribute_global_batches(batches, [None] * 2, options=options)


def _through_the_strategy(strategy, batches, options):
    return strategy.experimental_distribute_dataset(batches, options)


@pytest.mark.parametrize(
    "distribute", [_through_the_input_layer, _through_the_strategy], ids=["input", "strategy"]
)
def test_a_sequence_first_lstm_on_two_replicas_equals_the_plain_loop(distribute):
    batches = lm_batches()
    expected = train_plain(batches)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = SeqFirstLM()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.5))

        def step(data, targets):
            token_loss(model, data, targets).backward()
            optimizer.step()
            optimizer.zero_grad()

        options = mirrored.InputOptions(batch_dim=1)
        for data, targets in distribute(strategy, batches, options):
            assert [t.shape[1] for t in data.values] == [4, 3]
            strategy.run(step, (data, targets))
    assert_same_parameters(expected, model.module)
    assert_replicas_identical(model)


@pytest.mark.parametrize("batch_dim", [-1, 1.0, True])
def test_a_batch_dim_that_is_not_a_whole_number_is_refused(batch_dim):
    with pytest.raises(ValueError, match=rf"InputOptions\(batch_dim={batch_dim!r}\)"):
        mirrored.InputOptions(batch_dim=batch_dim)
