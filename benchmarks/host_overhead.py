"""Host time per replica step, and the part of it that holds the GIL: MirroredStrategy's replicas
are threads of one process, so on GPUs their Python work runs one replica at a time.

Launch-bound variants of compare.py's workloads: the same layers and op sequences with tiny
tensors, so that the kernels cost next to nothing and what is left of a step is host work
(Python dispatch of every op, the strategy's torch-function mode, autograd's bookkeeping, the
optimizer's loop), the work each replica's thread does per step on a GPU too:

- ``mlp``: Linear 8-8-8-10 with ReLUs, 8 features, cross-entropy;
- ``bert``: examples/bert_mlm.py's ``BertMaskedLM`` at hidden 8, 2 layers, 2 heads, intermediate
  16, vocabulary 64, 8 tokens with 2 masked (dropout 0.1 as in BERT);
- ``cnn``: conv 3->2, ReLU, max-pool 2, conv 2->2, ReLU, max-pool 2, linear 2->10 on 3x4x4
  images;

each with batch 2 per replica (weak scaling) and Adam with ``foreach=True``, what torch chooses
for CUDA parameters. One intra-op thread everywhere (``torch.set_num_threads(1)``).

Rows, all timed over ``--steps`` steps after 3 warm-ups:

- ``plain``: the plain loop on one thread;
- ``mirrored-1``, ``-2``, ``-4``: MirroredStrategy on 1, 2, 4 logical CPU devices with
  ``ReductionToOneDevice``, so that, as over NCCL on GPUs, every replica packs its gradients,
  exchanges them and runs the whole optimizer (the default on shared memory instead updates each
  parameter once, on its owner); the same step with ``compute_average_loss``; the mode is on from
  2 replicas;
- ``traced-1``, ``-2``, ``-4``: the same step under ``@mirrored.function`` (issue 33): traced
  once per replica during the warm-ups, then replayed. The row raises if the step did not
  replay (a ``mirrored.function`` warning: a fallback to eager, a retrace) or was traced other
  than once per replica;
- ``threads-2``, ``-4``: the plain loop on 2 and 4 threads of this process at once, each with its
  own model: the GIL without the strategy;
- ``processes-2``, ``-4``: the same loops in 2 and 4 processes (one GIL each), started once
  and kept idle between their turns: what this machine's cores give N loops at once.

Rounds are interleaved (every row once per round, the order rotated); figures are medians over
rounds. Measured per row: wall seconds per step (all N loops together) and CPU seconds per step
of the loops' threads (``time.thread_time``; the mirrored rows: ``time.process_time``, all
replica threads). CPU time is what this 2-core shared machine measures best: other jobs delay a
thread but do not add to its CPU time.

**The GIL-held part.** PyTorch releases the GIL inside each op (from ATen's dispatch to the
kernel's return) and for all of autograd's engine; the rest of a step (the Python calls around
the ops, module calls, the optimizer's Python) holds it. Each round, ``--profile-steps`` steps
of ``plain`` run under ``torch.profiler`` with each phase (forward and loss, backward, optimizer
step and ``zero_grad``) marked: the outermost ops in a phase (below the optimizer's own
annotations) and, in backward, the time between autograd's nodes count as GIL-free, the rest of
the phase as held. The held share of the profiled step (median over rounds) times the plain
loop's unprofiled CPU per step is its GIL-held time. Limits: wall-clock spans (a preemption by
another job falls where it lands); the profiler's cost per op falls mostly inside the ops, so
the share errs low, while the engine's start and end count as held, which errs high; an op that
keeps the GIL (few do) counts as free. For the mirrored rows, the host work each replica adds
over ``plain`` (CPU per replica step) is taken as held: the mode's ``__torch_function__`` per
op and the strategy's Python, with a handful of tiny copies. So per replica: ``h`` =
mirrored-N's CPU per step / N, ``h_gil`` = plain's held time + (``h`` - plain's CPU per step).
The check: N threads need at least ``N * h_gil`` of wall time per step.

**Traced rows** hold the GIL differently: a replay runs each piece of the graph between host
calls in TorchScript's interpreter, which releases the GIL for the whole piece, and the rest
in Python (the host calls: gradients handed to autograd's accumulation and the gradient
reducer, the optimizer's ``step()`` and ``zero_grad()``; the signature check and the graph's
glue; a piece TorchScript refused runs as FX Python code). Measured, not modelled: while the
row is timed, every TorchScript module call adds its thread's CPU time (``time.thread_time``
around its ``forward``) to ``scripted``; ``h`` = the process's CPU per step / N as above, and
``h_gil`` = ``h`` - ``scripted`` per replica step (median over rounds). Everything outside the
scripted pieces counts as held, the ops inside the host calls included (they release the GIL
inside ATen): ``h_gil`` errs high, and so the ratio eager / traced ``h_gil`` errs low against
the eager rows' profiler split. Also printed per replica step: ``in step`` (CPU of the replica
threads inside the replica function; the rest of ``h`` is ``strategy.run``'s) and the scripted
calls per step (0: no piece ran in TorchScript).

``floor``: the CPU time of ``strategy.run`` of a replica function that does one op, per replica
and step (N = 1, 2, 4): what a replica step costs whatever the model, the least a captured (CUDA
graph) step still pays.

**GPU predictions** (scaling_model.py), per GPU of one machine (NVLink, PCIe), DDP's buckets:
the device step from compare.py's GPU compute (``--compute-ms``; by default the figures of its
recorded run, the plain loop / 20), split into forward, backward and update as the plain loop's
phases at compare.py's sizes (measured here on one thread); without the host term, and with
``Host(h_gil, h - h_gil)`` of the mirrored-2 row and of the traced-2 row (measured on CPU
devices: on CUDA a replay runs its pieces as FX Python code, not TorchScript, so it errs low
there), and with the host work each way out would leave: CUDA graphs (``h_gil`` = the floor +
one op's held time, the replay), one interpreter per replica (one process per GPU as
MultiWorkerMirroredStrategy runs, or a free-threaded CPython 3.13t: ``h_gil`` = 0, host =
``h``). The host figures are this machine's CPU: a faster host CPU scales them down.

Run from the repository root (about 8 minutes on the loaded 2-core machine of RESULTS.md):
``.venv/bin/python benchmarks/host_overhead.py [--json PATH]``; ``--workloads``, ``--rows``,
``--rounds``, ``--steps``, ``--profile-steps``, ``--compute-ms``. Traced against eager on the
MLP alone, in about a minute: ``--workloads mlp --rows
plain,mirrored-1,mirrored-2,mirrored-4,traced-1,traced-2,traced-4``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import scaling_model
import torch
import torch.distributed as dist
from compare import (
    SPECS,
    UNTIMED,
    gpu_compute,
    make_cnn,
    make_image_batches,
    measure_local,
    parse_pairs,
)
from compare import gradient_tensor_bytes as full_size_gradient_bytes
from mirrored.examples.bert_mlm import BertMaskedLM
from multi_worker import Workload, bert_loss, make_bert_batches, mlp_loss
from multi_worker import train_step as phased_step
from overhead import (
    LEARNING_RATE,
    SEED,
    WARMUP_STEPS,
    Clock,
    MustReplay,
    Peer,
    free_port,
    machine_description,
    settings_of,
    subset,
    write_report,
)
from torch import nn
from torch.autograd.profiler_util import FunctionEvent

import mirrored
from mirrored import config

Batch = tuple[torch.Tensor, ...]

BATCH_SIZE = 2  # per replica
WIDTH = 8
VOCAB_SIZE, SEQ_LEN, MASKED = 64, 8, 2
REPLICA_COUNTS = (2, 4)
LOGICAL_DEVICES = max(REPLICA_COUNTS)
PHASES = ("forward", "backward", "optimizer")
# One machine's links: the replicas of one process share a host.
HOST_LINKS = scaling_model.GPU_LINKS[:2]
GPU_COUNTS = (1, 2, 4, 8)
# compare.py's GPU compute per step in its recorded run (benchmarks/RESULTS.md, "Its GPU
# predictions": the plain loop's phases on this machine's 2 cores / 20): the same assumption.
COMPARE_GPU_COMPUTE_MS = {"mlp": 0.41, "bert": 11.7, "cnn": 1.0}
# Issue 33's aim: a traced replica step needs this many times less host and GIL-held time.
TRACED_GOAL = 5.0
TRACED_WAY = "traced replica steps, measured"


# -- launch-bound workloads ------------------------------------------------------------------------


def make_mlp() -> nn.Module:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 10)
    )


def make_mlp_batches(num_batches: int, batch_size: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(SEED)
    return [
        (
            torch.randn(batch_size, WIDTH, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


def make_bert() -> nn.Module:
    torch.manual_seed(SEED)
    return BertMaskedLM(VOCAB_SIZE, SEQ_LEN, hidden_dim=WIDTH, intermediate_dim=2 * WIDTH)


WORKLOADS = {
    "mlp": Workload("mlp", "MLP 8-8-8-10", make_mlp, make_mlp_batches, mlp_loss),
    "bert": Workload(
        "bert",
        f"BERT masked LM, hidden {WIDTH}, 2 layers, {SEQ_LEN} tokens",
        make_bert,
        functools.partial(make_bert_batches, vocab_size=VOCAB_SIZE, seq_len=SEQ_LEN, masked=MASKED),
        bert_loss,
    ),
    "cnn": Workload(
        "cnn",
        "CNN conv2-conv2-linear on 3x4x4",
        functools.partial(make_cnn, (2, 2), 4),
        functools.partial(make_image_batches, side=4),
        mlp_loss,
    ),
}
DEFAULT_STEPS = {"mlp": 200, "bert": 40, "cnn": 120}


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LEARNING_RATE, foreach=True)


# -- timing ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timing:
    """One loop's timed steps: wall-clock start and end (``perf_counter``, one clock for every
    thread and process of this machine), CPU seconds."""

    start: float
    end: float
    cpu: float
    # The mirrored rows: CPU seconds of the replicas' threads inside the replica function, and
    # the part of it inside TorchScript's calls (a traced replay's pieces), with their count.
    in_step: float = 0.0
    scripted: float = 0.0
    scripted_calls: int = 0


@contextmanager
def scripted_cpu(samples: list[float]) -> Iterator[None]:
    """While active, each call of a TorchScript method (a traced replay's piece between host
    calls, however the replay reaches it: a module call or its ``forward``) appends the CPU
    seconds its thread spent in it to ``samples``: the GIL-free part of a traced step. The
    call releases the GIL around TorchScript's interpreter only: turning the arguments into
    its stack and the result back (a few microseconds) hold it, but count here as free."""
    method = torch._C.ScriptMethod
    run = method.__call__

    def timed_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return run(self, *args, **kwargs)
        finally:
            samples.append(time.thread_time() - start)

    method.__call__ = timed_call  # type: ignore[method-assign]
    try:
        yield
    finally:
        method.__call__ = run  # type: ignore[method-assign]


def plain_loop(
    workload: Workload,
    steps: int,
    start_together: Callable[[], object] = lambda: None,
    clock: Clock = UNTIMED,
) -> Timing:
    """The plain loop on this thread: its own model and batches, 3 warm-ups, then
    ``start_together()`` and ``steps`` timed steps (CPU: this thread's)."""
    model = workload.make_model()
    optimizer = make_optimizer(model.parameters())
    batches = workload.make_batches(WARMUP_STEPS + steps, BATCH_SIZE)

    def step(batch: Batch) -> None:
        phased_step(lambda: workload.per_example_loss(model, batch).mean(), optimizer, clock)

    for batch in batches[:WARMUP_STEPS]:
        step(batch)
    gc.collect()
    start_together()
    cpu, start = time.thread_time(), time.perf_counter()
    for batch in batches[WARMUP_STEPS:]:
        step(batch)
    return Timing(start, time.perf_counter(), time.thread_time() - cpu)


def threads_loop(workload: Workload, steps: int, num_threads: int) -> list[Timing]:
    """``plain_loop`` on ``num_threads`` threads at once, started together."""
    barrier = threading.Barrier(num_threads)
    timings: list[Timing | BaseException] = [RuntimeError("not run")] * num_threads

    def run(index: int) -> None:
        try:
            timings[index] = plain_loop(workload, steps, barrier.wait)
        except BaseException as error:
            barrier.abort()
            timings[index] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for timing in timings:
        if isinstance(timing, BaseException):
            raise timing
    return [t for t in timings if isinstance(t, Timing)]


def mirrored_loop(
    workload: Workload, steps: int, num_replicas: int, replica_step: str = "train"
) -> Timing:
    """MirroredStrategy on ``num_replicas`` logical CPU devices, each replica on its batch of
    ``BATCH_SIZE``; ``replica_step``: "train", "traced" (the same under ``mirrored.function``,
    checked to replay) or "one-op" (the floor). CPU: the process's."""
    strategy = mirrored.MirroredStrategy(
        devices=[f"cpu:{i}" for i in range(num_replicas)],
        cross_device_ops=mirrored.ReductionToOneDevice(),
    )
    try:
        net = workload.make_model()
        model, optimizer = strategy.mirror(net, make_optimizer(net.parameters()))

        def train(batch: Batch) -> torch.Tensor:
            # Returns the loss: a traced step that returns None fails to replay (StopIteration
            # in Replay.__call__: a None result reads as a graph output's place).
            return phased_step(
                lambda: mirrored.compute_average_loss(workload.per_example_loss(model, batch)),
                optimizer,
                UNTIMED,
            )

        def one_op(batch: Batch) -> None:
            batch[0].sum()

        with MustReplay(num_replicas, f"traced-{num_replicas} ({workload.name})") as trace:
            steps_by_kind = {"train": train, "one-op": one_op}
            step = trace(train) if replica_step == "traced" else steps_by_kind[replica_step]
            return _timed_run(
                strategy,
                step,
                workload.make_batches(WARMUP_STEPS + steps, BATCH_SIZE * num_replicas),
            )
    finally:
        strategy.close()


def _timed_run(
    strategy: mirrored.MirroredStrategy, step: Callable[[Batch], object], batches: Sequence[Batch]
) -> Timing:
    """``strategy.run(step)`` on each batch split over the replicas: 3 warm-ups, then the rest
    timed, with the replicas' CPU inside ``step`` and inside TorchScript's calls."""
    in_step: list[float] = []

    def timed_step(batch: Batch) -> None:
        start = time.thread_time()
        try:
            step(batch)
        finally:
            in_step.append(time.thread_time() - start)

    for batch in strategy.experimental_distribute_dataset(batches[:WARMUP_STEPS]):
        strategy.run(timed_step, args=(batch,))
    timed = strategy.experimental_distribute_dataset(batches[WARMUP_STEPS:])
    in_step.clear()
    scripted: list[float] = []
    gc.collect()
    with scripted_cpu(scripted):
        cpu, start = time.process_time(), time.perf_counter()
        for batch in timed:
            strategy.run(timed_step, args=(batch,))
        end, cpu = time.perf_counter(), time.process_time() - cpu
    return Timing(start, end, cpu, sum(in_step), sum(scripted), len(scripted))


def _process_worker(rank: int, world_size: int, port: int, commands: Any, results: Any) -> None:
    """One of ``world_size`` processes on a gloo group (for its barrier): ("run", workload,
    steps) runs ``plain_loop`` in every process at once; rank 0 answers every rank's Timing."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        dist.barrier()
        if rank == 0:
            results.put("ready")
        while (command := commands.get()) != "stop":
            _, name, steps = command
            timing = plain_loop(WORKLOADS[name], steps, dist.barrier)
            everyone: list[Any] = [None] * world_size
            dist.all_gather_object(everyone, timing)
            if rank == 0:
                results.put(everyone)
    finally:
        dist.destroy_process_group()


def per_step(timings: Sequence[Timing], steps: int) -> dict[str, float]:
    """Seconds per step: wall, from the first loop's start to the last one's end; CPU, all
    loops'."""
    wall = max(t.end for t in timings) - min(t.start for t in timings)
    totals = {
        key: sum(getattr(t, key) for t in timings) / steps
        for key in ("cpu", "in_step", "scripted", "scripted_calls")
    }
    return {"wall": wall / steps, **totals}


ROWS = (
    "plain",
    "mirrored-1",
    "traced-1",
    *(
        f"{kind}-{n}"
        for n in REPLICA_COUNTS
        for kind in ("threads", "processes", "mirrored", "traced")
    ),
)


def replicas_of(row: str) -> int:
    return 1 if row == "plain" else int(row.rsplit("-", 1)[1])


def measure_row(row: str, name: str, steps: int, peers: dict[int, Peer]) -> dict[str, float]:
    workload, num = WORKLOADS[name], replicas_of(row)
    if row == "plain":
        return per_step([plain_loop(workload, steps)], steps)
    if row.startswith("threads"):
        return per_step(threads_loop(workload, steps, num), steps)
    if row.startswith("processes"):
        return per_step(peers[num].ask(("run", name, steps)), steps)
    replica_step = "traced" if row.startswith("traced") else "train"
    return per_step([mirrored_loop(workload, steps, num, replica_step)], steps)


# -- the GIL-held part -----------------------------------------------------------------------------


class MarkedClock(Clock):
    """Marks each phase for the profiler instead of timing it."""

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        with torch.profiler.record_function(f"phase:{phase}"):
            yield


def _outermost_ops(event: FunctionEvent) -> Iterator[FunctionEvent]:
    """The ops directly under ``event``, looking through annotations (``Optimizer.step#...``)."""
    for child in event.cpu_children:
        if child.is_user_annotation:
            yield from _outermost_ops(child)
        else:
            yield child


def gil_split(workload: Workload, steps: int) -> dict[str, Any]:
    """Per phase of the plain loop, seconds per step: the phase under the profiler, its GIL-free
    part (outermost ops; autograd's engine between its nodes) and the rest, held; outermost ops
    per step (see module docstring)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        plain_loop(workload, steps, clock=MarkedClock())
    totals = {phase: {"phase": 0.0, "free": 0.0, "ops": 0} for phase in PHASES}
    markers = sorted(
        (e for e in profile.events() if e.name.startswith("phase:")),
        key=lambda e: e.time_range.start,
    )
    timed_markers = markers[WARMUP_STEPS * len(PHASES) :]
    for marker in timed_markers:
        ops = sorted(_outermost_ops(marker), key=lambda e: e.time_range.start)
        nodes = [e for e in ops if e.name.startswith("autograd::engine::")]
        free = sum(e.time_range.elapsed_us() for e in ops)
        free += sum(b.time_range.start - a.time_range.end for a, b in itertools.pairwise(nodes))
        total = totals[marker.name.removeprefix("phase:")]
        total["phase"] += marker.time_range.elapsed_us() / 1e6
        total["free"] += free / 1e6
        total["ops"] += len(ops)
    split = {
        phase: {
            "phase": t["phase"] / steps,
            "free": t["free"] / steps,
            "held": (t["phase"] - t["free"]) / steps,
            "ops": t["ops"] / steps,
        }
        for phase, t in totals.items()
    }
    return {
        "phases": split,
        "phase": sum(p["phase"] for p in split.values()),
        "held": sum(p["held"] for p in split.values()),
        "ops": sum(p["ops"] for p in split.values()),
    }


# -- the rounds ------------------------------------------------------------------------------------


def run_workload(
    name: str,
    rows: Sequence[str],
    steps: int,
    profile_steps: int,
    rounds: int,
    peers: dict[int, Peer],
) -> dict[str, Any]:
    print(f"\n== {name}: {WORKLOADS[name].description}; {steps} steps, {rounds} rounds", flush=True)
    measured: dict[str, list[dict[str, float]]] = {row: [] for row in rows}
    splits = []
    for round_index in range(rounds):
        shift = round_index % len(rows)
        for row in [*rows[shift:], *rows[:shift]]:
            measured[row].append(measure_row(row, name, steps, peers))
        splits.append(gil_split(WORKLOADS[name], profile_steps))
        print(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(f"{row} {1e3 * m[-1]['wall']:.2f}" for row, m in measured.items())
            + f" ms/step; GIL-held share {100 * splits[-1]['held'] / splits[-1]['phase']:.0f}%",
            flush=True,
        )
    return {"steps": steps, "rows": measured, "splits": splits}


def median_of(records: Sequence[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in records)


def floor_seconds(rounds: int, steps: int) -> dict[int, float]:
    """CPU seconds per replica per step of ``strategy.run`` of one op, median over rounds."""
    floors: dict[int, list[float]] = {n: [] for n in (1, *REPLICA_COUNTS)}
    for _ in range(rounds):
        for n in floors:
            timing = mirrored_loop(WORKLOADS["mlp"], steps, n, replica_step="one-op")
            floors[n].append(timing.cpu / steps / n)
    return {n: statistics.median(values) for n, values in floors.items()}


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds, and per replica: ``h``, ``h_gil`` (see module docstring)."""
    plain_rounds = result["rows"]["plain"]
    rows = {
        row: {
            **{key: median_of(records, key) for key in records[0]},
            # CPU per loop over the same round's plain loop: cancels the machine's drift.
            "cpu_per_loop_paired": statistics.median(
                r["cpu"] / replicas_of(row) / p["cpu"]
                for r, p in zip(records, plain_rounds, strict=True)
            ),
        }
        for row, records in result["rows"].items()
    }
    splits = result["splits"]
    share = statistics.median(s["held"] / s["phase"] for s in splits)
    held = share * rows["plain"]["cpu"]
    phases = {
        phase: {
            key: statistics.median(s["phases"][phase][key] for s in splits)
            for key in ("phase", "free", "held", "ops")
        }
        for phase in PHASES
    }
    ops = statistics.median(s["ops"] for s in splits)
    return {
        "rows": rows,
        "held_share": share,
        "held": held,
        "phases": phases,
        "ops": ops,
        "per_replica": per_replica(rows, result["rows"], held),
    }


def per_replica(
    rows: dict[str, dict[str, float]], rounds: dict[str, list[dict[str, float]]], held: float
) -> dict[str, dict[str, float]]:
    """Per replica step of each mirrored and traced row: ``h``, ``h_gil`` and its parts (see
    module docstring); a traced row's ratios to the eager row of as many replicas."""
    plain_cpu = rows["plain"]["cpu"]
    hosts: dict[str, dict[str, float]] = {}
    for row, r in rows.items():
        n = replicas_of(row)
        parts = {
            "h": r["cpu"] / n,
            "in_step": r["in_step"] / n,
            "scripted": r["scripted"] / n,
            "scripted_calls": r["scripted_calls"] / n,
        }
        if row.startswith("mirrored"):
            hosts[row] = {**parts, "h_gil": held + max(0.0, parts["h"] - plain_cpu)}
        elif row.startswith("traced"):
            h_gil = statistics.median((t["cpu"] - t["scripted"]) / n for t in rounds[row])
            hosts[row] = {**parts, "h_gil": h_gil}
    for row, traced in hosts.items():
        eager = hosts.get(row.replace("traced", "mirrored"))
        if row.startswith("traced") and eager is not None:
            traced["eager_over_traced_h"] = eager["h"] / traced["h"]
            traced["eager_over_traced_h_gil"] = eager["h_gil"] / traced["h_gil"]
    return hosts


def print_measurements(summaries: dict[str, dict[str, Any]]) -> None:
    print(
        f"\n{'workload':<8} {'row':<12} {'wall ms':>8} {'x plain':>7} {'CPU ms':>7} "
        f"{'CPU/loop':>8} {'paired':>6} {'N*h_gil':>8} {'wall/(N*h_gil)':>14}"
    )
    for name, s in summaries.items():
        plain = s["rows"]["plain"]
        for row, r in s["rows"].items():
            n = replicas_of(row)
            # The GIL-held work N loops of this row need: the plain loop's, or the replica's.
            host = s["per_replica"].get(row)
            gil = s["held"] if host is None else host["h_gil"]
            serial = (
                f"{r['wall'] / (n * gil):14.2f}" if not row.startswith("proc") else f"{'-':>14}"
            )
            print(
                f"{name:<8} {row:<12} {1e3 * r['wall']:8.3f} {r['wall'] / plain['wall']:7.2f} "
                f"{1e3 * r['cpu']:7.3f} {1e3 * r['cpu'] / n:8.3f} "
                f"{r['cpu_per_loop_paired']:5.2f}x {1e3 * n * gil:8.3f} {serial:>14}"
            )
    print(
        "medians over rounds, per step of all N loops; CPU/loop: CPU ms per loop (replica) per "
        "step; paired: median over rounds of CPU/loop over the same round's plain loop;\n"
        "N*h_gil: the GIL-held work the N loops need (threads: plain's held part; mirrored, "
        "traced: the replica's h_gil); wall/(N*h_gil) near 1: the GIL sets the pace"
    )
    print(
        "\nGIL split of the plain loop under the profiler (ms per step, held = phase - free; "
        "held share of the step; outermost ops per step):"
    )
    print(
        f"  {'workload':<8} "
        + " ".join(f"{p + ' held/phase':>24}" for p in PHASES)
        + f" {'share':>6} {'ops':>5} {'held':>8}"
    )
    for name, s in summaries.items():
        cells = [
            f"{1e3 * s['phases'][p]['held']:8.3f} / {1e3 * s['phases'][p]['phase']:8.3f}"
            for p in PHASES
        ]
        print(
            f"  {name:<8} "
            + " ".join(f"{c:>24}" for c in cells)
            + f" {100 * s['held_share']:5.0f}% {s['ops']:5.0f} {1e3 * s['held']:8.3f}"
        )
    print("  held: the share times the plain loop's CPU per step, unprofiled (ms)")
    print_per_replica(summaries)


def print_per_replica(summaries: dict[str, dict[str, Any]]) -> None:
    print(
        "\nPer replica step, CPU ms (h: the row's CPU per step / N; in step: inside the replica "
        "function, the rest is strategy.run's; scripted: inside TorchScript's calls, in calls "
        "per step;\nh_gil: mirrored-N plain's held + (h - plain's CPU), traced-N h - scripted; "
        f"eager/traced: mirrored-N's over traced-N's, goal >= {TRACED_GOAL:g}x):"
    )
    print(
        f"  {'workload':<8} {'row':<11} {'h':>7} {'in step':>7} {'scripted':>8} {'calls':>5} "
        f"{'h_gil':>7} {'eager/traced h':>14} {'h_gil':>6}"
    )
    for name, s in summaries.items():
        for row, v in s["per_replica"].items():
            ratios = (
                f"{v['eager_over_traced_h']:13.2f}x {v['eager_over_traced_h_gil']:5.2f}x"
                if "eager_over_traced_h" in v
                else f"{'-':>14} {'-':>6}"
            )
            print(
                f"  {name:<8} {row:<11} {1e3 * v['h']:7.3f} {1e3 * v['in_step']:7.3f} "
                f"{1e3 * v['scripted']:8.3f} {v['scripted_calls']:5.1f} {1e3 * v['h_gil']:7.3f} "
                f"{ratios}"
            )


# -- GPU predictions -------------------------------------------------------------------------------


def full_size_phases(names: Sequence[str]) -> dict[str, dict[str, float]]:
    """The plain loop's forward / backward / optimizer (ms per step) at compare.py's sizes, on
    one thread (two threads on a loaded machine stall each other): their shares split the GPU
    compute."""
    phases: dict[str, dict[str, float]] = {}
    for name in names:
        spec = SPECS[name]
        batches = spec.workload.make_batches(WARMUP_STEPS + spec.quick_steps, spec.batch_size)
        phases[name] = measure_local("plain", spec, batches)["phases_ms"]
    return phases


def ways_out(summary: dict[str, Any], floors: dict[int, float]) -> dict[str, scaling_model.Host]:
    """The host work per replica each way predicts (see module docstring); the measured ways
    where their row (mirrored-2, traced-2) ran."""
    hosts = summary["per_replica"]
    one_call = summary["held"] / summary["ops"]  # GIL-held seconds per op, plain loop
    ways = {"devices only (no host term)": scaling_model.NO_HOST}
    for row, way in (("mirrored-2", "replica threads (GIL), measured"), ("traced-2", TRACED_WAY)):
        if row in hosts:
            ways[way] = scaling_model.Host(
                hosts[row]["h_gil"], hosts[row]["h"] - hosts[row]["h_gil"]
            )
    ways["CUDA graphs: one replay a step"] = scaling_model.Host(floors[2] + one_call)
    if "mirrored-2" in hosts:
        ways["one interpreter per replica"] = scaling_model.Host(0.0, hosts["mirrored-2"]["h"])
    return ways


def predict_gpus(
    summaries: dict[str, dict[str, Any]],
    phases: dict[str, dict[str, float]],
    floors: dict[int, float],
    compute_ms: dict[str, float],
) -> list[dict[str, Any]]:
    print(
        "\nPredicted scaling efficiency t(1)/t(N) on GPUs of one machine (weak scaling, DDP's "
        f"buckets), N = {' / '.join(map(str, GPU_COUNTS[1:]))}. Compute per GPU: --compute-ms "
        "(default: compare.py's, its plain loop / 20), split as the plain loop's phases at "
        "compare.py's sizes; host per replica from the mirrored-2 and traced-2 rows."
    )
    predictions = []
    for name, summary in summaries.items():
        compute = gpu_compute(phases[name], 1.0, compute_ms[name])
        buckets = scaling_model.bucket_sizes(full_size_gradient_bytes(name))
        ways = ways_out(summary, floors)
        hosts = [
            f"{row} h = {1e3 * host['h']:.3f} ms, h_gil = {1e3 * host['h_gil']:.3f} ms"
            for row, host in summary["per_replica"].items()
            if row in ("mirrored-2", "traced-2")
        ]
        print(
            f"  {name}: device compute {1e3 * compute.total:.3f} ms/step; host per replica: "
            + "; ".join(hosts)
            + f" ({1e6 * summary['held'] / summary['ops']:.1f} us held per op of the plain loop)"
        )
        print(
            f"    {'':<32} "
            + " ".join(f"{link.name.split(' (')[0]:>17}" for link in HOST_LINKS)
            + f" {'t(1) ms':>8} {'t(8) ms':>8} ({HOST_LINKS[0].name.split(' (')[0]})"
        )
        for way, host in ways.items():
            steps = {
                link.name: [
                    scaling_model.predict_step(compute, buckets, n, link, host).step
                    for n in GPU_COUNTS
                ]
                for link in HOST_LINKS
            }
            cells = [
                " / ".join(f"{100 * times[0] / t:3.0f}" for t in times[1:]) + "%"
                for times in steps.values()
            ]
            first = steps[HOST_LINKS[0].name]
            print(
                f"    {way:<32} "
                + " ".join(f"{c:>17}" for c in cells)
                + f" {1e3 * first[0]:8.3f} {1e3 * first[-1]:8.3f}"
            )
            predictions += [
                {
                    "workload": name,
                    "way": way,
                    "link": link,
                    "num_gpus": n,
                    "compute_s": dataclasses.asdict(compute),
                    "host": dataclasses.asdict(host),
                    "step_s": step,
                    "efficiency": times[0] / step,
                }
                for link, times in steps.items()
                for n, step in zip(GPU_COUNTS, times, strict=True)
            ]
    print(
        "  CUDA graphs: h_gil = the strategy's floor per replica (N=2) + one op's GIL-held call "
        "(the replay); a compiled step without graphs keeps one Python launch per fused kernel: "
        "about that many x the held time per op above.\n  One interpreter per replica: one "
        "process per GPU (MultiWorkerMirroredStrategy) or free-threaded CPython 3.13t+ (no GIL): "
        "the host work of the replicas runs in parallel, host = h.\n  Traced: on CPU devices "
        "a replay's pieces run in TorchScript (GIL-free); on CUDA they run as FX Python code, "
        "one held call per op, so this row errs low there."
    )
    return predictions


# -- arguments, main -------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help="comma-separated subset of the rows (plain always runs: the others are paired "
        "with it), e.g. plain,mirrored-2,traced-2 for a short run",
    )
    parser.add_argument(
        "--steps",
        default="",
        help="timed steps: N for every workload, or mlp=N,bert=N,cnn=N "
        f"(default {','.join(f'{k}={v}' for k, v in DEFAULT_STEPS.items())})",
    )
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument(
        "--profile-steps", type=int, default=20, help="profiled steps per round (default 20)"
    )
    parser.add_argument(
        "--compute-ms",
        default="",
        help="GPU compute per step, e.g. mlp=0.5,bert=6 (default "
        f"{','.join(f'{k}={v:g}' for k, v in COMPARE_GPU_COMPUTE_MS.items())})",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.workloads = subset(parser, "--workloads", args.workloads, tuple(WORKLOADS))
    args.rows = ["plain", *(r for r in subset(parser, "--rows", args.rows, ROWS) if r != "plain")]
    try:
        given = (
            dict.fromkeys(WORKLOADS, float(args.steps))
            if args.steps.isdigit()
            else parse_pairs(args.steps, "--steps", list(WORKLOADS))
        )
        args.compute_ms = {
            **COMPARE_GPU_COMPUTE_MS,
            **parse_pairs(args.compute_ms, "--compute-ms", list(WORKLOADS)),
        }
    except ValueError as error:
        parser.error(str(error))
    args.steps = {name: int(given.get(name, DEFAULT_STEPS[name])) for name in WORKLOADS}
    if args.rounds < 1 or args.profile_steps < 1 or min(args.steps.values()) < 1:
        parser.error(
            f"--rounds={args.rounds}, --profile-steps={args.profile_steps} and --steps="
            f"{args.steps} must be at least 1"
        )
    if any(v <= 0 for v in args.compute_ms.values()):
        parser.error(f"--compute-ms={args.compute_ms}: each must be positive")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    torch.set_num_threads(1)
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * LOGICAL_DEVICES
    )
    results: dict[str, Any] = {}
    peers: dict[int, Peer] = {}
    try:
        for n in REPLICA_COUNTS:
            if f"processes-{n}" in args.rows:
                peers[n] = Peer(_process_worker, (n, free_port()), n, f"{n} processes")
        for name in args.workloads:
            results[name] = run_workload(
                name, args.rows, args.steps[name], args.profile_steps, args.rounds, peers
            )
    finally:
        for peer in peers.values():
            peer.close()
    floors = floor_seconds(args.rounds, args.steps["mlp"])
    print(
        "\nfloor (strategy.run of one op), CPU ms per replica per step: "
        + ", ".join(f"N={n} {1e3 * s:.3f}" for n, s in floors.items())
    )
    summaries = {name: summarize(result) for name, result in results.items()}
    print_measurements(summaries)
    phases = full_size_phases(args.workloads)
    predictions = predict_gpus(summaries, phases, floors, args.compute_ms)
    machine["load_average_1min_end"] = os.getloadavg()[0]
    print(
        f"load average (1 min) at the start {machine['load_average_1min']:.2f}, end "
        f"{machine['load_average_1min_end']:.2f}"
    )
    write_report(
        args.json,
        machine,
        settings_of(args, "json"),
        results=results,
        summary=summaries,
        floor_s=floors,
        full_size_phases_ms=phases,
        gpu_predictions=predictions,
    )


if __name__ == "__main__":
    main()
