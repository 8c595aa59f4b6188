"""Every collective of a strategy, in two levels: this process's replicas, then its workers.

TensorFlow's strategies hold their communication in a cross-device op object
(``CollectiveAllReduce`` across workers) instead of overriding it per strategy; ours hold a
``Communicator``. It first combines the values of this process's replicas over their
``ReplicaExchange`` with the strategy's cross-device op (:mod:`mirrored.comm.cross_device_ops`,
:mod:`mirrored.comm.replica_collectives`). With a worker group (:mod:`mirrored.comm.worker_group`)
the first local replica then combines the workers' results, one collective per bucket or tensor, and
shares them with the other local replicas. Sums run in replica order, then rank order: the same
result on every run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from mirrored._torch_internals import tensor_bytes
from mirrored.comm.bucketing import plan_gather
from mirrored.comm.cross_device_ops import CrossDeviceOps
from mirrored.comm.replica_collectives import all_gather_local, all_reduce_in_buckets
from mirrored.config import LogicalDevice
from mirrored.core.replica_meeting import ReplicaExchange
from mirrored.core.values import PerReplica, ReduceOp

if TYPE_CHECKING:
    from mirrored.comm.wire_compression import BucketCompressor, PendingSum
    from mirrored.comm.worker_group import WorkerGroup
    from mirrored.core.replica_set import Participant

__all__ = ["Communicator", "WorkerLayout"]


@dataclasses.dataclass(frozen=True)
class WorkerLayout:
    """How the replicas are spread over the workers: ``replicas_per_worker`` in rank order, and
    this worker's ``rank`` (one process: one worker, rank 0)."""

    replicas_per_worker: tuple[int, ...]
    rank: int

    @property
    def num_workers(self) -> int:
        return len(self.replicas_per_worker)

    @property
    def num_replicas(self) -> int:
        """Every replica of every worker."""
        return sum(self.replicas_per_worker)

    @property
    def first_replica(self) -> int:
        """The global id of this worker's first replica."""
        return sum(self.replicas_per_worker[: self.rank])


class Communicator:
    """The collectives of one process's replicas, and across its workers if it has a group.

    Args:
        cross_device_ops: how one bucket is summed over this process's replicas.
        devices: this process's replicas' devices, in replica order.
        workers: the workers' process group; None in one process. Making a communicator with
            one is a collective: the workers exchange their replica counts.
    """

    def __init__(
        self,
        cross_device_ops: CrossDeviceOps,
        devices: Sequence[LogicalDevice],
        workers: WorkerGroup | None = None,
    ) -> None:
        self.cross_device_ops = cross_device_ops
        self.devices = tuple(devices)
        self.workers = workers
        if workers is None:
            self.layout = WorkerLayout((len(self.devices),), 0)
        else:
            names = workers.all_gather_json(
                [d.short_name for d in self.devices], "strategy: devices of every worker"
            )
            self.layout = WorkerLayout(tuple(len(n) for n in names), workers.rank)

    def __repr__(self) -> str:
        across = "" if self.workers is None else f", across {self.workers}"
        return f"Communicator({self.cross_device_ops}, {len(self.devices)} local replicas{across})"

    @property
    def num_replicas_in_sync(self) -> int:
        """Every replica of every worker."""
        return self.layout.num_replicas

    # -- inside a run: every local replica calls these ------------------------------------------
    def all_reduce_tensors(
        self, replica: Participant, reduce_op: ReduceOp, tensors: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Reduce ``tensors`` over every replica, packed into the cross-device op's buckets."""
        return all_reduce_in_buckets(
            replica,
            reduce_op,
            tensors,
            self.cross_device_ops,
            self.all_reduce_buffer,
            self.num_replicas_in_sync,
        )

    def all_reduce_buffer(self, exchange: ReplicaExchange, flat: torch.Tensor) -> None:
        """Sum one flat bucket over every replica, in place: over the local replicas, then one
        all-reduce across workers by the first, shared back with the others."""
        self.cross_device_ops.all_reduce(exchange, flat)
        if self.workers is None:
            return
        if exchange.replica_id == 0:
            self.workers.all_reduce(flat, "all_reduce")
        if exchange.num_replicas > 1:
            first = exchange.all("all_reduce: across workers", flat, cross_device=True)[0]
            if exchange.replica_id:
                flat.copy_(first, non_blocking=True)
            exchange.barrier("all_reduce: across workers done", cross_device=True)

    def all_gather_tensors(
        self, replica: Participant, tensors: Sequence[torch.Tensor], axis: int
    ) -> list[torch.Tensor]:
        """Each tensor concatenated along ``axis`` over every replica, in replica order, on this
        replica's device (sizes along ``axis`` may differ)."""
        one = len(self.devices) == 1
        local = list(tensors) if one else all_gather_local(replica, tensors, axis)
        if self.workers is None:
            return local
        gathered = None
        if replica.exchange.replica_id == 0:
            gathered = self._gather_across_workers(local, axis)
        if one:
            assert gathered is not None
            return gathered
        first = replica.exchange.all("all_gather: across workers", gathered, cross_device=True)[0]
        result = [t.to(replica.exchange.device) for t in first]
        replica.exchange.barrier("all_gather: across workers done", cross_device=True)
        return result

    # -- between runs: the caller's thread --------------------------------------------------------
    def reduce(self, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor:
        """One value (a PerReplica, or a plain value the same on every replica) combined over
        every replica on the first local replica's device; with ``axis``, each replica's value
        is summed along it first and MEAN divides by the total length along it."""
        if self.workers is None:
            return self._reduce_local(op, value, axis)
        total = self._reduce_local(ReduceOp.SUM, value, axis).clone()
        self.workers.all_reduce(total, "reduce")
        if op is not ReduceOp.MEAN:
            return total
        if axis is None:
            return total / self.num_replicas_in_sync
        count = torch.tensor(
            [float(sum(torch.as_tensor(p).shape[axis] for p in self._parts(value)))],
            device=total.device,
        )
        self.workers.all_reduce(count, "reduce: lengths")
        return total / count

    def _parts(self, value: Any) -> Sequence[Any]:
        # A plain value is the same on every replica (run() unwraps identical results), as a
        # mirrored value is in TensorFlow: SUM counts it once per replica.
        return value.values if isinstance(value, PerReplica) else (value,) * len(self.devices)

    def _reduce_local(self, op: ReduceOp, value: Any, axis: int | None) -> torch.Tensor:
        tensors = [torch.as_tensor(p).detach() for p in self._parts(value)]
        destination = self.devices[0].torch_device
        if axis is None:
            return self.cross_device_ops.reduce(op, tensors, destination)
        total = self.cross_device_ops.reduce(
            ReduceOp.SUM, [t.sum(dim=axis) for t in tensors], destination
        )
        if op is ReduceOp.MEAN:
            total = total / sum(t.shape[axis] for t in tensors)
        return total

    def gather(self, parts: Sequence[Any], axis: int) -> torch.Tensor:
        """The local replicas' ``parts`` of one value, then every worker's, concatenated along
        ``axis`` on the first local replica's device (detached)."""
        destination = self.devices[0].torch_device
        local = torch.cat([torch.as_tensor(p).detach().to(destination) for p in parts], dim=axis)
        return local if self.workers is None else self._gather_across_workers([local], axis)[0]

    # -- the second level alone: one thread of each worker calls these ---------------------------
    def all_reduce_across_workers_async(
        self,
        tensor: torch.Tensor,
        label: str,
        compressor: BucketCompressor | None = None,
        bucket: int = 0,
    ) -> PendingSum:
        """Start summing ``tensor`` (already summed over the local replicas) over the workers,
        in place; ``compressor``: how gradient bucket ``bucket`` crosses compressed."""
        workers = self._across()
        if compressor is None:
            return workers.all_reduce_async(tensor, label)
        return compressor.start(workers, bucket, tensor, label)

    def sum_across_workers(self, values: Sequence[float], label: str) -> list[float]:
        """``values`` summed over the workers (small metadata, such as flags)."""
        workers = self._across()
        total = torch.tensor(list(values), device=workers.meta_device)
        workers.all_reduce(total, label)
        return [float(v) for v in total.tolist()]

    def reduce_scatter_across_workers(
        self, outgoing: torch.Tensor, received: torch.Tensor, out: torch.Tensor, label: str
    ) -> None:
        """Worker ``i``'s ``out`` becomes the sum over the workers, in rank order, of the i-th
        of their ``outgoing``'s equal chunks (``received``: staging as long as ``outgoing``)."""
        workers = self._across()
        workers.all_to_all_async(received, outgoing, label).wait()
        chunks = received.view(workers.world_size, out.numel())
        out.copy_(chunks[0])
        for chunk in chunks[1:]:
            out.add_(chunk)

    def all_gather_across_workers(
        self, gathered: torch.Tensor, tensor: torch.Tensor, label: str
    ) -> None:
        """Every worker's ``tensor`` (same size everywhere) end to end into ``gathered``, in
        rank order."""
        self._across().all_gather_into_async(gathered, tensor, label).wait()

    def _gather_across_workers(
        self, tensors: Sequence[torch.Tensor], axis: int
    ) -> list[torch.Tensor]:
        """Every worker's ``tensors``, each concatenated along ``axis`` (sizes along it may
        differ), in two collectives whatever their number: the lengths, then every tensor's
        bytes end to end, bit for bit. One at a time, a model's BatchNorm buffers synced after
        each step took two collectives each: most of MobileNetV2's step across processes."""
        workers = self._across()
        moved = [t.detach().movedim(axis, 0).contiguous() for t in tensors]
        mine = [(len(m), m[0].numel() * m.element_size() if len(m) else -1) for m in moved]
        sizes = torch.tensor(mine, dtype=torch.int64, device=workers.meta_device).reshape(-1, 2)
        everyone = [p.tolist() for p in workers.all_gather(sizes, "gather: lengths")]
        starts, total = plan_gather(everyone)
        results: dict[int, torch.Tensor] = {}
        for device in dict.fromkeys(m.device for m in moved):
            here = [i for i, m in enumerate(moved) if m.device == device]
            packed = torch.zeros(total, dtype=torch.uint8, device=device)
            for i in here:
                flat = tensor_bytes(moved[i])
                packed[starts[i] : starts[i] + len(flat)] = flat
            parts = workers.all_gather(packed, "gather")
            for i in here:  # rows * bytes per row: 0 where a worker has no rows (bytes -1)
                pieces = [
                    part[starts[i] : starts[i] + theirs[i][0] * theirs[i][1]]
                    .view(moved[i].dtype)
                    .view(theirs[i][0], *moved[i].shape[1:])
                    for part, theirs in zip(parts, everyone, strict=True)
                ]
                results[i] = torch.cat(pieces).movedim(0, axis)
        return [results[i] for i in range(len(moved))]

    def _across(self) -> WorkerGroup:
        assert self.workers is not None, "a collective across workers without a worker group"
        return self.workers
