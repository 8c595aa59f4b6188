"""Physical and logical devices, and the device names accepted everywhere."""

from __future__ import annotations

import pytest
import torch

import mirrored
from mirrored import config
from tests.conftest import NUM_LOGICAL_CPUS

CPU = config.list_physical_devices("CPU")[0]


def test_physical_devices_by_type():
    assert config.list_physical_devices("CPU") == [CPU]
    assert CPU.name == "/physical_device:CPU:0" and CPU.torch_device == torch.device("cpu")
    assert config.list_physical_devices("GPU") == config.list_physical_devices("cuda")
    assert len(config.list_physical_devices()) == 1 + torch.cuda.device_count()
    with pytest.raises(ValueError, match="device_type='TPU'"):
        config.list_physical_devices("TPU")


def test_logical_cpu_devices_from_the_session_configuration():
    devices = config.list_logical_devices("CPU")
    assert [d.name for d in devices] == [f"/device:CPU:{i}" for i in range(NUM_LOGICAL_CPUS)]
    assert [d.short_name for d in devices] == [f"cpu:{i}" for i in range(NUM_LOGICAL_CPUS)]
    assert all(d.torch_device == torch.device("cpu") and d.physical == CPU for d in devices)
    assert (
        config.get_logical_device_configuration(CPU)
        == [config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
    )


@pytest.mark.parametrize(
    "name",
    [
        "cpu:2",
        "/cpu:2",
        "/device:CPU:2",
        "CPU:2",
        " cpu:2 ",
        "/job:localhost/replica:0/task:0/device:CPU:2",
        torch.device("cpu", 2),
    ],
)
def test_device_names_are_accepted_in_every_spelling(name):
    assert config.resolve_devices([name])[0].short_name == "cpu:2"


def test_bare_names_mean_index_zero():
    assert config.resolve_devices(["cpu"])[0].short_name == "cpu:0"
    assert config.resolve_devices([torch.device("cpu")])[0].short_name == "cpu:0"


@pytest.mark.parametrize(
    ("names", "error", "message"),
    [
        (["cpu:7"], ValueError, r"device 'cpu:7' does not exist; this process has \['cpu:0'"),
        (
            ["cuda:0"] if not torch.cuda.is_available() else ["cuda:99"],
            ValueError,
            "does not exist",
        ),
        (["cpu:0", "/cpu:0"], ValueError, "listed twice"),
        (["tpu:0"], ValueError, "is not a device name"),
        ([torch.device("meta")], ValueError, "only cpu and cuda"),
        ([3], TypeError, "expected a name"),
        ([], ValueError, "devices is empty"),
    ],
)
def test_bad_device_names_are_clear_errors(names, error, message):
    with pytest.raises(error, match=message):
        config.resolve_devices(names)


def test_configuration_errors():
    with pytest.raises(ValueError, match="memory_limit=-1"):
        config.LogicalDeviceConfiguration(memory_limit=-1)
    with pytest.raises(ValueError, match="memory limits are enforced on CUDA devices only"):
        config.set_logical_device_configuration(CPU, [config.LogicalDeviceConfiguration(512)])
    with pytest.raises(ValueError, match="logical_devices is empty"):
        config.set_logical_device_configuration(CPU, [])
    with pytest.raises(TypeError, match="expected LogicalDeviceConfiguration"):
        config.set_logical_device_configuration(CPU, [None])
    with pytest.raises(TypeError, match="expected a PhysicalDevice"):
        config.set_logical_device_configuration("cpu", [config.LogicalDeviceConfiguration()])
    with pytest.raises(ValueError, match="does not exist"):
        config.set_logical_device_configuration(
            config.PhysicalDevice("/physical_device:GPU:42", "GPU", 42),
            [config.LogicalDeviceConfiguration()],
        )


def test_configuration_is_frozen_once_a_strategy_uses_the_device(fresh_config):
    assert [d.short_name for d in config.list_logical_devices("CPU")] == ["cpu:0"]
    config.set_logical_device_configuration(CPU, [config.LogicalDeviceConfiguration()] * 3)
    config.set_logical_device_configuration(CPU, [config.LogicalDeviceConfiguration()] * 2)
    with mirrored.MirroredStrategy() as strategy:
        assert strategy.num_replicas_in_sync == 2
    # The same configuration again is fine (a notebook cell run twice); another one is not.
    config.set_logical_device_configuration(CPU, [config.LogicalDeviceConfiguration()] * 2)
    with pytest.raises(RuntimeError, match="cannot be changed after initialization"):
        config.set_logical_device_configuration(CPU, [config.LogicalDeviceConfiguration()] * 4)


@pytest.mark.cuda
def test_logical_gpus_are_numbered_across_physical_gpus(fresh_config):
    gpu = config.list_physical_devices("GPU")[0]
    config.set_logical_device_configuration(gpu, [config.LogicalDeviceConfiguration(256)] * 2)
    logical = config.list_logical_devices("GPU")
    assert [d.short_name for d in logical[:2]] == ["cuda:0", "cuda:1"]
    assert logical[1].physical == gpu and logical[1].slot == 1 and logical[1].memory_limit == 256
