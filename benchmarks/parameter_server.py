"""Asynchronous parameter servers against synchronous training, with and without a straggler.

Issue 5: "the async mode must keep its throughput where the synchronous one drops to the
straggler's pace". Two workers train ``overhead.py``'s MLP (784-512-512-10, the same initial
weights) with SGD (lr 0.01) and cross-entropy on synthetic batches of ``--batch-size`` examples
per worker and step; worker ``i`` cycles through the same ``NUM_BATCHES`` batches on every side.
Every process has one torch thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``). The
sides:

- ``ps_async``: ``ParameterServerStrategy()`` (fully asynchronous), a TF_CONFIG cluster of a
  chief, 2 workers and 1 ps task on 127.0.0.1. The chief schedules ``2 * --steps`` functions
  (``ps_step``: the worker's next batch from its per-worker dataset, forward, backward,
  ``optimizer.step()``, which pushes the gradients to the ps task) and times them from the first
  ``schedule`` to ``join``. A free worker takes the next function, so a slow one runs fewer;
- ``ps_sync``: the same with ``synchronous=True``: rounds of one function per worker, averaged on
  the ps task; a round starts once the coordinator has committed the one before;
- ``mwms``: ``MultiWorkerMirroredStrategy(devices=["cpu:0"])`` in 2 processes (torchrun's
  variables), ``--steps`` steps of ``strategy.run`` on global batches of ``2 * --batch-size``
  (each worker's batch, as above), an all-reduce every step (the default, AUTO: shared memory
  between the two processes), timed by rank 0 between two barriers.

The straggler: in every step, worker 1 (the second worker task; rank 1 of ``mwms``) sleeps
``--straggler-ms`` between its backward and its optimizer step, a fixed delay standing for a
slower machine. Every side runs without it and with it. Throughput is training examples per
second over the timed steps, after ``WARMUP_STEPS`` warm-up steps per worker; for ``ps_*`` the
time includes the function still running on the straggler when the fast worker is done
(``join`` waits for it).

Every configuration runs in a fresh set of processes (4 for ``ps_*``, 2 for ``mwms``; start-up
is not timed). Rounds interleave the six configurations, the order reversed every round. Ratios
come from this run only, two ways: **best** (fastest to fastest: interference on a shared host
only adds time) and **paired** (the median over rounds of the same round's ratio):

- **kept**: throughput with the straggler over without it, per side. A synchronous step waits
  for the slowest worker, so ``mwms`` and ``ps_sync`` fall to the straggler's pace; asynchronous
  workers do not wait for each other, so with workers that do not share resources ``ps_async``
  keeps about (1 + 1/s) / 2 for a straggler s times slower;
- **ps_async / mwms**, without and with the straggler.

How many functions each worker ran (``ps_async``) shows the fast worker taking up the straggler's
share. Where processes outnumber cores the workers do share resources: on the 2-core VM of
RESULTS.md the chief and the ps task share the cores with the workers (4 processes, against 2 for
``mwms``), so a sleeping straggler frees CPU for the others; every process of ``ps_*`` has
tensorpipe's shared-memory reactor thread, which polls in a ``sched_yield`` loop (3-30% of a
core per idle process there, read from ``/proc``); and every function moves the parameters twice
through RPC (a pull and a push of 2.7 MB). Without a straggler the parameter-server sides are
expected to be slower than ``mwms`` there.

Each process's output goes to a log, printed when its configuration fails. Run from the
repository root: ``.venv/bin/python benchmarks/parameter_server.py [--json PATH]`` (about 3
minutes on 2 cores); ``--steps``, ``--rounds``, ``--batch-size``, ``--straggler-ms``,
``--timeout``; ``--quick`` (10 steps, 1 round) checks that it runs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

# Run as a script, this file's folder is on sys.path: the model and data come from overhead.py.
from overhead import (
    free_port,
    machine_description,
    make_batches,
    make_model,
    settings_of,
    write_report,
)
from torch import nn

import mirrored

SIDES = ("ps_async", "ps_sync", "mwms")
CONDITIONS = ("no_straggler", "straggler")
NUM_WORKERS = 2
NUM_BATCHES = 8  # distinct batches per worker, cycled
WARMUP_STEPS = 3
LEARNING_RATE = 0.01
DEFAULTS = {"steps": 40, "rounds": 3}
QUICK = {"steps": 10, "rounds": 1}

WorkerBatch = tuple[torch.Tensor, torch.Tensor, int]  # inputs, labels, the worker's index


def worker_batches(batch_size: int, worker: int) -> list[WorkerBatch]:
    """Worker ``worker``'s batches, the same on every side, tagged with its index so that a
    scheduled function knows whether it runs on the straggler."""
    batches = make_batches(NUM_BATCHES * NUM_WORKERS, batch_size)[worker::NUM_WORKERS]
    return [(x, y, worker) for x, y in batches]


def train_step(
    loss_of: Callable[[], torch.Tensor], optimizer: Any, straggler_seconds: float
) -> torch.Tensor:
    """Every side's step; the straggler computes as fast, then takes longer."""
    loss = loss_of()
    loss.backward()
    if straggler_seconds:
        time.sleep(straggler_seconds)
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


# -- ps_async and ps_sync: every task runs this script -------------------------------------------


def ps_dataset(batch_size: int, context: mirrored.InputContext) -> list[WorkerBatch]:
    return worker_batches(batch_size, context.input_pipeline_id)


def ps_step(
    model: nn.Module, optimizer: Any, iterator: Any, straggler_seconds: float
) -> tuple[torch.Tensor, int]:
    """One scheduled function: a step on the worker's next batch; its loss and which worker
    ran it."""
    x, y, worker = next(iterator)
    delay = straggler_seconds if worker == 1 else 0.0
    return train_step(lambda: F.cross_entropy(model(x), y), optimizer, delay), worker


def run_ps(args: argparse.Namespace) -> dict[str, Any]:
    """The chief's part; the worker and ps tasks serve inside the constructor, then exit."""
    timeout = args.timeout / 2  # a lost task fails the job before the driver's deadline
    synchronous = args.task == "ps_sync"
    strategy = mirrored.ParameterServerStrategy(synchronous=synchronous, timeout_seconds=timeout)
    with strategy:
        coordinator = mirrored.ClusterCoordinator(strategy)
        net = make_model()
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=LEARNING_RATE))
        dataset = functools.partial(ps_dataset, args.batch_size)
        iterator = iter(coordinator.create_per_worker_dataset(dataset))
        step_args = (model, optimizer, iterator, args.straggler_ms / 1e3)

        def run(count: int) -> list[tuple[torch.Tensor, int]]:
            values = [coordinator.schedule(ps_step, step_args) for _ in range(count)]
            coordinator.join()
            return [value.fetch() for value in values]

        run(NUM_WORKERS * WARMUP_STEPS)
        start = time.perf_counter()
        results = run(NUM_WORKERS * args.steps)
        seconds = time.perf_counter() - start
    workers = [worker for _, worker in results]
    return {
        "seconds": seconds,
        "examples_per_s": len(results) * args.batch_size / seconds,
        "functions_per_worker": [workers.count(w) for w in range(NUM_WORKERS)],
    }


# -- mwms ----------------------------------------------------------------------------------------


def global_batches(batch_size: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each step's global batch: the workers' batches one after the other, so that rank ``i``
    gets worker ``i``'s batch, as on the parameter-server sides."""
    parts = [worker_batches(batch_size, w) for w in range(NUM_WORKERS)]
    batches = []
    for i in range(steps):
        pieces = [part[i % NUM_BATCHES] for part in parts]
        batches.append((torch.cat([x for x, _, _ in pieces]), torch.cat([y for _, y, _ in pieces])))
    return batches


def run_mwms(args: argparse.Namespace) -> dict[str, Any] | None:
    """One of the two workers; rank 0 returns the measurement."""
    options = mirrored.CommunicationOptions(timeout_seconds=args.timeout / 2)
    strategy = mirrored.MultiWorkerMirroredStrategy(options, devices=["cpu:0"])
    try:
        rank = dist.get_rank()
        net = make_model()
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), lr=LEARNING_RATE))
        batches = global_batches(args.batch_size, WARMUP_STEPS + args.steps)
        iterator = iter(strategy.experimental_distribute_dataset(batches))
        delay = args.straggler_ms / 1e3 if rank == 1 else 0.0

        def step(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            x, y = batch

            def loss() -> torch.Tensor:
                return mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))

            return train_step(loss, optimizer, delay)

        for _ in range(WARMUP_STEPS):
            strategy.run(step, args=(next(iterator),))
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.steps):
            strategy.run(step, args=(next(iterator),))
        dist.barrier()
        seconds = time.perf_counter() - start
    finally:
        strategy.close()
    if rank:
        return None
    examples = args.steps * NUM_WORKERS * args.batch_size
    return {"seconds": seconds, "examples_per_s": examples / seconds}


def run_task(args: argparse.Namespace) -> None:
    """One process of a configuration; the chief (rank 0) writes the measurement to ``--out``."""
    torch.set_num_threads(1)
    result = run_mwms(args) if args.task == "mwms" else run_ps(args)
    if result is not None:
        Path(args.out).write_text(json.dumps(result))


# -- the driver ----------------------------------------------------------------------------------


def task_environments(side: str) -> list[dict[str, str]]:
    """Each process's own variables: torchrun's ranks for ``mwms``, else one TF_CONFIG task each
    (a chief, the workers, a ps task)."""
    if side == "mwms":
        group = {"WORLD_SIZE": str(NUM_WORKERS), "MASTER_ADDR": "127.0.0.1"}
        group["MASTER_PORT"] = str(free_port())
        return [{"RANK": str(r), "LOCAL_RANK": str(r), **group} for r in range(NUM_WORKERS)]
    tasks = [("chief", 0), *(("worker", w) for w in range(NUM_WORKERS)), ("ps", 0)]
    cluster: dict[str, list[str]] = {}
    for job, _ in tasks:
        cluster.setdefault(job, []).append(f"127.0.0.1:{free_port()}")
    return [
        {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}
        for job, index in tasks
    ]


def wait_all(processes: Sequence[subprocess.Popen[bytes]], timeout: float) -> str | None:
    """Wait for every process under one deadline: why they did not all end well, or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [process.poll() for process in processes]
        failed = [f"process {i} exited {code}" for i, code in enumerate(codes) if code]
        if failed:
            return ", ".join(failed)
        if None not in codes:
            return None
        time.sleep(0.1)
    return f"still running after --timeout={timeout:g} s"


def measure(side: str, straggler_ms: float, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration in fresh processes: the chief's measurement. Whatever happens, the
    processes (their whole process groups) are gone when it returns."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TF_CONFIG")
    base = {key: value for key, value in os.environ.items() if key not in launcher}
    base.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with tempfile.TemporaryDirectory(prefix="parameter_server_bench_") as folder:
        out, logs = Path(folder) / "result.json", []
        settings = {"steps": args.steps, "batch-size": args.batch_size, "timeout": args.timeout}
        command = [sys.executable, os.path.abspath(__file__), f"--task={side}", f"--out={out}"]
        command += [f"--{k}={v}" for k, v in {**settings, "straggler-ms": straggler_ms}.items()]
        processes: list[subprocess.Popen[bytes]] = []
        try:
            for index, env in enumerate(task_environments(side)):
                logs.append(Path(folder) / f"process{index}.log")
                with logs[-1].open("wb") as log:
                    processes.append(
                        subprocess.Popen(
                            command,
                            env={**base, **env},
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            failure = wait_all(processes, args.timeout)
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        if failure is not None:
            tails = "".join(
                f"\n--- process {i}:\n{p.read_text()[-3000:]}" for i, p in enumerate(logs)
            )
            raise RuntimeError(f"{side}, straggler {straggler_ms:g} ms: {failure}{tails}")
        return dict(json.loads(out.read_text()))


# -- summary -------------------------------------------------------------------------------------


def ratios(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float]:
    """Best to best, and the median of the per-round ratios."""
    per_round = [n / d for n, d in zip(numerators, denominators, strict=True)]
    return {"best": max(numerators) / max(denominators), "paired": statistics.median(per_round)}


def summarize(records: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    rates = {
        side: {c: [r["examples_per_s"] for r in records[side][c]] for c in CONDITIONS}
        for side in SIDES
    }
    return {
        "examples_per_s": {
            side: {
                c: {"best": max(rates[side][c]), "median": statistics.median(rates[side][c])}
                for c in CONDITIONS
            }
            for side in SIDES
        },
        "kept": {
            side: ratios(rates[side]["straggler"], rates[side]["no_straggler"]) for side in SIDES
        },
        "ps_async_over_mwms": {
            c: ratios(rates["ps_async"][c], rates["mwms"][c]) for c in CONDITIONS
        },
        "ps_async_functions_per_worker": {
            c: [r["functions_per_worker"] for r in records["ps_async"][c]] for c in CONDITIONS
        },
    }


def print_summary(summary: dict[str, Any], straggler_ms: float) -> None:
    rates, kept = summary["examples_per_s"], summary["kept"]
    header = ("examples/s: best (median)", "no straggler", f"straggler {straggler_ms:g} ms")
    print(f"\n{header[0]:<26} {header[1]:>16} {header[2]:>18}  kept: best / paired")
    for side in SIDES:
        best, median = ([rates[side][c][key] for c in CONDITIONS] for key in ("best", "median"))
        cells = [f"{b:.0f} ({m:.0f})" for b, m in zip(best, median, strict=True)]
        kept_cell = f"{kept[side]['best']:.2f} / {kept[side]['paired']:.2f}"
        print(f"{side:<26} {cells[0]:>16} {cells[1]:>18}  {kept_cell}")
    for c in CONDITIONS:
        ratio, counts = (
            summary["ps_async_over_mwms"][c],
            summary["ps_async_functions_per_worker"][c],
        )
        print(
            f"{c.replace('_', ' ')}: ps_async / mwms {ratio['best']:.2f}x best, "
            f"{ratio['paired']:.2f}x paired; ps_async functions run by worker 0 / worker 1 in "
            "each round: " + ", ".join(f"{a}/{b}" for a, b in counts)
        )


# -- main ----------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, help=f"timed steps per worker (default {DEFAULTS['steps']})"
    )
    parser.add_argument(
        "--rounds", type=int, help=f"interleaved rounds (default {DEFAULTS['rounds']})"
    )
    parser.add_argument(
        "--batch-size", type=int, default=64, help="examples per worker and step (default 64)"
    )
    parser.add_argument(
        "--straggler-ms",
        type=float,
        default=60.0,
        help="worker 1's extra time per step (default 60)",
    )
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds per configuration (default 300)"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK['steps']} steps, {QUICK['rounds']} round: check that it runs",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--task", choices=SIDES, help=argparse.SUPPRESS)  # a process of a side
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key, default in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, default)
    for name in ("steps", "rounds", "batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    if args.straggler_ms < 0:
        parser.error(f"--straggler-ms={args.straggler_ms:g}: must be at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.task:
        run_task(args)
        return
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    print(
        f"{NUM_WORKERS} workers, batch {args.batch_size} per worker, {args.steps} timed steps per "
        f"worker after {WARMUP_STEPS} warm-up, {args.rounds} round(s), straggler "
        f"{args.straggler_ms:g} ms",
        flush=True,
    )
    configurations = [(side, c) for side in SIDES for c in CONDITIONS]
    records: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {c: [] for c in CONDITIONS} for s in SIDES
    }
    start = time.monotonic()
    for round_index in range(args.rounds):
        order = configurations if round_index % 2 == 0 else configurations[::-1]
        for side, condition in order:
            delay = args.straggler_ms if condition == "straggler" else 0.0
            record = measure(side, delay, args)
            records[side][condition].append(record)
            rate = record["examples_per_s"]
            print(
                f"round {round_index + 1}: {side:<8} {condition:<12} {rate:6.0f} examples/s",
                flush=True,
            )
    summary = summarize(records)
    print_summary(summary, args.straggler_ms)
    print(f"wall time {time.monotonic() - start:.0f} s")
    settings = settings_of(args, "task", "out", "json")
    write_report(args.json, machine, settings, records=records, **summary)


if __name__ == "__main__":
    main()
