"""MultiWorkerMirroredStrategy against DistributedDataParallel: 2 processes x 1 CPU device each.

Both sides train the same model from the same initial weights with Adam (lr 1e-3) on the same
synthetic global batches (fixed seed), each process on the same half of every batch, with
``cpu_count // 2`` intra-op threads per process (``torch.set_num_threads`` and
``OMP_NUM_THREADS``). Two workloads:

- ``mlp``: ``overhead.py``'s MLP 784-512-512-10 and data, global batch 256;
- ``bert``: ``examples/bert_mlm.py``'s ``BertMaskedLM`` (BERT-tiny: 2 layers, hidden 128, 2 heads,
  intermediate 512, dropout 0.1, vocabulary 8000, output tied to the token embedding), sequences
  of 128 tokens with 20 of them masked, cross-entropy at the masked positions; global batch 32 (the
  example's 128 would take about 1 s a step on one core).

The sides:

- ``mirrored``: the custom loop, ``MultiWorkerMirroredStrategy(devices=["cpu:0"])``, the model
  and optimizer from ``strategy.mirror``, ``experimental_distribute_dataset`` over the global
  batches and ``strategy.run`` of a step with ``compute_average_loss``, backward,
  ``optimizer.step()`` and ``optimizer.zero_grad()``;
- ``mirrored_gloo``: the same with ``CommunicationImplementation.RING``: gloo for every
  collective, as DDP (``mirrored`` uses the default, AUTO, which sums through shared memory
  between the two processes of this machine);
- ``ddp``: ``DistributedDataParallel`` with its defaults on the same gloo process group, fed the
  same half of each global batch by slicing it, the mean loss of that half, the same step.

This script starts two worker processes with torchrun's variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR=127.0.0.1``, ``MASTER_PORT``); under ``torchrun --nproc-per-node 2`` it is a worker
itself. Each worker creates the two strategies (the first sets up the default process group, the
second joins it), and every side runs in those two processes on that group. Each measurement
builds a fresh model and optimizer, runs 3 warm-up steps, then times ``--*-steps`` steps between
two barriers (rank 0's wall time). Rounds are interleaved: each round measures every side, the
order reversing each round, so slow drift of this shared machine falls on all. Each throughput
ratio over ddp is printed two ways, both from this run: best to best (interference only adds
time, so the fastest measurement is the least disturbed) and the median of the per-round
ratios.

Per-step breakdown (ms, each process's mean over the timed steps, averaged over the two processes,
median over rounds), from ``time.perf_counter`` around the phases of every timed step:

- **step**: the whole step, from asking for the batch to the end of ``strategy.run`` (mirrored)
  or of the step function (DDP);
- **compute**: forward + backward with no communication: after the timed steps, the same model
  runs forward and backward on the same halves in both processes at once, with its communication
  off (DDP: under ``ddp.no_sync()``; mirrored: the mirrored model's replica 0 outside
  ``strategy.run``, where the gradient reducer's hooks stand aside); one warm-up step, then
  ``--*-steps // 3`` (at least 3);
- **exposed communication**: backward in a timed step minus backward with no communication. For
  mirrored also: the part blocked in ``PendingCollective.wait`` during backward, and the reducer's
  bookkeeping (time in ``OverlappedGradientReducer._on_grad`` and ``finish_pass``, less that
  wait); the rest is backward itself running slower beside gloo's threads;
- **optimizer**: ``optimizer.step()`` + ``optimizer.zero_grad()``;
- **input**: getting the next batch: DDP, the next global batch and its slice; mirrored,
  ``next()`` of the distributed dataset's iterator (split, the workers' step agreement; its part
  blocked in ``PendingCollective.wait`` is shown too);
- **other**: the step less the four terms: dispatch (``strategy.run``), and forward running
  slower than with no communication (also shown).

The waits and the reducer are timed by wrapping ``PendingCollective.wait``,
``OverlappedGradientReducer._on_grad`` and ``finish_pass`` in the worker processes (nothing in
``src/`` changes); ``--no-breakdown`` leaves them unwrapped and skips the no-communication steps.

Run from the repository root: ``.venv/bin/python benchmarks/multi_worker.py [--json PATH]`` (about
2.5 minutes on 2 cores); ``--workload``, ``--rounds``, ``--mlp-steps``, ``--bert-steps``,
``--mlp-batch-size``, ``--bert-batch-size``, ``--no-breakdown``, ``--timeout``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mirrored.examples.bert_mlm import SPECIAL_TOKENS, BertMaskedLM

# Run as a script, this file's folder is on sys.path: the shared pieces come from overhead.py.
from overhead import (
    LEARNING_RATE,
    SEED,
    WARMUP_STEPS,
    Clock,
    free_port,
    machine_description,
    make_batches,
    make_model,
    settings_of,
    write_report,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mirrored
from mirrored.comm.worker_group import PendingCollective
from mirrored.replication.gradient_reducer import OverlappedGradientReducer

Batch = tuple[torch.Tensor, ...]
WORLD_SIZE = 2
# mirrored: CommunicationImplementation.AUTO (the default: shared memory between the two
# processes of this machine); mirrored_gloo: RING, gloo as DDP uses it.
SIDES = ("ddp", "mirrored", "mirrored_gloo")
MIRRORED_SIDES = SIDES[1:]
MIRRORED_OVER_DDP_GOAL = 1.0
VOCAB_SIZE = 8000
SEQ_LEN = 128
MASKED_PER_SEQUENCE = 20  # BERT masks 15% of the tokens: about 19 of 128


# -- workloads ---------------------------------------------------------------------------------


def make_bert() -> nn.Module:
    """The same initial weights for every measurement."""
    torch.manual_seed(SEED)
    return BertMaskedLM(VOCAB_SIZE, SEQ_LEN)


def make_bert_batches(
    num_batches: int,
    batch_size: int,
    vocab_size: int = VOCAB_SIZE,
    seq_len: int = SEQ_LEN,
    masked: int = MASKED_PER_SEQUENCE,
) -> list[Batch]:
    """Random token ids with ``masked`` distinct positions per sequence masked (never [CLS],
    position 0); the labels are the original tokens there. Deterministic: every worker builds
    the same."""
    generator = torch.Generator().manual_seed(SEED)
    mask_id = SPECIAL_TOKENS.index("[MASK]")
    batches: list[Batch] = []
    for _ in range(num_batches):
        ids = torch.randint(
            len(SPECIAL_TOKENS), vocab_size, (batch_size, seq_len), generator=generator
        )
        positions = torch.stack(
            [
                torch.randperm(seq_len - 1, generator=generator)[:masked] + 1
                for _ in range(batch_size)
            ]
        )
        labels = ids.gather(1, positions)
        ids.scatter_(1, positions, mask_id)
        batches.append((ids, torch.ones_like(ids), positions, labels))
    return batches


def mlp_loss(model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def bert_loss(model: Callable[..., torch.Tensor], batch: Batch) -> torch.Tensor:
    """Per sequence: the mean cross-entropy over its masked positions."""
    ids, attention_mask, positions, labels = batch
    logits = model(ids, attention_mask, positions)
    return F.cross_entropy(logits.transpose(1, 2), labels, reduction="none").mean(dim=1)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_model: Callable[[], nn.Module]
    make_batches: Callable[[int, int], Sequence[Batch]]
    per_example_loss: Callable[[Callable[..., torch.Tensor], Batch], torch.Tensor]


WORKLOADS = {
    "mlp": Workload("mlp", "MLP 784-512-512-10 (overhead.py)", make_model, make_batches, mlp_loss),
    "bert": Workload(
        "bert",
        f"BERT-tiny masked LM (examples/bert_mlm.py), vocabulary {VOCAB_SIZE}, {SEQ_LEN} tokens",
        make_bert,
        make_bert_batches,
        bert_loss,
    ),
}


# -- timing ------------------------------------------------------------------------------------


CLOCK = Clock()


def _wrap(cls: type, name: str, key: Callable[[], str]) -> None:
    """Time ``cls.name`` into ``CLOCK`` under ``key()`` (read when the call starts)."""
    method = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        label, start = key(), time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            CLOCK.add(label, time.perf_counter() - start)

    setattr(cls, name, timed)


def instrument_strategy() -> None:
    """Time the strategy's waits on other workers and its reducer's bookkeeping, in this process
    only. Before ``strategy.mirror``: the reducer binds ``_on_grad`` when it registers hooks."""
    _wrap(PendingCollective, "wait", lambda: f"wait:{CLOCK.phase}")
    _wrap(OverlappedGradientReducer, "_on_grad", lambda: "hooks")
    _wrap(OverlappedGradientReducer, "finish_pass", lambda: "finish_pass")


def local_part(batch: Batch, rank: int, world_size: int) -> Batch:
    """This process's slice of a global batch: the shard the strategy gives it too."""
    size = len(batch[0]) // world_size
    return tuple(t[rank * size : (rank + 1) * size] for t in batch)


def train_step(
    loss_of_batch: Callable[[], torch.Tensor], optimizer: Any, clock: Clock | None = None
) -> torch.Tensor:
    """Both sides' step, its phases timed into ``clock`` (default ``CLOCK``): forward (and
    loss), backward, optimizer."""
    clock = CLOCK if clock is None else clock
    with clock.timing("forward"):
        loss = loss_of_batch()
    with clock.timing("backward"):
        loss.backward()
    with clock.timing("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    return loss


def time_steps(run_step: Callable[[], object], steps: int) -> float:
    """Warm up, then time ``steps`` whole steps between barriers; phases restart at zero."""
    gc.collect()
    for _ in range(WARMUP_STEPS):
        run_step()
    dist.barrier()
    CLOCK.reset()
    start = time.perf_counter()
    for _ in range(steps):
        with CLOCK.timing("step"):
            run_step()
    dist.barrier()
    return time.perf_counter() - start


def time_compute(
    model: nn.Module, workload: Workload, batches: Sequence[Batch], steps: int
) -> None:
    """Forward and backward with no communication on this process's halves (a warm-up step,
    then ``steps``), into ``CLOCK`` as ``compute_forward`` and ``compute_backward``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    dist.barrier()
    for index in range(steps + 1):
        part = local_part(batches[index % len(batches)], rank, world_size)
        start = time.perf_counter()
        loss = workload.per_example_loss(model, part).mean()
        middle = time.perf_counter()
        loss.backward()
        end = time.perf_counter()
        model.zero_grad()
        if index:
            CLOCK.add("compute_forward", middle - start)
            CLOCK.add("compute_backward", end - middle)
    dist.barrier()


def record(seconds: float, steps: int, compute_steps: int) -> dict[str, float]:
    """This process's measurement: wall seconds, and each phase's mean seconds per step."""
    result = {"seconds": seconds}
    for key, total in CLOCK.totals.items():
        result[key] = total / (compute_steps if key.startswith("compute_") else steps)
    return result


def measure_ddp(
    workload: Workload, batches: Sequence[Batch], steps: int, compute_steps: int
) -> dict[str, float]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(workload.make_model())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=LEARNING_RATE)
    iterator = iter(batches)

    def run_step() -> torch.Tensor:
        with CLOCK.timing("input"):
            batch = local_part(next(iterator), rank, world_size)
        return train_step(lambda: workload.per_example_loss(ddp, batch).mean(), optimizer)

    seconds = time_steps(run_step, steps)
    if compute_steps:
        with ddp.no_sync():
            time_compute(ddp, workload, batches[WARMUP_STEPS:], compute_steps)
    return record(seconds, steps, compute_steps)


def measure_mirrored(
    strategy: mirrored.MultiWorkerMirroredStrategy,
    workload: Workload,
    batches: Sequence[Batch],
    steps: int,
    compute_steps: int,
) -> dict[str, float]:
    net = workload.make_model()
    model, optimizer = strategy.mirror(net, torch.optim.Adam(net.parameters(), lr=LEARNING_RATE))

    def step(batch: Batch) -> torch.Tensor:
        return train_step(
            lambda: mirrored.compute_average_loss(workload.per_example_loss(model, batch)),
            optimizer,
        )

    iterator = iter(strategy.experimental_distribute_dataset(batches))

    def run_step() -> torch.Tensor:
        with CLOCK.timing("input"):
            batch = next(iterator)
        return strategy.run(step, args=(batch,))

    seconds = time_steps(run_step, steps)
    if next(iterator, None) is not None:  # the end of the input: the workers' last agreement
        raise AssertionError("the distributed dataset has more batches than were timed")
    if compute_steps:
        time_compute(model.module, workload, batches[WARMUP_STEPS:], compute_steps)
    return record(seconds, steps, compute_steps)


# -- summary -----------------------------------------------------------------------------------


def terms(ranks: Sequence[dict[str, float]]) -> dict[str, float]:
    """One measurement's breakdown in ms per step, the processes' mean."""

    def mean(key: str) -> float:
        return 1e3 * statistics.fmean(r.get(key, 0.0) for r in ranks)

    compute = mean("compute_forward") + mean("compute_backward")
    exposed = mean("backward") - mean("compute_backward")
    bookkeeping = mean("hooks") + mean("finish_pass") - mean("wait:backward")
    four = compute + exposed + mean("optimizer") + mean("input")
    return {
        "step": mean("step"),
        "compute": compute,
        "exposed_communication": exposed,
        "blocked_in_backward": mean("wait:backward"),
        "reducer_bookkeeping": bookkeeping,
        "optimizer": mean("optimizer"),
        "input": mean("input"),
        "blocked_in_input": mean("wait:input"),
        "other": mean("step") - four,
        "forward_overhead": mean("forward") - mean("compute_forward"),
        "forward": mean("forward"),
        "backward": mean("backward"),
    }


# The table: (key, label, shown for DDP too).
ROWS = [
    ("step", "step (whole step, input included)", True),
    ("compute", "  compute: forward + backward, no communication", True),
    ("exposed_communication", "  exposed communication: backward - no-comm backward", True),
    ("blocked_in_backward", "    blocked in PendingCollective.wait", False),
    ("reducer_bookkeeping", "    reducer hooks + finish_pass, less that wait", False),
    ("optimizer", "  optimizer: step + zero_grad", True),
    ("input", "  input: next batch", True),
    ("blocked_in_input", "    blocked in PendingCollective.wait", False),
    ("other", "  other: step - the four terms above", True),
    ("forward_overhead", "    forward - no-comm forward", True),
]
# The terms a step splits into: the largest is where the next optimisation should aim.
TERMS = ("compute", "exposed_communication", "optimizer", "input", "other")


def summarize(
    records: dict[str, list[list[dict[str, float]]]], steps: int, breakdown: bool
) -> dict[str, Any]:
    seconds = {side: [rounds[0]["seconds"] for rounds in records[side]] for side in SIDES}
    summary: dict[str, Any] = {
        "seconds": seconds,
        "steps_per_s_best": {side: steps / min(seconds[side]) for side in SIDES},
    }
    for side in MIRRORED_SIDES:
        summary[f"{side}_over_ddp_best"] = min(seconds["ddp"]) / min(seconds[side])
        summary[f"{side}_over_ddp_paired"] = statistics.median(
            d / m for d, m in zip(seconds["ddp"], seconds[side], strict=True)
        )
    if breakdown:
        per_round = {side: [terms(ranks) for ranks in records[side]] for side in SIDES}
        summary["breakdown_ms"] = {
            side: {
                key: statistics.median(t[key] for t in per_round[side])
                for key in per_round[side][0]
            }
            for side in SIDES
        }
    return summary


def print_summary(summary: dict[str, Any]) -> None:
    steps_per_s = summary["steps_per_s_best"]
    print("steps/s (best of rounds): " + ", ".join(f"{s} {steps_per_s[s]:.2f}" for s in SIDES))
    for side in MIRRORED_SIDES:
        best, paired = summary[f"{side}_over_ddp_best"], summary[f"{side}_over_ddp_paired"]
        met = "yes" if best >= MIRRORED_OVER_DDP_GOAL else "NO"
        print(
            f"throughput {side} / ddp: best to best {best:.3f}x, median of per-round ratios "
            f"{paired:.3f}x (aim >= {MIRRORED_OVER_DDP_GOAL:.1f}x, best to best): {met}"
        )
    if "breakdown_ms" not in summary:
        return
    table = summary["breakdown_ms"]
    print(f"\n{'ms per step (median over rounds)':<56}" + "".join(f" {s:>13}" for s in SIDES))
    for key, label, both in ROWS:
        ddp = f"{table['ddp'][key]:13.2f}" if both else f"{'-':>13}"
        print(f"{label:<56} {ddp}" + "".join(f" {table[s][key]:13.2f}" for s in MIRRORED_SIDES))
    for side in SIDES:
        largest = max(TERMS, key=lambda key: table[side][key])
        print(f"largest term, {side}: {largest} ({table[side][largest]:.2f} ms)")


# -- processes ---------------------------------------------------------------------------------


def threads_per_process() -> int:
    return max(1, (os.cpu_count() or 1) // WORLD_SIZE)


def run_workload(
    strategies: dict[str, mirrored.MultiWorkerMirroredStrategy],
    workload: Workload,
    steps: int,
    batch_size: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    compute_steps = max(3, steps // 3) if args.breakdown else 0
    batches = workload.make_batches(WARMUP_STEPS + steps, batch_size)
    measure: dict[str, Callable[[], dict[str, float]]] = {
        "ddp": functools.partial(measure_ddp, workload, batches, steps, compute_steps),
        **{
            side: functools.partial(
                measure_mirrored, strategies[side], workload, batches, steps, compute_steps
            )
            for side in MIRRORED_SIDES
        },
    }
    if rank == 0:
        print(
            f"\n== {workload.name}: {workload.description}; global batch {batch_size} "
            f"({batch_size // world_size} per process), {steps} timed steps after {WARMUP_STEPS} "
            f"warm-up, {args.rounds} rounds",
            flush=True,
        )
    records: dict[str, list[list[dict[str, float]]]] = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        order = SIDES if round_index % 2 == 0 else SIDES[::-1]
        for side in order:
            mine = measure[side]()
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, mine)
            records[side].append(everyone)
        if rank == 0:
            print(
                f"round {round_index + 1}/{args.rounds} ({order[0]} first): "
                + ", ".join(f"{side} {records[side][-1][0]['seconds']:.3f} s" for side in SIDES),
                flush=True,
            )
    summary = summarize(records, steps, args.breakdown)
    if rank == 0:
        print_summary(summary)
    return {"steps": steps, "batch_size": batch_size, "records": records, **summary}


def worker(args: argparse.Namespace) -> None:
    """One process of the job (RANK and WORLD_SIZE set): every side, every round."""
    torch.set_num_threads(threads_per_process())
    if args.breakdown:
        instrument_strategy()
    # Collectives fail (naming the missing worker) well before the launcher ends the job. The
    # first strategy sets up the process group, the second joins it.
    strategies = {
        side: mirrored.MultiWorkerMirroredStrategy(
            mirrored.CommunicationOptions(
                timeout_seconds=args.timeout / 3,
                implementation=mirrored.CommunicationImplementation[implementation],
            ),
            devices=["cpu:0"],
        )
        for side, implementation in zip(MIRRORED_SIDES, ("AUTO", "RING"), strict=True)
    }
    try:
        world_size = dist.get_world_size()
        for name in ("mlp", "bert"):
            size = getattr(args, f"{name}_batch_size")
            if size % world_size:
                raise ValueError(
                    f"--{name}-batch-size={size}: must be a multiple of the {world_size} processes"
                )
        machine = machine_description()
        if dist.get_rank() == 0:
            print(", ".join(f"{key}: {value}" for key, value in machine.items()))
            print(
                f"{world_size} processes x 1 device, {torch.get_num_threads()} thread(s) each "
                f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}), gloo on 127.0.0.1, "
                f"Adam lr {LEARNING_RATE}; "
                + ", ".join(f"{side}: {strategy!r}" for side, strategy in strategies.items()),
                flush=True,
            )
        names = list(WORKLOADS) if args.workload == "both" else [args.workload]
        results = {
            name: run_workload(
                strategies,
                WORKLOADS[name],
                getattr(args, f"{name}_steps"),
                getattr(args, f"{name}_batch_size"),
                args,
            )
            for name in names
        }
        if dist.get_rank() == 0:
            write_report(args.json, machine, settings_of(args, "json"), results=results)
    finally:
        for strategy in reversed(strategies.values()):  # the group's owner last
            strategy.close()


def launch(argv: Sequence[str], timeout: float) -> int:
    """Start the workers as torchrun would and wait for them; a worker that fails or a job past
    ``timeout`` ends the others."""
    port, threads = free_port(), threads_per_process()
    processes = []
    for rank in range(WORLD_SIZE):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD_SIZE),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS=str(threads),
            PYTHONUNBUFFERED="1",
        )
        command = [sys.executable, os.path.abspath(__file__), *argv]
        processes.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + timeout
    try:
        while True:
            codes = [p.poll() for p in processes]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                print(f"worker(s) failed (rank, exit code): {failed}", file=sys.stderr)
                return 1
            if all(code == 0 for code in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"the job ran past --timeout={timeout} s; stopping it", file=sys.stderr)
                return 1
            time.sleep(0.2)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
        for process in processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=["mlp", "bert", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (default 6)")
    parser.add_argument("--mlp-steps", type=int, default=150, help="timed steps (default 150)")
    parser.add_argument("--bert-steps", type=int, default=20, help="timed steps (default 20)")
    parser.add_argument("--mlp-batch-size", type=int, default=256, help="global (default 256)")
    parser.add_argument("--bert-batch-size", type=int, default=32, help="global (default 32)")
    parser.add_argument(
        "--breakdown",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="per-step breakdown (wraps the strategy's waits; default on)",
    )
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds for the whole job (default 900)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    for name in ("rounds", "mlp_steps", "bert_steps", "mlp_batch_size", "bert_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be at least 1")
    for name in ("mlp_batch_size", "bert_batch_size"):
        if getattr(args, name) % WORLD_SIZE:
            parser.error(
                f"--{name.replace('_', '-')}={getattr(args, name)}: must be a multiple of the "
                f"{WORLD_SIZE} processes (each takes the same share)"
            )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        worker(args)
    else:
        sys.exit(launch(argv, args.timeout))


if __name__ == "__main__":
    main()
