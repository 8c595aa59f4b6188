"""``mirrored launch --num-ps``: each task of a parameter-server cluster supervised on its own.

The launched processes here only wait for the test (no RPC): what is checked is the launcher's
side, which task is restarted, which end ends the job, and that nothing is left running. The
jobs with a real coordinator are in tests/multiprocess/test_parameter_server.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from mirrored.launch.plan import LaunchPlan
from mirrored.launch.ps_cluster import Verdict, verdict
from tests.launch.test_launcher import _alive, _launcher, _read, _stderr, _wait_for

TASK = """
import os, sys, time

out, rank = sys.argv[1], os.environ["RANK"]
path = os.path.join(out, f"pid.{rank}.{os.environ['TORCHELASTIC_RESTART_COUNT']}.json")
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(path + ".tmp", path)
end = os.path.join(out, "end")  # the chief exits with the status written there, the others 0
while not os.path.exists(end):
    time.sleep(0.05)
if rank == "0":
    sys.exit(int(open(end).read()))


def chief_running():
    try:
        with open(f"/proc/{open(os.path.join(out, 'pid.0.0.json')).read()}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


while chief_running():
    time.sleep(0.05)
time.sleep(1)  # after the chief's end, as tasks told to stop take a while
open(os.path.join(out, f"exit.{rank}"), "w").close()  # it ended by itself
"""

CHIEF, WORKER, PS = 0, 1, 2  # the ranks of 3 processes with --num-ps 1


@pytest.mark.parametrize(
    ("task_type", "status", "restarts_left", "expected"),
    [
        ("chief", 0, 1, Verdict.END),
        ("chief", 1, 1, Verdict.END),
        ("chief", -9, 1, Verdict.END),
        ("worker", 0, 1, Verdict.DONE),
        ("worker", 1, 1, Verdict.DONE),  # it exited by itself: the coordinator failed or is gone
        ("worker", -9, 1, Verdict.RESTART),
        ("worker", -15, 2, Verdict.RESTART),
        ("worker", -9, 0, Verdict.LOST),
        ("ps", 0, 1, Verdict.DONE),
        ("ps", 1, 1, Verdict.DONE),
        ("ps", -9, 1, Verdict.END),
    ],
)
def test_what_a_task_s_end_means_for_the_job(
    task_type: str, status: int, restarts_left: int, expected: Verdict
) -> None:
    assert verdict(task_type, status, restarts_left) is expected


def test_a_parameter_server_cluster_may_restart_workers_across_nodes() -> None:
    """A restart is of one worker task, which no other node needs to know of."""
    flags = {"nnodes": 2, "master_port": 29500, "max_restarts": 1, "nproc_per_node": 2}
    LaunchPlan("train", module=True, num_ps=1, **flags)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--max-restarts 1 with --nnodes 2"):
        LaunchPlan("train", module=True, **flags)  # type: ignore[arg-type]


def _start_tasks(tmp_path: Path, max_restarts: int) -> tuple[list[str], Path]:
    """The flags of a launch of TASK as a chief, a worker and a ps task, and its output folder."""
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "task.py").write_text(TASK)
    flags = ["--nproc-per-node", "3", "--num-ps", "1", "--max-restarts", str(max_restarts)]
    return [*flags, "task.py", str(tmp_path / "out")], tmp_path / "out"


def _all_started(tmp_path: Path, proc: subprocess.Popen[bytes]) -> dict[tuple[int, int], int]:
    """Wait for the 3 tasks' first processes; their pids."""
    out = tmp_path / "out"
    _wait_for(lambda: len(_read(out, "pid")) == 3 or proc.poll() is not None, "3 tasks")
    assert proc.poll() is None, _stderr(tmp_path)
    return _read(out, "pid")


def _end(out: Path, chief_status: int) -> None:
    """Tell TASK's processes to end, the chief with ``chief_status``."""
    (out / "end.tmp").write_text(str(chief_status))
    (out / "end.tmp").rename(out / "end")


@pytest.mark.timeout(120)
def test_a_killed_worker_alone_is_restarted_as_the_same_task(tmp_path: Path) -> None:
    flags, out = _start_tasks(tmp_path, max_restarts=1)
    with _launcher(tmp_path, *flags) as proc:
        os.kill(_all_started(tmp_path, proc)[WORKER, 0], signal.SIGKILL)
        _wait_for(lambda: (WORKER, 1) in _read(out, "pid"), "the worker's restart")
        os.kill(_read(out, "pid")[WORKER, 1], signal.SIGKILL)  # its one restart is used
        _wait_for(lambda: "not restarted" in _stderr(tmp_path), "the second loss")
        _end(out, 0)
        assert proc.wait(timeout=60) == 0, _stderr(tmp_path)
    pids = _read(out, "pid")
    assert sorted(pids) == [(CHIEF, 0), (WORKER, 0), (WORKER, 1), (PS, 0)]  # no other restart
    assert not any(_alive(pid) for pid in pids.values())
    err = _stderr(tmp_path)
    assert (
        "mirrored launch: worker0 (rank 1) ended with signal SIGKILL; restarting it to rejoin "
        "the running job (restart 1 of 1)"
    ) in err
    assert (
        "mirrored launch: worker0 (rank 1) ended with signal SIGKILL and is not restarted "
        "(--max-restarts 1: the restarts of each worker task); the coordinator goes on"
    ) in err


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ending", ["ps killed", "chief failed", "launcher stopped"])
def test_the_job_ends_with_its_chief_a_lost_ps_task_or_its_launcher(
    tmp_path: Path, ending: str
) -> None:
    """A killed ps task ends the job at once (the others are stopped); a chief that fails ends
    it with its status (the others, told to stop, end by themselves); a launcher sent SIGTERM
    passes it on and exits 128 + 15. Nothing is left running."""
    flags, out = _start_tasks(tmp_path, max_restarts=1)
    with _launcher(tmp_path, *flags) as proc:
        started = _all_started(tmp_path, proc)
        if ending == "ps killed":
            os.kill(started[PS, 0], signal.SIGKILL)
        elif ending == "chief failed":
            _end(out, 3)
        else:
            os.kill(proc.pid, signal.SIGTERM)
        code = proc.wait(timeout=60)
    pids = _read(out, "pid")
    assert len(pids) == 3 and not any(_alive(pid) for pid in pids.values())
    err = _stderr(tmp_path)
    expected = {
        "ps killed": (1, "ps0 (rank 2) ended with signal SIGKILL: its parameters were lost"),
        "chief failed": (
            1,
            "chief (rank 0) ended with exit status 3: the coordinator's program runs there, so "
            "the job ends with it\n",
        ),
        "launcher stopped": (128 + signal.SIGTERM, "stopped by SIGTERM"),
    }[ending]
    assert code == expected[0], err
    assert f"mirrored launch: {expected[1]}" in err
    ended_by_themselves = sorted(path.name for path in out.glob("exit.*"))
    assert ended_by_themselves == (["exit.1", "exit.2"] if ending == "chief failed" else [])
