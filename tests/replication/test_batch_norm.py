"""BatchNorm: per-replica statistics by default, global-batch statistics with sync_batch_norm."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.replication.batch_norm import MirroredSyncBatchNorm
from tests.reference_loops import assert_replicas_identical, assert_same_parameters, make_batches

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


def make_bn_net(seed: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(12, 16),
        nn.BatchNorm1d(16),
        nn.ReLU(),
        nn.Linear(16, 8),
        nn.BatchNorm1d(8, momentum=None),
        nn.ReLU(),
        nn.Linear(8, 5),
    )


def _train(strategy, module, batches, sync_batch_norm=False):
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    if strategy is None:
        for x, y in batches:
            F.cross_entropy(module(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return module
    model, optimizer = strategy.mirror(module, optimizer, sync_batch_norm=sync_batch_norm)

    def step(batch):
        x, y = batch
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(batch,))
    return model


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_sync_batch_norm_equals_single_device_batch_norm(num_replicas):
    batches = make_batches(num_examples=150, batch_size=32)  # last batch: 22 examples
    reference = _train(None, make_bn_net(), batches)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(num_replicas)]) as strategy:
        model = _train(strategy, make_bn_net(), batches, sync_batch_norm=True)
        assert isinstance(model.replicas[1][1], MirroredSyncBatchNorm)
    assert_same_parameters(reference, model)  # includes running stats
    assert_replicas_identical(model)
    model.eval()
    x = batches[0][0]
    reference.eval()
    torch.testing.assert_close(model(x), reference(x))


def test_per_replica_batch_norm_keeps_running_statistics_identical():
    batches = make_batches(num_examples=96, batch_size=32)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model = _train(strategy, make_bn_net(), batches)
        assert_replicas_identical(model)
        bn = model.replicas[0][1]
        assert bn.num_batches_tracked.item() == len(batches)
        # Running mean = mean over replicas of per-replica updates: not the single-device value.
        reference = _train(None, make_bn_net(), batches)
        assert not torch.allclose(bn.running_var, reference[1].running_var, rtol=1e-3)


def test_sync_batch_norm_conversion_keeps_parameters_and_state():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_bn_net()
        weight = module[1].weight
        model = strategy.mirror(module, sync_batch_norm=True)
        assert model.replicas[0][1].weight is weight
        assert isinstance(model.replicas[0][4], MirroredSyncBatchNorm)
        assert model.replicas[0][4].momentum is None
        with pytest.raises(ValueError, match="at least 2D"):
            strategy.run(lambda: model.replicas[0][1](torch.ones(3)))
