"""ZeRO (zero_stage=1/2): the parameters of the unsharded run, 1/N of the optimizer state per
replica, and the plain single-optimizer state_dict."""

from __future__ import annotations

import copy
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.core.replica_meeting import ReplicaExchange
from mirrored.replication.sharded_update import state_bytes
from tests.allocations import AllocationCount
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    Batch,
    DeepNet,
    adamw,
    assert_replicas_identical,
    assert_same_parameters,
    assert_same_state,
    compiled_deep_net,
    make_batches,
    make_mlp,
    merge_batches,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py

DEVICES = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def _step_bytes() -> int:
    """An optimizer's step count: a tensor of the default dtype."""
    return torch.get_default_dtype().itemsize


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)


def assert_sharded_state(
    plain: torch.optim.Optimizer, optimizer: mirrored.MirroredOptimizer, num_replicas: int
) -> None:
    """Every element's state lives on one replica only (a parameter cut between replicas keeps
    a step count in each piece), 1/N each, and it joins back into the plain state."""
    whole = sum(state_bytes([plain]))
    shares = optimizer.state_bytes()
    assert whole <= sum(shares) <= whole + _step_bytes() * (num_replicas - 1)
    assert max(shares) <= whole / num_replicas * 1.05, shares
    assert_same_state(plain.state_dict(), optimizer.state_dict())


@pytest.mark.parametrize(
    ("num_replicas", "stage", "ops", "make_optimizer"),
    [
        (2, 1, "one_device", adamw),  # bucketed all-reduce, then owners update
        (2, 2, "default", adamw),  # owners sum the gradients
        (3, 1, "hierarchical", sgd_momentum),
        (4, 2, "default", sgd_momentum),
        (4, 1, "default", adamw),
    ],
)
def test_sharded_training_equals_one_device_with_1_over_n_of_the_state(
    num_replicas: int, stage: int, ops: str, make_optimizer
) -> None:
    batches = make_batches(num_examples=6 * 16, batch_size=16)
    expected = DeepNet()
    plain_optimizer = make_optimizer(expected)
    train_plain(expected, plain_optimizer, batches)
    model = DeepNet()
    with mirrored.MirroredStrategy(
        DEVICES[:num_replicas], CROSS_DEVICE_OPS[ops](), zero_stage=stage
    ) as strategy:
        mirrored_model, optimizer, _ = train_mirrored(
            strategy, model, make_optimizer(model), batches
        )
        assert optimizer.zero_stage == stage
        assert_same_parameters(expected, mirrored_model.module)
        assert_replicas_identical(mirrored_model)
        assert_sharded_state(plain_optimizer, optimizer, num_replicas)


@pytest.mark.parametrize(("num_replicas", "stage"), [(4, 1), (4, 2), (3, 2)])
def test_a_parameter_larger_than_1_over_n_is_shared_by_several_owners(
    num_replicas: int, stage: int
) -> None:
    # The MLP's 32 x 16 weight is half of its 1029 numbers: whole owners would keep 0.5.
    batches = make_batches(num_examples=6 * 16, batch_size=16)
    expected = make_mlp()
    plain_optimizer = torch.optim.Adam(expected.parameters(), lr=1e-2, amsgrad=True)
    train_plain(expected, plain_optimizer, batches)
    model = make_mlp()
    with mirrored.MirroredStrategy(DEVICES[:num_replicas], zero_stage=stage) as strategy:
        mirrored_model, optimizer, _ = train_mirrored(
            strategy, model, torch.optim.Adam(model.parameters(), lr=1e-2, amsgrad=True), batches
        )
        assert_same_parameters(expected, mirrored_model.module)
        assert_replicas_identical(mirrored_model)
        assert_sharded_state(plain_optimizer, optimizer, num_replicas)
        # The joined state loads back into pieces: a new run on other replicas resumes it.
        saved = optimizer.state_dict()
    resumed = copy.deepcopy(mirrored_model.module)
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=1) as strategy:
        resumed_model, resumed_optimizer = strategy.mirror(
            resumed, torch.optim.Adam(resumed.parameters(), lr=1e-2, amsgrad=True)
        )
        resumed_optimizer.load_state_dict(saved)
        train_plain(expected, plain_optimizer, batches[:2])
        for batch in strategy.experimental_distribute_dataset(batches[:2]):
            strategy.run(_replica_step, (batch, resumed_model, resumed_optimizer))
        assert_same_parameters(expected, resumed_model.module)


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_an_optimizer_state_that_does_not_fit_changes_no_replica(zero_stage: int) -> None:
    batches = make_batches(num_examples=2 * 16, batch_size=16)
    sgd_model = make_mlp()
    sgd = sgd_momentum(sgd_model)
    train_plain(sgd_model, sgd, batches)
    model = make_mlp()
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=zero_stage) as strategy:
        mirrored_model, optimizer, _ = train_mirrored(
            strategy, model, torch.optim.Adam(model.parameters(), lr=1e-2), batches
        )
        before = copy.deepcopy(optimizer.state_dict())
        replicas = [copy.deepcopy(o.state_dict()) for o in optimizer.optimizers]
        with pytest.raises(ValueError, match=r"has no \['betas', 'eps'\] .*saved by SGD\?"):
            optimizer.load_state_dict(sgd.state_dict())
        with pytest.raises(ValueError, match=r"has no 'step' .*saved by Muon or SGD\?"):
            optimizer.load_state_dict({**sgd.state_dict(), "param_groups": before["param_groups"]})
        assert_same_state(before, optimizer.state_dict())
        for replica, saved in zip(optimizer.optimizers, replicas, strict=True):
            assert_same_state(saved, replica.state_dict())
        strategy.run(
            _replica_step,
            (
                next(iter(strategy.experimental_distribute_dataset(batches))),
                mirrored_model,
                optimizer,
            ),
        )


def _step_keeping_gradients(batch: Batch, model, optimizer) -> None:
    x, y = batch
    loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
    loss.backward()
    optimizer.step()  # no zero_grad: the test reads what the step left


def test_stage_2_leaves_each_reduced_gradient_on_its_owner_only() -> None:
    batches = make_batches(num_examples=32, batch_size=32)
    expected = DeepNet()
    F.cross_entropy(expected(batches[0][0]), batches[0][1]).backward()
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=2) as strategy:
        net = DeepNet()
        model, optimizer = strategy.mirror(net, adamw(net))
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        strategy.run(_step_keeping_gradients, (batch, model, optimizer))
        cut = {piece.position for piece in optimizer.update_plan.zero.pieces if not piece.whole}
        assert cut  # 2 replicas: one parameter is cut between them
        for index, (name, reference) in enumerate(expected.named_parameters()):
            grads = [list(replica.parameters())[index].grad for replica in model.replicas]
            held = [g for g in grads if g is not None]
            if reference.grad is None or index in cut:
                assert not held, name  # a cut one's ranges went to its owners' pieces
                continue
            assert len(held) == 1, f"{name}: held by {len(held)} replicas"
            assert_close_float64(held[0], reference.grad)


def test_state_dict_round_trip_resumes_the_same_training(tmp_path: Path) -> None:
    batches = make_batches(num_examples=8 * 16, batch_size=16)
    first, second = batches[:4], batches[4:]
    expected = DeepNet()
    expected_optimizer = adamw(expected)
    train_plain(expected, expected_optimizer, first)
    model = DeepNet()
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=1) as strategy:
        _, optimizer, _ = train_mirrored(strategy, model, adamw(model), first)
        torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    train_plain(expected, expected_optimizer, second)
    # A new run on 3 replicas (other owners) resumes from the file.
    resumed = copy.deepcopy(model)
    optimizer_state = torch.load(tmp_path / "optimizer.pt")
    with mirrored.MirroredStrategy(DEVICES[:3], zero_stage=2) as strategy:
        resumed_model, resumed_optimizer = strategy.mirror(resumed, adamw(resumed))
        resumed_optimizer.load_state_dict(optimizer_state)
        whole = sum(state_bytes([expected_optimizer]))
        assert whole <= sum(resumed_optimizer.state_bytes()) <= whole + _step_bytes() * 2
        for batch in strategy.experimental_distribute_dataset(second):
            strategy.run(_replica_step, (batch, resumed_model, resumed_optimizer))
        assert_same_parameters(expected, resumed_model.module)
        assert_same_state(expected_optimizer.state_dict(), resumed_optimizer.state_dict())


def _replica_step(batch: Batch, model, optimizer) -> None:
    _step_keeping_gradients(batch, model, optimizer)
    optimizer.zero_grad()


def test_fit_and_save_with_sharded_state_equal_fit_without(tmp_path: Path) -> None:
    x = torch.randn(96, 12, generator=torch.Generator().manual_seed(0))
    y = torch.randint(0, 5, (96,), generator=torch.Generator().manual_seed(1))
    results = []
    for zero_stage in (0, 2):
        torch.manual_seed(7)
        with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=zero_stage) as strategy:
            model = compiled_deep_net(strategy)
            model.fit(x, y, batch_size=16, epochs=2, verbose=0)
            model.save(tmp_path / f"zero{zero_stage}.pt")
            results.append((model.module, torch.load(tmp_path / f"zero{zero_stage}.pt")))
    (plain_module, plain_file), (sharded_module, sharded_file) = results
    assert_same_parameters(plain_module, sharded_module)
    assert_same_state(plain_file["optimizer"], sharded_file["optimizer"])


@pytest.mark.parametrize("zero_stage", [3, -1, True, 1.0])
def test_zero_stage_must_be_0_1_or_2(zero_stage) -> None:
    with pytest.raises(ValueError, match=r"zero_stage=.*expected 0 .*, 1 .* or 2"):
        mirrored.MirroredStrategy(DEVICES[:2], zero_stage=zero_stage)


def test_local_sgd_and_zero_do_not_combine() -> None:
    with pytest.raises(ValueError, match="local_sgd and zero_stage=1 do not combine"):
        mirrored.MirroredStrategy(DEVICES[:2], zero_stage=1, local_sgd=mirrored.LocalSGD(2))


def test_an_optimizer_of_unknown_update_is_refused_at_mirror() -> None:
    class Scaled(torch.optim.SGD):
        pass

    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=1) as strategy:
        model = DeepNet()
        with pytest.raises(TypeError, match=r"zero_stage=1 needs an optimizer .* got Scaled"):
            strategy.mirror(model, Scaled(model.parameters(), lr=0.1))


def test_sharded_state_with_gradient_accumulation_equals_one_step_on_the_window() -> None:
    batches = make_batches(num_examples=8 * 16, batch_size=16)
    expected = DeepNet()
    train_plain(expected, adamw(expected), merge_batches(batches, 2))
    model = DeepNet()
    with mirrored.MirroredStrategy(
        DEVICES[:2], zero_stage=2, gradient_accumulation_steps=2
    ) as strategy:
        mirrored_model, _, _ = train_mirrored(strategy, model, adamw(model), batches)
        assert_same_parameters(expected, mirrored_model.module)


def test_stage_2_refuses_compressed_gradients() -> None:
    with pytest.raises(ValueError, match="zero_stage=2 and compression='bf16' do not combine"):
        mirrored.MultiWorkerMirroredStrategy(
            mirrored.CommunicationOptions(compression="bf16"), zero_stage=2
        )


@pytest.mark.parametrize("stage", [1, 2])
def test_a_parameter_unfrozen_after_mirroring_is_an_error_not_a_silent_constant(
    stage: int,
) -> None:
    batches = make_batches(num_examples=32, batch_size=32)
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=stage) as strategy:
        net = DeepNet()
        model, optimizer = strategy.mirror(net, adamw(net))
        batch = next(iter(strategy.experimental_distribute_dataset(batches)))
        strategy.run(_replica_step, (batch, model, optimizer))  # frozen: fine
        before = [p.clone() for p in model.module.parameters()]
        model.frozen.requires_grad_(True)
        with pytest.raises(RuntimeError, match=r"frozen \(requires_grad=False\) when the model"):
            strategy.run(_replica_step, (batch, model, optimizer))
        # Nothing was updated: the step stopped before any owner stepped.
        for old, new in zip(before, model.module.parameters(), strict=True):
            assert torch.equal(old, new)


def test_a_run_failing_after_the_owners_updated_leaves_the_steps_parameters_and_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Replica 1 fails at the sync point after every owner's update (as a Ctrl-C or a peer's
    # failure would release it there): the owners' values go with their advanced state, so
    # the model ends where two full steps put it, on every replica. Replica 1 arrives last at
    # each sync point and fails before replica 0 has left the one before the update (it holds
    # the meeting' lock until its next sync call): replica 0 still makes its update.
    batches = make_batches(num_examples=2 * 16, batch_size=16)
    expected = make_mlp()
    plain_optimizer = torch.optim.Adam(expected.parameters(), lr=1e-2)
    train_plain(expected, plain_optimizer, batches)
    exchange_all = ReplicaExchange.all
    fail = {"on": False, "holding": False}

    def failing(self: ReplicaExchange, label: str, value, cross_device: bool = False):
        if not fail["on"] or self.replica_id == 0:
            return exchange_all(self, label, value, cross_device)
        if label == "ZeRO: parameters updated":
            error = RuntimeError("interrupted")
            self.meeting.abort(error)
            self.meeting._cond.release()
            raise error
        if fail["holding"]:
            self.meeting._cond.release()
        while self.meeting.waiting() != {0: label}:
            time.sleep(0.001)
        self.meeting._cond.acquire()
        fail["holding"] = True
        return exchange_all(self, label, value, cross_device)

    monkeypatch.setattr(ReplicaExchange, "all", failing)
    model = make_mlp()
    with mirrored.MirroredStrategy(DEVICES[:2], zero_stage=1) as strategy:
        mirrored_model, optimizer = strategy.mirror(
            model, torch.optim.Adam(model.parameters(), lr=1e-2)
        )
        first, second = strategy.experimental_distribute_dataset(batches)
        strategy.run(_replica_step, (first, mirrored_model, optimizer))
        fail["on"] = True
        with pytest.raises(RuntimeError, match="interrupted"):
            strategy.run(_replica_step, (second, mirrored_model, optimizer))
        assert_replicas_identical(mirrored_model)
        assert_same_parameters(expected, mirrored_model.module)
        assert_same_state(plain_optimizer.state_dict(), optimizer.state_dict())


def test_a_frozen_layers_state_is_kept_and_a_schedule_reaches_every_owner() -> None:
    batches = make_batches(num_examples=5 * 16, batch_size=16)
    expected, model = make_mlp(), make_mlp()
    optimizers = []
    for module in (expected, model):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
        train_plain(module, optimizer, batches[:1])  # every parameter has a state ...
        module[0].requires_grad_(False)  # ... and the first layer's stays as it is
        optimizers.append(optimizer)
    schedule = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)
    for batch in batches[1:]:
        train_plain(expected, optimizers[0], [batch])
        schedule.step()
    with mirrored.MirroredStrategy(DEVICES[:3], zero_stage=2) as strategy:
        mirrored_model, optimizer = strategy.mirror(model, optimizers[1])
        schedule = torch.optim.lr_scheduler.StepLR(optimizer.optimizer, step_size=1, gamma=0.5)
        for batch in strategy.experimental_distribute_dataset(batches[1:]):
            strategy.run(_replica_step, (batch, mirrored_model, optimizer))
            schedule.step()
        assert_same_parameters(expected, mirrored_model.module)
        assert_same_state(optimizers[0].state_dict(), optimizer.state_dict())


def test_zero_on_replicas_sharing_one_device_s_memory_says_it_saves_nothing() -> None:
    """They already keep one optimizer state (owner updates): stage 1 saves nothing there. The
    warning points at the program's line."""
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=1) as strategy:
        module = make_mlp()
        with pytest.warns(UserWarning, match=r"zero_stage=1 saves no memory on 2 replicas") as seen:
            strategy.mirror(module, torch.optim.Adam(module.parameters()))
    assert seen[0].filename == __file__


def test_zero_stage_2_on_replicas_sharing_one_device_s_memory_says_nothing() -> None:
    """Stage 2 saves memory there (the gradients are summed at the step, with no reduction
    buckets): no warning."""
    module = make_mlp()
    with (
        mirrored.MirroredStrategy(["cpu:0", "cpu:1"], zero_stage=2) as strategy,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("error")
        strategy.mirror(module, torch.optim.Adam(module.parameters()))


def _peak_bytes_on_one_replica(zero_stage: int) -> int:
    """The tensor bytes alive at the peak (tests/allocations.py) of mirroring DeepNet with AdamW
    on one replica and training it 3 steps; one thread allocates, so the count is the same on
    every run."""
    count = AllocationCount()
    with mirrored.MirroredStrategy(["cpu:0"], zero_stage=zero_stage) as strategy:
        net = DeepNet()
        with warnings.catch_warnings(), count.tracking():
            warnings.simplefilter("ignore", UserWarning)  # stage 1 saves nothing here
            model, optimizer = strategy.mirror(net, adamw(net))

        def step(batch: Batch) -> None:
            with count.tracking():
                _replica_step(batch, model, optimizer)

        for batch in strategy.experimental_distribute_dataset(make_batches(num_examples=48)):
            strategy.run(step, (batch,))
    return count.peak


@pytest.mark.parametrize("zero_stage", [1, 2])
def test_zero_on_one_replica_holds_no_more_than_stage_0(zero_stage: int) -> None:
    """One replica owns everything, so ZeRO has nothing to shard and must hold no more than
    stage 0. Its update once took torch's foreach path, whose temporaries (one per parameter)
    are alive at once."""
    assert _peak_bytes_on_one_replica(zero_stage) <= _peak_bytes_on_one_replica(0)
