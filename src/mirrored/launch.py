"""Run a script in worker processes, as torchrun does, with the store listening on one address.

    mirrored launch --nproc-per-node 2 train.py --epochs 3
    mirrored launch --nnodes 2 --node-rank R --master-addr 10.0.0.1 --master-port 29500 train.py
    mirrored launch --nproc-per-node 4 --num-ps 1 train_ps.py   # chief, 2 workers, 1 ps task

Each worker gets torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, ...; OMP_NUM_THREADS, unless set, is the
node's cores shared among its workers). A failed worker group is restarted up to
``--max-restarts`` times; the exit status is 0, or 1 after the last failure, with torchrun's
summary of which rank failed and how. torch's elastic agent does the work (``LocalElasticAgent``,
run as torch's ``launch_agent`` runs it). What this module changes:

- where the rendezvous store listens, because the store has no authentication: whoever reaches
  its port can read and write the job's keys, join the job or stall it (below);
- how a job ends. Each worker runs its program through ``mirrored.launch_worker``, which marks
  the program finished once it has returned: a worker that torch's teardown then aborts counts
  as finished (never restarted, never reported failed), and workers stop by themselves when
  their launcher is killed. Error files and markers live in a folder of the launch,
  ``mirrored-launch-*`` in the temporary directory, locked while its launcher runs: the next
  launch removes those of launchers killed with SIGKILL.

Sockets that listen, and where:

- the stores, ``TCPStore`` servers in the launcher of node 0: the agents' store on
  (``--master-addr``, ``--master-port``) for the whole job, and for each attempt (the first start
  and every restart) a fresh one for its workers on (``--master-addr``, a free port). Plain
  torchrun's servers listen on every interface (``*:port``) whatever host they are given; here
  the launcher binds each socket itself and hands it over with ``TCPStore(master_listen_fd=...)``,
  so they listen on that address only (127.0.0.1 by default; ``--master-port 0`` picks a free
  port, race-free since the socket is already bound). The elastic agents of every node, node 0's
  included, and all workers are clients: workers get MASTER_ADDR = ``--master-addr``,
  MASTER_PORT = their attempt's store and TORCHELASTIC_USE_AGENT_STORE=True, with which
  ``init_process_group`` starts no server of its own. The agents use a rendezvous handler of
  ours, torch's static one made client-only, registered in torch's public
  ``rendezvous_handler_registry``.
- gloo's connections between workers: each worker listens on the address of GLOO_SOCKET_IFNAME's
  interface or, unset, on the address the machine's hostname resolves to, which is a LAN address
  on most machines even when MASTER_ADDR is 127.0.0.1. With a loopback ``--master-addr`` every
  worker is on this machine, so the launcher sets GLOO_SOCKET_IFNAME to the loopback interface
  (``lo``) for the workers unless it is set already.
- nothing else: the agent opens a health-check port only when TORCHELASTIC_HEALTH_CHECK_PORT is
  set. (tests/test_launch.py reads every listening socket of a running job from /proc.)

On a cluster: put the nodes on a private network, pass node 0's address on it as
``--master-addr`` and the same ``--master-port`` on every node, set GLOO_SOCKET_IFNAME to that
network's interface, and keep the ports closed to anything outside the job. Restarts are for
one node: across nodes, a node whose workers are healthy would not learn that another restarted
(torchrun's static rendezvous then hangs), so ``--max-restarts`` needs ``--nnodes 1``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

from mirrored._torch_internals import elastic_worker_processes
from mirrored.launch_worker import FINISHED_DIR, LAUNCHER_PID, finished_marker
from mirrored.worker_group import loopback_interface

__all__ = ["LaunchPlan", "add_arguments", "launch", "main", "run_arguments"]

_BACKEND = "mirrored-static"  # our rendezvous handler's name in torch's registry
_RUN_ID = "mirrored"  # the same on every node: it prefixes the job's keys in the store
_RENDEZVOUS_TIMEOUT_S = 900  # torchrun's default wait for the other nodes
# The agent installs handlers for these (TORCHELASTIC_SIGNALS_TO_HANDLE) and never removes them.
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_FOLDER_PREFIX = "mirrored-launch-"  # each launch's folder in the temporary directory


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
        if self.max_restarts > 0 and self.nnodes > 1:
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


class _AddressError(ValueError):
    """``--master-addr`` / ``--master-port`` cannot be resolved or listened on."""


def _resolve(host: str, port: int) -> tuple[socket.AddressFamily, tuple[str, int]]:
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise _AddressError(
            f"--master-addr {host}: cannot resolve it ({error.strerror}); pass node 0's IP "
            "address or a name this machine resolves"
        ) from error
    return family, (str(address[0]), int(address[1]))


def _serve(host: str, port: int) -> TCPStore:
    """A store server listening on (host, port) only; it stops when the last reference goes.

    ``TCPStore(is_master=True)`` binds its own socket to every interface whatever ``host`` is; a
    socket we bind ourselves and pass as ``master_listen_fd`` is used as it is.
    """
    family, address = _resolve(host, port)
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        bound_port = int(sock.getsockname()[1])
        server = TCPStore(
            host, bound_port, is_master=True, wait_for_workers=False, master_listen_fd=sock.fileno()
        )
    except OSError as error:
        sock.close()
        raise _AddressError(
            f"--master-addr {host} --master-port {port}: cannot listen there ({error.strerror}); "
            "on node 0 pass one of this machine's addresses and a free port (0: pick one)"
        ) from error
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now and closes it when it stops
    return server


class _ClientStaticRendezvous(RendezvousHandler):
    """torch's static rendezvous (fixed nodes and ranks), a client of the launcher's store.

    Each round (the first start and every restart) has its own key prefix, and node 0 starts a
    fresh store for that round's workers: workers use the agent's store with no prefix of their
    own (TORCHELASTIC_USE_AGENT_STORE), so on a reused one a restarted worker can read the
    attempt before's keys and dial a dead peer: gloo's "Connection refused" failed 4 of 12 runs
    of torch 2.13's torchrun --max-restarts 1 with a worker that exits before init_process_group.
    """

    def __init__(self, master_addr: str, master_port: int, node_rank: int, nnodes: int) -> None:
        self._master_addr = master_addr
        self._master_port = master_port
        self._node_rank = node_rank
        self._nnodes = nnodes
        self._store: Store | None = None
        self._workers_store: TCPStore | None = None  # node 0's, for this round's workers
        self._round = 0

    def get_backend(self) -> str:
        return _BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the workers connect to node 0's store through MASTER_ADDR and MASTER_PORT

    def next_rendezvous(self) -> RendezvousInfo:
        if self._store is None:
            self._store = TCPStore(
                self._master_addr,
                self._master_port,
                is_master=False,
                timeout=timedelta(seconds=_RENDEZVOUS_TIMEOUT_S),
            )
        store = PrefixStore(f"{_RUN_ID}/{self._round}", self._store)
        self._round += 1
        if self._node_rank == 0:
            self._workers_store = None  # the last round's workers are stopped: so is their store
            self._workers_store = _serve(self._master_addr, 0)
            store.set("workers_store_port", str(self._workers_store.port))
        workers_port = int(store.get("workers_store_port"))  # waits for node 0
        return RendezvousInfo(
            store,
            self._node_rank,
            self._nnodes,
            RendezvousStoreInfo(self._master_addr, workers_port),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return _RUN_ID

    def shutdown(self) -> bool:
        self._store = self._workers_store = None
        return True


def _create_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    return _ClientStaticRendezvous(
        params.get("master_addr"),
        int(params.get("master_port")),
        int(params.get("node_rank")),
        params.max_nodes,
    )


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(_resolve(host, 0)[1][0]).is_loopback
    except ValueError:
        return False


def _num_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def _restored_process_state() -> Iterator[None]:
    """Undo what the elastic agent changes in the calling process: variables, signal handlers."""
    environ = dict(os.environ)
    main_thread = threading.current_thread() is threading.main_thread()
    signals = [getattr(signal, name) for name in _AGENT_SIGNALS if hasattr(signal, name)]
    handlers = {sig: signal.getsignal(sig) for sig in signals} if main_thread else {}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


class _Agent(LocalElasticAgent):
    """torch's agent, except that a worker which finished its program (its
    ``mirrored.launch_worker`` marker is there) counts as succeeded whatever its exit status:
    torch's teardown sometimes aborts a process after its program returned, and a finished job
    must be neither restarted nor reported failed."""

    def __init__(self, spec: WorkerSpec, logs_specs: DefaultLogsSpecs, folder: str) -> None:
        super().__init__(spec, logs_specs)
        self._folder = folder

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        workers = elastic_worker_processes(self)
        if isinstance(workers, SubprocessContext):  # always: the entrypoint is a command
            for local_rank, handler in workers.subprocess_handlers.items():
                status = handler.proc.poll()
                env = workers.envs[local_rank]
                marker = finished_marker(
                    self._folder, env["TORCHELASTIC_RESTART_COUNT"], env["RANK"]
                )
                if status and os.path.exists(marker):
                    print(
                        f"mirrored launch: rank {env['RANK']} finished its program, then its "
                        f"process ended with {_describe(status)}; it counts as finished",
                        file=sys.stderr,
                    )
                    handler.proc.returncode = 0  # what torch's poll of the process reads next
        return super()._monitor_workers(worker_group)


def _describe(status: int) -> str:
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
    return f"exit status {status}"


@contextlib.contextmanager
def _launch_folder() -> Iterator[str]:
    """A folder of this launch (the workers' error files and finished markers), removed at the
    end. It is locked (``flock``) for as long as its launcher runs, so that the next launch can
    remove the folders of launchers killed with SIGKILL; a folder gets its final name only once
    locked, so no launch ever takes another's for abandoned."""
    _remove_abandoned_folders()
    staging = tempfile.mkdtemp(prefix="mirrored-new-")
    lock = os.open(staging, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        folder = os.path.join(os.path.dirname(staging), _FOLDER_PREFIX + staging.rsplit("-", 1)[1])
        os.rename(staging, folder)
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    finally:
        os.close(lock)


def _remove_abandoned_folders() -> None:
    """Remove the folders of launchers that are gone: those no process holds locked."""
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(_FOLDER_PREFIX):
            continue
        path = os.path.join(root, name)
        try:
            lock = os.open(path, os.O_RDONLY)
        except OSError:  # another user's, or removed meanwhile
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its launcher is running
            os.close(lock)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def _run_agent(plan: LaunchPlan, port: int, folder: str) -> None:
    """torch's ``launch_agent``, with our agent; raises ``ChildFailedError`` after the last
    failure."""
    command = ["-u", "-m", "mirrored.launch_worker"]
    command += [*(["-m"] if plan.module else []), plan.program, *plan.args]
    handler = rendezvous_handler_registry.create_handler(
        RendezvousParameters(
            backend=_BACKEND,
            endpoint=f"{plan.master_addr}:{port}",
            run_id=_RUN_ID,
            min_nodes=plan.nnodes,
            max_nodes=plan.nnodes,
            master_addr=plan.master_addr,
            master_port=port,
            node_rank=plan.node_rank,
        )
    )
    spec = WorkerSpec(
        role="default",
        local_world_size=plan.nproc_per_node,
        entrypoint=sys.executable,
        args=tuple(command),
        rdzv_handler=handler,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
    )
    agent = _Agent(spec, DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")), folder)
    closing = True
    try:
        result = agent.run()
        if result.is_failed():
            raise ChildFailedError(name=plan.program, failures=result.failures)
    except SignalException:
        closing = False  # as torch's launch_agent: a signalled agent leaves the rendezvous open
        raise
    finally:
        if closing:
            handler.shutdown()


def launch(plan: LaunchPlan) -> int:
    """Run ``plan`` on this node and wait for it; the exit status: 0, or 1 after a failure."""
    rendezvous_handler_registry.register(_BACKEND, _create_rendezvous)
    # Node 0 hosts the agents' store from the start: the other nodes connect to it at once.
    server = _serve(plan.master_addr, plan.master_port) if plan.node_rank == 0 else None
    port = plan.master_port if server is None else server.port
    with _restored_process_state(), _launch_folder() as folder:
        # torchrun sets 1; a share of the cores each keeps CPU workers from competing or idling.
        if plan.nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ:
            os.environ["OMP_NUM_THREADS"] = str(max(1, _num_cpus() // plan.nproc_per_node))
        if plan.num_ps:
            os.environ["MIRRORED_NUM_PS"] = str(plan.num_ps)  # read by TorchrunClusterResolver
        loopback = loopback_interface()
        if loopback and "GLOO_SOCKET_IFNAME" not in os.environ and _is_loopback(plan.master_addr):
            os.environ["GLOO_SOCKET_IFNAME"] = loopback
        os.environ[FINISHED_DIR] = folder
        os.environ[LAUNCHER_PID] = str(os.getpid())
        try:
            _run_agent(plan, port, folder)
        except ChildFailedError as error:
            print(error.format_msg(), file=sys.stderr)
            return 1
        except SignalException as error:
            print(f"mirrored launch: stopped by {error.sigval.name}", file=sys.stderr)
            return 128 + int(error.sigval)
        finally:
            server = None  # stops listening, even while a traceback holds this frame
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``mirrored launch`` and ``python -m mirrored.launch``."""
    flag = parser.add_argument
    flag("--nproc-per-node", type=int, default=1, metavar="K", help="workers per node (1)")
    flag("--nnodes", type=int, default=1, metavar="N", help="number of machines (1)")
    flag("--node-rank", type=int, default=0, metavar="R", help="this machine's rank (0)")
    flag(
        "--master-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="node 0's address; its store listens there only (127.0.0.1)",
    )
    flag(
        "--master-port",
        type=int,
        default=0,
        metavar="PORT",
        help="the store's port; 0 picks a free one, with one node only (0)",
    )
    flag(
        "--max-restarts",
        type=int,
        default=0,
        metavar="R",
        help="restarts of the worker group after a failure (0)",
    )
    flag(
        "--monitor-interval",
        type=float,
        default=0.1,
        metavar="S",
        help="seconds between checks on the workers (0.1)",
    )
    flag(
        "--num-ps",
        type=int,
        default=0,
        metavar="P",
        help="a ParameterServerStrategy cluster: rank 0 the chief, the last P ranks ps tasks (0)",
    )
    flag("-m", dest="module", action="store_true", help="run SCRIPT as a module, like python -m")
    flag("script", help="the Python script (or, with -m, module) to run")
    flag("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")


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
    except _AddressError as error:  # only ours: a ValueError from inside torch is not a usage error
        parser.error(str(error))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mirrored.launch",
        description="Run a script in worker processes with torchrun's environment.",
    )
    add_arguments(parser)
    return run_arguments(parser, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
