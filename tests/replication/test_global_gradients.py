"""After ``loss.backward()`` in a replica, every replica's ``.grad`` is the global batch's
gradient (as with DistributedDataParallel): the gradients are summed while backward runs, so
clipping, logging and updates by hand are exact, with or without a mirrored optimizer."""

from __future__ import annotations

import gc
import time

import pytest
import torch
import torch.nn.functional as F

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


def _global_gradients(batch) -> list[torch.Tensor]:
    model = make_mlp()
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def _assert_gradients_global_after_backward(strategy, model) -> None:
    """One step's backward on every replica; each replica's ``.grad`` must then be the global
    batch's gradient."""
    batch = make_batches()[0]
    seen: dict[int, list[torch.Tensor]] = {}

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="none")
        mirrored.compute_average_loss(loss).backward()
        replica = mirrored.get_replica_context().replica_id_in_sync_group
        seen[replica] = [p.grad.clone() for p in model.parameters()]

    (shards,) = strategy.experimental_distribute_dataset([batch])
    strategy.run(step, args=shards)
    assert sorted(seen) == list(range(strategy.num_replicas_in_sync))
    for gradients in seen.values():
        for actual, wanted in zip(gradients, _global_gradients(batch), strict=True):
            assert_close_float64(actual, wanted)


@pytest.mark.parametrize("optimizer_name", [None, *sorted(OPTIMIZERS)])
def test_after_backward_every_replica_holds_the_global_gradient(optimizer_name):
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        module = make_mlp()
        if optimizer_name is None:
            model = strategy.mirror(module)
        else:
            model, _ = strategy.mirror(module, OPTIMIZERS[optimizer_name](module))
        _assert_gradients_global_after_backward(strategy, model)


def test_gradients_stay_global_when_the_program_drops_the_mirrored_optimizer():
    """``model = strategy.mirror(module, optimizer)[0]``: the parameters' hooks hold their
    reducer weakly, so the mirrored module keeps it."""
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        module = make_mlp()
        model = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))[0]
        gc.collect()
        _assert_gradients_global_after_backward(strategy, model)


def test_an_update_by_hand_after_clipping_equals_the_plain_loop():
    """pytorch/examples' word_language_model updates without an optimizer: clip the global
    gradient's norm, then ``p.data.add_(p.grad, alpha=-lr)``."""
    batches, lr = make_batches(), 0.5
    expected = make_mlp()
    for x, y in batches:
        F.cross_entropy(expected(x), y).backward()
        torch.nn.utils.clip_grad_norm_(expected.parameters(), 0.25)
        for p in expected.parameters():
            p.data.add_(p.grad, alpha=-lr)
        expected.zero_grad()
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())

        def step(x, y):
            model.zero_grad()
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=batch)
    assert_same_parameters(expected, model)
    assert_replicas_identical(model)


def test_an_accumulation_window_s_gradient_is_global_at_its_last_micro_step():
    batches = make_batches(num_examples=32, batch_size=16)
    seen: list[list[torch.Tensor]] = []
    with mirrored.MirroredStrategy(DEVICES[:2], gradient_accumulation_steps=2) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(x, y):
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            if optimizer.step_updates and mirrored.get_replica_context().replica_id_in_sync_group:
                seen.append([p.grad.clone() for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=batch)
    whole = (torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches]))
    (gradients,) = seen
    for actual, wanted in zip(gradients, _global_gradients(whole), strict=True):
        assert_close_float64(actual, wanted)


@pytest.mark.parametrize("line_search", [None, "strong_wolfe"])
@pytest.mark.parametrize("num_replicas", [1, 3])
def test_lbfgs_step_with_a_closure_equals_the_plain_loop(line_search, num_replicas):
    """Each call of the closure re-evaluates every replica's shard; LBFGS sees the global
    batch's loss and gradient, the same on every replica, so all take the same steps."""
    batches = make_batches(num_examples=64, batch_size=32)

    def lbfgs(module):
        return torch.optim.LBFGS(
            module.parameters(), lr=0.5, max_iter=5, line_search_fn=line_search
        )

    expected = make_mlp()
    optimizer = lbfgs(expected)
    for x, y in batches:

        def plain_closure(x=x, y=y):
            optimizer.zero_grad()
            loss = F.cross_entropy(expected(x), y)
            loss.backward()
            return loss

        optimizer.step(plain_closure)
    losses = []
    with mirrored.MirroredStrategy(DEVICES[:num_replicas]) as strategy:
        module = make_mlp()
        model, mirrored_optimizer = strategy.mirror(module, lbfgs(module))

        def step(x, y):
            def closure():
                mirrored_optimizer.zero_grad()
                loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
                loss.backward()
                return loss

            return mirrored_optimizer.step(closure)

        for batch in strategy.experimental_distribute_dataset(batches):
            losses.append(strategy.run(step, args=batch))
    assert_same_parameters(expected, model)
    assert_replicas_identical(model)


def test_a_closure_with_gradient_accumulation_is_refused_with_the_fix():
    with mirrored.MirroredStrategy(DEVICES[:2], gradient_accumulation_steps=2) as strategy:
        module = make_mlp()
        _, optimizer = strategy.mirror(module, torch.optim.LBFGS(module.parameters()))
        with pytest.raises(ValueError, match="turn gradient_accumulation_steps, local_sgd"):
            strategy.run(lambda: optimizer.step(lambda: torch.zeros(())))


def test_a_gradient_only_one_replica_produced_reaches_every_replica(monkeypatch):
    """Whether any replica produced a gradient is read from every replica's flags: a replica
    slow to read them must still see a fast one's, which may not start over before."""
    from mirrored.replication.gradient_reducer import OverlappedGradientReducer

    counts = OverlappedGradientReducer._counts

    def slow_on_replica_1(self, buffer, bucket):
        if mirrored.get_replica_context().replica_id_in_sync_group == 1:
            time.sleep(0.05)
        return counts(self, buffer, bucket)

    monkeypatch.setattr(OverlappedGradientReducer, "_counts", slow_on_replica_1)
    with mirrored.MirroredStrategy(DEVICES[:2]) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

        def step(x, y):
            hidden = model[0](x)
            if mirrored.get_replica_context().replica_id_in_sync_group == 1:
                hidden = hidden.detach()  # no gradient reaches replica 1's first layer
            out = model[4](model[3](model[2](model[1](hidden))))
            mirrored.compute_average_loss(F.cross_entropy(out, y, reduction="none")).backward()
            grads = [p.grad for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            return [g is None for g in grads]

        (shards,) = strategy.experimental_distribute_dataset([make_batches()[0]])
        missing = strategy.run(step, args=shards)
    per_replica = missing.values if isinstance(missing, mirrored.PerReplica) else [missing]
    assert not any(any(flags) for flags in per_replica)
    assert_replicas_identical(model)


def test_a_per_parameter_optimizer_s_closure_runs_once_before_its_owners_update():
    """SGD's ``step(closure)`` evaluates the closure once and returns its (global) loss; each
    parameter's owner then updates it, as without a closure."""
    batches = make_batches(num_examples=64, batch_size=32)
    expected = make_mlp()
    plain = torch.optim.SGD(expected.parameters(), lr=0.1, momentum=0.9)
    plain_losses = []
    for x, y in batches:
        plain.zero_grad()
        loss = F.cross_entropy(expected(x), y)
        loss.backward()
        plain.step()
        plain_losses.append(loss.item())
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
        )
        calls = []

        def step(x, y):
            def closure():
                calls.append(1)
                optimizer.zero_grad()
                loss = F.cross_entropy(model(x), y, reduction="none")
                loss = mirrored.compute_average_loss(loss)
                loss.backward()
                return loss

            return optimizer.step(closure)

        losses = []
        for batch in strategy.experimental_distribute_dataset(batches):
            per_replica = strategy.experimental_local_results(strategy.run(step, args=batch))
            assert all(torch.equal(loss, per_replica[0]) for loss in per_replica)
            losses.append(per_replica[0].item())
    assert len(calls) == len(DEVICES) * len(batches)
    assert_close_float64(torch.tensor(losses), torch.tensor(plain_losses))
    assert_same_parameters(expected, model)
    assert_replicas_identical(model)
