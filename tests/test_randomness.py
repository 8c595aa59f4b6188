"""Per-replica random streams: different across replicas, reproducible from the seed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.training import make_batches


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


def test_random_ops_of_every_kind_use_the_replica_stream():
    def draws():
        return torch.cat(
            [
                torch.rand(2),
                torch.randn(2),
                torch.empty(2).uniform_(),
                torch.randint(0, 1000, (2,)).float(),
                torch.randperm(4).float(),
                torch.bernoulli(torch.full((4,), 0.5)),
            ]
        )

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        torch.manual_seed(11)
        first = strategy.experimental_local_results(strategy.run(draws))
        torch.manual_seed(11)
        again = strategy.experimental_local_results(strategy.run(draws))
    assert not torch.equal(first[0], first[1])
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
