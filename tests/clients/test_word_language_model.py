"""pytorch/examples' word_language_model ported to MirroredStrategy: an LSTM language model on
sequence-first batches, trained without an optimizer (``clip_grad_norm_``, then
``p.data.add_(p.grad, alpha=-lr)`` on every parameter), against the plain program, in float64.

Upstream's ``RNNModel`` (embedding, LSTM, linear decoder, log-softmax; dropout at 0 so that the
runs compare number for number), ``batchify`` and ``get_batch`` with bptt, made tiny. The port's
changes: the model is mirrored (no optimizer), batches are split along dim 1
(``InputOptions(batch_dim=1)``), targets stay ``[bptt, batch]`` and are flattened in the step,
and the per-token losses go through ``compute_average_loss`` with the global count of tokens.
Both programs start each batch from a zero hidden state (upstream carries it over, which would
need a per-replica state kept between runs).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.reference_loops import assert_replicas_identical, assert_same_parameters

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

NTOKENS, EMSIZE, NHID, BPTT, BATCH_SIZE, LR, CLIP = 20, 8, 8, 5, 6, 2.0, 0.25


class RNNModel(nn.Module):
    """upstream's model, LSTM only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.drop = nn.Dropout(0.0)
        self.encoder = nn.Embedding(NTOKENS, EMSIZE)
        self.rnn = nn.LSTM(EMSIZE, NHID, 1, dropout=0.0)
        self.decoder = nn.Linear(NHID, NTOKENS)
        self.encoder.weight.data.uniform_(-0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1)

    def forward(self, input, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, NTOKENS)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz):
        weight = next(self.parameters())
        return (weight.new_zeros(1, bsz, NHID), weight.new_zeros(1, bsz, NHID))


def batchify(data, bsz):
    """upstream's: the token stream as ``bsz`` columns (sequence first)."""
    nbatch = data.size(0) // bsz
    return data.narrow(0, 0, nbatch * bsz).view(bsz, -1).t().contiguous()


def get_batch(source, i):
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len]


def _train_data():
    tokens = torch.randint(
        0, NTOKENS, (BATCH_SIZE * 21,), generator=torch.Generator().manual_seed(0)
    )
    source = batchify(tokens, BATCH_SIZE)
    return [get_batch(source, i) for i in range(0, source.size(0) - 1, BPTT)]


def train_plain(batches):
    model = RNNModel()
    criterion = nn.NLLLoss()
    for data, targets in batches:
        model.zero_grad()
        output, _ = model(data, model.init_hidden(BATCH_SIZE))
        loss = criterion(output, targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)
    return model


def train_port(strategy, batches):
    model = strategy.mirror(RNNModel())

    def step(data, targets):
        model.zero_grad()
        output, _ = model(data, model.init_hidden(data.size(1)))
        per_token = F.nll_loss(output, targets.reshape(-1), reduction="none")
        tokens = targets.size(0) * BATCH_SIZE  # this batch's tokens, over all replicas
        mirrored.compute_average_loss(per_token, global_batch_size=tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-LR)

    options = mirrored.InputOptions(batch_dim=1)
    for data, targets in strategy.experimental_distribute_dataset(batches, options):
        strategy.run(step, args=(data, targets))
    return model


@pytest.mark.parametrize("num_devices", [1, 2, 4])
def test_the_port_trains_as_the_plain_program(num_devices):
    batches = _train_data()
    assert [tuple(data.shape) for data, _ in batches][-1] == (BPTT, BATCH_SIZE)
    expected = train_plain(batches)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_devices)]) as strategy:
        model = train_port(strategy, batches)
    assert_same_parameters(expected, model)
    assert_replicas_identical(model)
