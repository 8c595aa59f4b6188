"""How ``mirrored launch --num-ps P`` supervises a parameter-server cluster: each task on its own.

torch's elastic agent treats its workers as one group: when one fails it stops them all and, with
restarts left, starts them all again. That suits synchronous workers (a lost rank stalls every
collective), not a parameter-server job, whose coordinator (the chief) fences a lost worker, runs
its functions on the others and admits the worker again when it restarts
(``mirrored.parameter_server.rpc_cluster``), as under ``TF_CONFIG``. So for a ``--num-ps`` cluster
the launcher starts and watches its processes itself, with the environment torch's agent gives
them, and acts on each task's end (``verdict``):

- a worker task killed by a signal (kill -9, the OOM killer, a preempted node) is started again as
  the same task, up to ``--max-restarts`` times each, and rejoins the running job as a new
  incarnation (``worker1_2``); with no restarts left the coordinator goes on with the others;
- a ps task killed by a signal ends the job: its parameters were lost with its process;
- the chief ending ends the job, with its exit status; the tasks it told to stop get 30 s to end;
- a task that exits by itself, with a status, decided to (its own error says why: the coordinator
  failed or is gone), and the chief's end decides the job.

A launcher sent SIGTERM, SIGINT, SIGHUP or SIGQUIT passes it on to every task, sends SIGKILL to
those still running 30 s later and exits 128 + the signal, as torch's agent does.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing import SignalException

from mirrored.cluster.resolvers import TorchrunClusterResolver
from mirrored.launch.agent import STOP_SIGNALS, describe_status, finished_anyway
from mirrored.launch.plan import LaunchPlan
from mirrored.launch.stores import RUN_ID, ClientStaticRendezvous

__all__ = ["Verdict", "run_ps_cluster", "verdict"]

_GRACE_SECONDS = 30.0  # for tasks told to stop, and between SIGTERM and SIGKILL (torch's too)


class Verdict(enum.Enum):
    """What a task's end means for the job."""

    DONE = "done"  # it finished, or exited by itself: nothing to do
    RESTART = "restart"  # a worker lost: start it again, to rejoin
    LOST = "lost"  # a worker lost for good: the coordinator goes on with the others
    END = "end"  # the job ends: the chief ended, or a ps task was lost


def verdict(task_type: str, status: int, restarts_left: int) -> Verdict:
    """What the end of a ``task_type`` task ("chief", "worker", "ps") with exit ``status``
    (negative: killed by that signal; 0 also for a program that finished) means."""
    if task_type == "chief":
        return Verdict.END
    if status >= 0:
        return Verdict.DONE
    if task_type == "ps":
        return Verdict.END
    return Verdict.RESTART if restarts_left > 0 else Verdict.LOST


@dataclass
class _Task:
    """One task of the cluster on this node, and its current process."""

    task_type: str  # "chief", "worker" or "ps"
    name: str  # "chief", "worker1", "ps0": as the coordinator's messages name it
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    restarts: int = 0

    def __str__(self) -> str:
        return f"{self.name} (rank {self.env['RANK']})"


def run_ps_cluster(plan: LaunchPlan, port: int, folder: str) -> int:
    """Run ``plan``'s tasks on this node until the job ends (the module's docstring says how);
    the exit status: 0, or 1 after a failure. ``port``: the agents' store, on node 0."""
    rendezvous = ClientStaticRendezvous(plan.master_addr, port, plan.node_rank, plan.nnodes)
    store = rendezvous.next_rendezvous().bootstrap_store_info
    assert store is not None  # ClientStaticRendezvous always names the workers' store
    tasks: list[_Task] = []
    last_signal = signal.SIGTERM  # what the tasks still running get as the launcher returns
    try:
        with _signals_raised():
            for local_rank in range(plan.nproc_per_node):
                env = _task_env(plan, local_rank, store.master_addr, store.master_port)
                resolver = TorchrunClusterResolver(env)
                name = "chief" if resolver.is_chief else f"{resolver.task_type}{resolver.task_id}"
                tasks.append(_Task(resolver.task_type, name, env, _start(plan, env)))
            return _watch(plan, folder, tasks)
    except SignalException as error:
        last_signal = error.sigval
        raise
    finally:
        _stop(tasks, last_signal)
        rendezvous.shutdown()


def _task_env(plan: LaunchPlan, local_rank: int, master_addr: str, port: int) -> dict[str, str]:
    """The environment torch's elastic agent gives a worker (``LocalElasticAgent``), for the
    first process of the task ``local_rank`` of this node runs."""
    rank = plan.node_rank * plan.nproc_per_node + local_rank
    world_size = plan.nnodes * plan.nproc_per_node
    return {
        **os.environ,
        "RANK": str(rank),
        "GROUP_RANK": str(plan.node_rank),
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(plan.nproc_per_node),
        "WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": str(plan.nnodes),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": str(plan.max_restarts),
        "TORCHELASTIC_RUN_ID": RUN_ID,
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # node 0's launcher hosts the store
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _start(plan: LaunchPlan, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """A task's process, in a session of its own (as torch's agent starts its workers)."""
    return subprocess.Popen(
        [sys.executable, *plan.worker_arguments], env=env, start_new_session=True
    )


def _watch(plan: LaunchPlan, folder: str, tasks: list[_Task]) -> int:
    """Act on each task's end until the job ends; the exit status. On a node without the chief
    the job ends for this node when its last task has: 1 if one of them failed by itself."""
    running = list(tasks)
    failed = False
    while running:
        time.sleep(plan.monitor_interval)
        for task in list(running):
            status = task.process.poll()
            if status is None:
                continue
            if finished_anyway(folder, task.env, status):
                status = 0
            decision = verdict(task.task_type, status, plan.max_restarts - task.restarts)
            _say(task, status, decision, plan.max_restarts)
            if decision is Verdict.RESTART:
                task.restarts += 1
                task.env = {**task.env, "TORCHELASTIC_RESTART_COUNT": str(task.restarts)}
                task.process = _start(plan, task.env)
                continue
            running.remove(task)
            if decision is Verdict.END:
                return _end_with(task, status, running, plan.monitor_interval)
            failed = failed or status > 0
    return int(failed)


def _end_with(task: _Task, status: int, running: list[_Task], interval: float) -> int:
    """The job ends with ``task``'s end (the chief's, or a lost ps task's); the exit status. The
    tasks a chief that ended by itself told to stop get ``_GRACE_SECONDS`` to end by themselves;
    the others are stopped at once (by the caller)."""
    if task.task_type == "chief" and status >= 0:
        deadline = time.monotonic() + _GRACE_SECONDS
        while time.monotonic() < deadline and any(t.process.poll() is None for t in running):
            time.sleep(interval)
    return int(status != 0)


def _say(task: _Task, status: int, decision: Verdict, max_restarts: int) -> None:
    """What a task's end means for the job, on stderr; nothing for one that finished or exited
    by itself (its own output says why)."""
    ended = f"mirrored launch: {task} ended with {describe_status(status)}"
    if decision is Verdict.RESTART:
        line = (
            f"{ended}; restarting it to rejoin the running job "
            f"(restart {task.restarts + 1} of {max_restarts})"
        )
    elif decision is Verdict.LOST:
        line = (
            f"{ended} and is not restarted (--max-restarts {max_restarts}: the restarts of each "
            "worker task); the coordinator goes on with the other workers"
        )
    elif decision is Verdict.END and task.task_type == "ps":
        line = (
            f"{ended}: its parameters were lost with its process, so the job ends; stopping "
            "the other tasks. Launch the job again: it resumes from the coordinator's last "
            "checkpoint (ClusterCoordinator.restore, Model.load)"
        )
    elif decision is Verdict.END and status:
        line = (
            f"{ended}: the coordinator's program runs there, so the job ends with it"
            f"{'; stopping the other tasks' if status < 0 else ''}"
        )
    else:
        return
    print(line, file=sys.stderr, flush=True)


def _stop(tasks: list[_Task], sig: signal.Signals) -> None:
    """Send ``sig`` to every task still running (its process group: its data loaders too),
    then SIGKILL to those still running ``_GRACE_SECONDS`` later."""
    for sent in (sig, signal.SIGKILL):
        running = [task.process for task in tasks if task.process.poll() is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sent)
        deadline = time.monotonic() + _GRACE_SECONDS
        for process in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))


@contextlib.contextmanager
def _signals_raised() -> Iterator[None]:
    """Turn the signals that stop a launcher into ``SignalException`` (in the main thread,
    where Python runs signal handlers), as torch's agent does; the handlers are put back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_signal(signum: int, frame: object) -> None:
        raise SignalException(
            f"the launcher got {signal.Signals(signum).name}", signal.Signals(signum)
        )

    signals = [getattr(signal, name) for name in STOP_SIGNALS if hasattr(signal, name)]
    handlers = {sig: signal.signal(sig, raise_signal) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
