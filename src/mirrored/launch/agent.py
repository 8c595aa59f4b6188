"""How ``mirrored launch`` supervises its workers: torch's elastic agent (``LocalElasticAgent``,
run as torch's ``launch_agent`` runs it), changed in how a job ends.

Each worker runs its program through ``mirrored.launch.worker``, which marks the program finished
once it has returned: a worker that torch's teardown then aborts counts as finished (never
restarted, never reported failed), and workers stop by themselves when their launcher is killed.
Error files and markers live in a folder of the launch, ``mirrored-launch-*`` in the temporary
directory, locked while its launcher runs: the next launch removes those of launchers killed with
SIGKILL. The agent's changes to the launcher's own process (environment, signal handlers) are
undone when it returns.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

from mirrored._torch_distributed import before_each_worker_poll
from mirrored.launch.plan import LaunchPlan
from mirrored.launch.stores import BACKEND, RUN_ID
from mirrored.launch.worker import finished_marker

__all__ = [
    "STOP_SIGNALS",
    "describe_status",
    "finished_anyway",
    "launch_folder",
    "restored_process_state",
    "run_agent",
]

# The signals that stop a launcher, passed on to its workers. The agent installs handlers for
# these (TORCHELASTIC_SIGNALS_TO_HANDLE) and never removes them.
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
_FOLDER_PREFIX = "mirrored-launch-"  # each launch's folder in the temporary directory


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """Undo what the elastic agent changes in the calling process: variables, signal handlers."""
    environ = dict(os.environ)
    main_thread = threading.current_thread() is threading.main_thread()
    signals = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    handlers = {sig: signal.getsignal(sig) for sig in signals} if main_thread else {}
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _count_finished_programs(folder: str, workers: Any) -> None:
    """Before torch's agent polls its ``workers`` (their process context): a worker whose
    program finished counts as succeeded whatever its exit status (``finished_anyway``)."""
    if not isinstance(workers, SubprocessContext):  # always one: the entrypoint is a command
        return
    for local_rank, handler in workers.subprocess_handlers.items():
        if finished_anyway(folder, workers.envs[local_rank], handler.proc.poll()):
            handler.proc.returncode = 0  # what torch's poll of the process reads next


def finished_anyway(folder: str, env: Mapping[str, str], status: int | None) -> bool:
    """Whether a worker's process (started with ``env``) that ended with a failing ``status``
    had finished its program: its ``mirrored.launch.worker`` marker is there. torch's teardown
    sometimes aborts a process after its program returned, and a finished job must be neither
    restarted nor reported failed; said on stderr when it happens."""
    marker = finished_marker(folder, env["TORCHELASTIC_RESTART_COUNT"], env["RANK"])
    if not status or not os.path.exists(marker):
        return False
    print(
        f"mirrored launch: rank {env['RANK']} finished its program, then its process ended "
        f"with {describe_status(status)}; it counts as finished",
        file=sys.stderr,
    )
    return True


def describe_status(status: int) -> str:
    """A process's exit status in words: ``signal SIGKILL`` or ``exit status 1``."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-status).name}"
    return f"exit status {status}"


@contextlib.contextmanager
def launch_folder() -> Iterator[str]:
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


def run_agent(plan: LaunchPlan, port: int, folder: str) -> None:
    """torch's ``launch_agent``, with our agent; raises ``ChildFailedError`` after the last
    failure."""
    handler = rendezvous_handler_registry.create_handler(
        RendezvousParameters(
            backend=BACKEND,
            endpoint=f"{plan.master_addr}:{port}",
            run_id=RUN_ID,
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
        args=tuple(plan.worker_arguments),
        rdzv_handler=handler,
        max_restarts=plan.max_restarts,
        monitor_interval=plan.monitor_interval,
    )
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=os.path.join(folder, "logs")))
    before_each_worker_poll(agent, functools.partial(_count_finished_programs, folder))
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
