"""Buffers changed inside replicas: one rule keeps every replica's copy the same after a run."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from tests.exactness import assert_close_float64
from tests.reference_loops import assert_replicas_identical, make_batches, replica_step

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


class WithEMA(nn.Module):
    """A classifier that keeps an exponential moving average of its inputs' mean (floating), a
    count of its forward calls (integer, the same on every replica) and a count of the examples
    it saw (integer, different on each shard)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.linear = nn.Linear(12, 5)
        self.register_buffer("ema", torch.zeros(12))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("examples", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(0.1 * x.mean(dim=0))
                self.calls += 1
                self.examples += x.shape[0]
        return self.linear(x)


def _train(strategy, model, optimizer, batches):
    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(replica_step, (batch, model, optimizer))


def _plain(batches) -> WithEMA:
    module = WithEMA()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    for x, y in batches:
        F.cross_entropy(module(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return module


@pytest.mark.parametrize("devices", [2, 4])
def test_a_moving_average_is_averaged_and_counters_follow_their_aggregation(devices):
    batches = make_batches(num_examples=16 * 6)  # even shards: the EMA's mean is one device's
    expected = _plain(batches)
    module = WithEMA()
    mirrored.set_buffer_aggregation(module, {"examples": "sum", "calls": "only_first_replica"})
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        _train(strategy, model, optimizer, batches)
    assert_replicas_identical(model)
    state = model.state_dict()
    assert_close_float64(state["ema"], expected.ema)
    assert state["calls"].item() == expected.calls.item() == 6  # the same on every replica
    assert state["examples"].item() == expected.examples.item() == 96  # the shards' counts added
    torch.testing.assert_close(state["linear.weight"], expected.linear.weight)


def test_an_integer_buffer_that_differs_is_an_error_naming_it_and_nothing_diverges():
    module = WithEMA()
    mirrored.set_buffer_aggregation(module, {"calls": "only_first_replica"})
    batches = make_batches(num_examples=11, batch_size=11)  # shards of 6 and 5
    expected = _plain(batches)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        with pytest.raises(
            ValueError, match=r"buffer 'examples' \(torch\.int64\) changed diff"
        ) as e:
            _train(strategy, model, optimizer, batches)
        assert_replicas_identical(model)  # the failed run resynced every replica from replica 0
    # The buffers are compared as the run ends: the step was taken, and the error says so.
    assert "(its optimizer.step()) were applied" in "\n".join(e.value.__notes__)
    assert "replica 0's parameters, optimizer state and buffers" in "\n".join(e.value.__notes__)
    torch.testing.assert_close(module.linear.weight, expected.linear.weight)
    assert module.examples.item() == 6  # replica 0's shard


@pytest.mark.parametrize("on", ["mirrored_module", "original_module"])
def test_sum_chosen_after_mirror_adds_the_replicas_changes(on):
    module = WithEMA()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        mirrored.set_buffer_aggregation(
            model if on == "mirrored_module" else module,
            {"examples": "sum", "calls": "only_first_replica"},
        )
        _train(strategy, model, optimizer, make_batches(num_examples=22, batch_size=11))
        assert_replicas_identical(model)
    assert module.examples.item() == 22 and module.calls.item() == 2


def test_an_integer_buffer_changed_alike_without_an_aggregation_warns_once_naming_it():
    """Copies that agree may still be wrong (an example count on equal shards): an integer
    buffer has no default aggregation, so the first run that changes one says so."""
    module = WithEMA()
    mirrored.set_buffer_aggregation(module, {"calls": "only_first_replica"})
    batches = make_batches(num_examples=24, batch_size=12)  # shards of 6 and 6
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        with pytest.warns(mirrored.BufferAggregationWarning) as caught:
            _train(strategy, model, optimizer, batches[:1])
        (warning,) = caught  # 'examples' alone: 'calls' has its aggregation, 'ema' is floating
        assert "buffer 'examples' (torch.int64)" in str(warning.message)
        assert "set_buffer_aggregation(module, {'examples': 'sum'})" in str(warning.message)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _train(strategy, model, optimizer, batches[1:])
    assert module.examples.item() == 12  # kept as each replica counted it: what was warned


def test_only_first_replica_and_reassigned_buffers():
    class Last(nn.Module):
        """Keeps the last input it saw, by reassigning its buffer (not in place)."""

        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("last", torch.zeros(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.last = x[-1].detach().clone()
            return x

    module = Last()
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model = strategy.mirror(module)
        mirrored.set_buffer_aggregation(model, {"last": mirrored.VariableAggregation.MEAN})
        (batch,) = strategy.experimental_distribute_dataset([torch.arange(12.0).reshape(6, 2)])
        strategy.run(model, (batch,))
        assert model.last.tolist() == [(2 + 6 + 10) / 3, (3 + 7 + 11) / 3]
        assert_replicas_identical(model)
        mirrored.set_buffer_aggregation(model, {"last": "only_first_replica"})
        strategy.run(model, (batch,))
        assert model.last.tolist() == [2.0, 3.0]
        assert_replicas_identical(model)


@pytest.mark.filterwarnings("error::mirrored.BufferAggregationWarning")
def test_batch_norm_statistics_of_a_forward_without_optimizer_are_averaged():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    halves = [copy.deepcopy(module) for _ in range(2)]
    x = torch.randn(8, 4)
    for half, part in zip(halves, x.split(4), strict=True):
        half(part)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = strategy.mirror(module)
        (batch,) = strategy.experimental_distribute_dataset([x])
        strategy.run(model, (batch,))
    assert_replicas_identical(model)
    expected = (halves[0][1].running_var + halves[1][1].running_var) / 2
    torch.testing.assert_close(model[1].running_var, expected)
    assert model[1].num_batches_tracked.item() == 1


def test_buffers_every_replica_changes_alike_stay_bit_exact():
    class Decay(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("rate", torch.tensor(0.1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.rate.mul_(0.7)  # data-independent: the same on every replica
            return x * self.rate

    expected = Decay()
    for _ in range(5):
        expected(torch.ones(3))
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"]) as strategy:
        model = strategy.mirror(Decay())
        (batch,) = strategy.experimental_distribute_dataset([torch.ones(3)])
        for _ in range(5):
            strategy.run(model, (batch,))
    assert torch.equal(model.rate, expected.rate)
    assert_replicas_identical(model)


def test_aggregation_errors_name_the_problem():
    module = WithEMA()
    with pytest.raises(ValueError, match=r"'missing' is not a buffer.*\['calls', 'ema', 'ex"):
        mirrored.set_buffer_aggregation(module, {"missing": "mean"})
    with pytest.raises(ValueError, match=r"aggregation='average': expected .*'only_first_replica'"):
        mirrored.set_buffer_aggregation(module, {"ema": "average"})
    with pytest.raises(TypeError, match=r"expected a torch\.nn\.Module"):
        mirrored.set_buffer_aggregation("model", {"ema": "mean"})


def test_the_changed_buffers_of_each_dtype_cross_as_one_tensor_and_agreeing_ones_stay_bitwise():
    class Mixed(nn.Module):
        """Floating and integer buffers, most changed alike on every replica, one by the data."""

        def __init__(self) -> None:
            super().__init__()
            for index in range(3):
                self.register_buffer(f"rate{index}", torch.tensor([0.1, 0.3]) * (index + 1))
                self.register_buffer(f"calls{index}", torch.zeros((), dtype=torch.int64))
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for index in range(3):
                getattr(self, f"rate{index}").mul_(0.7)
                getattr(self, f"calls{index}").add_(1)
            self.seen.copy_(x.sum(0))  # a different value on each shard
            return x

    expected = Mixed()
    expected(torch.ones(1, 1))
    crossing: list[int] = []
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = strategy.mirror(Mixed())
        counters = {f"calls{index}": "only_first_replica" for index in range(3)}
        mirrored.set_buffer_aggregation(model, counters)
        gather = strategy.communicator.all_gather_tensors

        def counted(replica, tensors, axis):
            crossing.append(len(tensors))
            return gather(replica, tensors, axis)

        strategy.communicator.all_gather_tensors = counted
        (batch,) = strategy.experimental_distribute_dataset([torch.tensor([[1.0], [2.0]])])
        strategy.run(model, (batch,))
    assert crossing == [2, 2]  # per replica: its floating buffers, then its integer ones
    for name, value in expected.named_buffers():
        if name != "seen":
            assert torch.equal(getattr(model, name), value), name
    assert torch.equal(model.seen, torch.tensor([1.5]))
    assert_replicas_identical(model)


def _bn_net() -> nn.Module:
    torch.manual_seed(4)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 5))


def _gathered_dtypes(strategy) -> list[list[torch.dtype]]:
    """Spy: the dtypes of the tensors each all_gather_tensors call sends."""
    calls: list[list[torch.dtype]] = []
    gather = strategy.communicator.all_gather_tensors

    def counted(replica, tensors, axis):
        calls.append([t.dtype for t in tensors])
        return gather(replica, tensors, axis)

    strategy.communicator.all_gather_tensors = counted
    return calls


@pytest.mark.parametrize("devices", [2, 3])
def test_running_statistics_the_update_averaged_do_not_cross_again(devices):
    """The optimizer's step averages BatchNorm's running statistics, so they agree on every
    replica when the run ends: the end of the run checks only the counters the forward moved."""
    batches = make_batches(num_examples=12 * devices, batch_size=4 * devices)
    with mirrored.MirroredStrategy([f"cpu:{i}" for i in range(devices)]) as strategy:
        module = _bn_net()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
        calls = _gathered_dtypes(strategy)
        _train(strategy, model, optimizer, batches)
        assert_replicas_identical(model)
        assert model[1].num_batches_tracked.item() == len(batches)
    assert calls and all(dtypes == [torch.int64] for dtypes in calls)


def test_a_forward_after_the_update_is_averaged_when_the_run_ends():
    """Running statistics a forward changes after the optimizer averaged them differ again on
    each replica: the end of the run averages them."""
    x, y = make_batches(num_examples=12)[0]

    def mirror(strategy):
        module = _bn_net()
        return strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:  # the update alone
        model, optimizer = mirror(strategy)
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])
        strategy.run(replica_step, (batch, model, optimizer))
        updated = copy.deepcopy(model.replicas[0])
    shards = [copy.deepcopy(updated) for _ in range(2)]
    for shard, part in zip(shards, x.split(6), strict=True):
        shard(part)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = mirror(strategy)
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])

        def step(batch):
            replica_step(batch, model, optimizer)
            model(batch[0])  # the running statistics move again, by each replica's shard

        strategy.run(step, (batch,))
        assert_replicas_identical(model)
        for name in ("running_mean", "running_var"):
            expected = (getattr(shards[0][1], name) + getattr(shards[1][1], name)) / 2
            assert not torch.equal(getattr(shards[0][1], name), expected)
            torch.testing.assert_close(getattr(model[1], name), expected)


class _FunctionalNorm(nn.BatchNorm1d):
    """A BatchNorm whose own forward updates the running statistics through F.batch_norm and
    keeps no count: nothing moves a version counter."""

    def __init__(self, features: int) -> None:
        super().__init__(features, track_running_stats=True)
        self.num_batches_tracked = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True)


@pytest.mark.parametrize("norm", ["subclass", "functional call"])
def test_statistics_moved_without_a_version_after_the_update_are_averaged(norm):
    """The update's mean makes the statistics agree; a later change that moves no version
    counter (a subclass's F.batch_norm, a functional call on a BatchNorm's buffers) makes them
    differ again, and the end of the run finds it."""
    torch.manual_seed(4)
    layer = _FunctionalNorm(16) if norm == "subclass" else nn.BatchNorm1d(16)
    module = nn.Sequential(nn.Linear(12, 16), layer, nn.ReLU(), nn.Linear(16, 5))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    x, y = make_batches(num_examples=12)[0]
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model, optimizer = strategy.mirror(module, optimizer)
        (batch,) = strategy.experimental_distribute_dataset([(x, y)])

        def step(batch):
            replica_step(batch, model, optimizer)
            bn = model[1]
            with torch.no_grad():
                F.batch_norm(model[0](batch[0]), bn.running_mean, bn.running_var, training=True)

        strategy.run(step, (batch,))
        assert_replicas_identical(model)


class _OwnStatistics(nn.Module):
    """Running statistics of its own, moved by F.batch_norm: no version counter moves."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(4))
        self.register_buffer("running_var", torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.batch_norm(x, self.running_mean, self.running_var, training=True)


@pytest.mark.parametrize("module", ["own statistics", "BatchNorm subclass"])
def test_statistics_moved_without_a_version_in_a_forward_are_averaged(module):
    """No optimizer averages them: the end of the run finds the change by the bytes."""
    torch.manual_seed(0)
    make = _OwnStatistics if module == "own statistics" else lambda: _FunctionalNorm(4)
    x = torch.randn(8, 4)
    halves = [make() for _ in range(2)]
    for half, part in zip(halves, x.split(4), strict=True):
        half(part)
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"]) as strategy:
        model = strategy.mirror(make())
        (batch,) = strategy.experimental_distribute_dataset([x])
        strategy.run(model, (batch,))
        assert_replicas_identical(model)
        expected = (halves[0].running_mean + halves[1].running_mean) / 2
        assert not torch.equal(halves[0].running_mean, expected)
        torch.testing.assert_close(model.running_mean, expected)
