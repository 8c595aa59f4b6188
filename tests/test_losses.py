"""compute_average_loss divides by the global batch size."""

from __future__ import annotations

import pytest
import torch

import mirrored


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
