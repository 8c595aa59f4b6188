"""The workers of a ``torch.distributed`` process group formed before the strategy.

A program may form the default process group itself, and so does Ray Train's ``TorchTrainer``
before the training function runs; with ``TorchConfig(init_method="tcp")`` Ray sets ``RANK`` and
``WORLD_SIZE`` but no ``MASTER_ADDR`` or ``MASTER_PORT``, which torchrun's resolver requires. The
group itself says who the workers are, whatever the environment says, and the strategy joins it
(:class:`mirrored.comm.worker_group.WorkerGroup`) instead of meeting at a rendezvous of its own.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from mirrored._torch_distributed import default_store
from mirrored.cluster.resolvers import ClusterResolver
from mirrored.comm import same_host_all_reduce

__all__ = ["ProcessGroupClusterResolver"]

_MACHINE_KEY = "mirrored/joined/machine/"


class ProcessGroupClusterResolver(ClusterResolver):
    """The default process group's workers: this process's rank in it and its size, and its
    place among the workers of its machine (``local_share`` splits the machine's GPUs by it),
    which the workers tell each other on the group's store. ``master_addr`` and ``master_port``
    are that store's address; the strategy reaches the store through the group.

    Args:
        timeout_seconds: how long to wait for the other workers to say where they run (each
            does so when it builds its strategy).
    """

    def __init__(self, timeout_seconds: float = 1800.0) -> None:
        if not dist.is_initialized():
            raise ValueError(
                "ProcessGroupClusterResolver: no torch.distributed process group exists; call "
                "torch.distributed.init_process_group first, or use "
                "mirrored.cluster.resolvers.resolve_cluster()"
            )
        rank, world_size = dist.get_rank(), dist.get_world_size()
        store = default_store()
        master_addr, master_port = _store_address(store, world_size)
        machines = _machines(store, rank, world_size, timeout_seconds)
        mine = [r for r in range(world_size) if machines[r] == machines[rank]]
        super().__init__(
            task_type="worker",
            task_id=rank,
            rank=rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            local_rank=mine.index(rank),
            local_world_size=len(mine),
        )


def _store_address(store: dist.Store, world_size: int) -> tuple[str, int]:
    """Where the group's TCP store listens (``init_method`` ``env://`` or ``tcp://``); a single
    worker's group may have another store, as no one needs to find it."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore):
        return store.host, store.port
    if world_size == 1:
        return "127.0.0.1", 0
    raise ValueError(
        f"the torch.distributed process group of {world_size} workers was formed over a "
        f"{type(store).__name__}, not a TCP store, so it has no rendezvous address: form it "
        "with init_method='env://' or 'tcp://host:port', or pass cluster_resolver= "
        "(rank and world_size as in the group)"
    )


def _machines(store: dist.Store, rank: int, world_size: int, timeout_seconds: float) -> list[str]:
    """Every worker's machine (``same_host_all_reduce``'s identity of it), in rank order."""
    store.set(f"{_MACHINE_KEY}{rank}", same_host_all_reduce.machine_identity())
    keys = [f"{_MACHINE_KEY}{r}" for r in range(world_size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_seconds))
    except RuntimeError as error:  # DistStoreError: the wait timed out
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
        raise TimeoutError(
            f"worker(s) {missing} of the process group did not build MultiWorkerMirroredStrategy "
            f"within {timeout_seconds:g} s (worker {rank} waited): every worker of the group "
            "must build it"
        ) from error
    return [store.get(key).decode() for key in keys]
