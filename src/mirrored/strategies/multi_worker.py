"""MultiWorkerMirroredStrategy: MirroredStrategy in every process, kept in sync across processes.

Inside a process the replicas are exactly MirroredStrategy's (threads, logical devices). Across
processes every collective is hierarchical (MirroredStrategy's communicator with a second level,
:mod:`mirrored.comm.communicator`): summed over the local replicas, one all-reduce per bucket
between the workers (``torch.distributed``: gloo on CPU, NCCL where every device is CUDA; shared
memory between the workers of one machine, :mod:`mirrored.comm.same_host_all_reduce`), then shared
with the local replicas again. Gradients go while backward still runs
(:mod:`mirrored.replication.gradient_reducer`). The cluster comes from ``TF_CONFIG`` or torchrun's
environment (:mod:`mirrored.cluster.resolvers`); the processes' collectives name the missing worker
when one dies or hangs (:mod:`mirrored.comm.worker_group`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from mirrored.cluster.resolvers import ClusterResolver, resolve_cluster
from mirrored.comm.communicator import Communicator
from mirrored.comm.formed_group import ProcessGroupClusterResolver
from mirrored.comm.options import (
    CommunicationImplementation,
    CommunicationOptions,
    choose_backend,
)
from mirrored.comm.worker_group import WorkerGroup
from mirrored.config import DeviceSpec, LogicalDevice
from mirrored.core.param_groups import settings_of
from mirrored.core.values import fingerprint
from mirrored.input import (
    DistributedDataset,
    InputContext,
    InputOptions,
    distribute_global_batches,
    distribute_loader_parts,
    distribute_replica_batches,
    refuse_distributed_sampler,
    shardable_loader,
)
from mirrored.replication.accumulation import AccumulationWindow
from mirrored.replication.gradient_reducer import (
    BYTES_PER_PACK,
    FIRST_PACK_BYTES,
    OverlappedGradientReducer,
)
from mirrored.replication.local_sgd import LocalSGD, LocalSteps
from mirrored.replication.mirrored_module import MirroredModule, tensors_of
from mirrored.replication.mirrored_optimizer import MirroredOptimizer
from mirrored.strategies.mirrored import MirroredStrategy, default_devices
from mirrored.strategies.step_agreement import WorkerStepAgreement

__all__ = ["CommunicationImplementation", "CommunicationOptions", "MultiWorkerMirroredStrategy"]

_DEFAULT_TIMEOUT_SECONDS = 1800.0


def local_share(devices: Sequence[LogicalDevice], resolver: ClusterResolver) -> list[LogicalDevice]:
    """This worker's part of the machine's GPUs when several workers share the machine's GPUs
    (its ``local_rank``-th equal slice); every device otherwise (one worker, or GPUs the launcher
    bound to this worker alone: ``resolver.visible_gpus_shared`` False), and the CPU's logical
    devices always (workers on one machine share its cores)."""
    gpus = [d for d in devices if d.device_type == "GPU"]
    if not gpus or resolver.local_world_size == 1 or not resolver.visible_gpus_shared:
        return list(devices)
    share, workers = len(gpus) // resolver.local_world_size, resolver.local_world_size
    if not share:
        raise ValueError(
            f"{workers} workers on this machine but {len(gpus)} GPU(s): give each worker a GPU "
            f"at least (fewer workers per machine), or pass devices= to each worker"
        )
    return gpus[resolver.local_rank * share : (resolver.local_rank + 1) * share]


def _connect_workers(
    options: CommunicationOptions,
    resolver: ClusterResolver,
    devices: Sequence[LogicalDevice],
    timeout_seconds: float,
) -> WorkerGroup:
    """This worker's process group with the others, on the backend ``options`` choose."""
    backend = choose_backend(options.implementation, devices)
    if backend == "nccl":  # NCCL's communicator and metadata use the current device
        torch.cuda.set_device(devices[0].torch_device)
    same_host = options.implementation is CommunicationImplementation.AUTO
    same_host = same_host and backend == "gloo"  # NCCL moves CUDA tensors itself
    return WorkerGroup(resolver, backend, timeout_seconds, same_host=same_host)


class MultiWorkerMirroredStrategy(MirroredStrategy):
    """Synchronous data parallelism over the devices of several processes (workers).

    Run the same program in every worker: under ``mirrored launch``/torchrun, or with a
    ``TF_CONFIG`` per process. ``num_replicas_in_sync`` counts every replica of every worker;
    each global batch is split over all of them, and every replica ends each step with the same
    parameters. Initial parameters and buffers come from the chief (rank 0); only the chief
    writes checkpoints (``should_checkpoint``).

    Args:
        communication_options: ``CommunicationOptions`` (bucket size, timeout, gloo/NCCL).
        cluster_resolver: who this worker is; by default the process group the program (or Ray
            Train) formed already, else torchrun's environment, else ``TF_CONFIG``, else an
            ``srun`` step, else a single local worker.
        devices: this worker's devices, as for MirroredStrategy (default: its GPUs, split
            evenly between the workers of its machine, else its logical CPU devices).
        gradient_accumulation_steps: as for MirroredStrategy: one reduction across the workers
            every k ``optimizer.step()`` calls; the backward passes in between send nothing.
        local_sgd: as for MirroredStrategy: local updates send nothing; the averages of the
            parameters cross the workers.
        zero_stage: as for MirroredStrategy, over every replica of every worker: 1 keeps the
            all-reduce during backward and all-gathers the updated parameters; 2 reduce-scatters
            the gradients at ``optimizer.step()`` instead (no compression).
    """

    def __init__(
        self,
        communication_options: CommunicationOptions | None = None,
        cluster_resolver: ClusterResolver | None = None,
        devices: Sequence[DeviceSpec | LogicalDevice] | None = None,
        *,
        gradient_accumulation_steps: int = 1,
        local_sgd: LocalSGD | None = None,
        zero_stage: int = 0,
    ) -> None:
        options = communication_options or CommunicationOptions()
        if not isinstance(options, CommunicationOptions):
            raise TypeError(
                f"communication_options={options!r}: expected a mirrored.CommunicationOptions"
            )
        if cluster_resolver is not None and not isinstance(cluster_resolver, ClusterResolver):
            raise TypeError(
                f"cluster_resolver={cluster_resolver!r}: expected a mirrored cluster resolver "
                "(TFConfigClusterResolver or TorchrunClusterResolver)"
            )
        if zero_stage == 2 and options.compression is not None:
            raise ValueError(
                f"zero_stage=2 and compression={options.compression!r} do not combine: stage 2 "
                "reduce-scatters the full-precision gradients at optimizer.step(); use "
                "zero_stage=1 (compressed all-reduce during backward) or no compression"
            )
        timeout = options.timeout_seconds or _DEFAULT_TIMEOUT_SECONDS
        if cluster_resolver is None and torch.distributed.is_initialized():
            cluster_resolver = ProcessGroupClusterResolver(timeout)  # the group: no rendezvous
        resolver = cluster_resolver or resolve_cluster()
        if devices is None:
            devices = local_share(default_devices(), resolver)
        super().__init__(
            devices,
            timeout_seconds=timeout,
            gradient_accumulation_steps=gradient_accumulation_steps,
            local_sgd=local_sgd,
            zero_stage=zero_stage,
        )
        self.communication_options = options
        self.cluster_resolver = resolver
        try:
            self._group = _connect_workers(options, resolver, self.devices, timeout)
        except BaseException:
            super().close()
            raise
        self._close_group = weakref.finalize(self, self._group.close)
        self._reducers: weakref.WeakSet[OverlappedGradientReducer] = weakref.WeakSet()
        # MirroredStrategy's collectives, with a second level across the workers.
        self.communicator = Communicator(self.cross_device_ops, self.devices, self._group)
        # Per-replica random streams are keyed by the global replica id.
        for local, randomness in enumerate(self._randomness):
            randomness.replica_id = self._first_replica_id + local

    # -- identity ---------------------------------------------------------------------------------
    @property
    def num_replicas_in_sync(self) -> int:
        """Every replica of every worker."""
        return self.communicator.num_replicas_in_sync

    @property
    def _first_replica_id(self) -> int:
        return self.communicator.layout.first_replica

    @property
    def worker_group(self) -> WorkerGroup:
        """This worker's rank, the world size and the cross-process collectives."""
        return self._group

    @property
    def should_checkpoint(self) -> bool:
        """Only the chief (rank 0) writes checkpoints, logs and summaries."""
        return self._group.is_chief

    def save_on_chief(self, write: Callable[[], object]) -> None:
        error: Exception | None = None
        if self.should_checkpoint:
            try:
                write()
            except Exception as caught:
                error = caught
        status = None if error is None else f"{type(error).__name__}: {error}"
        chief = self._group.all_gather_json(status, "checkpoint: written by the chief")[0]
        if error is not None:
            raise error
        if chief is not None:
            raise RuntimeError(f"the chief (worker 0) failed to write the checkpoint: {chief}")

    def check_same_on_workers(self, value: Any, what: str) -> None:
        mine = torch.tensor([fingerprint(value)], dtype=torch.int64, device=self._group.meta_device)
        checksums = [int(c.item()) for c in self._group.all_gather(mine, f"checking {what}")]
        differ = [rank for rank, checksum in enumerate(checksums) if checksum != checksums[0]]
        if differ:
            raise ValueError(
                f"worker(s) {differ} hold other values than worker 0 for {what}: each worker "
                "read a different file; keep checkpoints and backups on storage every worker "
                "reads (a shared filesystem), or copy the chief's file to every worker"
            )

    def check_same_settings(self, settings: dict[str, Any], what: str) -> None:
        everyone = self._group.all_gather_json(settings, f"checking {what}")
        for rank, theirs in enumerate(everyone):
            different = sorted(
                k for k in {*theirs, *everyone[0]} if theirs.get(k) != everyone[0].get(k)
            )
            if different:
                key = different[0]
                raise ValueError(
                    f"worker {rank} has other {what} than worker 0: {key} is "
                    f"{theirs.get(key)!r} there, {everyone[0].get(key)!r} on worker 0 "
                    f"(differing: {different}); every worker must train with the same settings"
                )

    def any_worker(self, flag: bool, what: str) -> bool:
        flags = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self._group.meta_device)
        self._group.all_reduce(flags, f"whether any worker {what}")
        return bool(flags.item())

    def __repr__(self) -> str:
        names = [d.short_name for d in self.devices]
        return (
            f"MultiWorkerMirroredStrategy(worker {self._group.rank} of {self._group.world_size}, "
            f"devices={names}, {self._group.transport})"
        )

    # -- running ----------------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """As MirroredStrategy's. A step that fails here may have run on the other workers, so
        the workers' collectives would no longer pair up: the failure ends the job's
        collectives (``WorkerGroup.abort``). The other workers fail at once with a
        ``WorkerLostError`` naming this one and its error, and this strategy refuses further
        collectives; restart the job (BackupAndRestore resumes it)."""
        if self._group.broken is not None:
            raise RuntimeError(
                f"the workers' collectives ended with an earlier failure: {self._group.broken}"
            ) from self._group.broken
        try:
            return super().run(fn, args, kwargs)
        except BaseException as error:
            for reducer in self._reducers:
                reducer.reset()
            if self._group.world_size > 1:
                self._group.abort(error)
            raise

    # -- input ------------------------------------------------------------------------------------
    def experimental_distribute_dataset(
        self, dataset: Iterable[Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Iterate the same global batches in every worker; each keeps its replicas' shards.

        A DataLoader over a map-style dataset is cloned so that each worker loads only the
        examples of its own shards; any other iterable is read whole by every worker.
        ``options``: ``InputOptions`` (reading ahead, the batch dimension; the workers' checks
        that they read alike stay on the training's thread).
        """
        refuse_distributed_sampler(dataset)
        agreement = WorkerStepAgreement(self._group, wait_for_global_size=False)
        if shardable_loader(dataset):
            return distribute_loader_parts(
                dataset,  # type: ignore[arg-type]
                self._input_devices,
                self._first_replica_id,
                self.num_replicas_in_sync,
                agreement,
                options,
            )
        return distribute_global_batches(
            dataset,
            self._input_devices,
            self._first_replica_id,
            self.num_replicas_in_sync,
            agreement,
            options=options,
        )

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Iterable[Any]]
    ) -> DistributedDataset:
        """``dataset_fn`` runs once per worker with its ``InputContext`` (pipeline id = rank) and
        yields per-replica batches; the global batch size of each step is agreed across workers."""
        input_context = InputContext(
            self._group.world_size, self._group.rank, self.num_replicas_in_sync
        )
        return distribute_replica_batches(
            [dataset_fn(input_context)],
            self._input_devices,
            WorkerStepAgreement(self._group, wait_for_global_size=True),
        )

    # -- models -----------------------------------------------------------------------------------
    def mirror(  # type: ignore[override]
        self,
        module: nn.Module,
        *optimizers: torch.optim.Optimizer | None,
        sync_batch_norm: bool = False,
        **keywords: Any,
    ) -> MirroredModule | tuple[MirroredModule | MirroredOptimizer, ...]:
        """As MirroredStrategy's (several optimizers included), after checking that every
        worker built the same model and giving every worker the chief's parameters and
        buffers."""
        if isinstance(module, nn.Module) and not isinstance(module, MirroredModule):
            self._check_same_model(module)
            for index, optimizer in enumerate(optimizers):
                if isinstance(optimizer, torch.optim.Optimizer):
                    self.check_same_settings(
                        settings_of(optimizer), f"settings of optimizer {index}"
                    )
            self._broadcast_from_chief(module)
        return super().mirror(module, *optimizers, sync_batch_norm=sync_batch_norm, **keywords)

    def _check_same_model(self, module: nn.Module) -> None:
        names = [n for n, _ in module.named_parameters(remove_duplicate=False)] + [
            n for n, _ in module.named_buffers(remove_duplicate=False)
        ]
        tensors = tensors_of(module)
        mine = [[n, list(t.shape), str(t.dtype)] for n, t in zip(names, tensors, strict=True)]
        everyone = self._group.all_gather_json(mine, "mirror: model signatures")
        for rank, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            difference = next(
                (f"{a} vs {b}" for a, b in zip(everyone[0], theirs, strict=False) if a != b),
                f"{len(everyone[0])} vs {len(theirs)} tensors",
            )
            raise ValueError(
                f"worker {rank} built a different model than worker 0 (first difference, worker "
                f"0 vs worker {rank}: {difference}); every worker must build the same model"
            )

    def _broadcast_from_chief(self, module: nn.Module) -> None:
        """Every worker gets the chief's parameters and buffers: one broadcast per dtype and
        device (the model's tensors packed end to end), not one per tensor."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors_of(module):
            if tensor.numel():
                groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        with torch.no_grad():
            for (dtype, _), tensors in groups.items():
                packed = torch.cat([t.detach().reshape(-1) for t in tensors])
                self._group.broadcast(packed, f"mirror: {dtype} parameters and buffers")
                for tensor, part in zip(
                    tensors, packed.split([t.numel() for t in tensors]), strict=True
                ):
                    tensor.copy_(part.view_as(tensor))

    def gradient_reducer(
        self,
        params: Sequence[Sequence[nn.Parameter]],
        window: AccumulationWindow | None,
        local: LocalSteps | None,
    ) -> OverlappedGradientReducer | None:
        if self.zero_stage == 2:
            return None  # the gradients are reduce-scattered at the step (zero_redundancy.py)
        bytes_per_pack = self.communication_options.bytes_per_pack
        reducer = OverlappedGradientReducer(
            self,
            params,
            self.communicator,
            window,
            local,
            self.communication_options.compression,
            bytes_per_pack or BYTES_PER_PACK,
            0 if bytes_per_pack else FIRST_PACK_BYTES,
        )
        self._reducers.add(reducer)
        return reducer

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the replica threads and leave the process group; idempotent."""
        super().close()
        self._close_group()
