"""Load balancing: global batches split by measured replica speed, with unchanged results."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import mirrored
from mirrored.input.load_balancing import ReplicaSpeeds
from tests.reference_loops import (
    OPTIMIZERS,
    Batch,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _record_splits(speeds: ReplicaSpeeds) -> list[list[int]]:
    """Every split ``speeds`` gives from now on, in order."""
    seen: list[list[int]] = []
    split = speeds.sizes

    def recorded(batch_size: int) -> list[int]:
        seen.append(split(batch_size))
        return seen[-1]

    speeds.sizes = recorded  # type: ignore[method-assign]
    return seen


def test_the_split_follows_the_measured_speeds() -> None:
    speeds = ReplicaSpeeds(mirrored.LoadBalancing(every_steps=2, smoothing=0.5), 2)
    assert speeds.sizes(10) == [5, 5]  # nothing measured yet: even
    speeds.record([0.010, 0.030], [5, 5])  # replica 1 three times slower per example
    assert speeds.sizes(10) == [5, 5]  # a window is 2 runs
    speeds.record([0.010, 0.030], [5, 5])
    assert speeds.shares == pytest.approx([0.75, 0.25])
    assert speeds.sizes(64) == [48, 16]
    assert speeds.sizes(10) == [8, 2]  # 7.5 / 2.5: the tie's extra example to replica 0
    # The next window halves toward the newest: replica 1 now as fast as replica 0.
    speeds.record([0.010, 0.010], [5, 5])
    speeds.record([0.010, 0.010], [5, 5])
    assert speeds.seconds_per_example == pytest.approx([0.002, 0.004])
    assert speeds.shares == pytest.approx([2 / 3, 1 / 3])


def test_every_replica_keeps_an_example_and_a_replica_without_one_keeps_its_estimate() -> None:
    speeds = ReplicaSpeeds(mirrored.LoadBalancing(every_steps=1, smoothing=1.0), 3)
    speeds.record([0.001, 1.0, 0.001], [4, 4, 4])
    assert speeds.sizes(3) == [1, 1, 1]
    assert speeds.sizes(2) == [1, 0, 1]
    speeds.record([0.001, 0.0, 0.001], [4, 0, 4])  # replica 1 had nothing to measure
    assert speeds.seconds_per_example[1] == pytest.approx(0.25)


@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_an_uneven_split_gives_the_single_device_parameters(optimizer: str) -> None:
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS[optimizer](expected), make_batches())
    model = make_mlp()
    balancing = mirrored.LoadBalancing(every_steps=1)
    with mirrored.MirroredStrategy(DEVICES[:3], load_balancing=balancing) as strategy:
        assert strategy.replica_speeds is not None
        strategy.replica_speeds.shares = [0.625, 0.125, 0.25]  # as if measured so
        strategy.replica_speeds.options = mirrored.LoadBalancing(every_steps=10**9)
        seen = _record_splits(strategy.replica_speeds)
        mirrored_model, _, _ = train_mirrored(
            strategy, model, OPTIMIZERS[optimizer](model), make_batches()
        )
    assert seen[0] == [10, 2, 4] and seen[-1] == [7, 1, 3]  # 16 and the ragged 11
    assert_same_parameters(expected, mirrored_model.module)
    assert_replicas_identical(mirrored_model)


def test_a_slowed_device_gets_fewer_examples_and_the_step_shortens() -> None:
    # Replica 1 is a device three times slower per example than replica 0 (a sleep stands in
    # for its compute, so that the measurement is not at the mercy of the shared cores).
    cost = [0.0005, 0.0015]  # seconds per example

    def step(batch: Batch, model: mirrored.MirroredModule, optimizer: mirrored.MirroredOptimizer):
        x, y = batch
        replica = mirrored.get_replica_context()
        time.sleep(cost[replica.replica_id_in_sync_group] * len(x))
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return torch.tensor(float(len(x)))

    balancing = mirrored.LoadBalancing(every_steps=4, smoothing=0.5)
    with mirrored.MirroredStrategy(DEVICES[:2], load_balancing=balancing) as strategy:
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(model, OPTIMIZERS["sgd"](model))
        batches = make_batches(num_examples=24 * 64, batch_size=64)
        split = []
        for batch in strategy.experimental_distribute_dataset(batches):
            sizes = strategy.run(step, args=(batch, mirrored_model, optimizer))
            split.append([int(s) for s in strategy.experimental_local_results(sizes)])
    assert split[0] == [32, 32]
    # The step lasts as long as its slowest replica: 48 ms at the even split, 24 ms at the
    # balanced 48 / 16. After a few windows the split is close to balanced.
    step_ms = [max(n * c for n, c in zip(sizes, cost, strict=True)) * 1000 for sizes in split]
    assert step_ms[0] == pytest.approx(48)
    assert split[-1][1] < 22, split
    assert step_ms[-1] < 0.7 * step_ms[0], step_ms


def test_load_balancing_must_be_a_load_balancing_object() -> None:
    with pytest.raises(TypeError, match=r"load_balancing=True: expected mirrored.LoadBalancing"):
        mirrored.MirroredStrategy(DEVICES[:2], load_balancing=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"every_steps=0"):
        mirrored.LoadBalancing(every_steps=0)
    with pytest.raises(ValueError, match=r"smoothing=0"):
        mirrored.LoadBalancing(smoothing=0)


def test_fit_on_an_uneven_split_equals_fit_on_one_device() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(100, 12, generator=generator)
    y = torch.randint(0, 5, (100,), generator=generator)

    def fitted(strategy: mirrored.MirroredStrategy) -> mirrored.Model:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            model.compile(
                optimizer="adam",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            )
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model

    with mirrored.MirroredStrategy(DEVICES[:1]) as one_device:
        expected = fitted(one_device)
    balancing = mirrored.LoadBalancing(every_steps=10**9)
    with mirrored.MirroredStrategy(DEVICES[:2], load_balancing=balancing) as strategy:
        assert strategy.replica_speeds is not None
        strategy.replica_speeds.shares = [0.8125, 0.1875]  # 13 / 3 of each batch of 16
        used = _record_splits(strategy.replica_speeds)
        actual = fitted(strategy)
    assert used[0] == [13, 3] and used[-1] == [3, 1]  # the last batch: 4 examples
    assert_same_parameters(expected.module, actual.module)
