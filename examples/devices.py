"""Device flags shared by the examples: ``--devices N`` and ``--logical-devices N``.

``--devices N`` trains on N physical devices (GPUs when there are any); ``--logical-devices N``
carves the first device (the first GPU, else the CPU) into N logical devices, as the articles do
with four 2 GB logical GPUs out of one card. On a machine without a GPU both mean N logical CPU
devices.
"""

from __future__ import annotations

import argparse
import contextlib

import mirrored
from mirrored import config

__all__ = ["add_device_arguments", "positive_int", "strategy_from_arguments"]


def positive_int(text: str) -> int:
    """An argparse type: a positive integer, else a usage error naming the value."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected a positive integer")
    return value


def add_device_arguments(parser: argparse.ArgumentParser, default_logical: int = 4) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--devices", type=positive_int, help="train on N physical devices (GPUs when any)"
    )
    group.add_argument(
        "--logical-devices",
        type=positive_int,
        default=default_logical,
        help=f"split the first device into N logical devices (default {default_logical})",
    )
    parser.add_argument(
        "--memory-limit",
        type=int,
        default=2048,
        help="MiB per logical GPU (ignored on the CPU; default 2048, as the article's)",
    )


def strategy_from_arguments(args: argparse.Namespace) -> mirrored.MirroredStrategy:
    """The MirroredStrategy the flags ask for."""
    gpus = config.list_physical_devices("GPU")
    count = args.devices if args.devices is not None else args.logical_devices
    if args.devices is not None and gpus:
        if count > len(gpus):
            raise SystemExit(f"--devices {count}: this machine has {len(gpus)} GPU(s)")
        return mirrored.MirroredStrategy([f"gpu:{i}" for i in range(count)])
    physical = gpus[0] if gpus else config.list_physical_devices("CPU")[0]
    limit = args.memory_limit if physical.device_type == "GPU" else None
    # Configured differently earlier in this process (a notebook, a test): take the first ones.
    with contextlib.suppress(RuntimeError):
        config.set_logical_device_configuration(
            physical, [config.LogicalDeviceConfiguration(memory_limit=limit)] * count
        )
    existing = [
        d for d in config.list_logical_devices(physical.device_type) if d.physical == physical
    ]
    if len(existing) < count:
        raise SystemExit(
            f"{count} logical devices were asked for, but {physical.name} is already split into "
            f"{len(existing)} in this process; restart Python to change it"
        )
    return mirrored.MirroredStrategy(existing[:count])
