"""ZeRO stages 1 and 2: optimizer-state memory per replica and step time, against stage 0.

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

Run from the repository root (about a minute on 2 cores):
``.venv/bin/python benchmarks/zero.py [--json PATH]``; ``--steps``, ``--rounds``,
``--batch-size``, ``--timeout``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
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
    write_report,
)
from torch import nn

import mirrored

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


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="timed steps (default 50)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--batch-size", type=int, default=256, help="global (default 256)")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait (default 300)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps={args.steps} and --rounds={args.rounds} must be at least 1")
    most = max(REPLICAS.values())
    if args.batch_size < most or args.batch_size % most:
        parser.error(f"--batch-size={args.batch_size}: must be a positive multiple of {most}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = start_benchmark(
        f"MLP 784-512-512-10, Adam lr {LEARNING_RATE}, global batch {args.batch_size}, "
        f"{args.steps} timed steps after {WARMUP_STEPS} warm-up, {args.rounds} interleaved rounds",
        max(LOCAL_SETTINGS.values()),
    )
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
    settings = {**settings_of(args, "json"), "warmup_steps": WARMUP_STEPS}
    write_report(args.json, machine, settings, results=rows)


if __name__ == "__main__":
    main()
