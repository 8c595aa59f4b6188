"""Replica steps on 1, 2 and 4 logical GPUs of one card, eager and traced, beside the plain loop
and the plain loop under ``torch.compile`` (issue 33): a prepared check for a machine with one
CUDA card; on a machine without one it says so and stops.

Workloads (multi_worker.py's, so the same model and batches as its runs):

- ``bert``: examples/bert_mlm.py's ``BertMaskedLM``, BERT-tiny (2 layers, 2 heads, hidden 128,
  intermediate 512, dropout 0.1), 128 tokens with 20 masked, an 8000-row vocabulary
  (seed_bert.py's job, but for its 8192 rows), global batch 128;
- ``mlp``: overhead.py's MLP 784-512-512-10, global batch 256;

Adam (lr 1e-3; foreach, torch's choice on CUDA), batches made once and put on the card before
anything is timed (no input pipeline in the step).

Rows, strong scaling (the global batch split over the replicas, all of them on the one card):

- ``plain``: the plain loop on the card;
- ``compiled``: the same with the model under ``torch.compile(mode="reduce-overhead")``
  (inductor's kernels replayed as CUDA graphs; backward's hand-off and Adam stay eager);
- ``mirrored-1``, ``-2``, ``-4``: MirroredStrategy on 1, 2, 4 logical GPUs of the card (its
  default cross-device ops), the step with ``compute_average_loss(global_batch_size=...)``;
- ``traced-1``, ``-2``, ``-4``: the same step under ``@mirrored.function``, checked to replay
  (``overhead.MustReplay``: no fallback to eager, traced once per replica). On CUDA a replay
  runs the pieces between host calls as the graph's FX Python code (tracing/replay.py
  scripts CPU pieces only): no module calls, autograd recording or per-op mode, but still one
  Python call per op under the GIL.

Each measurement builds its model (and strategy), runs 5 warm-up steps (tracing, compiling and
CUDA-graph recording happen there), then times ``--steps`` steps between two
``torch.cuda.synchronize()``; rounds are interleaved (the order rotated by one per round) and a
round starts only while ``--budget-s`` is not spent, so a run ends in about that time plus one
round. A row that fails prints its error and is left out of later rounds; the others go on.

Printed: ms per step per row (best and median over rounds) and its ratio to the plain loop;
the issue's ratios: traced-N / traced-1 step time (goal <= 1.15: replicas that share a card
cost no more than one replica with the whole batch) and compiled / traced-1 step time
(traced-1's throughput over the compiled plain loop's, goal >= 1.0); mirrored-N / mirrored-1
beside them. Also each row's final parameters against the plain loop's of the same round,
largest absolute difference (TF32 and kernel choice differ between rows; BERT's dropout masks
differ between the plain loop and the replicas' streams, so for it only the order of magnitude
means anything).

Run from the repository root (about 5 minutes on one H200):
``.venv/bin/python benchmarks/gpu_scaling.py [--json PATH]``; ``--workloads``, ``--rows``,
``--steps``, ``--rounds``, ``--budget-s``. ``--device cpu`` runs the same code on logical CPU
devices with ``torch.compile``'s default mode, a smoke run of this script, not a measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
from compare import UNTIMED
from multi_worker import WORKLOADS, Workload
from multi_worker import train_step as phased_step
from overhead import (
    LEARNING_RATE,
    MustReplay,
    machine_description,
    settings_of,
    subset,
    write_report,
)
from torch import nn

import mirrored
from mirrored import config

Batch = tuple[torch.Tensor, ...]

WARMUP_STEPS = 5  # compiling, CUDA graphs' warm-up and recording take the first calls
REPLICA_COUNTS = (1, 2, 4)
GLOBAL_BATCH = {"bert": 128, "mlp": 256}
ROWS = (
    "plain",
    "compiled",
    *(f"{kind}-{n}" for kind in ("mirrored", "traced") for n in REPLICA_COUNTS),
)
SCALING_GOAL = 1.15  # traced-N / traced-1 step time, at most
COMPILED_GOAL = 1.0  # compiled / traced-1 step time, at least


@dataclasses.dataclass(frozen=True)
class Measured:
    seconds: float
    params: list[torch.Tensor]


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, warm_up: Callable[[], object], run: Callable[[], object]) -> float:
    """Seconds of ``run`` after ``warm_up``, from an idle device to an idle device."""
    warm_up()
    synchronize(device)
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def final_params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().float().cpu() for p in model.parameters()]


def plain_row(
    workload: Workload, batches: Sequence[Batch], device: torch.device, compile_mode: str | None
) -> Measured:
    model = workload.make_model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    forward = model if compile_mode is None else torch.compile(model, mode=compile_mode)

    def loss(batch: Batch) -> torch.Tensor:
        return workload.per_example_loss(forward, batch).mean()

    def steps(some: Sequence[Batch]) -> None:
        for batch in some:
            phased_step(functools.partial(loss, batch), optimizer, UNTIMED)

    seconds = timed(
        device, lambda: steps(batches[:WARMUP_STEPS]), lambda: steps(batches[WARMUP_STEPS:])
    )
    return Measured(seconds, final_params(model))


def mirrored_row(
    workload: Workload, batches: Sequence[Batch], devices: list[str], traced: bool
) -> Measured:
    global_batch = batches[0][0].shape[0]
    with mirrored.MirroredStrategy(devices=devices) as strategy:
        net = workload.make_model()
        model, optimizer = strategy.mirror(
            net, torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
        )

        def train(batch: Batch) -> torch.Tensor:
            return phased_step(
                lambda: mirrored.compute_average_loss(
                    workload.per_example_loss(model, batch), global_batch_size=global_batch
                ),
                optimizer,
                UNTIMED,
            )

        def steps(step: Callable[[Batch], torch.Tensor], some: Sequence[Batch]) -> None:
            for batch in strategy.experimental_distribute_dataset(some):
                strategy.run(step, args=(batch,))

        with MustReplay(len(devices), f"traced-{len(devices)} ({workload.name})") as trace:
            step = trace(train) if traced else train
            seconds = timed(
                batches[0][0].device,
                lambda: steps(step, batches[:WARMUP_STEPS]),
                lambda: steps(step, batches[WARMUP_STEPS:]),
            )
        return Measured(seconds, final_params(net))


def measure(row: str, workload: Workload, batches: Sequence[Batch], kind: str) -> Measured:
    device = batches[0][0].device
    if row in ("plain", "compiled"):
        mode = "reduce-overhead" if kind == "GPU" else "default"
        return plain_row(workload, batches, device, mode if row == "compiled" else None)
    n = int(row.rsplit("-", 1)[1])
    names = [d.short_name for d in config.list_logical_devices(kind)[:n]]
    return mirrored_row(workload, batches, names, traced=row.startswith("traced"))


def run_workload(
    name: str, rows: Sequence[str], args: argparse.Namespace, kind: str, deadline: float
) -> dict[str, Any]:
    """Rounds of every row (see module docstring): seconds per round, errors, and the largest
    difference of each row's final parameters from the same round's plain loop."""
    workload = WORKLOADS[name]
    device = torch.device("cuda" if kind == "GPU" else "cpu")
    made = workload.make_batches(WARMUP_STEPS + args.steps, GLOBAL_BATCH[name])
    batches = [tuple(t.to(device) for t in batch) for batch in made]
    print(f"\n== {name}: {workload.description}, global batch {GLOBAL_BATCH[name]}", flush=True)
    seconds: dict[str, list[float]] = {row: [] for row in rows}
    errors: dict[str, str] = {}
    differences: dict[str, float] = {}
    for round_index in range(args.rounds):
        if round_index and time.perf_counter() > deadline:
            print(f"--budget-s spent: {round_index} round(s)", flush=True)
            break
        shift = round_index % len(rows)
        params: dict[str, list[torch.Tensor]] = {}
        for row in [*rows[shift:], *rows[:shift]]:
            if row in errors:
                continue
            try:
                result = measure(row, workload, batches, kind)
            except Exception as error:  # one row's failure must not lose the others
                errors[row] = f"{type(error).__name__}: {error}"
                print(f"{row} failed:\n{traceback.format_exc()}", flush=True)
                continue
            seconds[row].append(result.seconds)
            params[row] = result.params
        for row, values in params.items():
            if "plain" in params:
                gap = max(
                    (a - b).abs().max().item() for a, b in zip(values, params["plain"], strict=True)
                )
                differences[row] = max(differences.get(row, 0.0), gap)
        print(
            f"round {round_index + 1}: "
            + ", ".join(f"{r} {1e3 * s[-1] / args.steps:.2f}" for r, s in seconds.items() if s)
            + " ms/step",
            flush=True,
        )
    return {"seconds": seconds, "errors": errors, "max_param_difference": differences}


def summarize(result: dict[str, Any], steps: int) -> dict[str, Any]:
    """ms per step (best, median) per row that ran, and the issue's ratios where both rows ran."""
    ms = {
        row: {"best": 1e3 * min(s) / steps, "median": 1e3 * statistics.median(s) / steps}
        for row, s in result["seconds"].items()
        if s
    }
    ratios: dict[str, dict[str, Any]] = {}

    def ratio(name: str, mine: str, base: str, goal: float | None, at_most: bool) -> None:
        if mine in ms and base in ms:
            value = ms[mine]["best"] / ms[base]["best"]
            met = None if goal is None else (value <= goal if at_most else value >= goal)
            ratios[name] = {"value": value, "goal": goal, "at_most": at_most, "met": met}

    for n in REPLICA_COUNTS[1:]:
        ratio(f"traced-{n} / traced-1 step", f"traced-{n}", "traced-1", SCALING_GOAL, True)
        ratio(f"mirrored-{n} / mirrored-1 step", f"mirrored-{n}", "mirrored-1", None, True)
    ratio("compiled / traced-1 step", "compiled", "traced-1", COMPILED_GOAL, False)
    ratio("mirrored-1 / traced-1 step", "mirrored-1", "traced-1", None, False)
    return {"ms_per_step": ms, "ratios": ratios}


def print_summary(name: str, result: dict[str, Any], summary: dict[str, Any]) -> None:
    ms = summary["ms_per_step"]
    plain = ms.get("plain", {}).get("best")
    print(f"\n{name}: {'row':<11} {'best ms':>8} {'median ms':>9} {'x plain':>7} {'max |dp|':>9}")
    for row, values in ms.items():
        vs_plain = f"{values['best'] / plain:7.2f}" if plain else f"{'-':>7}"
        gap = result["max_param_difference"].get(row)
        print(
            f"{name}: {row:<11} {values['best']:8.3f} {values['median']:9.3f} {vs_plain} "
            + (f"{gap:9.1e}" if gap is not None else f"{'-':>9}")
        )
    for row, error in result["errors"].items():
        print(f"{name}: {row:<11} FAILED: {error.splitlines()[0]}")
    for label, r in summary["ratios"].items():
        goal = "" if r["goal"] is None else f" (goal {'<=' if r['at_most'] else '>='} {r['goal']})"
        met = "" if r["met"] is None else (": met" if r["met"] else ": NOT met")
        print(f"{name}: {label}: {r['value']:.3f}{goal}{met}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="bert,mlp", help="comma-separated: bert, mlp")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    parser.add_argument("--steps", type=int, default=50, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, at most")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=240.0,
        help="no new round of a workload once its share of this many seconds is spent "
        "(default 240; the first round always runs)",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: a smoke run of this script on logical CPU devices, not a measurement",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    args.workloads = subset(parser, "--workloads", args.workloads, tuple(GLOBAL_BATCH))
    args.rows = subset(parser, "--rows", args.rows, ROWS)
    if args.steps < 1 or args.rounds < 1 or args.budget_s <= 0:
        parser.error(
            f"--steps={args.steps}, --rounds={args.rounds} must be at least 1 and "
            f"--budget-s={args.budget_s} positive"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_scaling.py: no CUDA device here (torch.cuda.is_available() is False); skipped. "
            "Run it on a machine with one CUDA card, or --device cpu for a smoke run."
        )
        return
    start = time.perf_counter()
    kind = "GPU" if args.device == "cuda" else "CPU"
    machine = machine_description()
    if kind == "GPU":
        machine["card"] = torch.cuda.get_device_name(0)
        machine["cuda"] = torch.version.cuda
    print(", ".join(f"{key}: {value}" for key, value in machine.items()), flush=True)
    physical = config.list_physical_devices(kind)[0]
    config.set_logical_device_configuration(
        physical, [config.LogicalDeviceConfiguration()] * max(REPLICA_COUNTS)
    )
    results, summaries = {}, {}
    for name in args.workloads:
        deadline = time.perf_counter() + args.budget_s / len(args.workloads)
        results[name] = run_workload(name, args.rows, args, kind, deadline)
        summaries[name] = summarize(results[name], args.steps)
    for name in args.workloads:
        print_summary(name, results[name], summaries[name])
    print(f"\n{time.perf_counter() - start:.0f} s in all")
    write_report(args.json, machine, settings_of(args, "json"), results=results, summary=summaries)


if __name__ == "__main__":
    main()
