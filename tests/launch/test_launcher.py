"""``mirrored launch``: real worker processes on 127.0.0.1, restarts, failures, listening sockets.

The workers run a throwaway script on plain ``torch.distributed`` (gloo); each launcher runs as
``python -m mirrored.launch.launcher`` in its own session, and whatever a test leaves running is
killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from mirrored import cli
from mirrored.launch import launcher as launch
from mirrored.launch import worker as launch_worker

WORKER = """
import atexit, json, os, sys, time
import torch
import torch.distributed as dist

out, mode = sys.argv[1], sys.argv[2]
rank = int(os.environ["RANK"])
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


def write(name, value):
    path = os.path.join(out, f"{name}.{rank}.{attempt}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


write("pid", os.getpid())
if mode == "exit-first" and attempt == 0 and rank == 1:
    os._exit(1)
if mode == "abort-at-exit" and rank == 1:  # as torch's teardown sometimes does
    atexit.register(os.abort)
dist.init_process_group("gloo")
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
write("result", {"sum": total.item(), "env": dict(os.environ), "argv": sys.argv[3:],
                 "file": __file__, "path0": sys.path[0]})
if mode == "abort" and rank == 1:
    os.abort()
if mode == "hold":  # until the test has looked at the job (or killed a worker)
    while not os.path.exists(os.path.join(out, "release")):
        time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


PS_JOB = """
import json, sys
import torch
import torch.distributed.rpc as rpc
from torch import nn
import mirrored


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.value = nn.Parameter(torch.zeros(3))

    def forward(self):
        return self.value.sum()


def count_down(model, optimizer):
    model().backward()
    optimizer.step()
    return rpc.get_worker_info().name


def train(strategy):
    coordinator = mirrored.ClusterCoordinator(strategy)
    module = Counter()
    model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=1.0))
    runs = [coordinator.schedule(count_down, (model, optimizer)) for _ in range(10)]
    coordinator.join()
    model.pull()
    with open(sys.argv[1], "w") as f:
        json.dump({"value": module.value.tolist(), "ran_on": [r.fetch() for r in runs]}, f)


if sys.argv[2] == "close":
    with mirrored.ParameterServerStrategy(timeout_seconds=60) as strategy:  # the chief goes on
        train(strategy)
else:  # as TensorFlow's programs end: without close()
    train(mirrored.ParameterServerStrategy(timeout_seconds=60))
    if sys.argv[2] == "raise":
        raise RuntimeError("the chief's program failed")
"""


def _read(out: Path, name: str) -> dict[tuple[int, int], Any]:
    """``{(rank, attempt): value}`` of the files the workers wrote."""
    found = {}
    for path in out.glob(f"{name}.*.*.json"):
        _, rank, attempt, _ = path.name.split(".")
        found[int(rank), int(attempt)] = json.loads(path.read_text())
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.05)


@contextmanager
def _launcher(
    tmp_path: Path, *flags: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """``python -m mirrored.launch.launcher FLAGS`` in tmp_path.

    Its output goes to tmp_path/launcher.{out,err}.
    """
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "out").mkdir()
    with open(tmp_path / "launcher.out", "wb") as out, open(tmp_path / "launcher.err", "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mirrored.launch.launcher", *flags],
            cwd=tmp_path,
            stdout=out,
            stderr=err,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for pid in _read(tmp_path / "out", "pid").values():  # workers have their own sessions
            if isinstance(pid, int) and _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "launcher.err").read_text()


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = {pid}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _listening(pids: set[int]) -> dict[int, list[tuple[str, int]]]:
    """The (address, port) of each listening TCP socket the processes own, from /proc."""
    sockets: dict[str, tuple[str, int]] = {}
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] != "0A":  # TCP_LISTEN
                    continue
                address, port = fields[1].split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                sockets[fields[9]] = (socket.inet_ntop(family, raw), int(port, 16))
    owned: dict[int, list[tuple[str, int]]] = {}
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # the process has just ended
            continue
        inodes = [link[len("socket:[") : -1] for link in links if link.startswith("socket:[")]
        owned[pid] = [sockets[inode] for inode in inodes if inode in sockets]
    return owned


@pytest.mark.timeout(120)
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads sockets from Linux /proc")
def test_two_workers_all_reduce_with_torchrun_env_on_loopback_only(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _launcher(
        tmp_path, "--nproc-per-node", "2", "worker.py", str(out), "hold", "--x", "1"
    ) as proc:
        _wait_for(lambda: len(_read(out, "result")) == 2 or proc.poll() is not None, "2 workers")
        assert proc.poll() is None, _stderr(tmp_path)
        results = _read(out, "result")
        workers = set(_read(out, "pid").values())
        job = _descendants(proc.pid)
        listening = _listening(job)
        (out / "release").touch()
        assert proc.wait(timeout=60) == 0, _stderr(tmp_path)

    assert workers <= job
    envs = [results[rank, 0]["env"] for rank in (0, 1)]
    port = envs[0]["MASTER_PORT"]
    for rank, env in enumerate(envs):
        assert results[rank, 0]["sum"] == 3.0
        assert results[rank, 0]["argv"] == ["--x", "1"]
        # As python worker.py: __main__'s file (absolute) and its folder first on sys.path.
        assert results[rank, 0]["file"] == str(tmp_path / "worker.py")
        assert results[rank, 0]["path0"] == str(tmp_path)
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == port != "0"
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "0"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"  # workers are the store's clients
        assert env["GLOO_SOCKET_IFNAME"] in ("lo", "lo0")
    # The store listens in the launcher on MASTER_PORT, and nothing anywhere but on 127.0.0.1.
    assert ("127.0.0.1", int(port)) in listening[proc.pid]
    everything = [address for addresses in listening.values() for address in addresses]
    assert everything and {host for host, _ in everything} == {"127.0.0.1"}, listening


@pytest.mark.timeout(120)
@pytest.mark.parametrize("max_restarts", [0, 1])
def test_a_failed_worker_restarts_the_group(tmp_path: Path, max_restarts: int) -> None:
    out = tmp_path / "out"
    flags = ["--nproc-per-node", "2", "--max-restarts", str(max_restarts)]
    with _launcher(tmp_path, *flags, "worker.py", str(out), "exit-first") as proc:
        code = proc.wait(timeout=90)
    pids = _read(out, "pid")
    assert not any(_alive(pid) for pid in pids.values())
    if max_restarts == 0:
        assert code == 1
        err = _stderr(tmp_path)
        assert "worker.py FAILED" in err and "Root Cause" in err
        root_cause = err.split("Root Cause")[1]
        assert re.search(r"rank\s*:\s*1 ", root_cause) and re.search(r"exitcode\s*:\s*1 ", err)
        assert _read(out, "result") == {}
    else:
        assert code == 0, _stderr(tmp_path)
        results = _read(out, "result")
        assert sorted(results) == [(0, 1), (1, 1)]  # both ranks, on the second attempt
        assert all(r["sum"] == 3.0 for r in results.values())
        assert results[0, 1]["env"]["TORCHELASTIC_RESTART_COUNT"] == "1"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["close", "return", "raise"])
def test_num_ps_launches_a_parameter_server_cluster(tmp_path: Path, ending: str) -> None:
    """4 processes with --num-ps 1: a chief, 2 workers, a ps task; 10 updates of -1 each. The
    job ends with the chief's program, whether it closes the strategy or not, with its status."""
    (tmp_path / "ps_job.py").write_text(PS_JOB)
    result = tmp_path / "result.json"
    flags = ["--nproc-per-node", "4", "--num-ps", "1", "ps_job.py", str(result), ending]
    with _launcher(tmp_path, *flags) as proc:
        code = proc.wait(timeout=90)
    if ending == "raise":
        assert code == 1 and "RuntimeError: the chief's program failed" in _stderr(tmp_path)
    else:
        assert code == 0, _stderr(tmp_path)
    written = json.loads(result.read_text())
    assert written["value"] == [-10.0, -10.0, -10.0]
    assert set(written["ran_on"]) <= {"worker0", "worker1"} and len(written["ran_on"]) == 10


@pytest.mark.timeout(120)
def test_a_sigkilled_worker_stops_the_others(tmp_path: Path) -> None:
    out = tmp_path / "out"
    with _launcher(tmp_path, "--nproc-per-node", "2", "worker.py", str(out), "hold") as proc:
        _wait_for(lambda: len(_read(out, "result")) == 2 or proc.poll() is not None, "2 workers")
        pids = _read(out, "pid")
        os.kill(pids[1, 0], signal.SIGKILL)
        code = proc.wait(timeout=60)  # rank 0 waits for "release" forever: the launcher stops it
    assert code == 1
    assert "Signal 9 (SIGKILL)" in _stderr(tmp_path)
    assert not _alive(pids[0, 0]) and not _alive(pids[1, 0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["abort-at-exit", "abort"])
def test_a_worker_aborting_after_its_program_finished_counts_as_finished(
    tmp_path: Path, mode: str
) -> None:
    """Rank 1 aborts (SIGABRT) once its program has returned, as torch's teardown sometimes
    does: the job succeeds, not restarted. Aborting inside the program still fails it."""
    out = tmp_path / "out"
    flags = ["--nproc-per-node", "2", "--max-restarts", "1", "worker.py", str(out), mode]
    with _launcher(tmp_path, *flags) as proc:
        code = proc.wait(timeout=90)
    err = _stderr(tmp_path)
    if mode == "abort-at-exit":
        assert code == 0, err
        assert sorted(_read(out, "result")) == [(0, 0), (1, 0)]  # one attempt
        assert "rank 1 finished its program, then its process ended with signal SIGABRT" in err
    else:
        assert code == 1 and "Signal 6 (SIGABRT)" in err, err
        assert sorted(_read(out, "result")) == [(0, 0), (0, 1), (1, 0), (1, 1)]  # restarted


@pytest.mark.timeout(180)
def test_workers_of_a_killed_launcher_stop_and_the_next_launch_removes_its_folder(
    tmp_path: Path,
) -> None:
    """A launcher killed with SIGKILL: its workers stop; a launch while it ran left its folder
    alone, the next one removes it."""
    out, temp = tmp_path / "out", tmp_path / "tmp"
    temp.mkdir()
    env = {"TMPDIR": str(temp)}

    def launch_another(where: Path) -> None:
        where.mkdir()
        (where / "hello.py").write_text("print('hello')\n")
        with _launcher(where, "hello.py", env=env) as another:
            assert another.wait(timeout=60) == 0, _stderr(where)

    with _launcher(tmp_path, "--nproc-per-node", "2", "worker.py", str(out), "hold", env=env) as a:
        _wait_for(lambda: len(_read(out, "result")) == 2 or a.poll() is not None, "2 workers")
        folders = list(temp.iterdir())
        assert [f.name.startswith("mirrored-launch-") for f in folders] == [True], folders
        launch_another(tmp_path / "while_it_runs")
        assert list(temp.iterdir()) == folders  # the running launcher's folder is kept
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        pids = _read(out, "pid").values()
        _wait_for(lambda: not any(_alive(pid) for pid in pids), "the workers to stop")
    assert "the launcher (process " in _stderr(tmp_path)
    launch_another(tmp_path / "after_it")
    assert list(temp.iterdir()) == []


@pytest.mark.timeout(120)
def test_cli_launches_a_module_in_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "hello_worker.py").write_text(
        "import os\nprint('hello from rank', os.environ['RANK'], os.environ['WORLD_SIZE'])\n"
    )
    monkeypatch.chdir(tmp_path)  # the workers start here, where -m finds the module
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    assert cli.main(["launch", "-m", "hello_worker"]) == 0
    assert "hello from rank 0 1" in capfd.readouterr().out
    # The elastic agent's signal handlers are gone (the hygiene fixture checks the variables).
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "worker.py"], "--nnodes 2 needs --master-port"),
        ([], "the following arguments are required: script"),
        (["--nproc-per-node", "two", "worker.py"], "--nproc-per-node: invalid int value: 'two'"),
        (["--nproc-per-node", "0", "worker.py"], "--nproc-per-node 0: a node runs at least one"),
        (["--master-port", "70000", "worker.py"], "--master-port 70000: not a TCP port"),
        (["--max-restarts", "-1", "worker.py"], "--max-restarts -1: pass 0"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--master-port", "29500", "worker.py"],
            "--node-rank 2 with --nnodes 2: node ranks run from 0 to 1",
        ),
        (
            ["--nnodes", "2", "--master-port", "29500", "--max-restarts", "1", "worker.py"],
            "--max-restarts 1 with --nnodes 2: a node whose workers are healthy",
        ),
        (["missing.py"], "script 'missing.py' not found"),
        (
            ["--nproc-per-node", "2", "--num-ps", "1", "worker.py"],
            "--num-ps 1 with 2 process(es): a parameter-server cluster is a chief (rank 0)",
        ),
        (["--master-addr", "no-such-host.invalid", "worker.py"], "--master-addr no-such-host"),
    ],
)
def test_argument_errors_exit_2_with_the_fix(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    (tmp_path / "worker.py").write_text("")
    monkeypatch.chdir(tmp_path)
    for main in (lambda: cli.main(["launch", *argv]), lambda: launch.main(argv)):
        with pytest.raises(SystemExit) as exit_info:
            main()
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_a_port_in_use_exits_2(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "worker.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = str(taken.getsockname()[1])
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["launch", "--master-port", port, "worker.py"])
    assert exit_info.value.code == 2
    assert f"--master-addr 127.0.0.1 --master-port {port}: cannot listen there" in (
        capsys.readouterr().err
    )


def test_the_worker_side_refuses_to_run_outside_the_launcher() -> None:
    with pytest.raises(SystemExit, match="run your script with mirrored launch"):
        launch_worker.main(["worker.py"])


def test_plan_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="--monitor-interval 0: pass a positive number"):
        launch.LaunchPlan("worker.py", module=True, monitor_interval=0)
    with pytest.raises(ValueError, match="no script given"):
        launch.LaunchPlan("", module=True)
