"""CentralStorageStrategy: the optimizer's state and update on one parameter device, the compute
mirrored on the others, exact against the plain loop."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    adamw,
    assert_replicas_identical,
    assert_same_parameters,
    assert_same_state,
    make_batches,
    make_mlp,
    merge_batches,
    replica_step,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

# The parameter device among the compute devices (its replica updates for all), or apart from
# them (a copy of the parameters and the optimizer live there, as on a machine of GPUs whose
# parameters live on the CPU).
LAYOUTS: dict[str, dict] = {
    "on_a_compute_device": {"compute_devices": ["cpu:0", "cpu:1", "cpu:2"]},
    "on_its_own_device": {
        "compute_devices": ["cpu:1", "cpu:2", "cpu:3"],
        "parameter_device": "cpu:0",
    },
    "on_a_later_replica": {
        "compute_devices": ["cpu:1", "cpu:0", "cpu:2"],
        "parameter_device": "cpu:0",
    },
}
OPTIMIZER_MAKERS = {**OPTIMIZERS, "adamw_two_groups": adamw}


def _loss() -> mirrored.losses.Loss:
    return mirrored.losses.SparseCategoricalCrossentropy(from_logits=True)


def _central(layout: str) -> mirrored.CentralStorageStrategy:
    return mirrored.CentralStorageStrategy(**LAYOUTS[layout])


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", ["sgd_momentum", "custom", "adam", "adamw_two_groups"])
def test_a_custom_loop_equals_the_plain_loop(layout: str, name: str) -> None:
    batches = make_batches()
    reference = make_mlp()
    expected_optimizer = OPTIMIZER_MAKERS[name](reference)
    expected = train_plain(reference, expected_optimizer, batches)
    with _central(layout) as strategy:
        assert strategy.num_replicas_in_sync == 3
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZER_MAKERS[name](model)
        mirrored_model, mirrored_optimizer, losses = train_mirrored(
            strategy, model, optimizer, batches
        )
        assert_replicas_identical(mirrored_model)
        assert_same_state(expected_optimizer.state_dict(), mirrored_optimizer.state_dict())
    assert_same_parameters(reference, model)
    assert_close_float64(torch.tensor(losses), torch.tensor(expected))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_optimizer_state_lives_once_on_the_parameter_device(layout: str) -> None:
    with _central(layout) as strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["adam"](model)
        _, mirrored_optimizer, _ = train_mirrored(strategy, model, optimizer, make_batches()[:2])
        central = mirrored_optimizer.update_plan.central
        assert central is not None
        assert central.parameter_device == strategy.parameter_device.torch_device
        # Only the updating replica's optimizer holds state (none where the parameter device is
        # apart), and the program's shows the very same tensors.
        holders = {i for i, o in enumerate(mirrored_optimizer.optimizers) if o.state}
        assert holders == {0, central.updater}
        shown = {id(t) for s in mirrored_optimizer.optimizers[0].state.values() for t in s.values()}
        assert shown == {id(t) for s in central.optimizer.state.values() for t in s.values()}
        state_size = sum(v.numel() for s in central.optimizer.state.values() for v in s.values())
        assert state_size == 2 * sum(p.numel() for p in model.parameters()) + len(
            list(model.parameters())
        )  # Adam: exp_avg, exp_avg_sq and a step counter per parameter


@pytest.mark.parametrize("layout", LAYOUTS)
def test_edits_outside_run_and_a_schedule_reach_the_update(layout: str) -> None:
    """A weight halved between steps and a learning rate decayed by torch's scheduler: the
    parameter device's copy takes both, as the plain loop does."""
    batches = make_batches()[:6]
    results = []
    for strategy in (None, _central(layout)):
        with strategy.scope() if strategy else mirrored.get_strategy().scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["sgd_momentum"](model)
        if strategy is not None:
            mirrored_model, optimizer = strategy.mirror(model, optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for step, batch in enumerate(batches):
            if step == 3:
                with torch.no_grad():
                    model[0].weight.mul_(0.5)
            if strategy is None:
                train_plain(model, optimizer, [batch])
            else:
                (shards,) = strategy.experimental_distribute_dataset([batch])
                strategy.run(replica_step, (shards, mirrored_model, optimizer))
            scheduler.step()
        if strategy is not None:
            assert_replicas_identical(mirrored_model)
            strategy.close()
        results.append(model)
    assert_same_parameters(results[0], results[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gradient_accumulation_equals_the_merged_batches(layout: str) -> None:
    batches = make_batches(num_examples=192, batch_size=24)
    reference = make_mlp()
    train_plain(reference, OPTIMIZERS["adam"](reference), merge_batches(batches, 2))
    strategy = mirrored.CentralStorageStrategy(**LAYOUTS[layout], gradient_accumulation_steps=2)
    with strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["adam"](model)
        train_mirrored(strategy, model, optimizer, batches)
    assert_same_parameters(reference, model)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fit_and_a_resumed_fit_equal_the_default_strategy(layout: str) -> None:
    x, y = torch.randn(96, 12), torch.randint(0, 5, (96,))
    trained, states = [], []
    for strategy in (mirrored.get_strategy(), _central(layout)):
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            model.compile(adamw(model.module), _loss())
        model.fit(x, y, batch_size=24, epochs=1, verbose=0, shuffle=False)
        saved = model.optimizer.state_dict()
        with strategy.scope():
            resumed = mirrored.Model(make_mlp())
            resumed.compile(adamw(resumed.module), _loss())
        resumed.module.load_state_dict(model.module.state_dict())
        resumed.optimizer.load_state_dict(saved)
        resumed.fit(x, y, batch_size=24, epochs=1, verbose=0, shuffle=False)
        trained.append(resumed.module)
        states.append(resumed.optimizer.state_dict())
        if strategy is not mirrored.get_strategy():
            strategy.close()
    assert_same_parameters(trained[0], trained[1])
    assert_same_state(states[0], states[1])


def test_the_default_parameter_device_follows_tensorflow() -> None:
    """Several CPU devices keep the parameters on the first (the CPU); one device keeps both."""
    with mirrored.CentralStorageStrategy() as strategy:
        assert strategy.num_replicas_in_sync == 4
        assert strategy.parameter_device.short_name == "cpu:0"
        assert repr(strategy) == (
            "CentralStorageStrategy(compute_devices=['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3'], "
            "parameter_device='cpu:0')"
        )
    with mirrored.CentralStorageStrategy(["cpu:2"]) as strategy:
        assert strategy.parameter_device.short_name == "cpu:2"


def test_step_with_a_closure_is_refused_before_anything_changes() -> None:
    with _central("on_its_own_device") as strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = torch.optim.LBFGS(model.parameters(), lr=0.1)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        before = [p.detach().clone() for p in model.parameters()]
        (x, y), *_ = make_batches()
        (shards,) = strategy.experimental_distribute_dataset([(x, y)])

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            def closure() -> torch.Tensor:
                loss = F.cross_entropy(mirrored_model(batch[0]), batch[1], reduction="sum")
                loss.backward()
                return loss

            mirrored_optimizer.step(closure)

        with pytest.raises(ValueError, match="CentralStorageStrategy"):
            strategy.run(step, (shards,))
        for old, new in zip(before, model.parameters(), strict=True):
            assert torch.equal(old, new)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"compute_devices": "cpu:0"}, TypeError, "expected a list of devices"),
        ({"parameter_device": ["cpu:0"]}, TypeError, "one device"),
        ({"parameter_device": "cpu:9"}, ValueError, "device 'cpu:9' does not exist"),
        ({"compute_devices": ["cpu:0", "cpu:0"]}, ValueError, "listed twice"),
    ],
)
def test_bad_devices_are_refused(arguments: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        mirrored.CentralStorageStrategy(**arguments)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_an_edit_right_after_step_is_not_lost_in_the_copies(layout: str) -> None:
    """The replica function scales the weights in place after ``step()``: every replica must
    have copied the update before the parameter device's values change again."""
    batches = make_batches()[:8]
    reference = make_mlp()
    reference_optimizer = OPTIMIZERS["sgd"](reference)
    for x, y in batches:
        train_plain(reference, reference_optimizer, [(x, y)])
        with torch.no_grad():
            for param in reference.parameters():
                param.mul_(0.9)

    def step(batch, model, optimizer) -> None:
        replica_step(batch, model, optimizer)
        with torch.no_grad():
            for param in model.parameters():
                param.mul_(0.9)

    with _central(layout) as strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["sgd"](model)
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, (batch, mirrored_model, mirrored_optimizer))
        assert_replicas_identical(mirrored_model)
    assert_same_parameters(reference, model)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_hooks_and_a_schedule_see_one_step_per_update(layout: str) -> None:
    """Hooks on the program's optimizer (before or after mirroring) and on the mirrored one run
    once per update, and torch's scheduler sees its optimizer step (no warning that it did
    not)."""
    calls = {"program": 0, "mirrored": 0, "program_after": 0}

    def counting(name: str):
        return lambda *_: calls.__setitem__(name, calls[name] + 1)

    with _central(layout) as strategy:
        with strategy.scope():
            model = make_mlp()
            optimizer = OPTIMIZERS["sgd"](model)
        optimizer.register_step_post_hook(counting("program"))
        mirrored_model, mirrored_optimizer = strategy.mirror(model, optimizer)
        mirrored_optimizer.register_step_post_hook(counting("mirrored"))
        optimizer.register_step_pre_hook(counting("program_after"))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch's "lr_scheduler.step() before optimizer.step()"
            for batch in strategy.experimental_distribute_dataset(make_batches()[:3]):
                strategy.run(replica_step, (batch, mirrored_model, mirrored_optimizer))
                scheduler.step()
    assert calls == {"program": 3, "mirrored": 3, "program_after": 3}
