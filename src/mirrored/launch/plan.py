"""What ``mirrored launch`` runs and how many copies: its flags as one checked value.

Every flag is checked here, together with the others, before any process or socket exists, so
that a wrong command line fails with the flag named and the fix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["LaunchPlan"]


@dataclass(frozen=True)
class LaunchPlan:
    """What to run and how many copies: ``--nproc-per-node`` workers on each of ``--nnodes``."""

    program: str  # a script's path or, with ``module=True``, a module name (``python -m``)
    args: tuple[str, ...] = ()
    module: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free port on master_addr (one node only)
    max_restarts: int = 0
    monitor_interval: float = 0.1  # seconds between the agent's checks on its workers
    num_ps: int = 0  # > 0: a parameter-server cluster (MIRRORED_NUM_PS), its last ranks the ps

    @property
    def worker_arguments(self) -> list[str]:
        """The interpreter's arguments of every worker process: the program, run by
        ``mirrored.launch.worker``."""
        program = [*(["-m"] if self.module else []), self.program, *self.args]
        return ["-u", "-m", "mirrored.launch.worker", *program]

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1:
            raise ValueError(
                f"--nproc-per-node {self.nproc_per_node}: a node runs at least one worker; "
                "pass a positive count"
            )
        if self.nnodes < 1:
            raise ValueError(f"--nnodes {self.nnodes}: pass a positive count of machines")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank {self.node_rank} with --nnodes {self.nnodes}: node ranks run from 0 "
                f"to {self.nnodes - 1}; give each node its own rank, 0 to the one hosting the store"
            )
        if not 0 <= self.master_port <= 65535:
            raise ValueError(
                f"--master-port {self.master_port}: not a TCP port; pass 1..65535, or 0 for a "
                "free one (one node only)"
            )
        if self.master_port == 0 and self.nnodes > 1:
            raise ValueError(
                f"--nnodes {self.nnodes} needs --master-port: the other nodes must know where "
                "node 0's store listens; pass the same --master-port (e.g. 29500) on every node"
            )
        if not self.master_addr:
            raise ValueError("--master-addr '': pass node 0's address, e.g. 127.0.0.1")
        if self.max_restarts < 0:
            raise ValueError(
                f"--max-restarts {self.max_restarts}: pass 0 (fail at the first failure) or more"
            )
        if self.max_restarts > 0 and self.nnodes > 1 and not self.num_ps:
            raise ValueError(
                f"--max-restarts {self.max_restarts} with --nnodes {self.nnodes}: a node whose "
                "workers are healthy would not know to restart with the failed one; pass "
                "--max-restarts 0 and let the scheduler rerun the job (BackupAndRestore resumes "
                "it), or use torchrun --rdzv-backend c10d, whose store listens on every interface"
            )
        processes = self.nnodes * self.nproc_per_node
        if self.num_ps < 0 or (self.num_ps and processes < self.num_ps + 2):
            raise ValueError(
                f"--num-ps {self.num_ps} with {processes} process(es): a parameter-server "
                "cluster is a chief (rank 0), at least one worker and the ps tasks (the last "
                f"ranks); launch at least {self.num_ps + 2} processes, or pass --num-ps 0"
            )
        if not self.monitor_interval > 0:
            raise ValueError(
                f"--monitor-interval {self.monitor_interval}: pass a positive number of seconds"
            )
        if not self.program:
            raise ValueError("no script given: pass a script's path, or -m MODULE")
        if not self.module and not os.path.isfile(self.program):
            raise ValueError(
                f"script {self.program!r} not found (working directory {os.getcwd()}): pass the "
                "path of a Python file, or -m MODULE to run a module"
            )
