"""The all-reduce algorithms: identical results, device names, validation."""

from __future__ import annotations

import pytest
import torch

import mirrored
from mirrored import config
from mirrored.replication.batch_norm import convert_sync_batch_norm
from tests.reference_loops import (
    CROSS_DEVICE_OPS,
    OPTIMIZERS,
    make_batches,
    make_mlp,
    train_mirrored,
)


def test_all_cross_device_ops_give_bit_identical_parameters():
    results = []
    for make_ops in CROSS_DEVICE_OPS.values():
        with mirrored.MirroredStrategy(["cpu:0", "cpu:1", "cpu:2"], make_ops()) as strategy:
            model = make_mlp()
            mirrored_model, _, _ = train_mirrored(
                strategy, model, OPTIMIZERS["adam"](model), make_batches()
            )
            results.append(mirrored_model.state_dict())
    for state in results[1:]:
        for name, value in state.items():
            assert torch.equal(value, results[0][name]), name


def test_reduce_to_device_accepts_any_device_name():
    ops = mirrored.ReductionToOneDevice(reduce_to_device="/device:CPU:1")
    assert ops.reduce_to_device.short_name == "cpu:1"
    with pytest.raises(ValueError, match="does not exist"):
        mirrored.ReductionToOneDevice(reduce_to_device="cpu:99")
    with mirrored.MirroredStrategy(["cpu:0", "cpu:1"], ops) as strategy:
        total = strategy.run(
            lambda: mirrored.get_replica_context().all_reduce("sum", torch.arange(3.0))
        )
        assert [t.tolist() for t in total.values] == [[0.0, 2.0, 4.0]] * 2


def _gpu(index, physical_index, slot):
    physical = config.PhysicalDevice(
        f"/physical_device:GPU:{physical_index}", "GPU", physical_index
    )
    return config.LogicalDevice(f"/device:GPU:{index}", "GPU", index, physical, slot)


def test_nccl_needs_one_replica_per_physical_gpu():
    cpu = config.list_logical_devices("CPU")[:2]
    with pytest.raises(ValueError, match="NcclAllReduce needs CUDA devices"):
        mirrored.NcclAllReduce().validate(cpu)
    with pytest.raises(ValueError, match="share a GPU; use HierarchicalCopyAllReduce"):
        mirrored.NcclAllReduce().validate([_gpu(0, 0, 0), _gpu(1, 0, 1)])
    mirrored.NcclAllReduce().validate([_gpu(0, 0, 0), _gpu(1, 1, 0)])


def test_sync_batch_norm_refuses_logical_devices_of_one_gpu():
    class TwoSlicesOfOneGpu:
        devices = (_gpu(0, 0, 0), _gpu(1, 0, 1))

    with pytest.raises(ValueError, match="would deadlock"):
        convert_sync_batch_norm(torch.nn.BatchNorm1d(3), TwoSlicesOfOneGpu())


@pytest.mark.parametrize("ops_name", ["hierarchical", "one_device"])
def test_tensors_smaller_than_the_replica_count_reduce_correctly(ops_name):
    with mirrored.MirroredStrategy(
        [f"cpu:{i}" for i in range(4)], CROSS_DEVICE_OPS[ops_name]()
    ) as s:
        result = s.run(
            lambda: mirrored.get_replica_context().all_reduce(
                "sum", torch.tensor([1.0 + mirrored.get_replica_context().replica_id_in_sync_group])
            )
        )
        assert [t.item() for t in s.experimental_local_results(result)] == [10.0] * 4


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_packs=-1"):
        mirrored.HierarchicalCopyAllReduce(num_packs=-1)
    with pytest.raises(ValueError, match="bytes_per_pack='big'"):
        mirrored.ReductionToOneDevice(bytes_per_pack="big")
