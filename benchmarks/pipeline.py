"""PipelineStrategy: the pipeline bubble against theory, and activation memory per stage.

Everything is read from ``strategy.stage_timelines()`` after each ``strategy.run`` (the stages'
own ``perf_counter`` records of every forward ``F`` and backward ``B``, and their activation
peak). The step is the usual one: ``model(x)``, ``compute_average_loss`` of the per-example
cross-entropy, ``loss.backward()``, ``optimizer.step()`` (SGD), ``optimizer.zero_grad()``, on
logical CPU devices ``cpu:0``.. (one stage each, one pipeline).

1. **Bubble.** For one step over ``p`` stages, with ``span`` the time from the first operation's
   start to the last one's end over all stages, the measured bubble is
   ``1 - sum(stage busy seconds) / (p * span)``; theory for ``m`` micro-batches and balanced
   stages is ``(p - 1) / (m + p - 1)`` for both GPipe and 1F1B. Reported: the median over
   ``--steps`` timed steps (after ``--warmup``), and its ratio to theory.

   - ``sleep`` model: ``p`` identical layers, one per stage, each a 16-16 linear layer followed
     by a fixed cost that does not use the CPU: ``time.sleep(--forward-ms)`` in its forward and
     ``time.sleep(--backward-ms)`` in its backward (4 and 8 ms per micro-batch), so the stages
     are balanced and really overlap even on a 2-core machine. Micro-batches of 8 examples;
     ``p`` in ``--stages``, ``m`` in ``--microbatches``, both schedules.
   - ``mlp`` model: the articles' MLP 784-512-256-10 (ReLU) on 3 stages, split by the default
     ``split="parameters"`` (784-512 | 512-256 | 256-10, each Linear with its ReLU), global batch
     ``--mlp-batch-size``, 8 micro-batches, both schedules. Real compute: the stages share the
     machine's cores (one intra-op thread each), and they are unbalanced, so the table also
     gives the bubble expected from the step's own operation times (GPipe's flow-shop span
     ``sum f + (m - 1) max f + sum b + (m - 1) max b``, from each stage's mean forward ``f``
     and backward ``b``).

   ``hop ms`` is the median hand-off latency between stages: how long after its input was ready
   (the previous stage's operation on the same micro-batch ended) and the stage was free (its
   own previous operation ended) an operation started. ``loss ms``: the last stage's idle time
   per step waiting for backwards whose forward it had run (the micro-batch's thread computing
   the loss and calling ``loss.backward()``), when it had nothing else to run: on 1F1B's
   critical path, mostly hidden under GPipe. Such gaps count as bubble.

2. **Activation memory.** ``StageTimeline.peak_activation_bytes`` per stage (what a stage keeps
   for its backwards: inputs and the tensors autograd saves, parameters excepted), for GPipe,
   1F1B and both with ``recompute=True``, on the MLP above, 3 stages, 8 micro-batches, global
   batch ``--memory-batch-size``; the maximum over ``--steps`` timed steps. Also given: the
   micro-batches held at the peak (the peak over GPipe's peak / m, range over the steps) against
   1F1B's bound ``p - s`` at stage ``s`` (so 1F1B should hold ``(p - s) / m`` of GPipe's).

Run from the repository root: ``.venv/bin/python benchmarks/pipeline.py [--json PATH]`` (about 30 s
on 2 cores); ``--steps``, ``--warmup``, ``--stages``, ``--microbatches``, ``--forward-ms``,
``--backward-ms``, ``--mlp-batch-size``, ``--memory-batch-size``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

# Run as a script, this file's folder is on sys.path: the machine description is overhead.py's.
from overhead import SEED, machine_description, settings_of, write_report
from torch import nn

import mirrored
from mirrored import config
from mirrored.pipeline.executor import StageTimeline

Batch = tuple[torch.Tensor, torch.Tensor]
SCHEDULES = ("gpipe", "1f1b")
SLEEP_WIDTH = 16
SLEEP_MICROBATCH_SIZE = 8
MLP_STAGES = 3
MLP_MICROBATCHES = 8
LEARNING_RATE = 0.01
MIB = 2**20


# -- models ------------------------------------------------------------------------------------


class _SleepCost(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed time without using the CPU."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepLayer(nn.Module):
    """A tiny linear layer, then the fixed cost (after it, so the first stage's backward, whose
    input needs no gradient, still pays it)."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        super().__init__()
        self.linear = nn.Linear(SLEEP_WIDTH, SLEEP_WIDTH)
        self.forward_s = forward_s
        self.backward_s = backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepCost.apply(self.linear(x), self.forward_s, self.backward_s)


def make_sleep_model(num_stages: int, forward_s: float, backward_s: float) -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(*[SleepLayer(forward_s, backward_s) for _ in range(num_stages)])


def make_mlp() -> nn.Sequential:
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)
    )


def make_batches(num_batches: int, batch_size: int, width: int, classes: int) -> list[Batch]:
    generator = torch.Generator().manual_seed(SEED)
    return [
        (
            torch.randn(batch_size, width, generator=generator),
            torch.randint(0, classes, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


# -- running -----------------------------------------------------------------------------------


def run_steps(
    make_model: Callable[[], nn.Sequential],
    num_stages: int,
    batches: Sequence[Batch],
    warmup: int,
    **options: Any,
) -> list[list[StageTimeline]]:
    """Train on ``batches`` with a fresh strategy; pipeline 0's stage timelines of each step
    after the first ``warmup``."""
    strategy = mirrored.PipelineStrategy(
        [f"cpu:{s}" for s in range(num_stages)], timeout_seconds=120.0, **options
    )
    try:
        net = make_model()
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), LEARNING_RATE))

        def step(batch: Batch) -> torch.Tensor:
            x, y = batch
            loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        timelines = []
        for batch in strategy.experimental_distribute_dataset(batches):
            strategy.run(step, args=(batch,))
            timelines.append(strategy.stage_timelines()[0])
        return timelines[warmup:]
    finally:
        strategy.close()


# -- what a step's timelines say ---------------------------------------------------------------


def theory_bubble(num_stages: int, num_microbatches: int) -> float:
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def span_seconds(stages: Sequence[StageTimeline]) -> float:
    ops = [op for stage in stages for op in stage.ops]
    return max(op.end for op in ops) - min(op.start for op in ops)


def measured_bubble(stages: Sequence[StageTimeline]) -> float:
    busy = sum(stage.busy_seconds for stage in stages)
    return 1.0 - busy / (len(stages) * span_seconds(stages))


def flow_shop_bubble(stages: Sequence[StageTimeline], num_microbatches: int) -> float:
    """The bubble of a GPipe step whose every operation takes its stage's mean time: forwards
    flow through the stages as identical jobs (span ``sum f + (m - 1) max f``), then backwards.
    Balanced stages give ``theory_bubble``; unbalanced ones more."""
    forward = [statistics.mean(op.end - op.start for op in s.ops if op.kind == "F") for s in stages]
    backward = [
        statistics.mean(op.end - op.start for op in s.ops if op.kind == "B") for s in stages
    ]
    m = num_microbatches
    span = sum(forward) + (m - 1) * max(forward) + sum(backward) + (m - 1) * max(backward)
    busy = m * (sum(forward) + sum(backward))
    return 1.0 - busy / (len(stages) * span)


def hop_latencies(stages: Sequence[StageTimeline]) -> list[float]:
    """For every operation whose input came from another stage (a forward at stages 1.., a
    backward at stages ..p-2): its start less the later of its input's end and the end of the
    stage's previous operation."""
    ends = {
        (s, op.kind, op.round, op.microbatch): op.end for s, t in enumerate(stages) for op in t.ops
    }
    latencies = []
    for s, stage in enumerate(stages):
        previous_end = None
        for op in stage.ops:
            source = s - 1 if op.kind == "F" else s + 1
            ready = ends.get((source, op.kind, op.round, op.microbatch))
            if ready is not None:
                free = ready if previous_end is None else max(ready, previous_end)
                latencies.append(op.start - free)
            previous_end = op.end
    return latencies


def loss_waits(stages: Sequence[StageTimeline]) -> list[float]:
    """At the last stage, for each backward: its start less the later of its forward's end and
    the end of the stage's previous operation (the micro-batch's thread computing the loss and
    calling ``loss.backward()``, when the stage had nothing else to do)."""
    last = stages[-1]
    forward_ends = {(op.round, op.microbatch): op.end for op in last.ops if op.kind == "F"}
    waits = []
    for previous, op in itertools.pairwise(last.ops):
        if op.kind == "B":
            waits.append(
                max(0.0, op.start - max(previous.end, forward_ends[op.round, op.microbatch]))
            )
    return waits


def bubble_row(
    name: str,
    schedule: str,
    num_stages: int,
    num_microbatches: int,
    steps: Sequence[Sequence[StageTimeline]],
) -> dict[str, Any]:
    theory = theory_bubble(num_stages, num_microbatches)
    bubbles = [measured_bubble(stages) for stages in steps]
    measured = statistics.median(bubbles)
    hops = [latency for stages in steps for latency in hop_latencies(stages)]
    return {
        "model": name,
        "schedule": schedule,
        "stages": num_stages,
        "microbatches": num_microbatches,
        "theory": theory,
        "measured": measured,
        "measured_per_step": bubbles,
        "ratio": measured / theory if theory else None,
        "span_ms": 1e3 * statistics.median(span_seconds(stages) for stages in steps),
        "hop_ms": 1e3 * statistics.median(hops) if hops else None,
        "loss_wait_ms": 1e3 * statistics.median(sum(loss_waits(stages)) for stages in steps),
        "flow_shop": statistics.median(flow_shop_bubble(s, num_microbatches) for s in steps),
    }


# -- the measurements --------------------------------------------------------------------------


def measure_sleep_bubbles(args: argparse.Namespace) -> list[dict[str, Any]]:
    forward_s, backward_s = args.forward_ms / 1e3, args.backward_ms / 1e3
    rows = []
    for num_stages in args.stages:
        for num_microbatches in args.microbatches:
            batches = make_batches(
                args.warmup + args.steps,
                SLEEP_MICROBATCH_SIZE * num_microbatches,
                SLEEP_WIDTH,
                SLEEP_WIDTH,
            )
            for schedule in SCHEDULES:
                steps = run_steps(
                    functools.partial(make_sleep_model, num_stages, forward_s, backward_s),
                    num_stages,
                    batches,
                    args.warmup,
                    num_microbatches=num_microbatches,
                    schedule=schedule,
                )
                rows.append(bubble_row("sleep", schedule, num_stages, num_microbatches, steps))
                print_bubble_row(rows[-1])
    return rows


def measure_mlp_bubbles(args: argparse.Namespace) -> list[dict[str, Any]]:
    batches = make_batches(args.warmup + args.steps, args.mlp_batch_size, 784, 10)
    rows = []
    for schedule in SCHEDULES:
        steps = run_steps(
            make_mlp,
            MLP_STAGES,
            batches,
            args.warmup,
            num_microbatches=MLP_MICROBATCHES,
            schedule=schedule,
        )
        rows.append(bubble_row("mlp", schedule, MLP_STAGES, MLP_MICROBATCHES, steps))
        print_bubble_row(rows[-1])
    return rows


def measure_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    batches = make_batches(args.warmup + args.steps, args.memory_batch_size, 784, 10)
    rows: list[dict[str, Any]] = []
    for recompute in (False, True):
        for schedule in SCHEDULES:
            steps = run_steps(
                make_mlp,
                MLP_STAGES,
                batches,
                args.warmup,
                num_microbatches=MLP_MICROBATCHES,
                schedule=schedule,
                recompute=recompute,
            )
            peaks = [[stage.peak_activation_bytes for stage in stages] for stages in steps]
            rows.append(
                {
                    "schedule": schedule,
                    "recompute": recompute,
                    "peak_bytes_per_step": peaks,
                    "peak_bytes": [max(column) for column in zip(*peaks, strict=True)],
                }
            )
    for row in rows:
        # GPipe holds all m micro-batches: its peak / m is one micro-batch's activations.
        gpipe = next(
            r for r in rows if r["schedule"] == "gpipe" and r["recompute"] == row["recompute"]
        )
        per_microbatch = [peak / MLP_MICROBATCHES for peak in gpipe["peak_bytes"]]
        row["microbatches_held"] = [
            [round(step[s] / per_microbatch[s], 2) for step in row["peak_bytes_per_step"]]
            for s in range(MLP_STAGES)
        ]
        row["of_gpipe"] = [
            mine / theirs
            for mine, theirs in zip(row["peak_bytes"], gpipe["peak_bytes"], strict=True)
        ]
        row["bound"] = [
            MLP_STAGES - s if row["schedule"] == "1f1b" else MLP_MICROBATCHES
            for s in range(MLP_STAGES)
        ]
    return rows


# -- printing ----------------------------------------------------------------------------------

BUBBLE_HEADER = (
    f"{'model':<6} {'schedule':<8} {'p':>2} {'m':>2} {'theory':>7} {'measured':>9} {'ratio':>6} "
    f"{'span ms':>8} {'hop ms':>7} {'loss ms':>8} {'flow-shop':>10}"
)


def print_bubble_row(row: dict[str, Any]) -> None:
    ratio = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
    hop = "-" if row["hop_ms"] is None else f"{row['hop_ms']:.2f}"
    print(
        f"{row['model']:<6} {row['schedule']:<8} {row['stages']:>2} {row['microbatches']:>2} "
        f"{row['theory']:>7.3f} {row['measured']:>9.3f} {ratio:>6} {row['span_ms']:>8.1f} "
        f"{hop:>7} {row['loss_wait_ms']:>8.1f} {row['flow_shop']:>10.3f}"
    )


def print_memory(rows: Sequence[dict[str, Any]]) -> None:
    stages = range(MLP_STAGES)
    print(
        f"\n{'schedule':<18} "
        + " ".join(f"{f'stage {s} MiB':>11}" for s in stages)
        + "   "
        + " ".join(f"{f'of GPipe {s}':>10}" for s in stages)
        + "   micro-batches held at stage 0, 1, 2 (min-max over steps; bound)"
    )
    for row in rows:
        name = row["schedule"] + (" + recompute" if row["recompute"] else "")
        held = ", ".join(
            f"{min(h):g}-{max(h):g} ({b})"
            for h, b in zip(row["microbatches_held"], row["bound"], strict=True)
        )
        print(
            f"{name:<18} "
            + " ".join(f"{peak / MIB:>11.3f}" for peak in row["peak_bytes"])
            + "   "
            + " ".join(f"{ratio:>10.3f}" for ratio in row["of_gpipe"])
            + f"   {held}"
        )
    expected = " ".join(f"{(MLP_STAGES - s) / MLP_MICROBATCHES:>10.3f}" for s in stages)
    print(f"{'1F1B expected':<18} " + " " * (12 * MLP_STAGES - 1) + f"   {expected}   (p - s) / m")


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive integers, e.g. 2,3,4")
    return values


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--stages", type=parse_ints, default=[2, 3, 4], help="e.g. 2,3,4")
    parser.add_argument("--microbatches", type=parse_ints, default=[1, 2, 4, 8], help="e.g. 1,8")
    parser.add_argument("--forward-ms", type=float, default=4.0, help="sleep layer's forward")
    parser.add_argument("--backward-ms", type=float, default=8.0, help="sleep layer's backward")
    parser.add_argument("--mlp-batch-size", type=int, default=2048, help="MLP bubble's batch")
    parser.add_argument("--memory-batch-size", type=int, default=256, help="memory's batch")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        parser.error(f"--steps={args.steps} must be >= 1 and --warmup={args.warmup} >= 0")
    if max(args.stages) > 8:
        parser.error(f"--stages={args.stages}: at most 8 stages (logical CPU devices)")
    for name in ("mlp_batch_size", "memory_batch_size"):
        if getattr(args, name) < MLP_MICROBATCHES:
            parser.error(
                f"--{name.replace('_', '-')}={getattr(args, name)}: must hold at least "
                f"{MLP_MICROBATCHES} examples (one per micro-batch)"
            )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * max(*args.stages, MLP_STAGES)
    )
    print(
        f"bubble: median over {args.steps} steps after {args.warmup} warm-up; sleep layers "
        f"{args.forward_ms:g} ms forward / {args.backward_ms:g} ms backward per micro-batch; "
        f"MLP 784-512-256-10, global batch {args.mlp_batch_size}, {MLP_MICROBATCHES} micro-batches"
    )
    print(BUBBLE_HEADER)
    bubbles = measure_sleep_bubbles(args) + measure_mlp_bubbles(args)
    print(
        "measured: 1 - busy / (p x span); ratio: measured / theory; hop: median stage-to-stage "
        "hand-off latency; loss: last stage's wait per step for the loss and loss.backward(); "
        "flow-shop: bubble expected from the step's mean op times per stage"
    )
    memory = measure_memory(args)
    print(
        f"\nactivation memory: MLP 784-512-256-10, {MLP_STAGES} stages, {MLP_MICROBATCHES} "
        f"micro-batches, global batch {args.memory_batch_size}; peak over {args.steps} steps"
    )
    print_memory(memory)
    write_report(args.json, machine, settings_of(args, "json"), bubble=bubbles, memory=memory)


if __name__ == "__main__":
    main()
