"""Mirrored modules and optimizers: proxies, state, hyperparameters, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.mirrored_steps import one_step, train_plain_scheduled
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

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

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
    with pytest.raises(TypeError, match=r"the closure returned 0\.0; return the loss tensor"):
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
    train_plain_scheduled(expected, plain_optimizer, plain_scheduler, batches)
    with mirrored.MirroredStrategy(DEVICES, CROSS_DEVICE_OPS[ops]()) as strategy:
        module = make_mlp()
        original = torch.optim.Adam(module.parameters(), lr=torch.tensor(0.01))
        model, optimizer = strategy.mirror(module, original)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        for batch in strategy.experimental_distribute_dataset(batches):
            one_step(strategy, model, optimizer, batch)
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
    one_step(strategy, mirrored_model, optimizer, batch)
    assert sorted(map(id, calls)) == sorted(map(id, optimizer.optimizers))
    handles.remove()
    one_step(strategy, mirrored_model, optimizer, batch)
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


def test_summing_gradients_early_is_refused_where_step_sums_its_own_way():
    with mirrored.MirroredStrategy(DEVICES[:2], gradient_accumulation_steps=2) as strategy:
        module = make_mlp()
        _, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        with pytest.raises(RuntimeError, match=r"inside strategy\.run"):
            optimizer.all_reduce_gradients()
        with pytest.raises(ValueError, match=r"last micro-step .*gradient_accumulation_steps > 1"):
            strategy.run(optimizer.all_reduce_gradients)
