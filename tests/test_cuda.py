"""CUDA paths: logical devices on one GPU (streams, memory limits), NCCL across GPUs.

Skipped without a GPU (the ``cuda`` marker); run them with ``pytest -m cuda`` on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch

import mirrored
from mirrored import config
from tests.exactness import assert_close_float64
from tests.reference_loops import (
    OPTIMIZERS,
    assert_replicas_identical,
    assert_same_parameters,
    make_batches,
    make_mlp,
    replica_step,
    train_mirrored,
    train_plain,
)

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("float64")]  # float64: no TF32 either


def _split_first_gpu(count, memory_limit=None):
    gpu = config.list_physical_devices("GPU")[0]
    config.set_logical_device_configuration(
        gpu, [config.LogicalDeviceConfiguration(memory_limit)] * count
    )
    return [f"cuda:{i}" for i in range(count)]


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_logical_gpus_match_the_single_gpu_loop(fresh_config, optimizer_name):
    devices = _split_first_gpu(3, memory_limit=1024)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches()]
    reference = make_mlp().cuda()
    train_plain(reference, OPTIMIZERS[optimizer_name](reference), batches)
    with mirrored.MirroredStrategy(devices) as strategy:
        assert isinstance(strategy.cross_device_ops, mirrored.HierarchicalCopyAllReduce)
        model = make_mlp()
        trained, _, _ = train_mirrored(strategy, model, OPTIMIZERS[optimizer_name](model), batches)
    assert_same_parameters(reference, trained)
    assert_replicas_identical(trained)


def test_a_replica_over_its_memory_limit_fails_naming_its_logical_device(fresh_config):
    devices = _split_first_gpu(2, memory_limit=64)
    with mirrored.MirroredStrategy(devices) as strategy:

        def allocate():
            replica = mirrored.get_replica_context()
            size = (128 << 20) if replica.replica_id_in_sync_group == 1 else 1024
            return torch.empty(size, dtype=torch.uint8, device="cuda")

        with pytest.raises(torch.OutOfMemoryError, match="logical device cuda:1"):
            strategy.run(allocate)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_nccl_across_physical_gpus_matches_one_gpu():
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches()]
    reference = make_mlp().cuda()
    train_plain(reference, OPTIMIZERS["adam"](reference), batches)
    with mirrored.MirroredStrategy(["cuda:0", "cuda:1"]) as strategy:
        assert isinstance(strategy.cross_device_ops, mirrored.NcclAllReduce)
        model = make_mlp()
        trained, _, _ = train_mirrored(strategy, model, OPTIMIZERS["adam"](model), batches)
    assert_same_parameters(reference, trained)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_on_logical_gpus_matches_one_gpu_with_1_over_n_of_the_state(fresh_config, stage):
    # Adam keeps its step counts on the CPU and its moments on the GPU: both are sharded, and
    # the joined state has them where torch puts them.
    devices = _split_first_gpu(3)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches()]
    reference = make_mlp().cuda()
    plain = OPTIMIZERS["adam"](reference)
    train_plain(reference, plain, batches)
    with mirrored.MirroredStrategy(devices, zero_stage=stage) as strategy:
        model = make_mlp()
        trained, optimizer, _ = train_mirrored(strategy, model, OPTIMIZERS["adam"](model), batches)
        state = optimizer.state_dict()["state"]
        assert max(optimizer.state_bytes()) <= sum(optimizer.state_bytes()) / 3 * 1.05
    assert_same_parameters(reference, trained)
    assert_replicas_identical(trained)
    for index, expected in plain.state_dict()["state"].items():
        for key, value in expected.items():
            assert state[index][key].device == value.device, (index, key)
            assert_close_float64(state[index][key], value)


@pytest.mark.parametrize("parameter_device", ["cpu:0", "cuda:0"])
def test_central_storage_on_logical_gpus_matches_the_single_gpu_loop(
    fresh_config, parameter_device
):
    """The update on the CPU (TensorFlow's default with several GPUs) or on the first GPU's
    replica, each replica copying the new values on its own stream."""
    devices = _split_first_gpu(3, memory_limit=1024)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches()]
    reference = make_mlp().cuda()
    train_plain(reference, OPTIMIZERS["adam"](reference), batches)
    with mirrored.CentralStorageStrategy(devices, parameter_device) as strategy:
        with strategy.scope():
            model = make_mlp()
        trained, optimizer, _ = train_mirrored(strategy, model, OPTIMIZERS["adam"](model), batches)
        state = next(iter(optimizer.update_plan.central.optimizer.state.values()))
        assert state["exp_avg"].device.type == torch.device(parameter_device).type
    assert_same_parameters(reference, trained)
    assert_replicas_identical(trained)


def test_traced_steps_on_logical_gpus_match_the_eager_ones(fresh_config):
    """mirrored.function on logical GPUs: the pieces run as the graph's Python code there (no
    TorchScript, no CUDA graphs yet), with the eager steps' results; dropout runs as written
    (CUDA's kernel draws from the global generator), so the model has none."""
    devices = _split_first_gpu(2)
    batches = [(x.cuda(), y.cuda()) for x, y in make_batches()]
    trained = []
    for traced in (False, True):
        with mirrored.MirroredStrategy(devices) as strategy:
            model = make_mlp()
            mirrored_model, optimizer = strategy.mirror(model, OPTIMIZERS["adam"](model))
            step = mirrored.function(replica_step) if traced else replica_step
            for batch in strategy.experimental_distribute_dataset(batches):
                strategy.run(step, args=(batch, mirrored_model, optimizer))
            if traced:
                assert step.experimental_get_tracing_count() >= len(devices)
        trained.append(model)
    assert_same_parameters(*trained)
