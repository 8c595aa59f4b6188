"""How the workers of a multi-worker job communicate: TensorFlow's ``CommunicationOptions``.

The options are checked as they are made, so a mistake is named where the user wrote it, before
any process connects; :func:`choose_backend` turns them into the ``torch.distributed`` backend
for this worker's devices.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence

import torch

from mirrored.comm.powersgd import PowerSGD
from mirrored.comm.wire_compression import WIRE_DTYPES
from mirrored.config import LogicalDevice

__all__ = ["CommunicationImplementation", "CommunicationOptions", "choose_backend"]


class CommunicationImplementation(enum.Enum):
    """The cross-process collective library (TensorFlow's names)."""

    # NCCL where every device of every worker is CUDA; else gloo (RING), except that CPU tensors
    # are summed through shared memory when every worker runs on this machine
    # (mirrored.comm.same_host_all_reduce: about 7x faster than gloo over loopback).
    AUTO = "AUTO"
    RING = "RING"  # gloo's ring all-reduce, on any device, for every collective
    NCCL = "NCCL"  # NCCL, CUDA devices only


@dataclasses.dataclass(frozen=True)
class CommunicationOptions:
    """How workers communicate (TensorFlow's ``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: gradient bucket size in bytes; 0 chooses (a 1 MiB first bucket, then
            25 MiB).
        timeout_seconds: how long any collective waits for the other workers before failing
            with an error naming the missing one; None: 30 minutes (never forever).
        implementation: ``CommunicationImplementation``.
        compression: "bf16" or "fp16": float32 gradients cross the network in 16 bits (half the
            bytes) and are summed in float32 (:mod:`mirrored.comm.wire_compression`); workers that
            sum through shared memory on one machine send them whole. ``PowerSGD(rank)``: each
            gradient matrix is summed as two rank-r factors, with error feedback
            (:mod:`mirrored.comm.powersgd`), over any transport. None: gradients go whole.
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation = CommunicationImplementation.AUTO
    compression: str | PowerSGD | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, int) or self.bytes_per_pack < 0:
            raise ValueError(
                f"bytes_per_pack={self.bytes_per_pack!r}: expected an int >= 0 (0: automatic)"
            )
        if self.timeout_seconds is not None and not self.timeout_seconds > 0:
            raise ValueError(
                f"timeout_seconds={self.timeout_seconds!r}: expected a positive number or None"
            )
        if not isinstance(self.implementation, CommunicationImplementation):
            raise TypeError(
                f"implementation={self.implementation!r}: expected a "
                "mirrored.CommunicationImplementation (AUTO, RING or NCCL)"
            )
        if not (
            self.compression is None
            or isinstance(self.compression, PowerSGD)
            or self.compression in WIRE_DTYPES
        ):
            raise ValueError(
                f"compression={self.compression!r}: expected one of {sorted(WIRE_DTYPES)} "
                "(gradients in 16 bits on the wire), mirrored.PowerSGD(rank=...) or None"
            )


def choose_backend(
    implementation: CommunicationImplementation, devices: Sequence[LogicalDevice]
) -> str:
    """The ``torch.distributed`` backend for ``implementation`` on this worker's ``devices``:
    "nccl" where every device is CUDA (and NCCL is built), "gloo" otherwise."""
    all_cuda = all(d.device_type == "GPU" for d in devices)
    if implementation is CommunicationImplementation.NCCL:
        if not all_cuda or not torch.distributed.is_nccl_available():
            raise ValueError(
                f"CommunicationImplementation.NCCL needs CUDA devices and a CUDA build of torch; "
                f"this worker's devices are {[d.short_name for d in devices]}: use "
                "CommunicationImplementation.RING (gloo) or AUTO"
            )
        return "nccl"
    if implementation is CommunicationImplementation.AUTO and all_cuda:
        return "nccl" if torch.distributed.is_nccl_available() else "gloo"
    return "gloo"
