"""Device flags shared by the examples: ``--devices N``, ``--logical-devices N``, ``--cpu``.

``--devices N`` trains on N physical devices (GPUs when there are any); ``--logical-devices N``
carves the first device (the first GPU, else the CPU) into N logical devices, as the articles do
with four 2 GB logical GPUs out of one card (``--memory-limit``: a logical GPU's MiB; logical CPU
devices share the host's memory, and ``mirrored.config`` refuses a limit on them);
``--cpu`` uses the CPU even where there is a GPU. On a machine without a GPU ``--devices N`` and
``--logical-devices N`` both mean N logical CPU devices.
"""

from __future__ import annotations

import argparse
import contextlib

import mirrored
from mirrored import config
from mirrored.config import LogicalDevice, PhysicalDevice

__all__ = [
    "GPU_MEMORY_LIMIT",
    "add_device_arguments",
    "devices_from_arguments",
    "logical_devices",
    "positive_int",
    "strategy_from_arguments",
]

GPU_MEMORY_LIMIT = 2048  # MiB per logical GPU by default: the articles' four 2 GB GPUs of one card


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


def add_device_arguments(
    parser: argparse.ArgumentParser, default_logical: int = 4, all_gpus_by_default: bool = False
) -> None:
    """The device flags. Without one: every local GPU when ``all_gpus_by_default`` and there
    is a GPU, else ``default_logical`` logical devices of the first device."""
    group = parser.add_mutually_exclusive_group()
    unset = "every GPU, else --logical-devices" if all_gpus_by_default else "--logical-devices"
    group.add_argument(
        "--devices",
        type=positive_int,
        help=f"train on N physical devices, GPUs when any (default: {unset})",
    )
    group.add_argument(
        "--logical-devices",
        type=positive_int,
        help=f"split the first device into N logical devices (default {default_logical})",
    )
    parser.add_argument("--cpu", action="store_true", help="use the CPU even when there is a GPU")
    parser.add_argument(
        "--memory-limit",
        type=positive_int,
        help=f"MiB per logical GPU (default {GPU_MEMORY_LIMIT}, as the article's); logical CPU "
        "devices share the host's memory: refused on the CPU",
    )
    parser.set_defaults(default_logical=default_logical, all_gpus_by_default=all_gpus_by_default)


def logical_devices(
    physical: PhysicalDevice, count: int, memory_limit: int | None = None
) -> list[LogicalDevice]:
    """The first ``count`` logical devices of ``physical``, splitting it when it is not split
    (``memory_limit``: MiB each, GPUs only).

    A split is set once per process: when it already is (a notebook cell run twice, a test
    session), its first ``count`` logical devices are used.
    """
    if config.get_logical_device_configuration(physical) is None:
        # RuntimeError: already in use whole, so its one logical device is all there is.
        with contextlib.suppress(RuntimeError):
            config.set_logical_device_configuration(
                physical, [config.LogicalDeviceConfiguration(memory_limit=memory_limit)] * count
            )
    available = [d for d in config.list_logical_devices() if d.physical == physical]
    if len(available) < count:
        raise ValueError(
            f"--logical-devices {count}: {physical.name} is already split into "
            f"{len(available)} logical device(s) in this process, and a split cannot change "
            f"once used; pass --logical-devices {len(available)} or fewer, or use a new process"
        )
    return available[:count]


def devices_from_arguments(args: argparse.Namespace) -> list[str] | list[LogicalDevice]:
    """The devices the flags name: ``--devices N`` GPUs where there are any (every GPU by
    default when ``all_gpus_by_default``), else N logical devices of the first GPU or the CPU."""
    gpus = [] if args.cpu else config.list_physical_devices("GPU")
    physical_count = args.devices
    if physical_count is None and args.logical_devices is None and args.all_gpus_by_default:
        physical_count = len(gpus) or None
    if physical_count is not None and gpus:
        if physical_count > len(gpus):
            raise ValueError(f"--devices {physical_count}: this machine has {len(gpus)} GPU(s)")
        if args.memory_limit is not None:
            raise ValueError(
                f"--memory-limit {args.memory_limit}: it limits logical GPUs, and --devices "
                f"{physical_count} trains on whole GPUs; pass --logical-devices N to split the "
                "first GPU, or leave out --memory-limit"
            )
        return [f"gpu:{i}" for i in range(physical_count)]
    count = physical_count or args.logical_devices or args.default_logical
    if not gpus:
        if args.memory_limit is not None:
            raise ValueError(
                f"--memory-limit {args.memory_limit}: memory limits are enforced on GPUs only, "
                "and these logical devices are the CPU's (they share the host's memory); "
                "leave out --memory-limit"
            )
        return logical_devices(config.list_physical_devices("CPU")[0], count)
    return logical_devices(gpus[0], count, args.memory_limit or GPU_MEMORY_LIMIT)


def strategy_from_arguments(args: argparse.Namespace) -> mirrored.MirroredStrategy:
    """The MirroredStrategy the flags ask for."""
    return mirrored.MirroredStrategy(devices_from_arguments(args))
