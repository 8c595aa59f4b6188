"""Mirrored modules and optimizers: proxies, state, hyperparameters, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import clip_grad_norm_, clip_grad_value_

import mirrored
from mirrored import torch_compat
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

DEVICES = ["cpu:0", "cpu:1", "cpu:2"]


@pytest.fixture
def strategy():
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        yield strategy


def test_replica_zero_is_the_original_module_and_state_is_plain(strategy):
    module = make_mlp()
    optimizer = torch.optim.Adam(module.parameters())
    model, mirrored_optimizer = strategy.mirror(module, optimizer)
    assert model.module is module and model.replicas[0] is module
    assert mirrored_optimizer.optimizer is optimizer
    assert list(model.state_dict()) == list(make_mlp().state_dict())  # no "module." prefix
    assert all(
        a is not b
        for a, b in zip(model.replicas[0].parameters(), model.replicas[1].parameters(), strict=True)
    )
    assert_replicas_identical(model)
    assert "MirroredModule(replicas=3" in repr(model)


def test_calls_resolve_to_the_current_replica(strategy):
    model = strategy.mirror(make_mlp())
    replicas = strategy.run(lambda: id(model._current()))
    assert strategy.experimental_local_results(replicas) == tuple(id(r) for r in model.replicas)
    assert model.training
    model.eval()
    assert not any(r.training for r in model.replicas)
    assert model(torch.zeros(2, 12)).shape == (2, 5)  # cross-replica: replica 0


def test_checkpoint_written_with_three_replicas_restores_with_two(strategy):
    batches = make_batches()
    model = make_mlp()
    trained, optimizer, _ = train_mirrored(strategy, model, OPTIMIZERS["adam"](model), batches[:6])
    state = {"model": trained.state_dict(), "optimizer": optimizer.state_dict()}

    reference = make_mlp()
    reference_optimizer = OPTIMIZERS["adam"](reference)
    train_plain(reference, reference_optimizer, batches)

    with mirrored.MirroredStrategy(["cpu:2", "cpu:3"]) as other:
        model = make_mlp(seed=99)
        new_optimizer = OPTIMIZERS["adam"](model)
        restored, restored_optimizer = other.mirror(model, new_optimizer)
        restored.load_state_dict(state["model"])
        restored_optimizer.load_state_dict(state["optimizer"])
        assert_replicas_identical(restored)
        _continue_training(other, restored, restored_optimizer, batches[6:])
    assert_same_parameters(reference, restored)


def _continue_training(strategy, model, optimizer, batches):
    def step(batch):
        x, y = batch
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=(batch,))


def _train_plain_scheduled(model, optimizer, scheduler, batches):
    """The plain loop with an LR scheduler stepped after every update."""
    for x, y in batches:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def _one_step(strategy, model, optimizer, batch):
    def step(batch):
        x, y = batch
        mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()
        optimizer.step()
        optimizer.zero_grad()

    strategy.run(step, args=(batch,))


def test_parameters_without_gradient_stay_untouched(strategy):
    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(3, 1)
            self.unused = nn.Linear(3, 1)

        def forward(self, x):
            return self.used(x)

    module = TwoHeads()
    before = module.unused.weight.detach().clone()
    model, optimizer = strategy.mirror(
        module, torch.optim.SGD(module.parameters(), lr=0.1, weight_decay=0.1)
    )
    (batch,) = strategy.experimental_distribute_dataset([torch.ones(6, 3)])
    strategy.run(
        lambda x: (
            mirrored.compute_average_loss(model(x).sum(1)).backward(),
            optimizer.step(),
        ),
        args=(batch,),
    )
    assert torch.equal(model.unused.weight, before)
    assert all(r.unused.weight.grad is None for r in model.replicas)


def test_errors_are_clear(strategy):
    module = make_mlp()
    foreign = torch.optim.SGD(make_mlp().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="not in the module"):
        strategy.mirror(module, foreign)
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        strategy.mirror("model")
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        strategy.mirror(module, "adam")
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="already mirrored"):
        strategy.mirror(model)
    with pytest.raises(AttributeError, match="cannot set 'flag'"):
        model.flag = True
    with pytest.raises(RuntimeError, match=r"must be called inside strategy\.run"):
        optimizer.step()
    with pytest.raises(TypeError, match="closure"):
        strategy.run(lambda: optimizer.step(closure=lambda: 0.0))


def test_sparse_gradients_are_rejected(strategy):
    module = nn.Embedding(10, 4, sparse=True)
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

    def step():
        model(torch.tensor([1, 2])).sum().backward()
        optimizer.step()

    with pytest.raises(TypeError, match="sparse gradient"):
        strategy.run(step)


def test_zero_grad_inside_a_replica_touches_only_that_replica(strategy):
    module = nn.Linear(2, 1)
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    strategy.run(lambda: model(torch.ones(1, 2)).sum().backward())
    strategy.run(
        lambda: (
            optimizer.zero_grad()
            if mirrored.get_replica_context().replica_id_in_sync_group == 0
            else None
        )
    )
    assert model.replicas[0].weight.grad is None and model.replicas[1].weight.grad is not None
    optimizer.zero_grad()
    model.zero_grad()
    assert all(r.weight.grad is None for r in model.replicas)


def test_default_strategy_leaves_module_and_optimizer_alone():
    module = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    assert mirrored.get_strategy().mirror(module, optimizer) == (module, optimizer)
    assert mirrored.get_strategy().mirror(module) is module


def test_mirroring_an_optimizer_that_already_has_state(strategy):
    batches = make_batches()
    reference = make_mlp()
    reference_optimizer = OPTIMIZERS["adam"](reference)
    train_plain(reference, reference_optimizer, batches)

    module = make_mlp()
    optimizer = OPTIMIZERS["adam"](module)
    train_plain(module, optimizer, batches[:4])  # Adam moments exist before mirroring
    model, mirrored_optimizer = strategy.mirror(module, optimizer)
    _continue_training(strategy, model, mirrored_optimizer, batches[4:])
    assert_same_parameters(reference, model)
    assert_replicas_identical(model)


def test_cross_replica_changes_reach_every_replica(strategy):
    model = strategy.mirror(make_mlp())
    model[0].requires_grad_(False)
    assert not any(r[0].weight.requires_grad for r in model.replicas)
    assert len(model) == 5 and [type(m.module) for m in model][1] is nn.ReLU
    model.apply(lambda m: nn.init.normal_(m.weight) if isinstance(m, nn.Linear) else None)
    assert_replicas_identical(model)
    calls = []
    handles = model.register_forward_hook(lambda *_: calls.append(1))
    strategy.run(lambda: model(torch.zeros(1, 12)))
    assert len(calls) == 3
    handles.remove()
    strategy.run(lambda: model(torch.zeros(1, 12)))
    assert len(calls) == 3
    with pytest.raises(TypeError, match=r"model\.half\(\) on a mirrored module"):
        model.half()
    inside = strategy.run(lambda: id(model[0]))  # inside run: the replica's own submodule
    assert strategy.experimental_local_results(inside) == tuple(id(r[0]) for r in model.replicas)


@pytest.mark.parametrize("ops", [mirrored.HierarchicalCopyAllReduce, mirrored.ReductionToOneDevice])
def test_a_learning_rate_set_by_replica_0_inside_the_step_reaches_every_replica(ops):
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], ops()) as strategy:
        module = nn.Linear(3, 1)
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), 0.1))

        def step():
            if mirrored.get_replica_context().replica_id_in_sync_group == 0:
                optimizer.param_groups[0]["lr"] = 10.0  # e.g. a warm-up set in the step
            model(torch.ones(2, 3)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

        for _ in range(3):
            strategy.run(step)
        assert_replicas_identical(model)


@pytest.mark.parametrize("ops", ["hierarchical", "one_device"])
def test_a_tensor_learning_rate_is_each_replica_s_own(ops):
    """A torch scheduler moves a tensor learning rate in place: every replica takes its value
    at each update into a tensor of its own, never replica 0's tensor itself."""
    batches = make_batches()[:4]
    expected = make_mlp()
    plain_optimizer = torch.optim.Adam(expected.parameters(), lr=torch.tensor(0.01))
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain_optimizer, 1, gamma=0.5)
    _train_plain_scheduled(expected, plain_optimizer, plain_scheduler, batches)
    with mirrored.MirroredStrategy(DEVICES, CROSS_DEVICE_OPS[ops]()) as strategy:
        module = make_mlp()
        original = torch.optim.Adam(module.parameters(), lr=torch.tensor(0.01))
        model, optimizer = strategy.mirror(module, original)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        for batch in strategy.experimental_distribute_dataset(batches):
            _one_step(strategy, model, optimizer, batch)
            scheduler.step()
    rates = [o.param_groups[0]["lr"] for o in optimizer.optimizers]
    assert len({id(rate) for rate in rates}) == len(rates)
    assert [float(r) for r in rates[1:]] == pytest.approx([0.01 * 0.5**3] * 2)  # last update's
    assert float(rates[0]) == float(plain_optimizer.param_groups[0]["lr"])
    assert float(rates[0]) == pytest.approx(0.01 * 0.5**4)
    assert_same_parameters(expected, model)


def test_mirrored_module_behaves_like_an_object_users_probe():
    import copy

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = strategy.mirror(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU()}))
        assert bool(model) and hasattr(model, "to") and model.training
        assert list(model) == ["a", "b"]
        assert isinstance(model["a"], mirrored.MirroredModule)
        with pytest.raises(TypeError, match="change one replica only"):
            model.to("cpu")
        with pytest.raises(TypeError, match="cannot be deep-copied"):
            copy.deepcopy(model)
        calls = []
        with model["a"].register_forward_pre_hook(lambda *_: calls.append(1)):
            strategy.run(lambda: model["a"](torch.ones(1, 2)))
        strategy.run(lambda: model["a"](torch.ones(1, 2)))
        assert len(calls) == 2


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
    _train_plain_scheduled(reference, reference_optimizer, reference_scheduler, batches)

    module = make_mlp()
    original = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    scheduler = SCHEDULERS[name](original) if built == "before_mirror" else None
    model, optimizer = strategy.mirror(module, original)
    assert isinstance(optimizer, torch.optim.Optimizer)
    scheduler = scheduler or SCHEDULERS[name](optimizer)  # on what mirror() returned
    for batch in strategy.experimental_distribute_dataset(batches):
        _one_step(strategy, model, optimizer, batch)
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


def test_a_mirrored_optimizer_refuses_what_would_reach_one_replica(strategy):
    module = make_mlp()
    mirrored_model, optimizer = strategy.mirror(
        module, torch.optim.SGD(module.parameters(), lr=0.1)
    )
    with pytest.raises(TypeError, match=r"before strategy\.mirror\(\)"):
        optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(1))]})
    with pytest.raises(TypeError, match="cannot be copied"):
        copy.deepcopy(optimizer)
    with pytest.raises(TypeError, match="already mirrored"):
        strategy.mirror(make_mlp(), optimizer)
    calls = []
    handles = optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(opt))
    (batch,) = strategy.experimental_distribute_dataset(make_batches()[:1])
    _one_step(strategy, mirrored_model, optimizer, batch)
    assert sorted(map(id, calls)) == sorted(map(id, optimizer.optimizers))
    handles.remove()
    _one_step(strategy, mirrored_model, optimizer, batch)
    assert len(calls) == len(optimizer.optimizers)


def test_state_dict_hooks_run_on_the_mirrored_optimizer(strategy):
    module = make_mlp()
    _, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters()))
    calls = []

    def tagged(optimizer, state):
        calls.append(("after state_dict", optimizer))
        return {**state, "tag": "mine"}

    def untagged(optimizer, state):
        calls.append(("before load", optimizer, state.get("tag")))
        return {k: v for k, v in state.items() if k != "tag"}

    handles = [
        optimizer.register_state_dict_pre_hook(lambda o: calls.append(("before state_dict", o))),
        optimizer.register_state_dict_post_hook(tagged),
        optimizer.register_load_state_dict_pre_hook(untagged),
        optimizer.register_load_state_dict_post_hook(lambda o: calls.append(("after load", o))),
    ]
    state = optimizer.state_dict()
    assert state["tag"] == "mine"
    optimizer.load_state_dict(state)
    assert calls == [
        ("before state_dict", optimizer),
        ("after state_dict", optimizer),
        ("before load", optimizer, "mine"),
        ("after load", optimizer),
    ]
    for handle in handles:
        handle.remove()
    assert "tag" not in optimizer.state_dict()
    assert len(calls) == 4


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


def test_a_module_mirrored_twice_is_refused_until_released():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as first:
        with mirrored.MirroredStrategy(["cpu:2", "cpu:3"]) as second:
            module = make_mlp()
            model = first.mirror(module)
            for target in (module, module[2]):  # the module, or one of its submodules
                with pytest.raises(ValueError, match="already mirrored by MirroredStrategy"):
                    second.mirror(target)
            with pytest.raises(ValueError, match="release"):
                first.mirror(module)
            model.release()
            again = second.mirror(module)
            with pytest.raises(RuntimeError, match="released"):
                first.run(lambda: model(torch.zeros(1, 12)))
            assert second.run(lambda: again(torch.zeros(1, 12))).values[1].shape == (1, 5)
        # The second strategy is closed: its mirror no longer holds the module.
        first.mirror(module)


def test_a_released_mirror_cannot_step():
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        module = make_mlp()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        model.release()
        with pytest.raises(RuntimeError, match="released"):
            strategy.run(optimizer.step)
        strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))


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
    with pytest.warns(RuntimeWarning, match=r"not the one mirrored knows \(_get_total_norm .*"):
        torch_compat.route_clipping_of(module, package, seen.append)
    params = list(make_mlp().parameters())
    # A generator is listed once: the hook and torch's function both see every parameter.
    assert package.clip_grad_norm_(iter(params), 1.0) == [id(p) for p in params]
    assert seen == [params]
    assert module.clip_grad_value_ is package.clip_grad_value_


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


def test_a_replica_stepping_without_backward_is_a_sync_mismatch(strategy):
    module = make_mlp()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

    def step(batch):
        x, y = batch
        if mirrored.get_replica_context().replica_id_in_sync_group != 1:
            loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            loss.backward()
        optimizer.step()

    (batch,) = strategy.experimental_distribute_dataset(make_batches()[:1])
    with pytest.raises(mirrored.SyncMismatchError, match=r"replica\(s\) \[1\] without a loss"):
        strategy.run(step, (batch,))
    for replica in model.replicas:
        for name, value in replica.state_dict().items():
            assert torch.equal(value, before[name]), name


def test_lazy_modules_are_refused_with_what_to_do(strategy):
    module = nn.Sequential(nn.LazyLinear(8), nn.ReLU(), nn.LazyLinear(2))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias, 2\.weight, 2\.bias .*model\(x\)"):
        strategy.mirror(module)
    module(torch.zeros(1, 5))
    model = strategy.mirror(module)
    assert model.replicas[1][0].weight.shape == (8, 5)


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
    _train_plain_scheduled(reference, reference_optimizer, reference_scheduler, batches)

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
    torch_compat.route_steps_of_subclasses(Base, lambda scheduler: id(scheduler) in skipped)

    class Late(Early):
        def step(self):
            return super().step() + " late"

    schedulers = [Base(), Early(), Late()]
    assert [s.step() for s in schedulers] == ["stepped", "stepped early", "stepped early late"]
    skipped.update(id(s) for s in schedulers)
    assert [s.step() for s in schedulers] == [None, None, None]


def test_summing_gradients_early_is_refused_where_step_sums_its_own_way():
    with mirrored.MirroredStrategy(DEVICES[:2], gradient_accumulation_steps=2) as strategy:
        module = make_mlp()
        _, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match=r"inside strategy\.run"):
            optimizer.all_reduce_gradients()
        with pytest.raises(ValueError, match="gradient_accumulation_steps > 1 or zero_stage=2"):
            strategy.run(optimizer.all_reduce_gradients)
