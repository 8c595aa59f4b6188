"""Gradient accumulation: k micro-steps on batches of B equal one step on their kB examples."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import mirrored
from mirrored.replication.accumulation import AccumulationWindow
from mirrored.training.float16_loss_scale import LossScale
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    Batch,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    merge_batches,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def strategy_with(num_replicas: int, steps: int, ops: str = "default") -> mirrored.MirroredStrategy:
    return mirrored.MirroredStrategy(
        DEVICES[:num_replicas],
        CROSS_DEVICE_OPS[ops](),
        gradient_accumulation_steps=steps,
    )


@pytest.mark.parametrize(
    ("num_replicas", "steps", "optimizer", "ops", "set_to_none"),
    [
        (1, 2, "adam", "default", True),
        (2, 2, "adam", "hierarchical", True),  # each parameter reduced and updated by its owner
        (2, 2, "adam", "one_device", True),  # bucketed all-reduce, every replica updates
        (2, 2, "adam", "one_device", False),  # gradients kept in the all-reduce's buffers
        (2, 3, "sgd_momentum", "hierarchical", False),
        (2, 3, "custom", "default", True),  # an unknown optimizer: the full update everywhere
        (4, 2, "adam", "default", True),
    ],
)
def test_k_micro_steps_equal_one_step_on_their_examples(
    num_replicas: int, steps: int, optimizer: str, ops: str, set_to_none: bool
) -> None:
    # 13 batches of 16: the last window is unfinished, so its gradients never reach an update.
    batches = make_batches(num_examples=13 * 16, batch_size=16)
    expected = make_mlp()
    plain_losses = train_plain(
        expected, OPTIMIZERS[optimizer](expected), merge_batches(batches, steps)
    )
    model = make_mlp()
    with strategy_with(num_replicas, steps, ops) as strategy:
        mirrored_model, _, losses = train_mirrored(
            strategy, model, OPTIMIZERS[optimizer](model), batches, set_to_none
        )
    assert_same_parameters(expected, mirrored_model.module)
    assert_replicas_identical(mirrored_model)
    # The micro-steps of a window all see the window's starting parameters: their losses
    # average to the single-device loss of the window's examples.
    window_losses = [
        sum(losses[i : i + steps]) / steps for i in range(0, len(plain_losses) * steps, steps)
    ]
    assert_close_float64(window_losses, plain_losses)


def _step(
    batch: Batch,
    model: mirrored.MirroredModule,
    optimizer: mirrored.MirroredOptimizer,
    fail_on_replica: int = -1,
) -> None:
    """One micro-step with every way of zeroing gradients a program may use."""
    features, labels = batch
    loss = mirrored.compute_average_loss(F.cross_entropy(model(features), labels, reduction="none"))
    loss.backward()
    if mirrored.get_replica_context().replica_id_in_sync_group == fail_on_replica:
        raise ValueError("boom")
    optimizer.step()
    optimizer.zero_grad()
    model.zero_grad()


def _shard_gradients(x: torch.Tensor, y: torch.Tensor, lo: int, hi: int) -> list[torch.Tensor]:
    """The gradient of examples lo:hi of the batch, divided by the batch's size."""
    reference = make_mlp()
    (F.cross_entropy(reference(x[lo:hi]), y[lo:hi], reduction="sum") / len(x)).backward()
    return [p.grad for p in reference.parameters()]


@pytest.mark.parametrize("ops", ["hierarchical", "one_device"])
def test_a_micro_step_keeps_each_replica_s_own_gradients_and_parameters(ops: str) -> None:
    x, y = make_batches(num_examples=16, batch_size=16)[0]
    with strategy_with(2, 2, ops) as strategy:
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.SGD(model.parameters(), lr=0.1)
        )
        before = {k: v.clone() for k, v in model.state_dict().items()}
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])
        assert not optimizer.step_updates
        strategy.run(_step, args=(batch, mirrored_model, optimizer))
        optimizer.zero_grad()  # outside run too: the window keeps them
        mirrored_model.zero_grad()
        getattr(mirrored_model, "0").zero_grad()  # a submodule's too
        assert optimizer.step_updates  # the next step ends the window
        for replica, (lo, hi) in zip(mirrored_model.replicas, [(0, 8), (8, 16)], strict=True):
            for name, value in replica.state_dict().items():
                assert torch.equal(value, before[name]), f"a micro-step changed {name}"
            # Each replica holds the gradient of its own half only: nothing was reduced.
            grads = [p.grad for p in replica.parameters()]
            torch.testing.assert_close(grads, _shard_gradients(x, y, lo, hi))
        strategy.run(_step, args=(batch, mirrored_model, optimizer))
        assert not optimizer.step_updates
        for replica in mirrored_model.replicas:
            assert all(p.grad is None for p in replica.parameters())
        assert_replicas_identical(mirrored_model)
        # Two micro-steps on the same batch: one SGD step on its gradient.
        expected = make_mlp()
        reference_optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
        F.cross_entropy(expected(x), y).backward()
        reference_optimizer.step()
        assert_same_parameters(expected, mirrored_model.module)


def test_a_failed_micro_step_drops_the_window_and_the_next_one_is_exact() -> None:
    batches = make_batches(num_examples=4 * 16, batch_size=16)
    with strategy_with(2, 2) as strategy:
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        shards = list(strategy.experimental_distribute_dataset(batches))
        strategy.run(_step, args=(shards[0], mirrored_model, optimizer))
        with pytest.raises(ValueError, match="boom"):
            strategy.run(_step, args=(shards[1], mirrored_model, optimizer, 1))
        for replica in mirrored_model.replicas:  # the unfinished window is gone, unapplied
            assert all(p.grad is None for p in replica.parameters())
        assert not optimizer.step_updates
        for shard in shards[2:]:
            strategy.run(_step, args=(shard, mirrored_model, optimizer))
    expected = make_mlp()
    train_plain(
        expected, torch.optim.Adam(expected.parameters(), lr=1e-2), merge_batches(batches[2:], 2)
    )
    assert_same_parameters(expected, mirrored_model.module)
    assert_replicas_identical(mirrored_model)


@pytest.mark.parametrize("steps", [0, -2, 1.5, True, "2"])
def test_a_window_length_that_is_not_a_whole_number_above_zero_is_refused(steps: object) -> None:
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=.*expected a whole number"):
        mirrored.MirroredStrategy(DEVICES[:2], gradient_accumulation_steps=steps)  # type: ignore[arg-type]


def test_the_window_counts_micro_steps_per_replica() -> None:
    window = AccumulationWindow(3, 2)
    assert window.scale == pytest.approx(1 / 3)
    seen = []
    for _ in range(6):
        seen.append((window.holding(0), window.final(0)))
        window.advance(0)
    assert seen == [(False, False), (True, False), (True, True)] * 2
    window.advance(1)
    assert window.holding(1) and not window.holding(0)
    window.reset()
    assert not window.holding(1)


@pytest.mark.parametrize("precision", ["32", pytest.param("16-mixed", marks=pytest.mark.float32)])
def test_fit_with_accumulation_equals_fit_on_the_larger_batch(precision: str) -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(192, 12, generator=generator)
    y = torch.randint(0, 5, (192,), generator=generator)

    def fitted(strategy: mirrored.Strategy, batch_size: int) -> mirrored.Model:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            model.compile(
                optimizer=mirrored.optimizers.Adam(
                    mirrored.optimizers.schedules.PolynomialDecay(
                        1e-2, decay_steps=12, end_learning_rate=1e-3
                    )
                ),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                precision=precision,
            )
        model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model

    with mirrored.MirroredStrategy(DEVICES[:1]) as one_device:
        expected = fitted(one_device, 32)
    with strategy_with(2, 2) as strategy:
        actual = fitted(strategy, 16)
    # float16 rounds batches of other shapes differently (2 replicas without accumulation are
    # 1.1e-3 away from one device here too); a wrongly scaled window would be far off.
    if precision == "32":
        assert_same_parameters(expected.module, actual.module)
    else:
        assert_same_parameters(expected.module, actual.module, rtol=1.3e-6, atol=5e-3)
    # the loss scale moved once per update
    assert actual._progress.loss_scale.scale == expected._progress.loss_scale.scale


@pytest.mark.float32
def test_a_float16_overflow_at_a_window_s_end_skips_its_update_and_drops_it() -> None:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(64, 12, generator=generator)
    y = torch.randint(0, 5, (64,), generator=generator)
    with strategy_with(2, 2) as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            model.compile(
                optimizer="adam",
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                precision="16-mixed",
            )
        model._progress.loss_scale = LossScale(scale=1e38)  # overflows
        before = {k: v.clone() for k, v in model.state_dict().items()}
        model.fit(x[:32], y[:32], batch_size=16, shuffle=False, verbose=0)  # one window
        for name, value in model.state_dict().items():
            assert torch.equal(value, before[name]), f"{name} changed in a skipped window"
        assert model._progress.loss_scale.scale == 1e38 / 2  # halved once, at the window's end
        assert not model._optimizer.step_updates  # a new window begins
        for replica in model._replicas.replicas:
            assert all(p.grad is None for p in replica.parameters())
        model._progress.loss_scale = LossScale()  # finite from here on
        model.fit(x[32:], y[32:], batch_size=16, shuffle=False, verbose=0)
        assert any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
