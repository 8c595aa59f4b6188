"""torch's gradient clipping, LR schedulers and GradScaler inside replicas of a mirrored
optimizer: the global batch's gradient is clipped, a schedule advances once per update, and a
scaler that would reach one replica is refused."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

import mirrored
from mirrored.torch_patches.clipping import install_clipping_routes
from mirrored.torch_patches.holders import Installation
from mirrored.torch_patches.schedulers import install_step_routes
from tests.mirrored_steps import one_step, train_plain_scheduled
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


@pytest.fixture
def strategy():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        yield strategy


SCHEDULERS = {
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    "one_cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=20),
    "cyclic": lambda o: torch.optim.lr_scheduler.CyclicLR(o, 0.01, 0.2, step_size_up=3),
    "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 1 / (1 + step)),
    "sequential": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [
            torch.optim.lr_scheduler.LinearLR(o, start_factor=0.5, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
        ],
        milestones=[2],
    ),
}


@pytest.mark.parametrize("built", ["before_mirror", "after_mirror"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_torch_schedulers_drive_every_replica(strategy, name, built):
    batches = make_batches()[:8]
    reference = make_mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_scheduler = SCHEDULERS[name](reference_optimizer)
    train_plain_scheduled(reference, reference_optimizer, reference_scheduler, batches)

    module = make_mlp()
    original = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scheduler = SCHEDULERS[name](original) if built == "before_mirror" else None
    model, optimizer = strategy.mirror(module, original)
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = scheduler or SCHEDULERS[name](optimizer)  # on what mirror() returned
    for batch in strategy.experimental_distribute_dataset(batches):
        one_step(strategy, model, optimizer, batch)
        scheduler.step()  # in cross-replica context, once per step
    assert scheduler.get_last_lr() == reference_scheduler.get_last_lr()
    assert_same_parameters(reference, model)
    assert_replicas_identical(model)


def test_reduce_lr_on_plateau_takes_the_mirrored_optimizer(strategy):
    module = make_mlp()
    _, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
    for loss in (1.0, 2.0, 3.0):
        scheduler.step(loss)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025)


def test_a_grad_scaler_in_replicas_is_refused_with_what_to_use(strategy):
    module = make_mlp()
    before = copy.deepcopy(module.state_dict())
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    (batch,) = strategy.experimental_distribute_dataset(make_batches()[:1])

    def step(batch, scaler):
        x, y = batch
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        optimizer.zero_grad()

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with pytest.raises(TypeError, match=r"GradScaler.*replica 0's.*precision='16-mixed'"):
        strategy.run(step, (batch, scaler))
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
    strategy.run(step, (batch, torch.amp.GradScaler("cpu", enabled=False)))  # a no-op scaler
    x, y = make_batches()[0]  # outside replicas torch's scaler is untouched
    assert torch.amp.GradScaler("cpu").scale(F.cross_entropy(module(x), y)).item() > 1


@pytest.mark.parametrize("ops", ["hierarchical", "one_device"])
def test_the_gradient_norm_after_the_step_is_the_global_batch_s(ops):
    """Logging the norm after optimizer.step() finds the gradients summed already (on the
    owner-update path, each parameter's sum is with its owner): they are not summed again."""
    batches = make_batches()[:3]

    def norm_after_step(model, optimizer, x, y, loss):
        loss.backward()
        optimizer.step()
        norm = clip_grad_norm_(model.parameters(), float("inf"))
        again = clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.zero_grad()
        return torch.stack([norm, again])

    expected = make_mlp()
    plain_optimizer = OPTIMIZERS["sgd"](expected)
    norms = [
        norm_after_step(expected, plain_optimizer, x, y, F.cross_entropy(expected(x), y))
        for x, y in batches
    ]
    with mirrored.MirroredStrategy(DEVICES, CROSS_DEVICE_OPS[ops]()) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, OPTIMIZERS["sgd"](module))

        def step(batch):
            x, y = batch
            per_example = F.cross_entropy(model(x), y, reduction="none")
            loss = mirrored.compute_average_loss(per_example)
            return norm_after_step(model, optimizer, x, y, loss)

        seen = [
            strategy.experimental_local_results(strategy.run(step, (batch,)))
            for batch in strategy.experimental_distribute_dataset(batches)
        ]
    assert_same_parameters(expected, model)
    for plain_norms, replica_norms in zip(norms, seen, strict=True):
        for replica_norm in replica_norms:
            torch.testing.assert_close(replica_norm, plain_norms)


def test_on_an_unknown_torch_clipping_warns_and_routes_the_public_functions():
    import types

    def torch_s_clipping(parameters, max_norm):
        return [id(p) for p in parameters]

    module = types.SimpleNamespace(clip_grad_norm_=torch_s_clipping, clip_grad_value_=len)
    package = types.SimpleNamespace()
    seen = []
    installation = Installation()
    with pytest.warns(RuntimeWarning, match=r"not the one mirrored knows \(_get_total_norm .*"):
        install_clipping_routes(installation, module, package, seen.append)
    params = list(make_mlp().parameters())
    # A generator is listed once: the hook and torch's function both see every parameter.
    assert package.clip_grad_norm_(iter(params), 1.0) == [id(p) for p in params]
    assert seen == [params]
    assert module.clip_grad_value_ is package.clip_grad_value_
    routed = package.clip_grad_norm_  # as a later patch of another's would still call it
    installation.remove()
    assert module.clip_grad_norm_ is torch_s_clipping and module.clip_grad_value_ is len
    assert vars(package) == {}
    assert routed(params, 1.0) == [id(p) for p in params] and seen == [params]  # torch's alone


def test_a_released_optimizer_takes_no_part_in_clipping_the_new_one_s_gradients():
    batches = make_batches()[:3]
    expected, norms = _plain_clipped(batches, CLIPS["norm"], OPTIMIZERS["sgd"])
    with mirrored.MirroredStrategy(DEVICES[:2], timeout_seconds=30) as strategy:
        module = make_mlp()
        first, _ = strategy.mirror(module, OPTIMIZERS["sgd"](module))
        first.release()
        model, optimizer = strategy.mirror(module, OPTIMIZERS["sgd"](module))
        seen = [
            strategy.experimental_local_results(
                strategy.run(_clipped_step, (batch, model, optimizer, CLIPS["norm"]))
            )
            for batch in strategy.experimental_distribute_dataset(batches)
        ]
    assert_same_parameters(expected, model)
    for plain_norm, replica_norms in zip(norms, seen, strict=True):
        for norm in replica_norms:
            torch.testing.assert_close(norm, plain_norm)


def _plain_clipped(batches, clip, optimizer_fn):
    model = make_mlp()
    optimizer = optimizer_fn(model)
    norms = []
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        norms.append(clip(model.parameters()))
        optimizer.step()
        optimizer.zero_grad()
    return model, norms


CLIPS = {
    "norm": lambda params: clip_grad_norm_(params, 0.3),
    "value": lambda params: clip_grad_value_(params, 0.02),
}


def _clipped_step(batch, model, optimizer, clip):
    x, y = batch
    loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    loss.backward()
    norm = clip(model.parameters())
    optimizer.step()
    optimizer.zero_grad()
    return norm


@pytest.mark.parametrize("ops", ["hierarchical", "one_device"])
@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_clipping_inside_replicas_clips_the_global_gradient(ops, clip):
    """clip_grad_norm_ / clip_grad_value_ imported by name, between backward and step."""
    batches = make_batches()[:5]
    optimizer_fn = OPTIMIZERS["adam"]
    expected, norms = _plain_clipped(batches, CLIPS[clip], optimizer_fn)
    with mirrored.MirroredStrategy(DEVICES, CROSS_DEVICE_OPS[ops]()) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, optimizer_fn(module))
        seen = [
            strategy.experimental_local_results(
                strategy.run(_clipped_step, (batch, model, optimizer, CLIPS[clip]))
            )
            for batch in strategy.experimental_distribute_dataset(batches)
        ]
    assert_same_parameters(expected, model)
    assert_replicas_identical(model)
    if clip == "norm":  # every replica saw the global batch's norm
        for plain_norm, replica_norms in zip(norms, seen, strict=True):
            for norm in replica_norms:
                torch.testing.assert_close(norm, plain_norm)


@pytest.mark.parametrize("where", ["mirrored", "original"])
def test_a_scheduler_stepped_inside_replicas_advances_once_per_update(strategy, where):
    batches = make_batches()[:6]
    reference = make_mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    reference_scheduler = torch.optim.lr_scheduler.StepLR(reference_optimizer, 2, gamma=0.5)
    train_plain_scheduled(reference, reference_optimizer, reference_scheduler, batches)

    module = make_mlp()
    original = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(original, 2, gamma=0.5)
    model, optimizer = strategy.mirror(module, original)
    if where == "mirrored":  # rather on what mirror() returned
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5)

    def step(batch):
        x, y = batch
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()  # where the Transformers docs' loop steps it: once per replica here

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, (batch,))
    assert scheduler.get_last_lr() == reference_scheduler.get_last_lr() == [0.0125]
    assert_same_parameters(reference, model)
    assert_replicas_identical(model)


class _Halving(torch.optim.lr_scheduler.LRScheduler):
    """A third-party scheduler with a step of its own (defined before any mirror())."""

    def step(self, epoch=None):
        for group in self.optimizer.param_groups:
            group["lr"] *= 0.5


@pytest.mark.parametrize("defined", ["before_mirror", "after_mirror"])
def test_a_scheduler_of_any_class_stepped_inside_replicas_advances_once(strategy, defined):
    batches = make_batches()[:3]
    module = make_mlp()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=1.0))
    kind = _Halving
    if defined == "after_mirror":

        class Halving(_Halving):
            def step(self, epoch=None):  # its own step again, on a class made after mirror()
                super().step(epoch)

        kind = Halving
    scheduler = kind(optimizer)
    expected = make_mlp()
    plain_optimizer = torch.optim.SGD(expected.parameters(), lr=1.0)
    plain_scheduler = kind(plain_optimizer)

    def step(model, optimizer, scheduler, loss):
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    for x, y in batches:
        step(expected, plain_optimizer, plain_scheduler, F.cross_entropy(expected(x), y))
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(
            lambda b: step(model, optimizer, scheduler, _average_loss(model, *b)), (batch,)
        )
    assert optimizer.param_groups[0]["lr"] == plain_optimizer.param_groups[0]["lr"] == 2**-4
    assert_same_parameters(expected, model)


def _average_loss(model, x, y):
    return mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))


def test_scheduler_classes_are_routed_whenever_they_are_defined():
    class Base:
        def step(self):
            return "stepped"

    class Early(Base):
        def step(self):
            return super().step() + " early"

    skipped = set()
    steps = [Base.step, Early.step]
    installation = Installation()
    install_step_routes(installation, Base, lambda scheduler: id(scheduler) in skipped)

    class Late(Early):
        def step(self):
            return super().step() + " late"

    schedulers = [Base(), Early(), Late()]
    assert [s.step() for s in schedulers] == ["stepped", "stepped early", "stepped early late"]
    skipped.update(id(s) for s in schedulers)
    assert [s.step() for s in schedulers] == [None, None, None]
    routed = Base.step  # as a later patch of another's would still call it
    installation.remove()
    assert [Base.step, Early.step] == steps and "__init_subclass__" not in vars(Base)
    assert [s.step() for s in schedulers] == ["stepped", "stepped early", "stepped early late"]
    assert routed(schedulers[0]) == "stepped"  # torch's alone, though skipped
