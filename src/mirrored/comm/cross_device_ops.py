"""All-reduce algorithms between the replicas of one process (TensorFlow's cross-device ops).

Each algorithm is collective: every replica thread calls ``all_reduce`` with its own flat bucket
and gets the sum back in place. ``ReductionToOneDevice`` and ``HierarchicalCopyAllReduce`` sum in
replica order, so they give bit-identical results and a run is reproducible; NCCL sums in the
order of its own ring or tree (reproducible for a fixed device set, not identical to the others).

- ``ReductionToOneDevice``: every bucket is summed on one device, then copied back to all.
- ``HierarchicalCopyAllReduce``: each replica sums its own slice of every bucket across replicas
  and writes it into all replicas' buckets (reduce-scatter then all-gather by copies); on logical
  devices that share memory this reads and writes each element the minimum number of times.
- ``NcclAllReduce``: ``torch.cuda.nccl`` over one replica per physical GPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mirrored.comm.bucketing import Bucket, plan_buckets
from mirrored.config import DeviceSpec, LogicalDevice, resolve_devices
from mirrored.core.replica_meeting import ReplicaExchange
from mirrored.core.values import ReduceOp

__all__ = [
    "CrossDeviceOps",
    "HierarchicalCopyAllReduce",
    "NcclAllReduce",
    "ReductionToOneDevice",
    "choose_cross_device_ops",
]


class CrossDeviceOps:
    """Base class: bucket planning, cross-replica reduce, and the collective all-reduce."""

    def __init__(self, num_packs: int = 1, bytes_per_pack: int = 0) -> None:
        if not isinstance(num_packs, int) or num_packs < 0:
            raise ValueError(f"num_packs={num_packs!r}: expected an int >= 0 (0: no packing)")
        if not isinstance(bytes_per_pack, int) or bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack={bytes_per_pack!r}: expected an int >= 0")
        self.num_packs = num_packs
        self.bytes_per_pack = bytes_per_pack

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(num_packs={self.num_packs}, bytes_per_pack={self.bytes_per_pack})"

    def validate(self, devices: Sequence[LogicalDevice]) -> None:
        """Raise ValueError if this algorithm cannot run on ``devices``."""

    def plan(self, tensors: Sequence[torch.Tensor]) -> tuple[Bucket, ...]:
        """The buckets ``tensors`` go into, by ``num_packs`` / ``bytes_per_pack``."""
        return plan_buckets(
            [t.shape for t in tensors],
            [t.dtype for t in tensors],
            self.num_packs,
            self.bytes_per_pack,
        )

    def reduce(
        self, reduce_op: ReduceOp, values: Sequence[torch.Tensor], destination: torch.device
    ) -> torch.Tensor:
        """Combine one tensor per replica on ``destination`` (cross-replica context)."""
        total = values[0].to(destination, copy=True)
        for value in values[1:]:
            total.add_(value.to(destination))
        # Out of place: the mean of integer counts is a float.
        return total / len(values) if reduce_op is ReduceOp.MEAN else total

    def all_reduce(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        """Collective: replace ``flat`` by its sum over all replicas, in place. Every replica
        must pass a tensor of the same shape and dtype (callers check)."""
        if exchange.num_replicas > 1:
            self._all_reduce_sum(exchange, flat)

    def _all_reduce_sum(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        raise NotImplementedError


class ReductionToOneDevice(CrossDeviceOps):
    """Sum every bucket on one device (``reduce_to_device``, default: the first replica's),
    then copy the sum back to every replica. Simple and works on any mix of devices."""

    def __init__(
        self,
        reduce_to_device: DeviceSpec | LogicalDevice | None = None,
        num_packs: int = 1,
        bytes_per_pack: int = 0,
    ) -> None:
        super().__init__(num_packs, bytes_per_pack)
        self.reduce_to_device = (
            None if reduce_to_device is None else resolve_devices([reduce_to_device])[0]
        )

    def _all_reduce_sum(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        values = exchange.all("all_reduce", flat, cross_device=True)
        total = None
        if exchange.replica_id == 0:
            device = self.reduce_to_device
            destination = flat.device if device is None else device.torch_device
            total = self.reduce(ReduceOp.SUM, values, destination)
        total = exchange.all("all_reduce broadcast", total, cross_device=True)[0]
        flat.copy_(total, non_blocking=True)
        exchange.barrier("all_reduce done", cross_device=True)


class HierarchicalCopyAllReduce(CrossDeviceOps):
    """Each replica reduces its own slice of every bucket and copies it to all replicas.

    The work and the traffic are spread evenly over the replica threads: on N logical devices
    sharing memory, each element is read N times and written N times in all, the minimum for N
    separate replicas.
    """

    def _all_reduce_sum(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        values = exchange.all("all_reduce", flat, cross_device=True)
        n = flat.numel()
        replicas = exchange.num_replicas
        lo = n * exchange.replica_id // replicas
        hi = n * (exchange.replica_id + 1) // replicas
        if hi > lo:
            device = flat.device
            # On a shared device this is a view of replica 0's bucket: accumulate in place.
            accumulator = values[0][lo:hi].to(device, non_blocking=True)
            in_place = values[0].device == device
            for value in values[1:]:
                accumulator.add_(value[lo:hi].to(device, non_blocking=True))
            for replica, value in enumerate(values):
                if not (replica == 0 and in_place):
                    value[lo:hi].copy_(accumulator, non_blocking=True)
        exchange.barrier("all_reduce done", cross_device=True)


class NcclAllReduce(CrossDeviceOps):
    """NCCL all-reduce over one replica per physical GPU (``torch.cuda.nccl``); CUDA only."""

    def validate(self, devices: Sequence[LogicalDevice]) -> None:
        if any(d.device_type != "GPU" for d in devices):
            raise ValueError(
                f"NcclAllReduce needs CUDA devices, got {[d.short_name for d in devices]}; "
                "use HierarchicalCopyAllReduce or ReductionToOneDevice on CPU devices"
            )
        physical = [d.physical for d in devices]
        if len(set(physical)) != len(physical):
            raise ValueError(
                f"NcclAllReduce needs one replica per physical GPU, but "
                f"{[d.short_name for d in devices]} share a GPU; use HierarchicalCopyAllReduce "
                "for logical devices of one GPU"
            )

    def _all_reduce_sum(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        from torch.cuda import nccl

        posted = exchange.all("all_reduce", (flat, torch.cuda.current_stream()))
        if exchange.replica_id == 0:
            nccl.all_reduce([t for t, _ in posted], streams=[s for _, s in posted])
        exchange.barrier("all_reduce done")


def choose_cross_device_ops(devices: Sequence[LogicalDevice]) -> CrossDeviceOps:
    """The default for a device set: NCCL across distinct GPUs, slice-parallel copies otherwise."""
    physical = [d.physical for d in devices]
    distinct_gpus = all(d.device_type == "GPU" for d in devices) and len(set(physical)) == len(
        physical
    )
    if len(devices) > 1 and distinct_gpus:
        from torch.cuda import nccl

        if nccl.is_available([torch.empty(0, device=d.torch_device) for d in devices]):
            return NcclAllReduce()
    return HierarchicalCopyAllReduce()
