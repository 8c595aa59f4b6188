"""Per-replica random streams: different across replicas, reproducible from the seed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.reference_loops import make_batches


def _dropout_masks(strategy):
    return strategy.experimental_local_results(
        strategy.run(lambda: F.dropout(torch.ones(64), p=0.5, training=True))
    )


def test_dropout_differs_across_replicas_and_repeats_with_the_seed():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        torch.manual_seed(7)
        first = _dropout_masks(strategy)
        second = _dropout_masks(strategy)
        torch.manual_seed(7)
        again = _dropout_masks(strategy)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    assert not torch.equal(first[0], second[0])  # the stream advances
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_a_step_without_random_ops_leaves_the_callers_random_stream_alone():
    torch.manual_seed(3)
    expected = torch.rand(4)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(3)
        strategy.run(lambda: torch.ones(3) * 2)
        assert torch.equal(torch.rand(4), expected)


RANDOM_OPS = {
    "rand": lambda: torch.rand(8),
    "randn": lambda: torch.randn(8),
    "uniform_": lambda: torch.empty(8).uniform_(),
    "normal_": lambda: torch.empty(8).normal_(),
    "randint": lambda: torch.randint(0, 10**6, (8,)).float(),
    "randperm": lambda: torch.randperm(64).float(),
    "bernoulli": lambda: torch.bernoulli(torch.full((64,), 0.5)),
    "multinomial": lambda: torch.multinomial(torch.ones(64), 8).float(),
    "dropout": lambda: F.dropout(torch.ones(64), 0.5, True),
    "module_dropout": lambda: nn.Dropout(0.5)(torch.ones(64)),
    "gamma": lambda: torch.distributions.Gamma(torch.ones(8), torch.ones(8)).sample(),
    "dirichlet": lambda: torch.distributions.Dirichlet(torch.ones(8)).sample(),
    "binomial": lambda: torch.distributions.Binomial(100, torch.full((8,), 0.5)).sample(),
    "sdpa_dropout": lambda: F.scaled_dot_product_attention(
        torch.ones(1, 4, 4), torch.ones(1, 4, 4), torch.ones(1, 4, 4), dropout_p=0.5
    ),
}


@pytest.mark.parametrize("name", sorted(RANDOM_OPS))
def test_each_random_op_uses_the_replica_stream(name):
    op = RANDOM_OPS[name]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(11)
        first = strategy.experimental_local_results(strategy.run(op))
        torch.manual_seed(11)
        again = strategy.experimental_local_results(strategy.run(op))
        # The caller's stream moved by exactly the one seed draw of the step, whatever the op.
        torch.manual_seed(123)
        torch.empty((), dtype=torch.int64).random_()
        expected_next = torch.rand(4)
        torch.manual_seed(123)
        strategy.run(op)
        assert torch.equal(torch.rand(4), expected_next)
    assert not torch.equal(first[0], first[1]), "replicas drew the same numbers"
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


def test_eval_mode_dropout_and_plain_ops_are_not_random():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        outputs = strategy.experimental_local_results(
            strategy.run(lambda: F.dropout(torch.ones(8), p=0.5, training=False))
        )
        assert all(torch.equal(o, torch.ones(8)) for o in outputs)


def _train_with_dropout(seed):
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters(), 1e-2))

        def step(batch):
            x, y = batch
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(make_batches()):
            strategy.run(step, args=(batch,))
        return model.state_dict()


def test_training_with_dropout_is_reproducible_bit_for_bit():
    first, second, other = _train_with_dropout(0), _train_with_dropout(0), _train_with_dropout(1)
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_one_replica_draws_exactly_what_the_plain_loop_draws():
    torch.manual_seed(5)
    expected = F.dropout(torch.ones(32), p=0.5, training=True)
    with mirrored.MirroredStrategy(["cpu:0"]) as strategy:
        torch.manual_seed(5)
        assert torch.equal(strategy.run(lambda: F.dropout(torch.ones(32), 0.5, True)), expected)
