"""What the in-process rows of compare.py (MobileNetV2, issue 35) and traced_cpu.py (the MLP,
issue 33) could reach at best, measured without any strategy: plain PyTorch loops laid out as
the strategy lays out its replicas.

compare.py judges two rows against ``ddp-2proc`` (2 processes, one replica of batch 32 each, one
core each) that lay their replicas out otherwise:

- ``mirrored-2proc-x2`` splits each process's batch over 2 replicas, threads sharing its one core;
- ``mirrored-2``: 2 replicas of batch 32 as threads of one process, one core each.

Two pairs of plain loops (compare.py's MobileNetV2 on 3x64x64, Adam, one intra-op thread in each
loop, each loop its own model and its own batch, ``--steps`` steps after 3 warm-ups; the time of
the slower loop, per step):

- ``split``, on one core (the process pinned to it): one loop at batch 32, then two loops at
  batch 16 as threads of one process. Their ratio is what splitting a batch over two replicas
  costs by itself (twice the ops, each half the size), so 1 / ratio bounds ``mirrored-2proc-x2``
  over ``ddp-2proc``;
- ``threads``, on two cores: two loops at batch 32 as threads of one process (one GIL), then as
  two processes. Their ratio is what sharing one process costs plain loops (the GIL), so what
  ``mirrored-2`` loses beyond it is the strategy's own.

traced_cpu.py judges ``traced-2`` (its MLP 784-512-512-10 with Adam, global batch 256 over 2
logical CPU devices: 2 replicas of batch 128 as threads, one intra-op thread each) against the
plain loop at batch 256 on the same two cores with torch's default threads. ``mlp``, on two
cores: that plain loop, then two loops at batch 128 (one intra-op thread each) as threads of one
process and as two processes, each loop its own model and no gradient exchanged. The plain loop
over the threads bounds ``mirrored-2`` over the plain loop (eager replicas hold the GIL for every
op's Python, as these loops do); over the processes it bounds ``traced-2``, whose replays run
their forward and backward without the GIL.

Every loop allocates under the policy a strategy gives a process with CPU devices
(``mirrored.config.set_host_memory_reuse``). Rounds interleave the sides; medians over rounds.

Run from the repository root: ``.venv/bin/python benchmarks/replica_bounds.py [--json PATH]``;
``--steps``, ``--rounds``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from compare import make_mobilenet
from overhead import (
    LEARNING_RATE,
    machine_description,
    make_batches,
    make_model,
    settings_of,
    write_report,
)
from traced_cpu import GOALS

from mirrored._glibc_malloc import keep_freed_memory

SIDE = 64  # compare.py's MobileNetV2 images
MLP_STEPS_PER_STEP = 10  # an MLP step is about a tenth of a MobileNetV2 step here
TRACED_GOAL = GOALS["traced-2"]


def loop_ms(
    batch: int, steps: int, start: Any = None, workload: str = "mobilenet", threads: int = 1
) -> float:
    """One plain training loop of ``workload`` ("mobilenet": compare.py's MobileNetV2, "mlp":
    traced_cpu.py's MLP) at ``batch`` on ``threads`` intra-op threads: ms per step after 3
    warm-ups (``start``: a barrier every loop of a pair waits at before its timed steps)."""
    torch.set_num_threads(threads)
    keep_freed_memory()
    if workload == "mlp":
        model = make_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        ((x, y),) = make_batches(1, batch)
    else:
        model = make_mobilenet()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(batch)
        x = torch.randn(batch, 3, SIDE, SIDE, generator=generator)
        y = torch.randint(0, 2, (batch,), generator=generator)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(3):
        step()
    if start is not None:
        start.wait()
    begin = time.perf_counter()
    for _ in range(steps):
        step()
    return 1e3 * (time.perf_counter() - begin) / steps


def as_threads(batch: int, steps: int, workload: str = "mobilenet") -> float:
    """Two loops at ``batch`` as threads of this process: the slower one's ms per step."""
    start = threading.Barrier(2)
    times: list[float] = []
    threads = [
        threading.Thread(target=lambda: times.append(loop_ms(batch, steps, start, workload)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return max(times)


def _process_loop(batch: int, steps: int, start: Any, results: Any, workload: str) -> None:
    results.put(loop_ms(batch, steps, start, workload))


def as_processes(batch: int, steps: int, workload: str = "mobilenet") -> float:
    """Two loops at ``batch`` in two fresh processes: the slower one's ms per step."""
    context = multiprocessing.get_context("spawn")
    start, results = context.Barrier(2), context.Queue()
    processes = [
        context.Process(target=_process_loop, args=(batch, steps, start, results, workload))
        for _ in range(2)
    ]
    for process in processes:
        process.start()
    times = [results.get() for _ in processes]
    for process in processes:
        process.join()
    return max(times)


def measure(steps: int, rounds: int) -> dict[str, list[float]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs two cores, this process may use {cores}")
    rows: dict[str, list[float]] = {}
    default_threads = torch.get_num_threads()  # traced_cpu.py's plain loop's
    for index in range(rounds):
        os.sched_setaffinity(0, cores[:1])  # threads and children inherit it
        rows.setdefault("one core: 1 loop at batch 32", []).append(loop_ms(32, steps))
        rows.setdefault("one core: 2 threads at batch 16", []).append(as_threads(16, steps))
        os.sched_setaffinity(0, cores[:2])
        rows.setdefault("two cores: 2 threads at batch 32", []).append(as_threads(32, steps))
        rows.setdefault("two cores: 2 processes at batch 32", []).append(as_processes(32, steps))
        mlp_steps = steps * MLP_STEPS_PER_STEP
        rows.setdefault("mlp: plain loop at batch 256", []).append(
            loop_ms(256, mlp_steps, workload="mlp", threads=default_threads)
        )
        rows.setdefault("mlp: 2 threads at batch 128", []).append(as_threads(128, mlp_steps, "mlp"))
        rows.setdefault("mlp: 2 processes at batch 128", []).append(
            as_processes(128, mlp_steps, "mlp")
        )
        print(f"round {index + 1}/{rounds}: " + ", ".join(f"{v[-1]:.1f}" for v in rows.values()))
    os.sched_setaffinity(0, cores)
    return rows


def report(rows: dict[str, list[float]]) -> dict[str, float]:
    medians = {name: statistics.median(times) for name, times in rows.items()}
    for name, value in medians.items():
        print(f"  {name:36s} {value:8.1f} ms/step (median; rounds {rows[name]})")
    split = medians["one core: 2 threads at batch 16"] / medians["one core: 1 loop at batch 32"]
    shared = (
        medians["two cores: 2 threads at batch 32"] / medians["two cores: 2 processes at batch 32"]
    )
    print(
        f"split: two replicas of batch 16 cost {split:.3f}x one of batch 32 on a core, so "
        f"mirrored-2proc-x2 over ddp-2proc is at most {1 / split:.3f}x"
    )
    print(
        f"threads: two loops in one process cost {shared:.3f}x two processes, so mirrored-2 "
        f"over ddp-2proc is at most {1 / shared:.3f}x from sharing a process"
    )
    layout = medians["mlp: plain loop at batch 256"] / medians["mlp: 2 threads at batch 128"]
    apart = medians["mlp: plain loop at batch 256"] / medians["mlp: 2 processes at batch 128"]
    print(
        f"mlp: two loops of batch 128 reach {layout:.3f}x the plain loop at batch 256 as threads, "
        f"{apart:.3f}x as processes: over plain, mirrored-2 is at most {layout:.3f}x, traced-2 "
        f"(GIL-free replays) at most {apart:.3f}x (traced_cpu.py's goal: {TRACED_GOAL}x)"
    )
    return {
        "split": split,
        "threads_over_processes": shared,
        "mlp_threads_over_plain": layout,
        "mlp_processes_over_plain": apart,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", help="write the run's figures here")
    args = parser.parse_args(argv)
    machine = machine_description()
    print(machine)
    rows = measure(args.steps, args.rounds)
    ratios = report(rows)
    write_report(args.json, machine, settings_of(args, "json"), rows=rows, ratios=ratios)


if __name__ == "__main__":
    main()
