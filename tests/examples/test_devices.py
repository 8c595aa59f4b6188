"""examples/devices.py: the device flags, and --memory-limit where it means something."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from mirrored.examples import devices

from mirrored import config
from mirrored.config import PhysicalDevice

GPU = PhysicalDevice("/physical_device:GPU:0", "GPU", 0)


def parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    devices.add_device_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """A machine with one (fake) GPU; the logical splits asked for are recorded, not made."""
    cpu = config.list_physical_devices("CPU")
    monkeypatch.setattr(
        config,
        "list_physical_devices",
        lambda kind=None: {"CPU": cpu, "GPU": [GPU]}.get(kind, [*cpu, GPU]),
    )
    splits: list[tuple[Any, ...]] = []
    monkeypatch.setattr(devices, "logical_devices", lambda *args: splits.append(args) or [])
    return splits


def test_the_help_says_what_a_memory_limit_does() -> None:
    parser = argparse.ArgumentParser()
    devices.add_device_arguments(parser)
    text = " ".join(parser.format_help().split())
    assert "MiB per logical GPU (default 2048, as the article's)" in text
    assert "refused on the CPU" in text


def test_a_memory_limit_on_the_cpu_is_refused() -> None:
    with pytest.raises(ValueError, match=r"--memory-limit 1024: .* GPUs only.* leave out"):
        devices.devices_from_arguments(
            parse("--cpu", "--logical-devices", "2", "--memory-limit", "1024")
        )


def test_the_cpu_splits_without_a_limit() -> None:
    names = [
        d.short_name
        for d in devices.devices_from_arguments(parse("--cpu", "--logical-devices", "2"))
    ]
    assert names == ["cpu:0", "cpu:1"]


def test_logical_gpus_get_the_limit_asked_or_2048(one_gpu: list[tuple[Any, ...]]) -> None:
    devices.devices_from_arguments(parse("--logical-devices", "4"))
    devices.devices_from_arguments(parse("--logical-devices", "2", "--memory-limit", "512"))
    assert one_gpu == [(GPU, 4, 2048), (GPU, 2, 512)]


def test_a_memory_limit_on_whole_gpus_is_refused(one_gpu: list[tuple[Any, ...]]) -> None:
    with pytest.raises(ValueError, match=r"--memory-limit 512: .*--devices 1 trains on whole"):
        devices.devices_from_arguments(parse("--devices", "1", "--memory-limit", "512"))
    assert devices.devices_from_arguments(parse("--devices", "1")) == ["gpu:0"]
