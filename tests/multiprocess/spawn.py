"""Our own spawn helper: run a job of ``tests.multiprocess.jobs`` in N real worker processes.

Each worker gets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT) or a
TF_CONFIG, one torch thread, and its own session, so that a test can kill every process it
started, and does so whatever happens. Python programs are forked by ``fork_server`` (torch
imported once for the session, not once per process) where their environment allows.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from tests.multiprocess.fork_server import RUN_TIME_VARIABLES, ForkedProcess, ForkServer, forkable

REPO = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Worker:
    rank: int
    process: subprocess.Popen[str] | ForkedProcess
    env: dict[str, str]
    output: str = ""

    @property
    def returncode(self) -> int | None:
        return self.process.returncode


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@functools.cache
def cluster_ports(first: int, count: int) -> tuple[int, ...]:
    """``count`` distinct ports starting with ``first`` (the chief's or master's), the same for
    every rank of one cluster: each TF_CONFIG must list the same addresses, none twice. The
    probes stay bound until all are chosen, so the kernel cannot hand out one port twice."""
    probes = []
    try:
        ports = [first]
        while len(ports) < count:
            probe = socket.socket()
            probes.append(probe)
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
            if port not in ports:
                ports.append(port)
        return tuple(ports)
    finally:
        for probe in probes:
            probe.close()


def program_env(logical_devices: int = 1) -> dict[str, str]:
    """A test program's environment: this process's, less any cluster, with one torch thread,
    the repository importable and this process's default dtype (float64 in exactness tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG")}
    env.update(OMP_NUM_THREADS="1", MIRRORED_TEST_LOGICAL_DEVICES=str(logical_devices))
    env["MIRRORED_TEST_DTYPE"] = str(torch.get_default_dtype()).removeprefix("torch.")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def worker_env(
    rank: int,
    num_workers: int,
    port: int,
    logical_devices: int,
    cluster: str,
    extra: dict[str, str] | None = None,
) -> dict[str, str]:
    env = program_env(logical_devices)
    if cluster == "torchrun":
        env.update(
            RANK=str(rank),
            WORLD_SIZE=str(num_workers),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    elif cluster.startswith("ps:"):  # "ps:W:P": rank 0 the chief, then W workers, P ps tasks
        num_train, num_ps = (int(n) for n in cluster.split(":")[1:])
        tasks = [("chief", 0)] + [("worker", i) for i in range(num_train)]
        tasks += [("ps", i) for i in range(num_ps)]
        assert len(tasks) == num_workers, f"{cluster} needs {len(tasks)} processes"
        spec: dict[str, list[str]] = {}
        for (job, _), task_port in zip(tasks, cluster_ports(port, len(tasks)), strict=True):
            spec.setdefault(job, []).append(f"127.0.0.1:{task_port}")
        job, task = tasks[rank]
        env["TF_CONFIG"] = json.dumps({"cluster": spec, "task": {"type": job, "index": task}})
    else:
        addresses = [f"127.0.0.1:{p}" for p in cluster_ports(port, num_workers)]
        env["TF_CONFIG"] = json.dumps(
            {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": rank}}
        )
    env.update(extra or {})
    return env


def start_workers(
    job: str,
    out: Path,
    num_workers: int = 2,
    *,
    args: Sequence[str] = (),
    logical_devices: int = 1,
    cluster: str = "torchrun",
    env: dict[int, dict[str, str]] | None = None,
    ranks: Sequence[int] | None = None,
) -> list[Worker]:
    """Workers of ``job`` in a cluster of ``num_workers``: all of them, or only ``ranks`` (the
    others never start)."""
    port = free_port()
    command = [sys.executable, "-m", "tests.multiprocess.jobs", job, str(out), *args]
    return [
        start_process(
            command,
            worker_env(rank, num_workers, port, logical_devices, cluster, (env or {}).get(rank)),
            rank,
        )
        for rank in (range(num_workers) if ranks is None else ranks)
    ]


def restart_worker(worker: Worker) -> Worker:
    """Start ``worker``'s program again, the same command with the same environment (the same
    TF_CONFIG task), as a launcher restarts a failed process."""
    return start_process(list(worker.process.args), worker.env, worker.rank)  # type: ignore[arg-type]


def start_process(command: list[str], env: dict[str, str], rank: int = 0) -> Worker:
    """``command`` in the repository with ``env``, its output captured, in its own session
    (so that ``kill_workers`` kills all it starts); a Python program forked where the server
    can start it."""
    if command[0] == sys.executable and forkable(command[1:]):
        server = _fork_server()
        if server.can_start(env):
            return Worker(rank, server.start(command[1:], env), env)
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return Worker(rank, process, env)


@functools.cache
def _fork_server() -> ForkServer:
    """The session's fork server, in a worker's environment less what varies by worker; closed
    when the session ends."""
    folder = Path(tempfile.mkdtemp(prefix="mirrored-fork-server-"))
    env = program_env()
    server = ForkServer(
        {k: v for k, v in env.items() if k not in RUN_TIME_VARIABLES}, REPO, folder / "socket"
    )
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    atexit.register(server.close)
    return server


def wait_workers(workers: Sequence[Worker], timeout: float) -> list[Worker]:
    """Wait for every worker (killing all of them past ``timeout``) and collect their output."""
    deadline = time.monotonic() + timeout
    try:
        for worker in workers:
            remaining = max(0.1, deadline - time.monotonic())
            worker.output, _ = worker.process.communicate(timeout=remaining)
    except subprocess.TimeoutExpired:
        kill_workers(workers)
        outputs = "\n".join(f"--- worker {w.rank}:\n{w.process.communicate()[0]}" for w in workers)
        raise AssertionError(f"workers still running after {timeout} s:\n{outputs}") from None
    finally:
        kill_workers(workers)
    return list(workers)


def kill_workers(workers: Sequence[Worker]) -> None:
    for worker in workers:
        if worker.process.poll() is None:
            os.killpg(worker.process.pid, signal.SIGKILL)
            worker.process.wait()


def run_workers(
    job: str, out: Path, num_workers: int = 2, *, timeout: float = 120, **kw: object
) -> list[Worker]:
    """Start ``num_workers`` workers of ``job`` and wait for all of them."""
    return wait_workers(start_workers(job, out, num_workers, **kw), timeout)  # type: ignore[arg-type]


def assert_all_failed_saying(workers: Sequence[Worker], *messages: str) -> None:
    """Every worker exited with an error, its output holding each of ``messages``."""
    for worker in workers:
        assert worker.returncode != 0, f"worker {worker.rank} exited 0"
        for message in messages:
            assert message in worker.output, worker.output[-2000:]


def assert_all_succeeded(workers: Sequence[Worker]) -> None:
    failed = [w for w in workers if w.returncode != 0]
    assert not failed, "\n".join(
        f"--- worker {w.rank} exited {w.returncode}:\n{w.output}" for w in failed
    )
