"""Start the multi-process tests' workers without importing torch in each of them.

``python -m tests.multiprocess.fork_server SOCKET`` imports once what the test jobs import
(torch, torch._dynamo, mirrored, scikit-learn: 4-6 s of CPU per process, most of a short job's
cost on 2 cores), then forks a worker per request. The worker starts its own session, takes the
request's environment, working directory and output pipe, and runs its program as ``python -m
MODULE ARGS`` or ``python SCRIPT ARGS`` would: as ``__main__``, to the interpreter's own exit (an
uncaught error prints its traceback and exits 1).

Only variables that are read when a job runs may differ between a worker and the server
(``RUN_TIME_VARIABLES``): anything else could have been read at import, so ``spawn`` starts a
fresh interpreter for such a worker instead. The server is single-threaded (OpenMP and BLAS see
``OMP_NUM_THREADS=1``, pyarrow's allocator ``_SINGLE_THREADED``), so a fork copies no lock held
by another thread; it reports each worker's exit status (``-N`` for signal N, as ``subprocess``
does) on the request's connection, and ends when its standard input closes (the test session
ended).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

PRELOADED = (  # what the jobs import (not the jobs themselves: runpy runs them afresh)
    "mirrored",
    "torch._dynamo",  # torch's optimizers import it when the first one is built (2 s of CPU)
    "tests.multiprocess.parameter_server_jobs",
    "tests.reference_loops",
    "sklearn.datasets",
    "examples.mnist_mlp",  # the digits split of the parameter-server jobs
)
RUN_TIME_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TF_CONFIG",
        "MIRRORED_TEST_LOGICAL_DEVICES",
        "MIRRORED_TEST_IMPLEMENTATION",
        "MIRRORED_TEST_DTYPE",
        "PYTEST_CURRENT_TEST",
    }
)
# pandas, which scikit-learn imports, imports pyarrow where it is installed (Ray Train installs
# it); pyarrow's jemalloc starts a background thread at import unless told not to, and a thread
# in the server would make every fork unsafe (the server refuses to fork: "the fork server ended
# before reporting"). jemalloc reads this when pyarrow loads, so it is set before the imports.
_SINGLE_THREADED = {"JE_ARROW_MALLOC_CONF": "background_thread:false"}
_REAP_SECONDS = 0.02  # how often the server collects its workers' exit statuses
_READY = "fork server ready:"  # then what the imports set in the environment, as JSON


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``python *argv`` runs a program the server can run: ``-m MODULE ARGS`` or
    ``SCRIPT ARGS`` (no interpreter options, no ``-c``)."""
    return len(argv) > 1 if argv[:1] == ["-m"] else bool(argv) and not argv[0].startswith("-")


def serve(path: str) -> list[str]:
    """Fork a worker per request on ``path`` until standard input closes; return, in a worker
    only, its interpreter arguments (``forkable``)."""
    os.environ.update(_SINGLE_THREADED)
    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen()
    set_by_imports = {k: v for k, v in os.environ.items() if before.get(k) != v}
    # The imported modules live as long as any worker: its collections, finalization included
    # (1 s of CPU at every exit), need not walk them (as the gc module's documentation advises
    # for a process that forks without exec).
    gc.freeze()
    print(_READY, json.dumps(set_by_imports), flush=True)
    connections: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], _REAP_SECONDS)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            os._exit(0)  # the test session ended; its workers were killed or end by themselves
        if listener in readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 1)
            request = json.loads(message)
            assert threading.active_count() == 1 and len(os.listdir("/proc/self/task")) == 1
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in connections.values():
                    other.close()
                connection.close()
                _become_worker(request, fds[0])
                return request["argv"]
            os.close(fds[0])
            _tell(connection, pid)
            connections[pid] = connection
        while connections:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = connections.pop(pid)
            _tell(connection, os.waitstatus_to_exitcode(status))
            connection.close()


def _tell(connection: socket.socket, number: int) -> None:
    """Send ``number`` unless the test has stopped listening (it dropped the process)."""
    with contextlib.suppress(OSError):
        connection.send(str(number).encode())


def _become_worker(request: dict, output: int) -> None:
    """What ``subprocess.Popen(..., start_new_session=True)`` gives a fresh process (reading
    nothing: the server's own input is the pipe that tells it the session ended)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(output, 1)
    os.dup2(output, 2)
    os.close(null)
    os.close(output)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])


class ForkedProcess:
    """What the tests use of ``subprocess.Popen`` for a worker the server forked: its pid, its
    output (stdout and stderr together, as text), its exit status."""

    def __init__(self, args: list[str], connection: socket.socket, output: int) -> None:
        self.args = args
        self.returncode: int | None = None
        self._connection = connection
        self._output = os.fdopen(output, "rb", buffering=0)
        self._received: list[bytes] = []
        self.pid = int(self._receive())

    def _receive(self) -> bytes:
        message = self._connection.recv(64)
        if not message:
            raise RuntimeError(f"the fork server ended before reporting on {self.args}")
        return message

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self.returncode = int(self._receive())
            self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self.poll()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Read the output to its end, then wait for the exit status (``Popen.communicate``:
        after a ``TimeoutExpired``, a later call goes on where this one stopped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._output.closed:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self._output], [], [], remaining)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            chunk = self._output.read(1 << 16)
            if chunk:
                self._received.append(chunk)
            else:
                self._output.close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        text = b"".join(self._received).decode(errors="replace")
        return text.replace("\r\n", "\n").replace("\r", "\n"), None  # as text=True reads it


class ForkServer:
    """A running server, started with ``env`` in ``cwd``."""

    def __init__(self, env: dict[str, str], cwd: Path, socket_path: Path) -> None:
        self.env, self.cwd, self._path = env, cwd, socket_path
        self._server = subprocess.Popen(
            [sys.executable, "-m", __name__, str(socket_path)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert self._server.stdout is not None
        printed = []  # before the ready line: the imports' warnings, if any
        while not (line := self._server.stdout.readline()).startswith(_READY):
            if not line:
                raise RuntimeError("the fork server did not start:\n" + "".join(printed))
            printed.append(line)
        # What the imports set themselves (scikit-learn's KMP_* variables, for one).
        self._set_by_imports: dict[str, str] = json.loads(line[len(_READY) :])

    def can_start(self, env: dict[str, str]) -> bool:
        """Whether a worker with ``env`` sees at import what a fresh interpreter would: the
        server's variables, but for ``RUN_TIME_VARIABLES`` and for those the imports set (a
        worker may already have them, from the test's own imports, with the same values)."""
        for name in (env.keys() | self.env.keys()) - RUN_TIME_VARIABLES:
            allowed = {self.env.get(name)}
            if name in self._set_by_imports:
                allowed |= {None, self._set_by_imports[name]}
            if env.get(name) not in allowed:
                return False
        return True

    def start(self, argv: Sequence[str], env: dict[str, str]) -> ForkedProcess:
        """``python *argv`` (``forkable``) with ``env``, forked."""
        assert forkable(argv), argv
        connection = self._connect()
        request = {
            "argv": list(argv),
            "env": {**self._set_by_imports, **env},  # as the imports would leave it
            "cwd": str(self.cwd),
        }
        read, write = os.pipe()
        try:
            socket.send_fds(connection, [json.dumps(request).encode()], [write])
        finally:
            os.close(write)
        return ForkedProcess([sys.executable, *argv], connection, read)

    def _connect(self) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect(str(self._path))
        except OSError as error:
            connection.close()
            self._server.kill()
            output = self._server.communicate()[0]
            raise RuntimeError(f"the fork server is gone ({error}):\n{output}") from None
        return connection

    def close(self) -> None:
        assert self._server.stdin is not None and self._server.stdout is not None
        self._server.stdin.close()
        self._server.wait()
        self._server.stdout.close()


def main() -> None:
    argv = serve(sys.argv[1])
    if argv[0] == "-m":  # as python -m: sys.path[0] stays the working directory
        sys.argv = argv[1:]  # run_module puts the module's path first
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:  # as python SCRIPT: the script's folder first on sys.path
        path = os.path.abspath(argv[0])
        sys.argv = [path, *argv[1:]]
        sys.path[0] = os.path.dirname(path)
        runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    main()
