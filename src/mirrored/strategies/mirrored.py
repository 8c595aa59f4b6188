"""MirroredStrategy: one process, one replica per local device, one worker thread per replica."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from mirrored import config
from mirrored.comm.cross_device_ops import CrossDeviceOps, choose_cross_device_ops
from mirrored.config import DeviceSpec, LogicalDevice
from mirrored.core.device_runtime import ReplicaDeviceRuntime, cap_process_memory
from mirrored.core.replica_meeting import ReplicaMeeting
from mirrored.core.replica_workers import Outcome, ReplicaWorkers, close_threads
from mirrored.core.values import flatten
from mirrored.input import PerReplicaShards
from mirrored.input.load_balancing import LoadBalancing, ReplicaSpeeds
from mirrored.random.routing import ReplicaRandomness, replica_streams
from mirrored.random.step_seeds import StepSeed
from mirrored.replication.accumulation import AccumulationWindow
from mirrored.replication.gradient_reducer import (
    BYTES_PER_PACK,
    FIRST_PACK_BYTES,
    OverlappedGradientReducer,
)
from mirrored.replication.local_sgd import LocalSGD, LocalSteps
from mirrored.strategies.replicated import ReplicatedStrategy, observe_backward

__all__ = ["MirroredStrategy", "default_devices", "local_devices"]


def default_devices() -> list[LogicalDevice]:
    """All logical GPUs when there are any, else all logical CPU devices."""
    return config.list_logical_devices("GPU") or config.list_logical_devices("CPU")


def local_devices(devices: Sequence[DeviceSpec | LogicalDevice] | None) -> list[LogicalDevice]:
    """The logical devices a list of names gives, or ``default_devices()`` for None."""
    if isinstance(devices, (str, torch.device)):
        raise TypeError(
            f"devices={devices!r}: expected a list of devices, such as [{str(devices)!r}]"
        )
    return config.resolve_devices(devices) if devices is not None else default_devices()


class MirroredStrategy(ReplicatedStrategy):
    """Synchronous data parallelism over the devices of one process.

    Replica 0 runs on the calling thread, the others on persistent worker threads.

    Args:
        devices: device names ("cpu:0", "/gpu:1", `torch.device`...); None: all local GPUs, or
            all logical CPU devices when there is no GPU.
        cross_device_ops: the all-reduce algorithm (an instance, or a class to build with its
            defaults); by default `NcclAllReduce` across distinct GPUs and
            `HierarchicalCopyAllReduce` otherwise.
        timeout_seconds: how long replicas wait for each other at a sync point before failing
            with an error naming the missing replica (None: forever).
        gradient_accumulation_steps: k > 1 makes every `optimizer.step()` of a mirrored
            optimizer a micro-step: the gradients of k steps are summed locally, reduced once,
            averaged and applied at the k-th (`mirrored.replication.accumulation`).
        local_sgd: `LocalSGD(period, warmup_steps)`: after the warm-up, each replica updates
            with its own gradient and the parameters are averaged every `period` updates
            (`mirrored.replication.local_sgd`). None: every update all-reduces the gradients.
        load_balancing: `LoadBalancing(every_steps, smoothing)`: split each global batch of
            `experimental_distribute_dataset` (and `fit`) by the measured speed of each replica
            (`mirrored.input.load_balancing`). None: evenly.
        zero_stage: 1 shards the optimizer state of a mirrored optimizer over the replicas
            (each range of the parameters has one owner, which alone updates it and keeps its
            state: 1/N per replica), 2 the gradients too; 0 (the default) keeps all of it on
            every replica (`mirrored.replication.zero_redundancy`). Needs one of torch's
            per-parameter optimizers.
        check_replicas: verify before and after every run that each replica's parameters and
            buffers are bit-identical to replica 0's, and raise `ReplicasDifferError` naming
            the tensor otherwise: a debugging aid that reads every tensor twice a run. None:
            on when the environment sets `MIRRORED_CHECK_REPLICAS=1`.
    """

    def __init__(
        self,
        devices: Sequence[DeviceSpec | LogicalDevice] | None = None,
        cross_device_ops: CrossDeviceOps | type[CrossDeviceOps] | None = None,
        *,
        timeout_seconds: float | None = 1800.0,
        gradient_accumulation_steps: int = 1,
        local_sgd: LocalSGD | None = None,
        load_balancing: LoadBalancing | None = None,
        zero_stage: int = 0,
        check_replicas: bool | None = None,
    ) -> None:
        if load_balancing is not None and not isinstance(load_balancing, LoadBalancing):
            raise TypeError(
                f"load_balancing={load_balancing!r}: expected mirrored.LoadBalancing(...)"
            )
        logical = local_devices(devices)
        if isinstance(cross_device_ops, type) and issubclass(cross_device_ops, CrossDeviceOps):
            cross_device_ops = cross_device_ops()  # the class, as the articles write it
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise TypeError(
                f"cross_device_ops={cross_device_ops!r}: expected a mirrored.CrossDeviceOps "
                "such as HierarchicalCopyAllReduce() or ReductionToOneDevice()"
            )
        ops = cross_device_ops or choose_cross_device_ops(logical)
        ops.validate(logical)
        super().__init__(
            logical,
            ops,
            timeout_seconds,
            gradient_accumulation_steps=gradient_accumulation_steps,
            local_sgd=local_sgd,
            zero_stage=zero_stage,
        )
        config.mark_in_use(logical)
        cap_process_memory(logical)
        self._choose_replica_check(check_replicas, local_sgd)

        cpu_replicas = sum(1 for d in logical if d.device_type == "CPU") or 1
        threads = max(1, torch.get_num_threads() // cpu_replicas)
        self._runtimes = [ReplicaDeviceRuntime(d, threads) for d in logical]
        self._randomness = [
            ReplicaRandomness(i, d.torch_device, on_backward=observe_backward)
            for i, d in enumerate(logical)
        ]
        for randomness in self._randomness:
            self.at_close(randomness.release)
        self._workers = ReplicaWorkers([d.short_name for d in logical])
        self.replica_speeds = (
            None if load_balancing is None else ReplicaSpeeds(load_balancing, len(logical))
        )
        self._caller_streams: list[torch.cuda.Stream | None] = [None] * len(logical)
        # Stop the threads when the strategy is collected without close().
        self._finalizer = weakref.finalize(self, self._workers.close, False)

    def _choose_replica_check(self, check_replicas: bool | None, local_sgd: Any) -> None:
        """``check_replicas``, or the environment's choice when None; refused with local SGD,
        whose replicas differ between averages by design."""
        if check_replicas is not None:
            self.check_replicas = check_replicas
        if self.check_replicas and local_sgd is not None:
            raise ValueError(
                "check_replicas=True with local_sgd: local SGD keeps the replicas apart between "
                "averages by design; check a run without local_sgd"
            )

    def gradient_reducer(
        self,
        params: Sequence[Sequence[torch.nn.Parameter]],
        window: AccumulationWindow | None,
        local: LocalSteps | None,
    ) -> OverlappedGradientReducer | None:
        """Gradients summed over the replicas while backward runs, so that after
        ``loss.backward()`` every replica's ``.grad`` is the global batch's (as with DDP) and
        ``optimizer.step()`` only applies; none with one replica, or with ``zero_stage=2``
        (each replica's gradient is reduce-scattered to its owner at the step)."""
        if len(self.devices) == 1 or self.zero_stage == 2:
            return None
        return OverlappedGradientReducer(
            self, params, self.communicator, window, local, None, BYTES_PER_PACK, FIRST_PACK_BYTES
        )

    def _balanced_sizes(self) -> Callable[[int], list[int]] | None:
        return None if self.replica_speeds is None else self.replica_speeds.sizes

    def _observe_run(self, meeting: ReplicaMeeting, inputs: Any) -> None:
        """With load balancing: the run's compute time and examples per replica, measured on
        runs that take a distributed batch."""
        if self.replica_speeds is None:
            return
        shards = next((v for v in flatten(inputs) if isinstance(v, PerReplicaShards)), None)
        busy = meeting.busy_seconds
        if shards is None or any(seconds is None for seconds in busy):
            return
        examples = [len(value) if value.dim() else 0 for value in shards.values]
        self.replica_speeds.record([s or 0.0 for s in busy], examples)

    def _execute(
        self, tasks: Sequence[Callable[[], Any]], meeting: ReplicaMeeting
    ) -> list[Outcome]:
        # The calling thread's current stream on each replica's GPU (None on the CPU).
        self._caller_streams = [
            torch.cuda.current_stream(d.torch_device) if d.device_type == "GPU" else None
            for d in self.devices
        ]
        with StepSeed() as step_seed:
            for randomness in self._randomness:
                randomness.start_step(step_seed)
            try:
                return self._workers.run(
                    tasks, self.timeout_seconds, meeting.abort, self._resync_now
                )
            finally:
                for runtime, caller_stream in zip(
                    self._runtimes, self._caller_streams, strict=True
                ):
                    runtime.caller_waits(caller_stream)

    @contextmanager
    def _replica_scope(self, replica_id: int) -> Iterator[None]:
        with (
            self._runtimes[replica_id].task_scope(self._caller_streams[replica_id]),
            replica_streams(self._randomness, replica_id, self.num_replicas_in_sync),
        ):
            yield

    def _usable(self) -> bool:
        return self._workers.broken is None

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the worker threads; the strategy cannot run afterwards."""
        try:
            close_threads(self._finalizer, lambda: self._workers.close(wait=True))
        finally:
            self._release_at_close()
