"""Which worker this process is, and where the workers meet (TensorFlow's cluster resolvers).

A multi-worker strategy needs, before it can open a process group, this process's rank among the
synchronous workers, their number, and the address of rank 0's rendezvous. TensorFlow users write
that down in ``TF_CONFIG``, one JSON document per task; processes started by ``mirrored launch``
or torchrun get it from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...);
the tasks of a SLURM step from the variables ``srun`` sets. The resolvers below read each into one
small value, so the strategies depend on no format, and ``resolve_cluster`` picks the one that
applies (the formats' own rules are checked in :mod:`mirrored.cluster.tf_config` and
:mod:`mirrored.cluster.slurm`). This module only parses and validates: it opens no socket and
calls nothing in ``torch.distributed``, so every rule is unit-tested without a process.

Ranks follow TensorFlow: the ``chief`` task is rank 0 and ``worker`` i is rank i + 1; without a
chief job, worker 0 is the chief. ``ps`` and ``evaluator`` tasks are not synchronous workers and get
``rank == -1``, which the multi-worker strategy refuses.

Security: the addresses in ``TF_CONFIG`` and the launcher's environment are trusted as given, and
the rendezvous they name is unauthenticated (anyone who reaches the port can join or disturb the
job). Run the workers on a private network or behind a firewall, never on a public address.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from mirrored.cluster.slurm import in_slurm_step, read_step
from mirrored.cluster.tf_config import (
    JOBS,
    NON_WORKER_JOBS,
    WORKER_JOBS,
    is_host_name,
    is_int,
    is_ipv6,
    normalize_host,
    parse_tf_config,
)

__all__ = [
    "ClusterResolver",
    "LocalClusterResolver",
    "SlurmClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "resolve_cluster",
]

_INT = re.compile(r"\s*-?[0-9]+\s*")


class ClusterResolver:
    """This process's place in the cluster: the values a multi-worker strategy starts from.

    Subclasses fill it from ``TF_CONFIG`` or torchrun's environment; it can also be built directly
    (TensorFlow's ``SimpleClusterResolver``). ``rank`` is -1 for a ``ps`` or ``evaluator`` task,
    which is not one of the ``world_size`` synchronous workers. ``master_port == 0`` asks the
    strategy to pick a free port, which only a single worker can do (nobody else needs to find it).
    ``visible_gpus_shared`` is False where the launcher gave each worker GPUs of its own (SLURM's
    ``--gpus-per-task``): the worker's visible GPUs are then all its, not the machine's to share.
    """

    def __init__(
        self,
        *,
        task_type: str,
        task_id: int,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        local_rank: int = 0,
        local_world_size: int = 1,
        agent_store: bool = False,
        restart_count: int = 0,
        cluster_spec: Mapping[str, list[str]] | None = None,
        visible_gpus_shared: bool = True,
    ) -> None:
        _check_place(task_type, task_id, rank, world_size)
        _check_rendezvous(master_addr, master_port, world_size)
        _check_local(local_rank, local_world_size)
        if not is_int(restart_count) or restart_count < 0:
            raise ValueError(f"restart_count={restart_count!r}: expected an int >= 0")
        self.task_type = task_type
        self.task_id = task_id
        self.rank = rank
        self.world_size = world_size
        self.master_addr = master_addr
        self.master_port = master_port
        self.local_rank = local_rank
        self.local_world_size = local_world_size  # synchronous workers on this machine
        self.agent_store = bool(agent_store)
        self.restart_count = restart_count
        self.visible_gpus_shared = bool(visible_gpus_shared)
        self._cluster_spec = {job: list(tasks) for job, tasks in (cluster_spec or {}).items()}

    def cluster_spec(self) -> dict[str, list[str]]:
        """TensorFlow's cluster dict (job -> ``["host:port", ...]``), a fresh copy.

        Empty when the addresses of the other tasks are not known (torchrun tells each process
        only rank 0's address; a local run has no cluster), as TensorFlow's local strategies do.
        """
        return {job: list(tasks) for job, tasks in self._cluster_spec.items()}

    @property
    def is_chief(self) -> bool:
        """Rank 0: the ``chief`` task, or worker 0 when there is no chief (TensorFlow's rule)."""
        return self.rank == 0

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(task_type={self.task_type!r}, task_id={self.task_id}, "
            f"rank={self.rank}, world_size={self.world_size}, "
            f"master_addr={self.master_addr!r}, master_port={self.master_port}, "
            f"local_rank={self.local_rank}, local_world_size={self.local_world_size}, "
            f"agent_store={self.agent_store}, "
            f"restart_count={self.restart_count})"
        )


class TFConfigClusterResolver(ClusterResolver):
    """The cluster described by ``TF_CONFIG``, with TensorFlow's meaning.

    ``tf_config`` is the JSON text or the already-parsed dict; None reads ``environ["TF_CONFIG"]``
    (``os.environ`` by default). ``local_rank`` counts the synchronous workers before this one
    whose address has the same host (as written: ``localhost`` and ``127.0.0.1`` are different
    hosts); it is 0 for ``ps`` and ``evaluator`` tasks. As in TensorFlow, the ``evaluator`` task
    may be left out of ``cluster``: it runs apart from the training cluster.
    """

    def __init__(
        self,
        tf_config: str | Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        source = "tf_config"
        if tf_config is None:
            source = "TF_CONFIG"
            tf_config = (os.environ if environ is None else environ).get("TF_CONFIG", "")
            if not tf_config.strip():
                raise ValueError(
                    "TF_CONFIG is not set (or empty); set it to the cluster JSON, e.g. "
                    '\'{"cluster": {"worker": ["host0:2222", "host1:2222"]}, '
                    '"task": {"type": "worker", "index": 0}}\', or pass tf_config='
                )
        config = parse_tf_config(tf_config, source)
        cluster, task_type, task_id = config.cluster, config.task_type, config.task_id
        addresses = config.addresses
        workers = [(job, i) for job in WORKER_JOBS for i in range(len(cluster.get(job, [])))]
        master_addr, master_port = addresses[workers[0]]
        if task_type in WORKER_JOBS:
            rank = workers.index((task_type, task_id))
            host = normalize_host(addresses[(task_type, task_id)][0])
            same_host = [normalize_host(addresses[w][0]) == host for w in workers]
            local_rank, local_world_size = sum(same_host[:rank]), sum(same_host)
        else:
            rank, local_rank, local_world_size = -1, 0, 1
        super().__init__(
            task_type=task_type,
            task_id=task_id,
            rank=rank,
            world_size=len(workers),
            master_addr=master_addr,
            master_port=master_port,
            local_rank=local_rank,
            local_world_size=local_world_size,
            cluster_spec=cluster,
        )


class TorchrunClusterResolver(ClusterResolver):
    """The cluster torchrun (or ``mirrored launch``) put in this process's environment.

    Reads ``RANK`` and ``WORLD_SIZE`` (required), ``LOCAL_RANK`` (default 0),
    ``LOCAL_WORLD_SIZE`` (default ``LOCAL_RANK + 1``), ``MASTER_ADDR``
    (default ``127.0.0.1``), ``MASTER_PORT`` (required when ``WORLD_SIZE > 1``; 0 otherwise),
    ``TORCHELASTIC_USE_AGENT_STORE`` and ``TORCHELASTIC_RESTART_COUNT``. Every process is a
    ``worker`` with ``task_id == rank``: worker 0 is the chief, as in a TensorFlow cluster without
    a chief job. ``cluster_spec()`` is empty: torchrun tells a process only rank 0's address.

    With ``MIRRORED_NUM_PS=P`` (``mirrored launch --num-ps P``) the processes form a
    parameter-server cluster instead: rank 0 is the ``chief``, the last P ranks are the ``ps``
    tasks and the ranks between are the ``worker`` tasks. ``cluster_spec()`` then gives the
    chief's address (rank 0's) and names every other task by its rank (``"rank3"``), since no
    process knows another's address.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        world_size = _env_int(env, "WORLD_SIZE")
        if world_size < 1:
            raise ValueError(
                f"WORLD_SIZE={env['WORLD_SIZE']!r}: the number of workers must be >= 1"
            )
        rank = _env_int(env, "RANK")
        if not 0 <= rank < world_size:
            raise ValueError(
                f"RANK={env['RANK']!r} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size}); "
                "each worker needs a distinct RANK below WORLD_SIZE"
            )
        local_rank = _env_int(env, "LOCAL_RANK", default=0)
        if not 0 <= local_rank < world_size:
            raise ValueError(
                f"LOCAL_RANK={env['LOCAL_RANK']!r} is outside 0..WORLD_SIZE-1 "
                f"(WORLD_SIZE={world_size}); it is the worker's index on its machine"
            )
        master_addr = _master_addr(env)
        master_port = _master_port(env, world_size)
        restart_count = _env_int(env, "TORCHELASTIC_RESTART_COUNT", default=0)
        if restart_count < 0:
            raise ValueError(
                f"TORCHELASTIC_RESTART_COUNT={env['TORCHELASTIC_RESTART_COUNT']!r}: expected an "
                "int >= 0 (torchrun counts restarts from 0)"
            )
        task_type, task_id, spec = "worker", rank, None
        num_ps = _env_int(env, "MIRRORED_NUM_PS", default=0)
        if num_ps:
            task_type, task_id, spec = _launched_ps_task(
                rank, world_size, num_ps, f"{master_addr}:{master_port}"
            )
        super().__init__(
            task_type=task_type,
            task_id=task_id,
            rank=-1 if task_type == "ps" else rank,
            world_size=world_size,
            master_addr=master_addr,
            master_port=master_port,
            local_rank=local_rank,
            local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", default=local_rank + 1),
            # torch.distributed.elastic compares with str(True) the same way.
            agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            restart_count=restart_count,
            cluster_spec=spec,
        )


def _launched_ps_task(
    rank: int, world_size: int, num_ps: int, chief_address: str
) -> tuple[str, int, dict[str, list[str]]]:
    """The task of ``rank`` in a launched parameter-server cluster, and the cluster: the chief
    (rank 0), the workers, then the ``num_ps`` ps tasks."""
    num_workers = world_size - 1 - num_ps
    if num_ps < 0 or num_workers < 1:
        raise ValueError(
            f"MIRRORED_NUM_PS={num_ps} with WORLD_SIZE={world_size}: a parameter-server cluster "
            f"is a chief, at least one worker and the ps tasks; launch at least {num_ps + 2} "
            "processes (mirrored launch --nproc-per-node N --num-ps P)"
        )
    spec = {
        "chief": [chief_address],
        "worker": [f"rank{r}" for r in range(1, 1 + num_workers)],
        "ps": [f"rank{r}" for r in range(1 + num_workers, world_size)],
    }
    if rank == 0:
        return "chief", 0, spec
    if rank <= num_workers:
        return "worker", rank - 1, spec
    return "ps", rank - 1 - num_workers, spec


class SlurmClusterResolver(ClusterResolver):
    """The task of an ``srun`` step, so that ``srun python train.py`` needs nothing else
    (TensorFlow's ``SlurmClusterResolver``, its rules in :mod:`mirrored.cluster.slurm`).

    Rank ``SLURM_PROCID`` of ``SLURM_STEP_NUM_TASKS`` workers, ``local_rank`` ``SLURM_LOCALID``
    of the tasks on its node. The rendezvous is on the step's first node, where SLURM starts task
    0, at a port every task derives alike from ``SLURM_JOB_ID`` and ``SLURM_STEP_ID``
    (:attr:`mirrored.cluster.slurm.SlurmStep.port`); a step of one task takes any free port.
    ``master_addr`` and ``master_port``, else ``MASTER_ADDR`` and ``MASTER_PORT``, replace them (a
    node's fast interface, a port the site opens). ``gpus_per_task`` counts this task's GPUs among
    ``CUDA_VISIBLE_DEVICES``. Every task is a ``worker`` and ``cluster_spec()`` is empty: where
    the other tasks run depends on the step's ``--distribution``, which no task is told.
    """

    def __init__(
        self,
        *,
        master_addr: str | None = None,
        master_port: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        step = read_step(env)
        if master_addr is None and "MASTER_ADDR" in env:
            master_addr = _master_addr(env)
        if master_addr is None and step.rank == 0 and step.node_index != 0:
            raise ValueError(
                f"SLURM_PROCID=0 runs on node {step.node_index} ({step.hosts[step.node_index]}) "
                f"of the step, not on its first node ({step.hosts[0]}) where the other tasks "
                "look for it; set MASTER_ADDR to its address in every task, or distribute the "
                "tasks by block or cyclic (srun --distribution)"
            )
        if master_port is None and "MASTER_PORT" in env:
            master_port = _master_port(env, step.num_tasks)
        if master_port is None:
            master_port = step.port if step.num_tasks > 1 else 0
        super().__init__(
            task_type="worker",
            task_id=step.rank,
            rank=step.rank,
            world_size=step.num_tasks,
            master_addr=step.hosts[0] if master_addr is None else master_addr,
            master_port=master_port,
            local_rank=step.local_rank,
            local_world_size=step.local_world_size,
            visible_gpus_shared=not step.gpus_bound,
        )
        self.gpus_per_task = step.gpus_per_task


class LocalClusterResolver(ClusterResolver):
    """A single worker on this machine: rank 0 of 1 at 127.0.0.1, any free port."""

    def __init__(self) -> None:
        super().__init__(
            task_type="worker",
            task_id=0,
            rank=0,
            world_size=1,
            master_addr="127.0.0.1",
            master_port=0,
        )


def resolve_cluster(environ: Mapping[str, str] | None = None) -> ClusterResolver:
    """The resolver for this process's environment (``os.environ`` by default), the first of:

    1. a launcher's ``RANK`` and ``WORLD_SIZE`` (torchrun or ``mirrored launch`` started this
       process, under srun too: the launcher's workers are the workers); one without the other
       is an error, and a ``TF_CONFIG`` beside them must describe as many synchronous workers;
    2. a non-empty ``TF_CONFIG``: the program's own cluster wins over the scheduler's;
    3. a task of an ``srun`` step (``SLURM_STEP_NUM_TASKS``). Not the batch script of ``sbatch``
       nor an ``salloc`` shell: they have ``SLURM_NTASKS`` and maybe ``SLURM_PROCID``, but a
       program started there is one process;
    4. a single local worker.
    """
    env = os.environ if environ is None else environ
    has_tf_config = bool(env.get("TF_CONFIG", "").strip())
    if "RANK" in env or "WORLD_SIZE" in env:
        missing = "WORLD_SIZE" if "RANK" in env else "RANK"
        if missing not in env:
            present = "RANK" if missing == "WORLD_SIZE" else "WORLD_SIZE"
            raise ValueError(
                f"{present}={env[present]!r} is set but {missing} is not; set both (as torchrun "
                "and mirrored launch do) or neither"
            )
        torchrun = TorchrunClusterResolver(env)
        if has_tf_config:
            tf = TFConfigClusterResolver(environ=env)
            if tf.world_size != torchrun.world_size:
                raise ValueError(
                    f"WORLD_SIZE={torchrun.world_size} but TF_CONFIG describes "
                    f"{tf.world_size} synchronous workers (chief + worker); make them agree, "
                    "or unset TF_CONFIG when launching with torchrun / mirrored launch"
                )
        return torchrun
    if has_tf_config:
        return TFConfigClusterResolver(environ=env)
    if in_slurm_step(env):
        return SlurmClusterResolver(environ=env)
    return LocalClusterResolver()


def _check_place(task_type: str, task_id: int, rank: int, world_size: int) -> None:
    """The task, and its rank among the ``world_size`` synchronous workers (-1 for the others)."""
    if task_type not in JOBS:
        raise ValueError(f"task_type={task_type!r}: expected one of {', '.join(JOBS)}")
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
    if not is_int(task_id) or task_id < 0:
        raise ValueError(f"task_id={task_id!r}: expected an int >= 0")
    if task_type in NON_WORKER_JOBS:
        if rank != -1:
            raise ValueError(
                f"rank={rank!r} for a {task_type!r} task: such tasks are not synchronous "
                "workers; pass rank=-1"
            )
    elif not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(
            f"rank={rank!r} is outside 0..world_size-1 ({world_size - 1}); "
            "pass the worker's position, chief first"
        )


def _check_rendezvous(master_addr: str, master_port: int, world_size: int) -> None:
    """Rank 0's address; port 0 (any free port) only for a single worker."""
    if not isinstance(master_addr, str) or not master_addr or master_addr.startswith("["):
        raise ValueError(
            f"master_addr={master_addr!r}: expected a non-empty host name or IP address "
            "(IPv6 without brackets)"
        )
    if not is_int(master_port) or not 0 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r}: expected an int in 0..65535")
    if master_port == 0 and world_size > 1:
        raise ValueError(
            f"master_port=0 with world_size={world_size}: only a single worker may pick a "
            "free port; give rank 0's port so the other workers can find it"
        )


def _check_local(local_rank: int, local_world_size: int) -> None:
    """This worker's index among the synchronous workers of its machine."""
    if not is_int(local_rank) or local_rank < 0:
        raise ValueError(f"local_rank={local_rank!r}: expected an int >= 0")
    if not is_int(local_world_size) or not local_rank < local_world_size:
        raise ValueError(
            f"local_world_size={local_world_size!r}: expected an int above local_rank "
            f"({local_rank}), the number of workers on this machine"
        )


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise ValueError(
                f"{name} is not set; launchers (torchrun, mirrored launch) set RANK, WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT; set it, or use TF_CONFIG instead"
            )
        return default
    if not _INT.fullmatch(value):
        raise ValueError(f"{name}={value!r} is not an integer; set it to a whole number")
    return int(value)


def _master_addr(env: Mapping[str, str]) -> str:
    """``MASTER_ADDR`` (default 127.0.0.1): a host name or an IP address, IPv6 in brackets or
    not, returned without them."""
    master_addr = env.get("MASTER_ADDR", "127.0.0.1").strip()
    if master_addr.startswith("[") and master_addr.endswith("]"):
        master_addr = master_addr[1:-1]  # a bracketed IPv6 address
        valid = is_ipv6(master_addr)
    else:
        valid = is_host_name(master_addr) or is_ipv6(master_addr)
    if not valid:
        raise ValueError(
            f"MASTER_ADDR={env.get('MASTER_ADDR')!r} is not a host name or IP address; "
            "set it to the host of rank 0 (e.g. 10.0.0.1)"
        )
    return master_addr


def _master_port(env: Mapping[str, str], world_size: int) -> int:
    """``MASTER_PORT``: required with more than one worker; 0 (any free port) only without."""
    if "MASTER_PORT" not in env and world_size > 1:
        raise ValueError(
            f"MASTER_PORT is not set but WORLD_SIZE={world_size}; set it to the port of rank "
            "0's rendezvous (torchrun sets it), e.g. MASTER_PORT=29500"
        )
    master_port = _env_int(env, "MASTER_PORT", default=0)
    low = 0 if world_size == 1 else 1
    if not low <= master_port <= 65535:
        raise ValueError(
            f"MASTER_PORT={env['MASTER_PORT']!r} is outside {low}..65535 "
            f"(WORLD_SIZE={world_size}); set it to the port of rank 0's rendezvous"
        )
    return master_port
