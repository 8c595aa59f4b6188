"""What ``mirrored.Model.fit`` costs over the training loop you would write by hand.

The same model, optimizer and data as ``overhead.py`` (MLP 784-512-512-10, ReLU, Adam lr 1e-3,
synthetic float32 batches from a fixed seed, global batch 256, all in memory), five ways:

- ``plain``: the plain single-device PyTorch loop with all cores (``overhead.time_plain``);
- ``plain-tracked``: the same loop keeping what fit reports, as a hand loop that prints its
  epoch's loss and accuracy does: the loss summed over examples and the correct predictions,
  added up on the device every step and read once, at the end;
- ``fit-1``: ``mirrored.Model(module)`` on the default one-device strategy (no scope), compiled
  with a torch Adam, ``SparseCategoricalCrossentropy(from_logits=True)`` and
  ``metrics=["accuracy"]``, trained by ``fit(x, y, batch_size=256, epochs=1, shuffle=False,
  verbose=0)``;
- ``loop-2``: the custom loop on ``MirroredStrategy`` over two logical CPU devices
  (``strategy.run`` of a step with ``compute_average_loss`` and ``optimizer.step`` inside:
  ``overhead.time_mirrored``, its ``mirrored-2`` configuration);
- ``fit-2``: ``fit`` on the same two-device ``MirroredStrategy`` (model created in its scope);
- ``fit-2-spe4``: ``fit-2`` with ``compile(steps_per_execution=4)``.

Each measurement builds a fresh model, optimizer (and strategy), runs the warm-up steps
(``overhead.WARMUP_STEPS``; for fit, one ``fit`` call on those batches), then times ``--steps``
steps; for fit that is one ``fit`` call over exactly those batches, so its per-call set-up
(data adapter, callbacks, History) is counted too. The fit variants pay for what the loops do not
do: the loss tracker and accuracy, one host copy of them per execution, the callback hooks.

Rounds are interleaved (every variant once per round, the order rotated by one each round), as in
``overhead.py``. Throughput ratios are printed, each against its reference from the same run:
fit-1 / plain-tracked (the same work), fit-1 / plain (fit's bookkeeping and the metrics), fit-2 /
loop-2 and fit-2-spe4 / loop-2, both best to best (the least disturbed measurement of each;
interference only adds time) and as the median of the per-round ratios. Goal: fit-1 over
plain-tracked and fit-2 over loop-2 at >= 0.97x (fit's bookkeeping costs under 3%), judged on
best.

Run from the repository root: ``.venv/bin/python benchmarks/fit_overhead.py`` (about 80 s on
a 2-core machine); ``--steps``, ``--rounds``, ``--batch-size``, ``--json PATH``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F

# Run as a script, this file's folder is on sys.path: the shared pieces come from overhead.py.
from overhead import (
    LEARNING_RATE,
    WARMUP_STEPS,
    Batch,
    machine_description,
    make_batches,
    make_model,
    settings_of,
    time_mirrored,
    time_plain,
    write_report,
)

import mirrored
from mirrored import config

TWO_DEVICES = ["cpu:0", "cpu:1"]
# (variant, its reference, goal for variant / reference throughput judged best to best or None).
COMPARISONS: list[tuple[str, str, float | None]] = [
    ("fit-1", "plain-tracked", 0.97),
    ("fit-1", "plain", None),
    ("fit-2", "loop-2", 0.97),
    ("fit-2-spe4", "loop-2", None),
]


class TrackedStep:
    """The plain step and the running loss and accuracy that fit reports, kept on the device."""

    def __init__(self) -> None:
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.correct = torch.zeros((), dtype=torch.int64)
        self.seen = 0

    def __call__(self, model: torch.nn.Module, optimizer: Any, batch: Batch) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            self.loss_sum += loss.detach().double() * len(y)
            self.correct += (logits.argmax(dim=1) == y).sum()
        self.seen += len(y)
        return loss

    def results(self) -> tuple[float, float]:
        """The mean loss and the accuracy (one host copy)."""
        return float(self.loss_sum) / self.seen, float(self.correct) / self.seen


def time_tracked(warmup: Sequence[Batch], timed: Sequence[Batch]) -> float:
    """``time_plain`` with ``TrackedStep``, its results read once after the timed steps."""
    step = TrackedStep()
    seconds = time_plain(warmup, timed, step=step)
    start = time.perf_counter()
    step.results()
    return seconds + time.perf_counter() - start


def as_arrays(batches: Sequence[Batch]) -> Batch:
    """The batches as one (x, y) pair, which fit batches again in the same order."""
    x, y = zip(*batches, strict=True)
    return torch.cat(x), torch.cat(y)


def time_fit(
    devices: Sequence[str] | None,
    warmup: Batch,
    timed: Batch,
    batch_size: int,
    steps_per_execution: int = 1,
) -> float:
    """Seconds of one ``fit`` call over the arrays ``timed`` after one over ``warmup``;
    ``devices=None``: the default strategy."""
    strategy = None if devices is None else mirrored.MirroredStrategy(devices=devices)
    try:
        with nullcontext() if strategy is None else strategy.scope():
            model = mirrored.Model(make_model())
            model.compile(
                optimizer=torch.optim.Adam(model.parameters(), lr=LEARNING_RATE),
                loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                steps_per_execution=steps_per_execution,
            )
        settings: dict[str, Any] = {
            "batch_size": batch_size,
            "epochs": 1,
            "shuffle": False,
            "verbose": 0,
        }
        model.fit(*warmup, **settings)
        start = time.perf_counter()
        model.fit(*timed, **settings)
        return time.perf_counter() - start
    finally:
        if strategy is not None:
            strategy.close()


def compare(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    """Throughput of each variant over its reference's, best to best and median paired."""
    rows = []
    for name, reference, goal in COMPARISONS:
        ratio_best = min(times[reference]) / min(times[name])
        ratio_paired = statistics.median(
            ref / mine for ref, mine in zip(times[reference], times[name], strict=True)
        )
        rows.append(
            {
                "variant": name,
                "reference": reference,
                "ratio_best": ratio_best,
                "ratio_paired": ratio_paired,
                "goal": goal,
                "met": None if goal is None else ratio_best >= goal,
            }
        )
    return rows


def print_report(times: dict[str, list[float]], rows: Sequence[dict[str, Any]], steps: int) -> None:
    print(f"\n{'variant':<13} {'best ms/step':>12} {'median ms/step':>15}")
    for name, seconds in times.items():
        best, median = 1e3 * min(seconds) / steps, 1e3 * statistics.median(seconds) / steps
        print(f"{name:<13} {best:>12.2f} {median:>15.2f}")
    print(f"\n{'ratio':<24} {'best':>7} {'paired':>7} {'goal':>8} {'met':>4}")
    for row in rows:
        goal = "-" if row["goal"] is None else f">={row['goal']:.2f}x"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "NO")
        print(
            f"{row['variant'] + ' / ' + row['reference']:<24} {row['ratio_best']:>6.3f}x "
            f"{row['ratio_paired']:>6.3f}x {goal:>8} {met:>4}"
        )
    print(
        "ratio: throughput of the variant over its reference's; best: fastest to fastest; "
        "paired: median of the per-round ratios"
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=160, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1 or args.batch_size < 1:
        parser.error(
            f"--steps={args.steps}, --rounds={args.rounds} and --batch-size={args.batch_size} "
            "must be at least 1"
        )
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    print(
        f"MLP 784-512-512-10, Adam, global batch {args.batch_size}, {args.steps} timed steps "
        f"after {WARMUP_STEPS} warm-up, {args.rounds} interleaved rounds"
    )

    torch.set_num_threads(os.cpu_count() or 1)
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 2)
    batches = make_batches(WARMUP_STEPS + args.steps, args.batch_size)
    warmup, timed = batches[:WARMUP_STEPS], batches[WARMUP_STEPS:]
    warmup_arrays, timed_arrays = as_arrays(warmup), as_arrays(timed)
    size = args.batch_size

    def fit_on(devices: Sequence[str] | None, steps_per_execution: int = 1) -> float:
        return time_fit(devices, warmup_arrays, timed_arrays, size, steps_per_execution)

    variants: dict[str, Callable[[], float]] = {
        "plain": lambda: time_plain(warmup, timed),
        "plain-tracked": lambda: time_tracked(warmup, timed),
        "fit-1": lambda: fit_on(None),
        "loop-2": lambda: time_mirrored(TWO_DEVICES, warmup, timed),
        "fit-2": lambda: fit_on(TWO_DEVICES),
        "fit-2-spe4": lambda: fit_on(TWO_DEVICES, steps_per_execution=4),
    }
    started = time.perf_counter()
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            times[name].append(variants[name]())
        print(
            f"round {round_index + 1}/{args.rounds}: "
            + ", ".join(f"{name} {1e3 * times[name][-1] / args.steps:.2f}" for name in names)
            + " ms/step"
        )

    rows = compare(times)
    print_report(times, rows, args.steps)
    print(
        f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}; "
        f"rounds took {time.perf_counter() - started:.0f} s"
    )
    settings = {**settings_of(args, "json"), "warmup_steps": WARMUP_STEPS}
    write_report(args.json, machine, settings, seconds=times, ratios=rows)


if __name__ == "__main__":
    main()
