"""Devices: the physical devices of this process and the logical devices carved out of them.

TensorFlow's model, kept on purpose: one physical device can be split into several logical
devices (four 2 GiB GPUs out of one card, four CPU devices out of one CPU) so that multi-device
training can be tried and tested on one device. The split must be configured before a strategy
first uses the device; changing it afterwards is an error, as in TensorFlow.

A logical CPU device shares the host's cores with its siblings; a logical CUDA device owns a
stream and, when it has a ``memory_limit``, a memory pool whose size is checked after each step
(see :mod:`mirrored.core.device_runtime`).

Host memory: once a strategy takes CPU devices into use, freed host memory is kept for reuse
(:func:`set_host_memory_reuse`), as a caching allocator keeps device memory.
"""

from __future__ import annotations

import dataclasses
import re
import threading
import warnings
from collections.abc import Iterable, Sequence

import torch

from mirrored import _glibc_malloc

__all__ = [
    "LogicalDevice",
    "LogicalDeviceConfiguration",
    "PhysicalDevice",
    "get_host_memory_reuse",
    "get_logical_device_configuration",
    "list_logical_devices",
    "list_physical_devices",
    "resolve_devices",
    "set_host_memory_reuse",
    "set_logical_device_configuration",
]

DeviceSpec = str | torch.device

_GPU_ALIASES = {"GPU", "CUDA"}


@dataclasses.dataclass(frozen=True)
class PhysicalDevice:
    """A device of this machine, as TensorFlow names it (``/physical_device:GPU:0``)."""

    name: str
    device_type: str  # "CPU" or "GPU"
    index: int

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device("cpu") if self.device_type == "CPU" else torch.device("cuda", self.index)
        )


@dataclasses.dataclass(frozen=True)
class LogicalDeviceConfiguration:
    """One logical device to carve out of a physical one; ``memory_limit`` in MiB (CUDA only)."""

    memory_limit: int | None = None

    def __post_init__(self) -> None:
        if self.memory_limit is not None and (
            not isinstance(self.memory_limit, int) or self.memory_limit <= 0
        ):
            raise ValueError(
                f"memory_limit={self.memory_limit!r}: expected a positive number of MiB or None"
            )


@dataclasses.dataclass(frozen=True)
class LogicalDevice:
    """A device a replica runs on: a whole physical device or a slice of one.

    ``index`` counts logical devices of one type across the machine (``cuda:1`` may be the second
    slice of physical GPU 0, as in TensorFlow); ``slot`` is its position inside its physical device.
    """

    name: str
    device_type: str
    index: int
    physical: PhysicalDevice
    slot: int
    memory_limit: int | None = None

    @property
    def torch_device(self) -> torch.device:
        """The torch device tensors of this logical device live on (its physical device's)."""
        return self.physical.torch_device

    @property
    def short_name(self) -> str:
        """The name users type: ``cpu:1``, ``cuda:0``."""
        return f"{'cpu' if self.device_type == 'CPU' else 'cuda'}:{self.index}"

    def __str__(self) -> str:
        return self.short_name


_lock = threading.Lock()
_configurations: dict[PhysicalDevice, tuple[LogicalDeviceConfiguration, ...]] = {}
_initialized: set[PhysicalDevice] = set()
_host_memory_reuse = True  # the setting
_host_memory_kept = False  # whether malloc keeps freed memory now (the setting, applied)


def _normalize_type(device_type: str | None) -> str | None:
    if device_type is None:
        return None
    upper = device_type.upper()
    if upper == "CPU":
        return "CPU"
    if upper in _GPU_ALIASES:
        return "GPU"
    raise ValueError(f"device_type={device_type!r}: expected 'CPU', 'GPU', 'CUDA' or None")


def list_physical_devices(device_type: str | None = None) -> list[PhysicalDevice]:
    """The physical devices of this process: one CPU, then each visible CUDA device."""
    kind = _normalize_type(device_type)
    devices = [PhysicalDevice("/physical_device:CPU:0", "CPU", 0)]
    if torch.cuda.is_available():
        devices += [
            PhysicalDevice(f"/physical_device:GPU:{i}", "GPU", i)
            for i in range(torch.cuda.device_count())
        ]
    return [d for d in devices if kind is None or d.device_type == kind]


def get_logical_device_configuration(
    device: PhysicalDevice,
) -> list[LogicalDeviceConfiguration] | None:
    """The configuration set for ``device``, or None when it is used whole."""
    with _lock:
        config = _configurations.get(device)
    return list(config) if config is not None else None


def set_logical_device_configuration(
    device: PhysicalDevice, logical_devices: Sequence[LogicalDeviceConfiguration] | None
) -> None:
    """Split ``device`` into ``len(logical_devices)`` logical devices (None: use it whole).

    Must run before a strategy first uses ``device``; setting the same configuration again is
    allowed (a notebook cell run twice), a different one raises RuntimeError.
    """
    if not isinstance(device, PhysicalDevice):
        raise TypeError(
            f"device={device!r}: expected a PhysicalDevice from "
            "mirrored.config.list_physical_devices()"
        )
    if device not in list_physical_devices():
        raise ValueError(
            f"device={device.name} does not exist; this process has "
            f"{[d.name for d in list_physical_devices()]}"
        )
    config: tuple[LogicalDeviceConfiguration, ...] | None = None
    if logical_devices is not None:
        config = tuple(logical_devices)
        if not config:
            raise ValueError(
                "logical_devices is empty: pass at least one LogicalDeviceConfiguration"
            )
        for item in config:
            if not isinstance(item, LogicalDeviceConfiguration):
                raise TypeError(
                    f"logical_devices holds {item!r}: expected LogicalDeviceConfiguration objects"
                )
            if device.device_type == "CPU" and item.memory_limit is not None:
                raise ValueError(
                    f"memory_limit={item.memory_limit} on {device.name}: memory limits are "
                    "enforced on CUDA devices only; pass LogicalDeviceConfiguration() for the CPU"
                )
    with _lock:
        if config == _configurations.get(device):
            return
        if device in _initialized:
            raise RuntimeError(
                f"{device.name} is already in use by a strategy; logical devices cannot be "
                "changed after initialization. Configure them before creating the first strategy."
            )
        if config is None:
            _configurations.pop(device, None)
        else:
            _configurations[device] = config


def list_logical_devices(device_type: str | None = None) -> list[LogicalDevice]:
    """Every logical device: CPU ones first, then GPUs numbered across physical GPUs."""
    kind = _normalize_type(device_type)
    result: list[LogicalDevice] = []
    gpu_index = 0
    for physical in list_physical_devices():
        with _lock:
            config = _configurations.get(physical, (LogicalDeviceConfiguration(),))
        for slot, item in enumerate(config):
            if physical.device_type == "CPU":
                index, name = slot, f"/device:CPU:{slot}"
            else:
                index, name = gpu_index, f"/device:GPU:{gpu_index}"
                gpu_index += 1
            result.append(
                LogicalDevice(name, physical.device_type, index, physical, slot, item.memory_limit)
            )
    return [d for d in result if kind is None or d.device_type == kind]


_NAME = re.compile(r"^(?:.*/)?(?:device:)?(cpu|gpu|cuda)(?::(\d+))?$", re.IGNORECASE)


def _parse(spec: DeviceSpec | LogicalDevice) -> tuple[str, int]:
    if isinstance(spec, torch.device):
        if spec.type not in ("cpu", "cuda"):
            raise ValueError(f"device {spec}: only cpu and cuda devices are supported")
        return ("CPU" if spec.type == "cpu" else "GPU"), spec.index or 0
    if isinstance(spec, LogicalDevice):
        return spec.device_type, spec.index
    if not isinstance(spec, str):
        raise TypeError(f"device {spec!r}: expected a name such as 'cpu:0' or a torch.device")
    match = _NAME.match(spec.strip())
    if match is None:
        raise ValueError(
            f"device {spec!r} is not a device name; use 'cpu:0', '/cpu:0', '/device:CPU:0', "
            "'cuda:1', '/gpu:1' or a torch.device"
        )
    kind = _normalize_type(match.group(1))
    assert kind is not None
    return kind, int(match.group(2) or 0)


def resolve_devices(specs: Iterable[DeviceSpec | LogicalDevice]) -> list[LogicalDevice]:
    """Map user device names onto logical devices; unknown or repeated names are a ValueError."""
    available = list_logical_devices()
    by_key = {(d.device_type, d.index): d for d in available}
    resolved: list[LogicalDevice] = []
    for spec in specs:
        device = by_key.get(_parse(spec))
        if device is None:
            raise ValueError(
                f"device {spec!r} does not exist; this process has "
                f"{[d.short_name for d in available]}. Pass a subset of "
                "mirrored.config.list_logical_devices(), or split a physical device first with "
                "mirrored.config.set_logical_device_configuration()"
            )
        if device in resolved:
            raise ValueError(f"device {spec!r} is listed twice; each replica needs its own device")
        resolved.append(device)
    if not resolved:
        raise ValueError("devices is empty: pass at least one device")
    return resolved


def mark_in_use(devices: Iterable[LogicalDevice]) -> None:
    """Freeze the configuration of the physical devices behind ``devices`` (now in use), and
    when one of them is a CPU device keep freed host memory for reuse (unless turned off)."""
    devices = list(devices)
    with _lock:
        _initialized.update(d.physical for d in devices)
        if any(d.device_type == "CPU" for d in devices):
            _apply_host_memory_reuse()


def _apply_host_memory_reuse() -> None:
    """Keep freed host memory from now on when the setting says so (under ``_lock``). A C
    library that refuses is warned about, never raised: it is a matter of speed."""
    global _host_memory_kept
    if not _host_memory_reuse or _host_memory_kept:
        return
    try:
        _host_memory_kept = _glibc_malloc.keep_freed_memory()
    except OSError as error:
        warnings.warn(
            f"freed host memory is not kept for reuse ({error}): CPU steps run at malloc's "
            "own speed; mirrored.config.set_host_memory_reuse(False) silences this",
            RuntimeWarning,
            stacklevel=3,
        )


def set_host_memory_reuse(enabled: bool) -> None:
    """Whether strategies computing on the CPU keep freed host memory for reuse (on by default).

    A training step allocates the same large activations and gradients every step; glibc's
    malloc maps each one afresh from the system and unmaps it when freed, so on the CPU every
    step faults its memory in again, page by page. Once a strategy takes a CPU device into use
    (at once, if one already has), freed memory stays in malloc's heap for the next step
    instead, for the whole process and the processes it forks (a ``DataLoader``'s workers): it
    then holds its peak heap rather than giving memory back between steps. Threads that start
    allocating from then on share the existing arenas, the main heap first, rather than make
    their own (glibc's per-thread heaps hold no block of 64 MiB or more), for good.

    ``False`` gives the kept memory back and maps large blocks apart again, for processes that
    must shrink after a peak, at fixed thresholds (32 MiB to map, 64 MiB to trim: where glibc's
    adaptive ones settle; they no longer adapt); threads keep sharing the main heap. Nothing
    changes under other C libraries than glibc, or where malloc was configured by hand
    (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``).
    """
    global _host_memory_reuse, _host_memory_kept
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled={enabled!r}: expected True or False")
    with _lock:
        _host_memory_reuse = enabled
        if not enabled and _host_memory_kept:
            _glibc_malloc.restore_adaptive_thresholds()
            _host_memory_kept = False
        elif enabled and any(physical.device_type == "CPU" for physical in _initialized):
            _apply_host_memory_reuse()


def get_host_memory_reuse() -> bool:
    """The setting: whether freed host memory is to be kept for reuse once a strategy uses a
    CPU device (whether it is, depends on the C library as well)."""
    with _lock:
        return _host_memory_reuse


def _reset_for_tests() -> None:
    """Forget every configuration and use; for this package's own tests only."""
    global _host_memory_reuse
    with _lock:
        _configurations.clear()
        _initialized.clear()
        _host_memory_reuse = True  # the setting; what malloc keeps stays as it is
