"""What a program does to the model outside ``strategy.run`` reaches every replica: freezing by
attribute, edits under ``torch.no_grad()``, ``p.data = ...``, a forward in training mode, hooks
on a parameter; ``check_replicas`` names a tensor the replicas disagree on."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.reference_loops import (
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]
Edit = Callable[[nn.Module, int], None]  # (the model as the program holds it, the step)


def _plain(model: nn.Module, edit: Edit, batches) -> nn.Module:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches):
        edit(model, step)
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def _mirrored(model: nn.Module, edit: Edit, batches, **strategy_options) -> mirrored.MirroredModule:
    with mirrored.MirroredStrategy(DEVICES, **strategy_options) as strategy:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)

        def step(x, y):
            loss = F.cross_entropy(mirrored_model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        for number, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
            edit(mirrored_model, number)
            strategy.run(step, args=batch)
    return mirrored_model


def _assert_like_the_plain_loop(edit: Edit, **strategy_options) -> mirrored.MirroredModule:
    batches = make_batches()
    expected = _plain(make_mlp(), edit, batches)
    actual = _mirrored(make_mlp(), edit, batches, **strategy_options)
    assert_same_parameters(expected, actual)
    assert_replicas_identical(actual)
    return actual


def _freeze_first_layer_by_attribute(model, step):
    if step == 4:  # between epochs, the common idiom
        for parameter in model[0].parameters():
            parameter.requires_grad = False


def _edit_under_no_grad(model, step):
    with torch.no_grad():
        model[2].weight.mul_(0.9)  # a hand-made weight decay
        model[4].bias.copy_(model[4].bias.clamp(-0.05, 0.05))


def _replace_data(model, step):
    if step % 3 == 0:
        model[0].bias.data = model[0].bias.detach() * 0.5


def _hook_on_a_parameter(model, step):
    if step == 2:
        model[2].weight.register_hook(lambda grad: grad * 0.25)
        mask = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0])
        model[4].bias.register_hook(lambda grad: grad * mask)  # linear: exact, as a sum of parts


@pytest.mark.parametrize(
    "edit",
    [_freeze_first_layer_by_attribute, _edit_under_no_grad, _replace_data, _hook_on_a_parameter],
)
def test_an_edit_outside_run_reaches_every_replica(edit):
    model = _assert_like_the_plain_loop(edit, check_replicas=True)
    if edit is _freeze_first_layer_by_attribute:
        assert not any(p.requires_grad for r in model.replicas for p in r[0].parameters())


def test_a_hook_removed_outside_run_is_removed_from_every_replica():
    handles = []

    def edit(model, step):
        if step == 1:
            handles.append(model[2].weight.register_hook(lambda grad: grad * 0.25))
        if step == 5:
            handles.pop().remove()

    _assert_like_the_plain_loop(edit)


class _Normalised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.inp, self.norm, self.out = nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Linear(16, 5)

    def forward(self, x):
        return self.out(torch.relu(self.norm(self.inp(x))))


def test_a_forward_outside_run_in_training_mode_moves_every_replica_s_statistics():
    """dcgan samples ``netG(fixed_noise)`` between steps in training mode: the statistics it
    moves on replica 0 are every replica's before the next run (which normalises with the
    global batch: ``sync_batch_norm``)."""
    batches, sample = make_batches(), torch.randn(6, 12)
    expected = _Normalised()
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.1)
    for x, y in batches:
        expected(sample)
        F.cross_entropy(expected(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    with mirrored.MirroredStrategy(DEVICES, check_replicas=True) as strategy:
        module = _Normalised()
        model, mirrored_optimizer = strategy.mirror(
            module, torch.optim.SGD(module.parameters(), lr=0.1), sync_batch_norm=True
        )

        def step(x, y):
            loss = F.cross_entropy(model(x), y, reduction="none")
            mirrored.compute_average_loss(loss).backward()
            mirrored_optimizer.step()
            mirrored_optimizer.zero_grad()

        for batch in strategy.experimental_distribute_dataset(batches):
            model(sample)
            strategy.run(step, args=batch)
    assert_same_parameters(expected, model)  # running statistics included
    assert_replicas_identical(model)


def test_a_data_edit_in_place_outside_run_is_named_by_check_replicas():
    def edit(model, step):
        if step == 3:
            model[0].weight.data.clamp_(-0.01, 0.01)  # invisible to torch's version counter

    with pytest.raises(mirrored.ReplicasDifferError, match=r"before a run, '0.weight' differs"):
        _mirrored(make_mlp(), edit, make_batches(), check_replicas=True)


def test_check_replicas_names_a_tensor_a_step_changed_differently(monkeypatch):
    monkeypatch.setenv("MIRRORED_CHECK_REPLICAS", "1")
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())

        def step():
            replica = mirrored.get_replica_context().replica_id_in_sync_group
            with torch.no_grad():
                model[4].bias.add_(replica)

        with pytest.raises(mirrored.ReplicasDifferError, match=r"after a run, '4.bias' differs"):
            strategy.run(step)


def test_check_replicas_refuses_local_sgd():
    with pytest.raises(ValueError, match="local SGD keeps the replicas apart"):
        mirrored.MirroredStrategy(DEVICES, local_sgd=mirrored.LocalSGD(2), check_replicas=True)


def test_an_untouched_model_costs_the_other_replicas_no_copy():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())
        versions = [[p._version for p in r.parameters()] for r in model.replicas[1:]]
        for _ in range(3):
            strategy.run(lambda: model(torch.randn(2, 12)))
        assert [[p._version for p in r.parameters()] for r in model.replicas[1:]] == versions


def test_a_post_accumulate_grad_hook_outside_run_is_refused_with_the_fix():
    """Such a hook runs before the replicas' gradients are summed, and the sum replaces what it
    did: refused, saying where to change the gradient instead."""

    def edit(model, step):
        if step == 1:
            model[4].bias.register_post_accumulate_grad_hook(lambda p: None)

    with pytest.raises(ValueError, match=r"register_post_accumulate_grad_hook.*register_hook"):
        _mirrored(make_mlp(), edit, make_batches())


def test_a_refused_hook_is_refused_again_at_the_next_run():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())
        strategy.run(lambda: None)
        model[4].bias.register_post_accumulate_grad_hook(lambda p: None)
        for _ in range(2):
            with pytest.raises(ValueError, match=r"register_post_accumulate_grad_hook"):
                strategy.run(lambda: None)


def test_hooks_registered_before_mirroring_reach_every_replica():
    """A deep copy of a module does not copy its tensors' hooks: the first run carries them."""

    def hooked() -> nn.Module:
        model = make_mlp()
        model[2].weight.register_hook(lambda grad: grad * 0.25)
        return model

    batches = make_batches()
    expected = _plain(hooked(), lambda model, step: None, batches)
    actual = _mirrored(hooked(), lambda model, step: None, batches)
    assert_same_parameters(expected, actual)
    assert_replicas_identical(actual)


def test_a_hook_the_replica_function_registers_on_every_replica_is_not_carried_again():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())
        registered: set[int] = set()

        def step():
            weight = model[2].weight  # this replica's
            if id(weight) not in registered:
                registered.add(id(weight))
                weight.register_hook(lambda grad: grad * 0.5)

        for _ in range(3):
            strategy.run(step)
        counts = [len(replica[2].weight._backward_hooks) for replica in model.replicas]
        assert counts == [counts[0]] * len(DEVICES)


class _KeepsLastMean(nn.Module):
    """Reassigns its buffer in every forward (not in place), as a cache of the last input."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.linear = nn.Linear(12, 5)
        self.register_buffer("last_mean", torch.zeros(12))

    def forward(self, x):
        self.last_mean = x.mean(0).detach()
        return self.linear(x + self.last_mean)


def test_an_edit_outside_run_reaches_a_buffer_the_last_run_reassigned():
    """The replicas' buffers are new tensors after each run: an edit between runs reaches the
    new ones (a scale under ``torch.no_grad()``, read by the next step's forward... after it
    reassigns it, so checked directly, before that forward)."""
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(_KeepsLastMean())
        for number, (x, _) in enumerate(strategy.experimental_distribute_dataset(make_batches())):
            strategy.run(model, args=(x,))
            with torch.no_grad():
                model.last_mean.fill_(float(number))
            strategy.run(lambda: None)  # carries the edit; the forward would overwrite it
            assert all(r.last_mean.eq(float(number)).all() for r in model.replicas)


def test_a_hook_on_a_parameter_frozen_when_mirrored_reaches_every_replica_once_it_trains():
    """torch registers no hook on a tensor that requires no gradient: a frozen parameter's
    hooks wait, and reach the other replicas at the first run after it is thawed."""
    calls: list[int] = []

    def hooked_then_frozen() -> nn.Module:
        model = make_mlp()
        model[2].weight.register_hook(lambda grad: calls.append(1) or grad * 0.25)
        model[2].weight.requires_grad_(False)
        return model

    def thaw_at_step_3(model, step):
        if step == 3:
            model[2].weight.requires_grad_(True)

    batches = make_batches()
    expected = _plain(hooked_then_frozen(), thaw_at_step_3, batches)
    plain_calls, calls[:] = len(calls), []
    actual = _mirrored(hooked_then_frozen(), thaw_at_step_3, batches)
    assert_same_parameters(expected, actual)
    assert_replicas_identical(actual)
    assert len(calls) == len(DEVICES) * plain_calls


def test_hooks_not_yet_carried_survive_an_apply():
    """``apply()`` re-marks the replicas (its resync) between runs: hooks registered before
    mirroring, or since the last run, are still carried by the next one."""

    def hooked() -> nn.Module:
        model = make_mlp()
        model[2].weight.register_hook(lambda grad: grad * 0.25)
        return model

    def hook_then_apply(model, step):
        if step == 2:
            model[4].weight.register_hook(lambda grad: grad * 0.5)
        if step in (0, 2):
            model.apply(lambda module: None)

    batches = make_batches()
    expected = _plain(hooked(), hook_then_apply, batches)
    actual = _mirrored(hooked(), hook_then_apply, batches)
    assert_same_parameters(expected, actual)
    assert_replicas_identical(actual)


def test_a_refused_hook_carries_none_of_the_hooks_registered_with_it():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        model = strategy.mirror(make_mlp())
        strategy.run(lambda: None)
        before = [len(r[4].bias._backward_hooks or {}) for r in model.replicas]
        for _ in range(8):  # in a set with the refused one: some come before it
            model[4].bias.register_hook(lambda grad: grad)
        model[4].bias.register_post_accumulate_grad_hook(lambda p: None)
        for _ in range(3):
            with pytest.raises(
                ValueError,
                match=r"register_post_accumulate_grad_hook on mirrored parameter '4.bias'",
            ):
                strategy.run(lambda: None)
        after = [len(r[4].bias._backward_hooks or {}) for r in model.replicas]
        assert after[1:] == before[1:]
