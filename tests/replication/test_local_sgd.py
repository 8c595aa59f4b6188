"""Local SGD: replicas update on their own gradients and average their parameters periodically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mirrored
from mirrored.replication.local_sgd import LocalSteps
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    merge_batches,
    replica_step,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _replicas_equal(model: mirrored.MirroredModule) -> bool:
    first = model.replicas[0].state_dict()
    return all(
        torch.equal(value, first[name])
        for replica in model.replicas[1:]
        for name, value in replica.state_dict().items()
    )


@pytest.mark.parametrize("ops", ["hierarchical", "one_device"])
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_plain_sgd_averaged_after_every_update_equals_synchronous_training(
    ops: str, num_replicas: int
) -> None:
    # The mean of the replicas' own SGD updates is the update of the summed gradient, ragged
    # last batch included (203 examples).
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["sgd"](expected), make_batches())
    model = make_mlp()
    strategy = mirrored.MirroredStrategy(
        DEVICES[:num_replicas], CROSS_DEVICE_OPS[ops](), local_sgd=mirrored.LocalSGD(period=1)
    )
    with strategy:
        mirrored_model, _, _ = train_mirrored(
            strategy, model, OPTIMIZERS["sgd"](model), make_batches()
        )
    assert_same_parameters(expected, mirrored_model.module)
    assert_replicas_identical(mirrored_model)


def test_replicas_drift_apart_between_averages_and_meet_at_each() -> None:
    batches = make_batches(num_examples=7 * 16, batch_size=16)
    local_sgd = mirrored.LocalSGD(period=3, warmup_steps=2)
    with mirrored.MirroredStrategy(DEVICES[:2], local_sgd=local_sgd) as strategy:
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.Adam(model.parameters(), lr=1e-2)
        )

        met = []
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(replica_step, args=(batch, mirrored_model, optimizer))
            met.append(_replicas_equal(mirrored_model))
    # Two synchronous warm-up updates, then an average after every third local update.
    assert met == [True, True, False, False, True, False, False]
    # The warm-up is synchronous training: equal to one device after its two updates.
    expected = make_mlp()
    with mirrored.MirroredStrategy(DEVICES[:2], local_sgd=local_sgd) as strategy:
        warmed, _, _ = train_mirrored(
            strategy,
            model := make_mlp(),
            torch.optim.Adam(model.parameters(), lr=1e-2),
            batches[:2],
        )
    train_plain(expected, torch.optim.Adam(expected.parameters(), lr=1e-2), batches[:2])
    assert_same_parameters(expected, warmed.module)


def _batch_norm_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))


def test_an_average_is_the_mean_of_the_replicas_parameters_and_running_statistics() -> None:
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    module = _batch_norm_mlp()
    with mirrored.MirroredStrategy(DEVICES[:2], local_sgd=mirrored.LocalSGD(period=2)) as strategy:
        mirrored_model, optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        )
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])
        strategy.run(replica_step, args=(batch, mirrored_model, optimizer))
        assert not _replicas_equal(mirrored_model)  # a local update on each replica's half
        strategy.run(replica_step, args=(batch, mirrored_model, optimizer))  # then the average
        assert_replicas_identical(mirrored_model)
    # Each replica is plain training on its own half (the mean loss of its 8 examples) with
    # its own momentum; the average is the mean of the two.
    replayed = []
    for lo, hi in [(0, 8), (8, 16)]:
        plain = _batch_norm_mlp()
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
        train_plain(plain, plain_optimizer, [(x[lo:hi], y[lo:hi])] * 2)
        replayed.append(plain.state_dict())
    for name, value in module.state_dict().items():
        if value.is_floating_point():
            mean = (replayed[0][name] + replayed[1][name]) / 2
            torch.testing.assert_close(value, mean, msg=name)
            assert not torch.equal(replayed[0][name], replayed[1][name]), name


def test_clipping_in_a_local_update_clips_the_shard_s_mean_gradient() -> None:
    """A local update uses its shard's mean gradient: clip_grad_norm_ inside the replica clips
    that (and logs its norm), as plain training on the shard would, after as before a step."""
    x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
    module = _batch_norm_mlp()
    max_norm = 0.05  # well below the gradients' norms: every update is clipped

    def clipped_step(model, optimizer, loss):
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        after = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.zero_grad()
        return torch.stack([norm, after])

    with mirrored.MirroredStrategy(DEVICES[:2], local_sgd=mirrored.LocalSGD(period=2)) as strategy:
        mirrored_model, optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1)
        )
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])

        def step(batch):
            inputs, labels = batch
            per_example = torch.nn.functional.cross_entropy(
                mirrored_model(inputs), labels, reduction="none"
            )
            return clipped_step(
                mirrored_model, optimizer, mirrored.compute_average_loss(per_example)
            )

        norms = [strategy.experimental_local_results(strategy.run(step, (batch,)))]
        norms.append(strategy.experimental_local_results(strategy.run(step, (batch,))))
    replayed = []
    for replica, (lo, hi) in enumerate([(0, 8), (8, 16)]):
        plain = _batch_norm_mlp()
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        for update in range(2):
            loss = torch.nn.functional.cross_entropy(plain(x[lo:hi]), y[lo:hi])
            plain_norms = clipped_step(plain, plain_optimizer, loss)
            torch.testing.assert_close(norms[update][replica], plain_norms)
        replayed.append(plain.state_dict())
    for name, value in module.state_dict().items():
        if value.is_floating_point():
            torch.testing.assert_close(value, (replayed[0][name] + replayed[1][name]) / 2)


@pytest.mark.float32  # the digits as the example reads them
def test_local_sgd_converges_on_the_digits_close_to_synchronous_training() -> None:
    sklearn = pytest.importorskip("sklearn.datasets")
    digits = sklearn.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16
    y = torch.tensor(digits.target)
    generator = torch.Generator().manual_seed(0)
    order = torch.randperm(len(x), generator=generator)
    train, test = order[:1500], order[1500:]

    def accuracy(local_sgd: mirrored.LocalSGD | None) -> float:
        torch.manual_seed(1)
        module = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
        strategy = mirrored.MirroredStrategy(DEVICES, local_sgd=local_sgd)
        with strategy:
            mirrored_model, optimizer = strategy.mirror(
                module, torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
            )

            shuffle = torch.Generator().manual_seed(2)
            for _ in range(8):
                epoch = train[torch.randperm(len(train), generator=shuffle)]
                batches = [(x[part], y[part]) for part in epoch.split(64)]
                for batch in strategy.experimental_distribute_dataset(batches):
                    strategy.run(replica_step, args=(batch, mirrored_model, optimizer))
        with torch.no_grad():
            return (module(x[test]).argmax(1) == y[test]).float().mean().item()

    synchronous = accuracy(None)
    local = accuracy(mirrored.LocalSGD(period=4, warmup_steps=10))
    assert synchronous > 0.9
    assert local > synchronous - 0.03, (local, synchronous)


def test_the_schedule_counts_warm_up_then_periods_per_replica() -> None:
    steps = LocalSteps(mirrored.LocalSGD(period=2, warmup_steps=1), 2)
    seen = []
    for _ in range(5):
        seen.append((steps.local(0), steps.averages(0)))
        steps.advance(0)
    assert seen == [(False, False), (True, False), (True, True), (True, False), (True, True)]
    steps.align()
    assert steps.local(1) and steps.averages(1) == steps.averages(0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"period": 0}, r"period=0\): expected a whole number >= 1"),
        ({"period": 2.5}, r"period=2.5\): expected a whole number >= 1"),
        ({"period": 2, "warmup_steps": -1}, r"warmup_steps=-1\): expected a whole number >= 0"),
    ],
)
def test_bad_local_sgd_options_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mirrored.LocalSGD(**kwargs)  # type: ignore[arg-type]


def test_local_sgd_must_be_a_local_sgd_object() -> None:
    with pytest.raises(TypeError, match=r"local_sgd=4: expected mirrored.LocalSGD"):
        mirrored.MirroredStrategy(DEVICES[:2], local_sgd=4)  # type: ignore[arg-type]


def test_local_sgd_composes_with_gradient_accumulation() -> None:
    # Each window's mean gradient drives a local update; averaged after every update, plain
    # SGD is synchronous training on the windows' examples.
    batches = make_batches(num_examples=8 * 16, batch_size=16)
    expected = make_mlp()
    train_plain(expected, OPTIMIZERS["sgd"](expected), merge_batches(batches, 2))
    model = make_mlp()
    strategy = mirrored.MirroredStrategy(
        DEVICES[:2], gradient_accumulation_steps=2, local_sgd=mirrored.LocalSGD(period=1)
    )
    with strategy:
        mirrored_model, _, _ = train_mirrored(strategy, model, OPTIMIZERS["sgd"](model), batches)
    assert_same_parameters(expected, mirrored_model.module)
    assert_replicas_identical(mirrored_model)
