"""ZeRO stages 1 and 2: optimizer-state memory, peak memory and step time, against stage 0.

Two parts (``--only time`` or ``--only memory`` runs one): state and step time on a small MLP in
interleaved rounds, then the peak memory of each process on a large model, every configuration
in processes of its own.

**Time part.**

Every setting trains overhead.py's MLP (784-512-512-10, ReLU) with Adam (lr 1e-3) on the same
synthetic float32 global batches (fixed seed, global batch ``--batch-size``), with the strategy's
``zero_stage`` 0 (off: every replica keeps the whole optimizer state), 1 (each parameter's owner
alone keeps its state and updates it; the updated parameters are all-gathered) and 2 (the gradients
are reduce-scattered at ``optimizer.step()`` too; see ``mirrored.replication.zero_redundancy``):

- ``2 devices``, ``4 devices``: ``MirroredStrategy`` on 2 and 4 logical CPU devices of this
  process (``config.set_logical_device_configuration``; the replicas share the cores,
  ``cores // replicas`` intra-op threads each, at least 1), overhead.py's replica step
  (``compute_average_loss``, backward, ``optimizer.step()``, ``optimizer.zero_grad()``);
- ``2 processes``: ``MultiWorkerMirroredStrategy(devices=["cpu:0"], zero_stage=...)`` in 2
  processes x 1 device on 127.0.0.1, ``cores // 2`` threads each, gloo group, default
  communication (AUTO: the all-reduce of stages 0 and 1 sums through shared memory; stage 2's
  all-to-all and the all-gather of stages 1 and 2 go through gloo). Each process creates the three
  strategies once (the first sets up the process group, the others join it), as multi_worker.py
  does, and waits idle on a pipe (overhead.py's ``Peer``) while the in-process settings run.

Two figures per setting and stage, each against stage 0 of the same setting in the same run:

- **state**: bytes of optimizer-state tensors each replica holds (``optimizer.state_bytes()`` after
  the timed steps; the largest over the replicas of every process) and its ratio to stage 0's. Goal:
  about 1/N for N replicas. Owners hold equal ranges of the parameters end to end (``plan_pieces``),
  so the 784x512 weight, 60% of the MLP, is cut between owners. Also printed: the sum over all
  replicas. On logical CPU devices the saving per replica is real, but all replicas share one
  process's RAM, and at stage 0 replicas of one device already share one copy of the state
  (``sharded_update.py``): the process holds the same state bytes at every stage. On GPUs (or across
  processes) each replica's share is on its own device. Gradients are not counted: with
  ``zero_grad(set_to_none=True)`` no stage keeps any between steps, and during backward every stage
  holds them all (stage 2 drops the others' at the step).
- **step time**: ms per step of the fastest round (interference on a shared host only adds time,
  so the fastest is the least disturbed) and its ratio to stage 0's (above 1: slower), best to
  best; **paired**: the median over rounds of the ratio to the same round's stage 0.

Also a check that the stages train alike: the largest difference between the final parameters
(replica 0, or rank 0) and stage 0's in the same round, and whether every replica ends with the
same parameters.

Each measurement builds a fresh model and optimizer (and, in this process, strategy), runs 3
warm-up steps, then times ``--steps`` steps: in this process ``next()`` of the distributed dataset
and ``strategy.run`` (overhead.py's ``timed_loop``); across processes between two barriers, rank
0's wall time (multi_worker.py's ``time_steps``). Rounds are interleaved: each round measures
every setting and stage once, the order rotated by one per round, so slow drift of the machine is
spread over all of them.

**Memory part.** ``--memory-depth`` (12) layers ``Linear(--memory-width, --memory-width)``
(2048: 201 MB of float32 parameters, about the model of issue 34) with Adam, ``--memory-steps``
(3) steps of overhead.py's replica step on a global batch of ``--memory-batch-size`` (64) random
examples, one class per output, then ``optimizer.state_dict()`` (what a checkpoint gathers: under
ZeRO across workers a collective that assembles the whole state), in these settings:

- ``plain loop``: overhead.py's ``train_step``, no strategy;
- ``1 device``, ``2 devices``, ``4 devices``: ``MirroredStrategy`` on as many logical CPU devices
  of one process, stages 0, 1 and 2;
- ``2 workers x 2 devices``: ``MultiWorkerMirroredStrategy(devices=["cpu:0", "cpu:1"])`` in 2
  processes on 127.0.0.1 (4 replicas), gloo, default communication, stages 0, 1 and 2.

Each configuration runs in fresh processes (spawned, so no peak carries over from another), which
report their peak RSS (``VmHWM`` of /proc/self/status, Linux only) before and after
``state_dict()`` and the optimizer-state bytes they hold (``optimizer.state_bytes()`` summed
over their replicas, a tensor several share counted once). Peak RSS moves by some tens of MB
between runs (the allocator keeps freed pages, and each replica thread allocates from an arena
of its own); tests/allocations.py counts tensor bytes instead, the same on every run.

Run from the repository root (about 4 minutes on 2 cores, 3 of them the memory part):
``.venv/bin/python benchmarks/zero.py [--json PATH]``; ``--steps``, ``--rounds``,
``--batch-size``, ``--timeout``, ``--only``, ``--memory-width``, ``--memory-depth``,
``--memory-steps``, ``--memory-batch-size``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

# Run as a script, this file's folder is on sys.path: the shared pieces come from there.
from multi_worker import time_steps
from overhead import (
    LEARNING_RATE,
    WARMUP_STEPS,
    Batch,
    Peer,
    free_port,
    make_batches,
    make_model,
    mlp_replica_step,
    settings_of,
    start_benchmark,
    timed_loop,
    train_step,
    write_report,
)
from torch import nn

import mirrored
from mirrored import config

STAGES = (0, 1, 2)
PROCESSES = 2
# Setting: replicas in all (in this process: its logical CPU devices).
LOCAL_SETTINGS = {"2 devices": 2, "4 devices": 4}
PROCESS_SETTING = "2 processes"
REPLICAS = {**LOCAL_SETTINGS, PROCESS_SETTING: PROCESSES}
Record = dict[str, Any]


def flat_parameters(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


# -- in this process ---------------------------------------------------------------------------


def measure_local(
    num_devices: int, zero_stage: int, warmup: Sequence[Batch], timed: Sequence[Batch]
) -> Record:
    """One measurement of ``MirroredStrategy`` on ``num_devices`` logical CPU devices."""
    devices = [f"cpu:{i}" for i in range(num_devices)]
    strategy = mirrored.MirroredStrategy(devices, zero_stage=zero_stage)
    try:
        net = make_model()
        adam = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
        model, optimizer = strategy.mirror(net, adam)
        if optimizer.zero_stage != zero_stage:
            raise AssertionError(f"optimizer.zero_stage={optimizer.zero_stage}, not {zero_stage}")
        step = mlp_replica_step(model, optimizer)
        for batch in strategy.experimental_distribute_dataset(warmup):
            strategy.run(step, args=(batch,))
        seconds = timed_loop(
            strategy.experimental_distribute_dataset(timed),
            lambda batch: strategy.run(step, args=(batch,)),
            None,
        )
        replicas = [flat_parameters(replica) for replica in model.replicas]
        return {
            "seconds": seconds,
            "state_bytes": optimizer.state_bytes(),
            "replica_spread": max(float((r - replicas[0]).abs().max()) for r in replicas),
            "params": replicas[0],
        }
    finally:
        strategy.close()


# -- the two processes -------------------------------------------------------------------------


def measure_workers(
    strategy: mirrored.MultiWorkerMirroredStrategy, batches: Sequence[Batch], steps: int
) -> tuple[Record, torch.Tensor]:
    """One measurement in this worker (every worker at once): its record and final parameters."""
    net = make_model()
    adam = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    model, optimizer = strategy.mirror(net, adam)
    if optimizer.zero_stage != strategy.zero_stage:
        raise AssertionError(f"optimizer.zero_stage={optimizer.zero_stage}")
    step = mlp_replica_step(model, optimizer)
    iterator = iter(strategy.experimental_distribute_dataset(batches))
    seconds = time_steps(lambda: strategy.run(step, args=(next(iterator),)), steps)
    if next(iterator, None) is not None:  # the end of the input: the workers' last agreement
        raise AssertionError("the distributed dataset has more batches than were timed")
    params = flat_parameters(model.module)
    everyone = [torch.empty_like(params) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, params)
    spread = max(float((p - everyone[0]).abs().max()) for p in everyone)
    return {"seconds": seconds, "state_bytes": optimizer.state_bytes(), "spread": spread}, params


def _worker(
    rank: int,
    port: int,
    steps: int,
    batch_size: int,
    timeout: float,
    commands: Any,
    results: Any,
) -> None:
    """One of the two processes: a strategy per stage, the batches, then commands (a stage to
    measure); rank 0 answers with every rank's record and its final parameters."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(PROCESSES),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))
    # Collectives fail (naming the missing worker) well before Peer gives up on the job.
    strategies = {
        stage: mirrored.MultiWorkerMirroredStrategy(
            mirrored.CommunicationOptions(timeout_seconds=timeout),
            devices=["cpu:0"],
            zero_stage=stage,
        )
        for stage in STAGES
    }
    try:
        batches = make_batches(WARMUP_STEPS + steps, batch_size)
        dist.barrier()
        if rank == 0:
            results.put(repr(strategies[0]))
        while (command := commands.get()) != "stop":
            record, params = measure_workers(strategies[command], batches, steps)
            everyone: list[Any] = [None] * PROCESSES
            dist.all_gather_object(everyone, record)
            if rank == 0:
                results.put((everyone, params))
    finally:
        for strategy in reversed(strategies.values()):  # the group's owner last
            strategy.close()


def measure_processes(pair: Peer, zero_stage: int) -> Record:
    ranks, params = pair.ask(zero_stage)
    return {
        "seconds": ranks[0]["seconds"],
        "state_bytes": [b for r in ranks for b in r["state_bytes"]],
        "replica_spread": max(r["spread"] for r in ranks),
        "params": params,
    }


# -- peak memory: each configuration in processes of its own -----------------------------------

# Setting: (logical CPU devices per process, processes); 0 devices is the plain loop.
MEMORY_SETTINGS = {
    "plain loop": (0, 1),
    "1 device": (1, 1),
    "2 devices": (2, 1),
    "4 devices": (4, 1),
    "2 workers x 2 devices": (2, 2),
}


@dataclasses.dataclass(frozen=True)
class MemoryRun:
    """One memory measurement: a setting's layout, the stage, the model and the steps."""

    devices: int
    processes: int
    stage: int
    width: int
    depth: int
    steps: int
    batch_size: int
    port: int


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (``VmHWM``). Not ``ru_maxrss``: Linux
    carries the parent's peak over exec, so a process spawned by a large one starts high."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status: the memory part needs Linux")


def train_for_memory(run: MemoryRun) -> list[dict[str, int]]:
    """``run.steps`` steps of Adam on ``run.depth`` Linear(width, width) layers (a class per
    output, random data), then the optimizer's ``state_dict()`` (what a checkpoint gathers);
    returns every process's figures (``memory_figures``), in rank order."""
    torch.manual_seed(0)
    net = nn.Sequential(*(nn.Linear(run.width, run.width) for _ in range(run.depth)))
    adam = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
    generator = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(run.batch_size, run.width, generator=generator),
            torch.randint(0, run.width, (run.batch_size,), generator=generator),
        )
        for _ in range(run.steps)
    ]
    if run.devices == 0:
        for batch in batches:
            train_step(net, adam, batch)
        held = [t for state in adam.state.values() for t in state.values()]
        return [memory_figures(adam, sum(t.numel() * t.element_size() for t in held))]
    devices = [f"cpu:{i}" for i in range(run.devices)]
    if run.processes == 1:
        strategy: Any = mirrored.MirroredStrategy(devices, zero_stage=run.stage)
    else:
        strategy = mirrored.MultiWorkerMirroredStrategy(devices=devices, zero_stage=run.stage)
    try:
        with warnings.catch_warnings():  # stage 1 in one process says it saves nothing there
            warnings.simplefilter("ignore", UserWarning)
            model, optimizer = strategy.mirror(net, adam)
        step = mlp_replica_step(model, optimizer)
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(batch,))
        mine = memory_figures(optimizer, sum(optimizer.state_bytes()))
        if run.processes == 1:
            return [mine]
        everyone: list[dict[str, int]] = strategy.worker_group.all_gather_json(mine, "figures")
        return everyone
    finally:
        strategy.close()


def memory_figures(optimizer: Any, state_bytes: int) -> dict[str, int]:
    """This process's peak RSS after training and after ``optimizer.state_dict()`` (a
    collective under ZeRO across workers, which gathers the whole state), beside the
    optimizer-state bytes it holds (for a mirrored optimizer the sum over its replicas, a tensor
    they share counted once)."""
    training = peak_rss_bytes()
    checkpoint = optimizer.state_dict()
    figures = {"peak_rss_training": training, "peak_rss": peak_rss_bytes()}
    del checkpoint
    return {**figures, "state_bytes": state_bytes}


def _memory_worker(rank: int, run: MemoryRun, commands: Any, results: Any) -> None:
    """One process of a memory measurement: train, and rank 0 answers with every rank's peak
    RSS and optimizer-state bytes; then it exits (its peak belongs to this run only)."""
    del commands  # answered once, with the measurement
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(run.processes),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(run.port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // run.processes))
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * max(1, run.devices)
    )
    everyone = train_for_memory(run)
    if rank == 0:
        results.put(everyone)


def measure_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every memory setting and stage, each in processes of its own; one row each."""
    rows = []
    for setting, (devices, processes) in MEMORY_SETTINGS.items():
        for stage in STAGES if devices else (0,):
            run = MemoryRun(
                devices,
                processes,
                stage,
                args.memory_width,
                args.memory_depth,
                args.memory_steps,
                args.memory_batch_size,
                free_port(),
            )
            with Peer(_memory_worker, (run,), processes, setting) as measured:
                ranks = measured.ready
            rows.append({"setting": setting, "stage": stage if devices else None, "ranks": ranks})
            print(f"{setting} stage {stage}: {ranks}", flush=True)
    return rows


# -- summary -----------------------------------------------------------------------------------


def summarize(
    records: dict[tuple[str, int], list[Record]], steps: int
) -> tuple[list[dict[str, Any]], list[tuple[str, int, int]]]:
    """One row per setting and stage (ratios to the same setting's stage 0); and where a stage's
    final parameters differ from stage 0's in the same round: (setting, stage, round)."""
    rows = []
    differing = []
    for (setting, stage), measured in records.items():
        reference = records[(setting, 0)]
        seconds = [r["seconds"] for r in measured]
        reference_seconds = [r["seconds"] for r in reference]
        state = max(measured[-1]["state_bytes"])
        reference_state = max(reference[-1]["state_bytes"])
        diffs = [
            float((mine["params"] - zero["params"]).abs().max())
            for mine, zero in zip(measured, reference, strict=True)
        ]
        differing += [(setting, stage, i + 1) for i, d in enumerate(diffs) if d > 0]
        rows.append(
            {
                "setting": setting,
                "stage": stage,
                "replicas": REPLICAS[setting],
                "state_bytes_per_replica": state,
                "state_bytes_all_replicas": sum(measured[-1]["state_bytes"]),
                "state_bytes_each_replica": measured[-1]["state_bytes"],
                "state_ratio": state / reference_state,
                "seconds": seconds,
                "step_ms_best": 1e3 * min(seconds) / steps,
                "step_ms_median": 1e3 * statistics.median(seconds) / steps,
                "time_ratio_best": min(seconds) / min(reference_seconds),
                "time_ratio_paired": statistics.median(
                    mine / zero for mine, zero in zip(seconds, reference_seconds, strict=True)
                ),
                "max_param_diff_vs_stage_0": max(diffs),
                "max_replica_spread": max(r["replica_spread"] for r in measured),
            }
        )
    return rows, differing


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"\n{'setting':<12} {'stage':>5} {'state KiB/replica':>17} {'vs s0':>6} {'1/N':>5} "
        f"{'all replicas':>12} {'step ms':>8} {'vs s0':>7} {'paired':>7} {'|dp| vs s0':>10}"
    )
    for row in rows:
        print(
            f"{row['setting']:<12} {row['stage']:>5} "
            f"{row['state_bytes_per_replica'] / 1024:>17.1f} {row['state_ratio']:>6.3f} "
            f"{1 / row['replicas']:>5.2f} {row['state_bytes_all_replicas'] / 1024:>12.1f} "
            f"{row['step_ms_best']:>8.2f} {row['time_ratio_best']:>6.3f}x "
            f"{row['time_ratio_paired']:>6.3f}x {row['max_param_diff_vs_stage_0']:>10.2g}"
        )
    print(
        "state: optimizer-state bytes of the largest replica, vs s0: ratio to stage 0's (goal "
        "about 1/N); all replicas: their sum (KiB); step ms: fastest round, vs s0: step time over "
        "stage 0's (above 1: slower), best to best; paired: median of per-round ratios; "
        "|dp| vs s0: largest difference of the final parameters from stage 0's"
    )


def summarize_memory(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and stage: each process's peak RSS and optimizer-state bytes, and the largest
    process's peak against its setting's stage 0 and against the plain loop."""
    plain = max(r["peak_rss"] for r in rows[0]["ranks"])
    stage_0 = {r["setting"]: max(x["peak_rss"] for x in r["ranks"]) for r in rows if not r["stage"]}
    return [
        {
            **row,
            "peak_rss_per_process": [r["peak_rss"] for r in row["ranks"]],
            "peak_rss_training_per_process": [r["peak_rss_training"] for r in row["ranks"]],
            "state_bytes_per_process": [r["state_bytes"] for r in row["ranks"]],
            "peak_vs_stage_0": max(r["peak_rss"] for r in row["ranks"]) / stage_0[row["setting"]],
            "peak_vs_plain": max(r["peak_rss"] for r in row["ranks"]) / plain,
        }
        for row in rows
    ]


def print_memory_table(rows: Sequence[dict[str, Any]]) -> None:
    mb = 1e6
    print(
        f"\n{'setting':<22} {'stage':>5} {'peak RSS MB per process':>24} {'vs s0':>6} "
        f"{'vs plain':>8} {'in training':>12} {'state MB per process':>21}"
    )
    for row in rows:
        peaks = ", ".join(f"{b / mb:.0f}" for b in row["peak_rss_per_process"])
        training = ", ".join(f"{b / mb:.0f}" for b in row["peak_rss_training_per_process"])
        states = ", ".join(f"{b / mb:.1f}" for b in row["state_bytes_per_process"])
        stage = "-" if row["stage"] is None else row["stage"]
        print(
            f"{row['setting']:<22} {stage:>5} {peaks:>24} {row['peak_vs_stage_0']:>6.3f} "
            f"{row['peak_vs_plain']:>8.3f} {training:>12} {states:>21}"
        )
    print(
        "peak RSS: each process's VmHWM (MB, 10^6 bytes) after training and state_dict(), a "
        "fresh process per row; vs s0 / vs plain: the largest process's over its setting's "
        "stage 0 / the plain loop's; in training: the peak before state_dict(); state: "
        "optimizer-state bytes each process holds"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=256, help="global (default 256)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait (default 300)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--only", choices=["time", "memory"], help="run one part (default both)")
    parser.add_argument(
        "--memory-width", type=int, default=2048, help="memory model's width (default 2048)"
    )
    parser.add_argument(
        "--memory-depth", type=int, default=12, help="memory model's layers (default 12)"
    )
    parser.add_argument("--memory-steps", type=int, default=3, help="memory steps (default 3)")
    parser.add_argument(
        "--memory-batch-size", type=int, default=64, help="memory global batch (default 64)"
    )
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps={args.steps} and --rounds={args.rounds} must be at least 1")
    most = max(REPLICAS.values())
    if args.batch_size < most or args.batch_size % most:
        parser.error(f"--batch-size={args.batch_size}: must be a positive multiple of {most}")
    if min(args.memory_width, args.memory_depth, args.memory_steps) < 1:
        parser.error("--memory-width, --memory-depth and --memory-steps must be at least 1")
    if args.memory_batch_size < 4 or args.memory_batch_size % 4:
        parser.error(f"--memory-batch-size={args.memory_batch_size}: a positive multiple of 4")
    return args


def measure_time(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The state and step-time part: every setting and stage in interleaved rounds."""
    batches = make_batches(WARMUP_STEPS + args.steps, args.batch_size)
    warmup, timed = batches[:WARMUP_STEPS], batches[WARMUP_STEPS:]
    environ = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // PROCESSES))}
    worker_args = (free_port(), args.steps, args.batch_size, args.timeout)
    with Peer(_worker, worker_args, PROCESSES, "2-process", environ) as pair:
        print(f"2 processes: {pair.ready}")
        configs: dict[tuple[str, int], Callable[[], Record]] = {}
        for setting, count in LOCAL_SETTINGS.items():
            for stage in STAGES:
                configs[(setting, stage)] = functools.partial(
                    measure_local, count, stage, warmup, timed
                )
        for stage in STAGES:
            configs[(PROCESS_SETTING, stage)] = functools.partial(measure_processes, pair, stage)
        records: dict[tuple[str, int], list[Record]] = {key: [] for key in configs}
        keys = list(configs)
        for round_index in range(args.rounds):
            shift = round_index % len(keys)
            for key in keys[shift:] + keys[:shift]:
                records[key].append(configs[key]())
            print(
                f"round {round_index + 1}/{args.rounds} (s per {args.steps} steps): "
                + ", ".join(f"{s} s{z} {records[(s, z)][-1]['seconds']:.3f}" for s, z in keys),
                flush=True,
            )
    rows, differing = summarize(records, args.steps)
    print_table(rows)
    if differing:
        print(f"final parameters differ from stage 0's (setting, stage, round): {differing}")
    split = [(r["setting"], r["stage"]) for r in rows if r["max_replica_spread"] > 0]
    if split:
        print(f"replicas ended with different parameters (setting, stage): {split}")
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = start_benchmark(
        f"time: MLP 784-512-512-10, Adam lr {LEARNING_RATE}, global batch {args.batch_size}, "
        f"{args.steps} timed steps after {WARMUP_STEPS} warm-up, {args.rounds} interleaved "
        f"rounds; memory: {args.memory_depth} x Linear({args.memory_width}, "
        f"{args.memory_width}), Adam, global batch {args.memory_batch_size}, "
        f"{args.memory_steps} steps",
        max(LOCAL_SETTINGS.values()),
    )
    results: dict[str, Any] = {}
    if args.only in (None, "time"):
        results["results"] = measure_time(args)
    if args.only in (None, "memory"):
        results["memory"] = summarize_memory(measure_memory(args))
        print_memory_table(results["memory"])
    settings = {**settings_of(args, "json"), "warmup_steps": WARMUP_STEPS}
    write_report(args.json, machine, settings, **results)


if __name__ == "__main__":
    main()
