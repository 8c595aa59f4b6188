"""Run a script in worker processes, as torchrun does, with the store listening on one address.

    mirrored launch --nproc-per-node 2 train.py --epochs 3
    mirrored launch --nnodes 2 --node-rank R --master-addr 10.0.0.1 --master-port 29500 train.py
    mirrored launch --nproc-per-node 4 --num-ps 1 train_ps.py   # chief, 2 workers, 1 ps task

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...; OMP_NUM_THREADS, unless set, is the
node's cores shared among its workers). A failed worker group is restarted up to
``--max-restarts`` times; the exit status is 0, or 1 after the last failure, with torchrun's
summary of which rank failed and how. torch's elastic agent does the work:
``mirrored.launch.agent`` says what we change in how a job ends, and ``mirrored.launch.stores``
where its sockets listen (the rendezvous store has no authentication, so it listens on
``--master-addr`` only).

A parameter-server cluster (``--num-ps``) is not one group: the launcher watches each task on its
own (``mirrored.launch.ps_cluster``), restarts a lost worker task alone (up to ``--max-restarts``
times each) to rejoin the running job, and ends the job with the chief or a lost ps task.

On a cluster: put the nodes on a private network, pass node 0's address on it as
``--master-addr`` and the same ``--master-port`` on every node, set GLOO_SOCKET_IFNAME to that
network's interface, and keep the ports closed to anything outside the job. Restarts are for
one node: across nodes, a node whose workers are healthy would not learn that another restarted
(torchrun's static rendezvous then hangs), so ``--max-restarts`` needs ``--nnodes 1``, but for
a parameter-server cluster's workers, each restarted alone.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

from mirrored.cluster.store import loopback_interface
from mirrored.launch.agent import launch_folder, restored_process_state, run_agent
from mirrored.launch.plan import LaunchPlan
from mirrored.launch.ps_cluster import run_ps_cluster
from mirrored.launch.stores import (
    BACKEND,
    AddressError,
    create_rendezvous,
    is_loopback,
    serve_store,
)
from mirrored.launch.worker import FINISHED_DIR, LAUNCHER_PID

__all__ = ["LaunchPlan", "add_arguments", "launch", "main", "run_arguments"]


def _num_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def launch(plan: LaunchPlan) -> int:
    """Run ``plan`` on this node and wait for it; the exit status: 0, or 1 after a failure."""
    rendezvous_handler_registry.register(BACKEND, create_rendezvous)
    # Node 0 hosts the agents' store from the start: the other nodes connect to it at once.
    server = serve_store(plan.master_addr, plan.master_port) if plan.node_rank == 0 else None
    port = plan.master_port if server is None else server.port
    with restored_process_state(), launch_folder() as folder:
        # torchrun sets 1; a share of the cores each keeps CPU workers from competing or idling.
        if plan.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(max(1, _num_cpus() // plan.nproc_per_node))
        if plan.num_ps:
            os.environ["MIRRORED_NUM_PS"] = str(plan.num_ps)  # read by TorchrunClusterResolver
        loopback = loopback_interface()
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ and is_loopback(plan.master_addr):
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ[FINISHED_DIR] = folder
        os.environ[LAUNCHER_PID] = str(os.getpid())
        try:
            if plan.num_ps:  # each task supervised on its own
                return run_ps_cluster(plan, port, folder)
            run_agent(plan, port, folder)
        except ChildFailedError as error:
            print(error.format_msg(), file=sys.stderr)
            return 1
        except SignalException as error:
            print(f"mirrored launch: stopped by {error.sigval.name}", file=sys.stderr)
            return 128 + int(error.sigval)
        finally:
            server = None  # stops listening, even while a traceback holds this frame
    return 0


# The flags of ``mirrored launch`` that take a value: name, type, default, metavar, help.
_VALUE_FLAGS: tuple[tuple[str, type, object, str, str], ...] = (
    ("--nproc-per-node", int, 1, "K", "workers per node"),
    ("--nnodes", int, 1, "N", "number of machines"),
    ("--node-rank", int, 0, "R", "this machine's rank"),
    ("--master-addr", str, "127.0.0.1", "ADDR", "node 0's address; its store listens there only"),
    ("--master-port", int, 0, "PORT", "the store's port; 0 picks a free one, with one node only"),
    (
        "--max-restarts",
        int,
        0,
        "R",
        "restarts of the worker group after a failure (with --num-ps: of each lost worker task)",
    ),
    ("--monitor-interval", float, 0.1, "S", "seconds between checks on the workers"),
    (
        "--num-ps",
        int,
        0,
        "P",
        "a ParameterServerStrategy cluster: rank 0 the chief, the last P ranks ps tasks",
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mirrored launch`` and ``python -m mirrored.launch.launcher``."""
    for name, kind, default, metavar, text in _VALUE_FLAGS:
        parser.add_argument(
            name, type=kind, default=default, metavar=metavar, help=f"{text} (default: %(default)s)"
        )
    parser.add_argument(
        "-m",
        dest="module",
        action="store_true",
        help="run SCRIPT as a module, like python -m (default: as a file)",
    )
    parser.add_argument("script", help="the Python script (or, with -m, module) to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


def run_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Launch what ``add_arguments``' flags describe; argument errors exit with status 2."""
    try:
        plan = LaunchPlan(
            program=args.script,
            args=tuple(args.script_args),
            module=args.module,
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            num_ps=args.num_ps,
        )
    except ValueError as error:
        parser.error(str(error))
    try:
        return launch(plan)
    except AddressError as error:  # only ours: a ValueError from inside torch is not a usage error
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mirrored.launch.launcher",
        description="Run a script in worker processes with torchrun's environment.",
    )
    add_arguments(parser)
    return run_arguments(parser, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
