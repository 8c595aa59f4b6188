"""MultiWorkerMirroredStrategy in one process (a single local worker on logical CPU devices):
options, and the gradient reducer's exactness beyond one backward per step. Several processes:
tests/multiprocess/test_multi_worker.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.cluster.resolvers import ClusterResolver
from mirrored.comm.options import choose_backend
from mirrored.config import LogicalDevice, PhysicalDevice
from mirrored.strategies.multi_worker import local_share
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    train_mirrored,
    train_plain,
)

pytestmark = pytest.mark.usefixtures("float64")  # exactness in float64: tests/exactness.py


@pytest.fixture
def strategy() -> Iterator[mirrored.MultiWorkerMirroredStrategy]:
    with mirrored.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"]) as strategy:
        yield strategy


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="bytes_per_pack=-1"):
        mirrored.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(ValueError, match="timeout_seconds=0"):
        mirrored.CommunicationOptions(timeout_seconds=0)
    with pytest.raises(TypeError, match="implementation='NCCL'"):
        mirrored.CommunicationOptions(implementation="NCCL")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"compression='int8': expected one of \['bf16', 'fp16'\]"):
        mirrored.CommunicationOptions(compression="int8")
    with pytest.raises(TypeError, match="communication_options"):
        mirrored.MultiWorkerMirroredStrategy(communication_options={"timeout_seconds": 3})  # type: ignore[arg-type]


def test_nccl_on_cpu_devices_is_refused_and_auto_picks_gloo() -> None:
    cpu = mirrored.config.list_logical_devices("CPU")[:2]
    with pytest.raises(ValueError, match="NCCL needs CUDA devices"):
        choose_backend(mirrored.CommunicationImplementation.NCCL, cpu)
    assert choose_backend(mirrored.CommunicationImplementation.AUTO, cpu) == "gloo"
    assert choose_backend(mirrored.CommunicationImplementation.RING, cpu) == "gloo"
    nccl = mirrored.CommunicationImplementation.NCCL
    options = mirrored.CommunicationOptions(implementation=nccl)
    with pytest.raises(ValueError, match="NCCL needs CUDA devices"):
        mirrored.MultiWorkerMirroredStrategy(options, devices=["cpu:0"])


def test_a_parameter_server_task_is_refused() -> None:
    ps = ClusterResolver(
        task_type="ps", task_id=0, rank=-1, world_size=1, master_addr="127.0.0.1", master_port=0
    )
    with pytest.raises(ValueError, match="task 'ps' 0, which takes no part"):
        mirrored.MultiWorkerMirroredStrategy(cluster_resolver=ps, devices=["cpu:0"])


def test_a_single_worker_is_the_mirrored_strategy(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    assert strategy.num_replicas_in_sync == 2
    assert strategy.should_checkpoint
    assert strategy.worker_group.world_size == 1
    assert "worker 0 of 1" in repr(strategy)
    for name in ("sgd_momentum", "adam", "custom"):
        model = make_mlp()
        mirrored_model, _, losses = train_mirrored(
            strategy, model, OPTIMIZERS[name](model), make_batches()
        )
        reference = make_mlp()
        expected = train_plain(reference, OPTIMIZERS[name](reference), make_batches())
        assert_same_parameters(reference, mirrored_model.module)
        assert_replicas_identical(mirrored_model)
        assert losses == pytest.approx(expected, rel=1e-5)


def test_a_distributed_sampler_is_refused(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    dataset = torch.utils.data.TensorDataset(torch.arange(8.0))
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=2, rank=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler)
    with pytest.raises(ValueError, match="uses a DistributedSampler"):
        strategy.experimental_distribute_dataset(loader)


def test_workers_on_one_machine_share_its_gpus_and_its_cpu() -> None:
    def resolver(local_rank: int, local_world_size: int, shared: bool = True) -> ClusterResolver:
        return ClusterResolver(
            task_type="worker",
            task_id=local_rank,
            rank=local_rank,
            world_size=4,
            master_addr="127.0.0.1",
            master_port=29500,
            local_rank=local_rank,
            local_world_size=local_world_size,
            visible_gpus_shared=shared,
        )

    gpus = [
        LogicalDevice(f"/device:GPU:{i}", "GPU", i, PhysicalDevice(f"GPU:{i}", "GPU", i), 0)
        for i in range(4)
    ]
    assert local_share(gpus, resolver(1, 2)) == gpus[2:]
    assert local_share(gpus, resolver(3, 4)) == gpus[3:]
    assert local_share(gpus, resolver(0, 1)) == gpus
    cpus = mirrored.config.list_logical_devices("CPU")
    assert local_share(cpus, resolver(1, 2)) == cpus
    with pytest.raises(ValueError, match="3 workers on this machine but 2 GPU"):
        local_share(gpus[:2], resolver(0, 3))
    # GPUs a launcher bound to this worker alone (srun --gpus-per-task) are all its own.
    assert local_share(gpus[:1], resolver(1, 2, shared=False)) == gpus[:1]


def test_close_leaves_no_process_group() -> None:
    strategy = mirrored.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    assert torch.distributed.is_initialized()
    strategy.close()
    strategy.close()
    assert not torch.distributed.is_initialized()


Step = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


def _compare(strategy: mirrored.Strategy, step: Step, steps: int = 3, seed: int = 1) -> None:
    """``step(model, x, y)`` (backward passes only; the caller steps the optimizer) on one
    device and in every replica: same parameters and the same gradients afterwards."""
    batches = make_batches(num_examples=37, batch_size=13)[:steps]
    reference = make_mlp(seed=seed)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=1e-2)
    for x, y in batches:
        step(reference, x, y)
        reference_optimizer.step()
    module = make_mlp(seed=seed)
    model, optimizer = strategy.mirror(module, torch.optim.Adam(module.parameters(), lr=1e-2))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
        step(model, x, y)  # type: ignore[arg-type]
        optimizer.step()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(replica_step, args=batch)
    assert_same_parameters(reference, model.module)
    assert_replicas_identical(model)
    for (name, expected), replica_grads in zip(
        reference.named_parameters(),
        zip(*(r.parameters() for r in model.replicas), strict=True),
        strict=True,
    ):
        for actual in replica_grads:
            if expected.grad is None:
                assert actual.grad is None, name
            else:
                assert_close_float64(actual.grad, expected.grad)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))


def test_gradients_accumulate_over_backward_passes_and_steps(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    def two_backwards_never_zeroed(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        (_loss(model, x, y) * 0.25).backward()
        (_loss(model, x, y) * 0.75).backward()

    _compare(strategy, two_backwards_never_zeroed)


@pytest.mark.parametrize("first_pass_whole", [True, False])
def test_a_parameter_left_out_of_one_backward_keeps_its_accumulated_gradient(
    strategy: mirrored.MultiWorkerMirroredStrategy, first_pass_whole: bool
) -> None:
    def whole(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model, x, y).backward()

    def without_last_layer(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        hidden = model[3](model[2](model[1](model[0](x))))  # type: ignore[index]
        mirrored.compute_average_loss(hidden.square().mean(1)).backward()

    def accumulated(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad()
        passes = (whole, without_last_layer) if first_pass_whole else (without_last_layer, whole)
        for backward in passes:
            backward(model, x, y)

    _compare(strategy, accumulated)


def test_a_step_without_backward_applies_the_gradient_left_as_on_one_device(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    # No zero_grad: the second optimizer.step() applies the same gradient again, not its sum
    # over the replicas.
    def backward_then_step_again(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad()
        _loss(model, x, y).backward()

    batches = make_batches(num_examples=26, batch_size=13)
    reference = make_mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    module = make_mlp()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

    def replica_step(x: torch.Tensor, y: torch.Tensor, backward: bool) -> None:
        if backward:
            backward_then_step_again(model, x, y)  # type: ignore[arg-type]
        optimizer.step()

    for (x, y), batch in zip(
        batches, strategy.experimental_distribute_dataset(batches), strict=True
    ):
        for backward in (True, False):
            if backward:
                backward_then_step_again(reference, x, y)
            reference_optimizer.step()
            strategy.run(replica_step, args=(*batch, backward))
    assert_same_parameters(reference, model.module)
    assert_replicas_identical(model)


class _FailingBackward(torch.autograd.Function):
    """Identity whose backward raises while ``fail`` is set: a backward that stops half done."""

    fail = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _FailingBackward.fail:
            raise RuntimeError("backward failed half way")
        return grad


def test_a_backward_that_failed_half_way_leaves_the_next_steps_exact(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    # One worker may go on after a failed step: the reducer forgets the half-done pass (the last
    # layer's gradient was packed, the others' never came).
    def through_failing_middle(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad()
        hidden = _FailingBackward.apply(model[1](model[0](x)))  # type: ignore[index]
        logits = model[4](model[3](model[2](hidden)))  # type: ignore[index]
        mirrored.compute_average_loss(F.cross_entropy(logits, y, reduction="none")).backward()

    batches = make_batches(num_examples=39, batch_size=13)
    reference = make_mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in batches[1:]:  # the failed step changes nothing
        through_failing_middle(reference, x, y)
        reference_optimizer.step()
    module = make_mlp()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))

    def replica_step(x: torch.Tensor, y: torch.Tensor) -> None:
        through_failing_middle(model, x, y)  # type: ignore[arg-type]
        optimizer.step()

    for number, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
        _FailingBackward.fail = number == 0
        try:
            if number == 0:
                with pytest.raises(RuntimeError, match="backward failed half way"):
                    strategy.run(replica_step, args=batch)
            else:
                strategy.run(replica_step, args=batch)
        finally:
            _FailingBackward.fail = False
    assert_same_parameters(reference, model.module)
    assert_replicas_identical(model)


def test_clipping_after_backward_sees_the_reduced_gradients(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    def clipped(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad()
        (_loss(model, x, y) * 50).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)

    _compare(strategy, clipped)


def test_unused_parameters_keep_no_gradient(strategy: mirrored.MultiWorkerMirroredStrategy) -> None:
    def last_layer_frozen_out(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        model.zero_grad()
        hidden = model[3](model[2](model[1](model[0](x))))  # type: ignore[index]
        mirrored.compute_average_loss(hidden.square().mean(1)).backward()

    _compare(strategy, last_layer_frozen_out)


def test_gradients_assigned_by_hand_are_reduced(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    def autograd_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        params = list(model.parameters())
        grads = torch.autograd.grad(_loss(model, x, y), params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    _compare(strategy, autograd_grad)


def test_a_parameter_unfrozen_after_mirroring_is_reduced(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    module = make_mlp()
    module[0].requires_grad_(False)
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model[0].requires_grad_(True)  # every replica's first layer
    reference = make_mlp()
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = make_batches()[:3]
    for x, y in batches:
        _loss(reference, x, y).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model, x, y).backward()  # type: ignore[arg-type]
        optimizer.step()
        optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch)
    assert_same_parameters(reference, model.module)


def test_mirroring_again_hands_the_parameters_to_the_new_optimizer(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    x, y = make_batches()[0]
    module = make_mlp()
    strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model, _ = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    reference = make_mlp()
    _loss(reference, x, y).backward()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _loss(model, x, y).backward()  # type: ignore[arg-type]

    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    for expected, actual in zip(reference.parameters(), model.module.parameters(), strict=True):
        assert_close_float64(actual.grad, expected.grad)


def test_backward_outside_run_is_not_reduced(
    strategy: mirrored.MultiWorkerMirroredStrategy,
) -> None:
    module = make_mlp()
    model, _ = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=0.1))
    x, y = make_batches()[0]
    _loss(model.module, x, y).backward()
    reference = make_mlp()
    _loss(reference, x, y).backward()
    for expected, actual in zip(reference.parameters(), model.module.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad)


def test_fit_on_a_single_worker_equals_one_device() -> None:
    x, y = torch.randn(45, 12), torch.randint(0, 5, (45,))

    def fit(model: mirrored.Model) -> tuple[dict[str, torch.Tensor], list[float]]:
        model.compile(optimizer="adam", loss=mirrored.losses.SparseCategoricalCrossentropy(True))
        torch.manual_seed(0)
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
        return model.state_dict(), history.history["loss"]

    expected_weights, expected_losses = fit(mirrored.Model(make_mlp()))
    strategy = mirrored.MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1", "cpu:2"])
    with strategy, strategy.scope():
        weights, losses = fit(mirrored.Model(make_mlp()))
    for name, value in expected_weights.items():
        assert_close_float64(weights[name], value)
    assert losses == pytest.approx(expected_losses, rel=1e-5)


def test_a_module_with_two_optimizers_trains_as_on_one_device(strategy):
    """An encoder and a decoder at their own learning rates, mirrored together."""
    batches = make_batches()
    expected = make_mlp()
    plain = [
        torch.optim.SGD(expected[:2].parameters(), lr=0.1),
        torch.optim.Adam(expected[2:].parameters(), lr=1e-2),
    ]
    for x, y in batches:
        torch.nn.functional.cross_entropy(expected(x), y).backward()
        for optimizer in plain:
            optimizer.step()
            optimizer.zero_grad()
    module = make_mlp()
    model, first, second = strategy.mirror(
        module,
        torch.optim.SGD(module[:2].parameters(), lr=0.1),
        torch.optim.Adam(module[2:].parameters(), lr=1e-2),
    )

    def step(x, y):
        loss = torch.nn.functional.cross_entropy(model(x), y, reduction="none")
        mirrored.compute_average_loss(loss).backward()
        for optimizer in (first, second):
            optimizer.step()
            optimizer.zero_grad()

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(step, args=batch)
    assert_same_parameters(expected, model)
