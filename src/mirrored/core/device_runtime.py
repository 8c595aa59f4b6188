"""What a replica's worker thread sets up on its logical device.

- CPU: the replica's share of the intra-op threads (logical CPU devices share the cores).
- CUDA: the physical device, the logical device's own stream, and, with a ``memory_limit``, its
  own memory pool. The process is capped at the sum of the limits of a GPU's logical devices, so
  the allocator itself refuses what goes beyond it; an out-of-memory error inside a replica names
  its logical device. What the replica's pool still holds after a step is checked against its own
  limit. That check is coarse: it sees memory held at the end of the step, not the peak, and
  allocations the autograd engine makes on its own device thread (most of backward) land in the
  shared pool, bounded by the process cap only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager

import torch

from mirrored.config import LogicalDevice, list_logical_devices

__all__ = ["ReplicaDeviceRuntime", "cap_process_memory", "intra_op_threads"]

_MIB = 1 << 20


@contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads on this thread (restored afterwards), so
    that replicas sharing the cores do not each start a full thread pool and oversubscribe."""
    threads = torch.get_num_threads()
    if threads != count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        if threads != count:
            torch.set_num_threads(threads)


class ReplicaDeviceRuntime:
    """Per-replica device state, entered around each of the replica's tasks."""

    def __init__(self, device: LogicalDevice, num_threads: int) -> None:
        self.device = device
        self.num_threads = num_threads
        self.stream: torch.cuda.Stream | None = None
        self.pool: torch.cuda.MemPool | None = None
        if device.device_type == "GPU":
            self.stream = torch.cuda.Stream(device=device.torch_device)
            if device.memory_limit is not None:
                self.pool = torch.cuda.MemPool()

    @contextmanager
    def task_scope(self, caller_stream: torch.cuda.Stream | None) -> Iterator[None]:
        """Around each replica task, on whichever thread runs it (restored afterwards): the
        replica's share of intra-op threads, and on CUDA its device, stream and memory pool.

        The replica's stream first waits for ``caller_stream`` (the caller's work on this device:
        input copies, parameter updates between steps); the caller waits for the replica's
        stream after the step (``caller_waits``).
        """
        with intra_op_threads(self.num_threads):
            if self.stream is None:
                yield
                return
            with ExitStack() as stack:
                stack.enter_context(torch.cuda.device(self.device.torch_device))
                stack.enter_context(torch.cuda.stream(self.stream))
                if self.pool is not None:
                    stack.enter_context(
                        torch.cuda.use_mem_pool(self.pool, self.device.torch_device)
                    )
                if caller_stream is not None:
                    self.stream.wait_stream(caller_stream)
                try:
                    yield
                except torch.OutOfMemoryError as error:
                    raise torch.OutOfMemoryError(
                        f"logical device {self.device.short_name} (slot {self.device.slot} of "
                        f"{self.device.physical.name}, memory_limit={self.device.memory_limit} MiB)"
                        f" ran out of memory: {error}"
                    ) from error
            self.check_memory()

    def caller_waits(self, caller_stream: torch.cuda.Stream | None) -> None:
        """Order the caller's later work on this device after this replica's step."""
        if self.stream is not None and caller_stream is not None:
            caller_stream.wait_stream(self.stream)

    def check_memory(self) -> None:
        """Raise OutOfMemoryError if the replica's pool holds more than its memory_limit."""
        if self.pool is None or self.device.memory_limit is None:
            return
        used = sum(segment["allocated_size"] for segment in self.pool.snapshot())
        if used > self.device.memory_limit * _MIB:
            raise torch.OutOfMemoryError(
                f"logical device {self.device.short_name} (slot {self.device.slot} of "
                f"{self.device.physical.name}) holds {used / _MIB:.1f} MiB, over its "
                f"memory_limit of {self.device.memory_limit} MiB; use a smaller per-replica "
                "batch or a larger memory_limit"
            )


def cap_process_memory(devices: Sequence[LogicalDevice]) -> None:
    """Cap this process on each GPU used by ``devices`` at the sum of the memory limits of that
    GPU's logical devices, when every one of them has a limit."""
    for physical in {d.physical for d in devices if d.device_type == "GPU"}:
        slices = [d for d in list_logical_devices("GPU") if d.physical == physical]
        limits = [d.memory_limit for d in slices]
        if any(limit is None for limit in limits):
            continue
        total = torch.cuda.get_device_properties(physical.index).total_memory
        fraction = min(1.0, sum(limit or 0 for limit in limits) * _MIB / total)
        torch.cuda.set_per_process_memory_fraction(fraction, physical.index)
