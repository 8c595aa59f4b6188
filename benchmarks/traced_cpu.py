"""Traced replica steps on the CPU against eager ones, the plain loop and ``torch.compile``
(issue 33): does ``@mirrored.function`` bring two logical CPU devices to the plain loop's
throughput on the same cores, and does ``torch.compile`` per replica give more?

overhead.py's MLP 784-512-512-10 with Adam (lr 1e-3) on its synthetic batches, global batch 256
(``--batch-size``), torch's default threads (all cores) for every row:

- ``plain``: the plain loop (``overhead.time_plain``);
- ``compiled``: the same with the model under ``torch.compile`` (inductor, default mode): what
  a compiled plain loop gives on these cores;
- ``mirrored-2``: MirroredStrategy on 2 logical CPU devices, overhead.py's replica step, eager;
- ``traced-2``: the same step under ``@mirrored.function``, checked to replay
  (``overhead.MustReplay``: no fallback, traced once per replica);
- ``compiled-2``: ``mirrored-2`` with the mirrored model under ``torch.compile``: dynamo
  compiles one graph per replica (its guards see which replica the mirrored module reaches);
  backward's hand-off, the gradient reducer and the optimizer stay eager. The issue's other
  way: torch.compile per replica.

First use, before the rounds: each row once with no timed step, the seconds to build it and
run its 3 warm-up steps, trace or compilation included, in a fresh inductor cache directory
(so compiling is cold); ``- plain``: over the plain loop's own first use. Then ``--rounds``
rounds, each row once per round in an order rotated by one (overhead.py's ``summarize`` and
``print_table``: best to best and paired ratios to plain); the goal, traced-2 at least 0.95x
the plain loop's throughput, is judged best to best. After every round, each row's final
parameters against the plain loop's, the largest absolute difference over the rounds: float32
summation order only (about 1e-6 here), or a row that computes something else.

Run from the repository root: ``.venv/bin/python benchmarks/traced_cpu.py [--json PATH]``;
``--steps``, ``--rounds``, ``--batch-size``.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch._inductor.config
from overhead import (
    WARMUP_STEPS,
    MustReplay,
    ReplicaStep,
    make_batches,
    make_model,
    mlp_replica_step,
    parse_mlp_args,
    print_table,
    settings_of,
    start_benchmark,
    summarize,
    time_mirrored,
    time_plain,
    write_report,
)
from torch import nn
from torch._dynamo.utils import counters

REPLICAS = 2
CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"
DEVICES = [f"cpu:{i}" for i in range(REPLICAS)]
GOALS: dict[str, float | None] = {
    "plain": None,
    "compiled": None,
    "mirrored-2": None,
    "traced-2": 0.95,
    "compiled-2": None,
}


def compiled_model() -> nn.Module:
    return torch.compile(make_model())  # type: ignore[return-value]


def compiled_replica_step(model: Any, optimizer: Any) -> ReplicaStep:
    return mlp_replica_step(torch.compile(model), optimizer)


class Rows:
    """Each row as one call: ``measure(row, warmup, timed)`` gives the seconds of ``timed``
    and keeps the row's final parameters in ``params[row]``."""

    def __init__(self) -> None:
        self.params: dict[str, list[torch.Tensor]] = {}

    def measure(self, row: str, warmup: Sequence[Any], timed: Sequence[Any]) -> float:
        def keep_plain(model: nn.Module, optimizer: object) -> None:
            self.params[row] = [p.detach().clone() for p in model.parameters()]

        def keep_mirrored(strategy: object, model: nn.Module, optimizer: object) -> None:
            keep_plain(model, optimizer)

        if row in ("plain", "compiled"):
            make = compiled_model if row == "compiled" else make_model
            return time_plain(warmup, timed, make=make, inspect=keep_plain)
        if row == "traced-2":
            with MustReplay(REPLICAS, row) as trace:
                return time_mirrored(
                    DEVICES,
                    warmup,
                    timed,
                    make_step=lambda model, opt: trace(mlp_replica_step(model, opt)),
                    inspect=keep_mirrored,
                )
        step = compiled_replica_step if row == "compiled-2" else mlp_replica_step
        return time_mirrored(DEVICES, warmup, timed, make_step=step, inspect=keep_mirrored)

    def largest_difference(self, row: str) -> float:
        return max(
            (a - b).abs().max().item()
            for a, b in zip(self.params[row], self.params["plain"], strict=True)
        )


def first_use(rows: Rows, warmup: Sequence[Any]) -> dict[str, float]:
    """Seconds to build each row and run its warm-up steps (traced or compiled on the way)."""
    seconds = {}
    for row in GOALS:
        start = time.perf_counter()
        rows.measure(row, warmup, [])
        seconds[row] = time.perf_counter() - start
    return seconds


def run_rounds(
    rows: Rows, rounds: int, warmup: Sequence[Any], timed: Sequence[Any]
) -> tuple[dict[str, list[float]], dict[str, float]]:
    times: dict[str, list[float]] = {row: [] for row in GOALS}
    differences = dict.fromkeys(GOALS, 0.0)
    names = list(GOALS)
    for round_index in range(rounds):
        shift = round_index % len(names)
        for row in names[shift:] + names[:shift]:
            times[row].append(rows.measure(row, warmup, timed))
        for row in names:
            differences[row] = max(differences[row], rows.largest_difference(row))
        print(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(f"{row} {times[row][-1]:.3f} s" for row in names),
            flush=True,
        )
    return times, differences


def print_first_use(seconds: dict[str, float], differences: dict[str, float]) -> None:
    print(f"\n{'row':<12} {'first use s':>11} {'- plain s':>9} {'max |dp| vs plain':>17}")
    for row, s in seconds.items():
        print(f"{row:<12} {s:11.2f} {s - seconds['plain']:9.2f} {differences[row]:17.2e}")
    print(
        "first use: building the row and its warm-up steps, tracing or cold compilation "
        "included; max |dp|: final parameters against the plain loop's, largest over rounds"
    )


@contextmanager
def cold_inductor_cache() -> Iterator[None]:
    """Inductor's cache in a new directory: the first compilation is cold, as on a new
    machine, whatever earlier runs left in the default one."""
    saved = os.environ.get(CACHE_VARIABLE)
    with tempfile.TemporaryDirectory(prefix="inductor-cache-") as cache:
        os.environ[CACHE_VARIABLE] = cache
        try:
            yield
        finally:
            if saved is None:
                del os.environ[CACHE_VARIABLE]
            else:
                os.environ[CACHE_VARIABLE] = saved


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_mlp_args(argv, __doc__, (100, 5), REPLICAS, "each replica takes an equal shard")
    machine = start_benchmark(
        f"MLP 784-512-512-10, Adam, global batch {args.batch_size}, {args.steps} timed steps "
        f"after {WARMUP_STEPS} warm-up, {args.rounds} interleaved rounds, "
        f"{os.cpu_count()} threads",
        REPLICAS,
    )
    batches = make_batches(WARMUP_STEPS + args.steps, args.batch_size)
    warmup, timed = batches[:WARMUP_STEPS], batches[WARMUP_STEPS:]
    # Compile in this process: inductor's pool of compile workers would otherwise stay busy
    # warming up after the first use, taking the cores from the first round.
    torch._inductor.config.compile_threads = 1
    rows = Rows()
    with cold_inductor_cache():
        seconds = first_use(rows, warmup)
        times, differences = run_rounds(rows, args.rounds, warmup, timed)
    table = summarize(times, args.steps, GOALS)
    print_table(table, args.steps)
    print_first_use(seconds, differences)
    compiled = {key: dict(counters[key]) for key in ("stats", "graph_break", "recompiles")}
    print(f"dynamo, all compiled rows: {compiled}")
    write_report(
        args.json,
        machine,
        {**settings_of(args, "json"), "warmup_steps": WARMUP_STEPS},
        results=table,
        first_use_s=seconds,
        max_param_difference=differences,
    )


if __name__ == "__main__":
    main()
