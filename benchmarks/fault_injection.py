"""Fault injection: a worker killed (SIGKILL) at a random moment of a job under ``mirrored launch``.

    python benchmarks/fault_injection.py --runs 50
    python benchmarks/fault_injection.py --runs 20 --signal term   # preemption instead
    python benchmarks/fault_injection.py --runs 20 --job ps        # a parameter-server worker

With ``--signal term`` the worker is sent SIGTERM, as a scheduler preempting its node would:
its ``BackupAndRestore`` backs up at the next step boundary on both workers (any worker's SIGTERM
counts for all), both exit with code 143, the launcher starts them again, and they resume there.

The job: ``MultiWorkerMirroredStrategy`` on 2 workers over gloo
(``CommunicationImplementation.RING``), ``Model.fit`` of a small MLP with dropout for 4 epochs of
13 batches on fixed random data, ``BackupAndRestore`` after every batch, slowed by 50 ms a batch
so that kills land in training as well as in the start-up and the end; every worker saves its
final weights.

First one uninterrupted run gives the reference: the sha256 of rank 0's weights (every tensor's
bytes, in order) and T, the time from the first worker's start to the launcher's exit. Then each
run starts ``mirrored launch --nproc-per-node 2 --max-restarts 3``, picks a rank at random, and
kills that rank's newest process with SIGKILL a moment drawn uniformly from [0, T) after the
rank's first process started (no kill when the rank has no process running then: between
attempts, or once the job has ended). Each run has its own temporary directory (``TMPDIR``),
output folder and backup folder.

With ``--job ps`` the job is a parameter-server cluster instead, ``mirrored launch
--nproc-per-node 4 --num-ps 1 --max-restarts 3``: a chief, 2 workers and a ps task count down
with 40 scheduled functions of two updates each (the i-th of weight i, 50 ms between the two);
the kill goes to a random worker task, which the launcher restarts alone to rejoin the running
job. Exact then means the chief's final count and number of functions equal the uninterrupted
run's (every update applied once); "rejoined" counts the runs whose chief ended with a restarted
worker taking part.

Printed per run and in total: runs; kills; runs ending with the reference's exact weights
(both ranks); runs the launcher reported failed (exit status not 0); runs that restarted; runs
whose worker was killed after its program had returned (the launcher counts it finished); what
was left behind: anything in the run's temporary directory or backup folder and worker
processes still running once the launcher has exited (torch's compiler cache, kept in the
temporary directory by design, goes elsewhere: TORCHINDUCTOR_CACHE_DIR); at the end, the
entries of /dev/shm that appeared during the runs and are still there (other programs of a
shared machine come and go there meanwhile). Not part of the test run: 50 runs take about half
an hour on a 2-core host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
from torch import nn

import mirrored

_EPOCHS = 4
_BATCH_SLEEP_S = 0.05
_MAX_RESTARTS = 3
_PS_FUNCTIONS = 40


def train(out: Path, backup: Path) -> None:
    """The workers' program: 2 workers of ``fit`` with BackupAndRestore; each saves its weights
    as ``out/rank{R}.pt`` and its pid as ``out/pid.{R}.{attempt}`` when it starts."""
    _write_pid(out)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(203, 12, generator=generator)
    y = torch.randint(0, 5, (203,), generator=generator)
    slow = mirrored.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: time.sleep(_BATCH_SLEEP_S)
    )
    options = mirrored.CommunicationOptions(
        timeout_seconds=60, implementation=mirrored.CommunicationImplementation.RING
    )
    with mirrored.MultiWorkerMirroredStrategy(communication_options=options) as strategy:
        with strategy.scope():
            module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
            model = mirrored.Model(module)
            model.compile(
                optimizer=mirrored.optimizers.Adam(1e-2),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=_EPOCHS,
            verbose=0,
            callbacks=[slow, mirrored.callbacks.BackupAndRestore(str(backup), save_freq=1)],
        )
        torch.save(model.state_dict(), out / f"rank{strategy.worker_group.rank}.pt")


def _write_pid(out: Path) -> None:
    """``out/pid.{RANK}.{attempt}``, as a worker (or task) starts."""
    rank, attempt = os.environ["RANK"], os.environ["TORCHELASTIC_RESTART_COUNT"]
    (out / f"pid.{rank}.{attempt}").write_text(str(os.getpid()))


class Counter(nn.Module):
    """One parameter of 4 zeros; a function's update of weight w takes w from every row."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(4))

    def forward(self) -> torch.Tensor:
        return self.value.sum()


def count_twice(model: nn.Module, optimizer: Any, weight: float) -> str:
    """A scheduled function: two updates of ``weight``, 50 ms apart (a kill can land between)."""
    for _ in range(2):
        (model() * weight).backward()
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(_BATCH_SLEEP_S)
    return str(rpc.get_worker_info().name)


def train_ps(out: Path) -> None:
    """The tasks' program with ``--job ps``: the chief schedules the functions and writes what
    the ps task holds at the end, which worker ran each function and the workers taking part
    to ``out/chief.json``; the other tasks serve it."""
    _write_pid(out)
    with mirrored.ParameterServerStrategy(timeout_seconds=30) as strategy:
        coordinator = mirrored.ClusterCoordinator(strategy)
        module = Counter()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=1.0))
        runs = [
            coordinator.schedule(count_twice, (model, optimizer, float(i)))
            for i in range(1, _PS_FUNCTIONS + 1)
        ]
        coordinator.join()
        model.pull()
        record = {
            "value": module.value.tolist(),
            "ran_on": [run.fetch() for run in runs],
            "live": strategy.live_workers(),
        }
        (out / "chief.json").write_text(json.dumps(record))


def weights_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    for name, tensor in torch.load(path, weights_only=True).items():
        digest.update(name.encode())
        digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class Run:
    """What one launch did and left."""

    status: int
    seconds: float  # from the first worker's start to the launcher's exit
    killed: str | None  # "rank R (attempt A) S s after its start"
    digests: dict[int, str | None]  # by rank; with --job ps, {0: the chief's final count}
    attempts: int
    counted_finished: bool  # the launcher counted a worker killed after its program as finished
    rejoined: bool  # --job ps: a restarted worker took part at the end
    leftovers: list[str] = field(default_factory=list)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(out: Path) -> dict[tuple[int, int], int]:
    """(rank, attempt) -> pid of every worker started so far."""
    found = {}
    for path in out.glob("pid.*.*"):
        _, rank, attempt = path.name.split(".")
        text = path.read_text()
        if text:
            found[int(rank), int(attempt)] = int(text)
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _first_start(out: Path, launcher: subprocess.Popen[bytes], rank: int | None) -> float | None:
    """When the first worker (of ``rank``, or of any) started: its pid file's time, on the
    monotonic clock; None when the launcher ended before."""
    pattern = f"pid.{'*' if rank is None else rank}.0"
    while launcher.poll() is None:
        found = [path.stat().st_mtime for path in out.glob(pattern)]
        if found:
            return time.monotonic() - (time.time() - min(found))
        time.sleep(0.01)
    return None


def _command(job: str, out: Path, backup: Path) -> list[str]:
    """The launch of ``job`` ("mirrored" or "ps")."""
    command = [
        sys.executable,
        "-m",
        "mirrored.launch.launcher",
        "--max-restarts",
        str(_MAX_RESTARTS),
    ]
    if job == "ps":
        return [*command, "--nproc-per-node", "4", "--num-ps", "1", __file__, "train_ps", str(out)]
    return [*command, "--nproc-per-node", "2", __file__, "train", str(out), str(backup)]


def _outcome(job: str, out: Path) -> tuple[dict[int, str | None], bool]:
    """What the job left to compare with the uninterrupted run's, and (``--job ps``) whether a
    restarted worker took part at the end."""
    if job == "mirrored":
        return {
            r: weights_sha256(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else None
            for r in range(2)
        }, False
    if not (out / "chief.json").exists():
        return {0: None}, False
    record = json.loads((out / "chief.json").read_text())
    count = f"value {record['value']} after {len(record['ran_on'])} functions"
    return {0: count}, any("_" in worker for worker in record["live"])


def launch_once(
    root: Path,
    kill_at: float | None,
    rank: int,
    sent: signal.Signals = signal.SIGKILL,
    job: str = "mirrored",
) -> Run:
    """One launch of ``job`` in ``root``; with ``kill_at``, send ``sent`` to worker ``rank``'s
    newest process that many seconds after the rank's first process started."""
    out, backup, temp = root / "out", root / "backup", root / "tmp"
    for folder in (out, temp):
        folder.mkdir(parents=True)
    command = _command(job, out, backup)
    # torch keeps its compiler's cache in the temporary directory by design: elsewhere here.
    cache = root.parent / "torchinductor-cache"
    env = {**os.environ, "TMPDIR": str(temp), "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env["OMP_NUM_THREADS"] = "1"
    with open(root / "launcher.log", "wb") as log:
        launcher = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        killed = None
        try:
            started = _first_start(out, launcher, None if kill_at is None else rank)
            if kill_at is not None and started is not None:
                try:
                    launcher.wait(timeout=max(0.0, started + kill_at - time.monotonic()))
                except subprocess.TimeoutExpired:
                    running = [
                        (attempt, pid)
                        for (r, attempt), pid in _pids(out).items()
                        if r == rank and _alive(pid)
                    ]
                    if running:
                        attempt, pid = max(running)
                        os.kill(pid, sent)
                        killed = (
                            f"rank {rank} (attempt {attempt}, {sent.name}) {kill_at:.2f} s after "
                            "its start"
                        )
            status = launcher.wait(timeout=600)
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    seconds = time.monotonic() - (started or time.monotonic())
    pids = _pids(out)
    leftovers = [f"process {pid} (rank {r}, attempt {a})" for (r, a), pid in pids.items()]
    leftovers = [text for text, pid in zip(leftovers, pids.values(), strict=True) if _alive(pid)]
    leftovers += [str(path.relative_to(root)) for path in sorted(temp.rglob("*"))]
    if backup.exists():
        leftovers += [str(path.relative_to(root)) for path in sorted(backup.rglob("*"))]
    digests, rejoined = _outcome(job, out)
    attempts = 1 + max((attempt for _, attempt in pids), default=0)
    counted = b"it counts as finished" in (root / "launcher.log").read_bytes()
    return Run(status, seconds, killed, digests, attempts, counted, rejoined, leftovers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=50, help="runs with a kill (50)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kills' moments (0)")
    parser.add_argument(
        "--signal",
        choices=["kill", "term"],
        default="kill",
        help="SIGKILL (a crash, the default) or SIGTERM (a preemption)",
    )
    parser.add_argument(
        "--job",
        choices=["mirrored", "ps"],
        default="mirrored",
        help="MultiWorkerMirroredStrategy's fit (the default) or a parameter-server cluster",
    )
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs {args.runs}: pass a positive number of runs")
    chooser = random.Random(args.seed)
    shm_before = _shm()
    workspace = Path(tempfile.mkdtemp(prefix="fault-injection-"))
    reference = launch_once(workspace / "reference", None, 0, job=args.job)
    expected = reference.digests[0]
    if reference.status != 0 or expected is None or reference.leftovers:
        raise SystemExit(
            f"the uninterrupted run failed (status {reference.status}, left "
            f"{reference.leftovers}); see {workspace / 'reference' / 'launcher.log'}"
        )
    shutil.rmtree(workspace / "reference")
    print(f"reference: {reference.seconds:.1f} s, sha256 {expected[:16]}...", flush=True)
    totals = dict.fromkeys(
        ["kills", "exact", "failed", "restarted", "finished", "rejoined", "leftovers"], 0
    )
    for index in range(args.runs):
        kill_at, rank = chooser.uniform(0, reference.seconds), chooser.randrange(2)
        rank += args.job == "ps"  # a worker task: ranks 1 and 2 (0 is the chief, 3 the ps)
        sent = signal.SIGTERM if args.signal == "term" else signal.SIGKILL
        run = launch_once(workspace / f"run{index}", kill_at, rank, sent, args.job)
        exact = all(digest == expected for digest in run.digests.values())
        totals["kills"] += run.killed is not None
        totals["exact"] += exact
        totals["failed"] += run.status != 0
        totals["restarted"] += run.attempts > 1
        totals["finished"] += run.counted_finished
        totals["rejoined"] += run.rejoined
        totals["leftovers"] += len(run.leftovers)
        print(
            f"run {index}: killed {run.killed or 'nothing (no process of that rank then)'}; "
            f"status {run.status}, {run.attempts} attempt(s)"
            f"{' (killed after its program: counted finished)' if run.counted_finished else ''}"
            f"{' (rejoined)' if run.rejoined else ''}, "
            f"{run.seconds:.1f} s, "
            f"{'exact' if exact else 'NOT EXACT'}, left {run.leftovers or 'nothing'}",
            flush=True,
        )
        if exact and not run.status and not run.leftovers:
            shutil.rmtree(workspace / f"run{index}")
    print(
        f"runs: {args.runs}, kills: {totals['kills']}, exact weights: {totals['exact']}, "
        f"reported failed: {totals['failed']}, restarted: {totals['restarted']}, killed after "
        f"their program and counted finished: {totals['finished']}, rejoined: "
        f"{totals['rejoined']}, files or processes left behind: {totals['leftovers']}"
    )
    print(f"/dev/shm entries left: {sorted(_shm() - shm_before) or 'none'}")
    shutil.rmtree(workspace / "torchinductor-cache", ignore_errors=True)
    if any(workspace.iterdir()):
        print(f"the folders of the runs that went wrong are kept in {workspace}")
    else:
        workspace.rmdir()


if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        train(Path(sys.argv[2]), Path(sys.argv[3]))
    elif sys.argv[1:2] == ["train_ps"]:
        train_ps(Path(sys.argv[2]))
    else:
        main()
