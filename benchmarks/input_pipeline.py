"""Input that never starves: the share of a training loop spent waiting for its next batch.

MirroredStrategy on two logical CPU devices trains overhead.py's MLP (784-512-512-10, Adam) on
global batches that cost ``--read-ms`` each to produce (a sleep standing in for reading and
decoding: it holds no core, as I/O would not), read three ways:

- ``free``: batches that cost nothing to read (the training alone: the reference);
- ``inline``: each batch read when the loop asks for it (``InputOptions()``, the default);
- ``ahead-K``: read, split and placed K batches ahead on a background thread
  (``InputOptions(experimental_per_replica_buffer_size=K)``).

For each, the loop's wall time over ``--steps`` steps and the part of it spent inside ``next()``
of the distributed dataset (the input wait). Rounds are interleaved, the order rotated by one per
round; the figures are each configuration's fastest round (interference only adds time) and its
median input-wait share. Goal: reading ahead brings the wait share near zero and the throughput
to the reference's while the read cost is below the step time.

Run from the repository root: ``python benchmarks/input_pipeline.py [--json results.json]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator, Sequence

import torch
from overhead import (
    LEARNING_RATE,
    Batch,
    machine_description,
    make_batches,
    make_model,
    mlp_replica_step,
    settings_of,
    write_report,
)

import mirrored
from mirrored import config

DEVICES = ["cpu:0", "cpu:1"]


class SlowSource:
    """Global batches that take ``seconds`` each to produce."""

    def __init__(self, batches: Sequence[Batch], seconds: float) -> None:
        self.batches = batches
        self.seconds = seconds

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for batch in self.batches:
            if self.seconds:
                time.sleep(self.seconds)
            yield batch


def measure(
    strategy: mirrored.MirroredStrategy, source: SlowSource, buffer: int, warmup: int
) -> tuple[float, float]:
    """(wall seconds, seconds waiting for input) of one pass over ``source`` after ``warmup``
    untimed steps."""
    net = make_model()
    model, optimizer = strategy.mirror(net, torch.optim.Adam(net.parameters(), lr=LEARNING_RATE))
    step = mlp_replica_step(model, optimizer)
    options = mirrored.InputOptions(experimental_per_replica_buffer_size=buffer)
    batches = iter(strategy.experimental_distribute_dataset(source, options))
    for _ in range(warmup):
        strategy.run(step, args=(next(batches),))
    waited = 0.0
    start = time.perf_counter()
    while True:
        asked = time.perf_counter()
        batch = next(batches, None)
        waited += time.perf_counter() - asked
        if batch is None:
            break
        strategy.run(step, args=(batch,))
    return time.perf_counter() - start, waited


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--read-ms", type=float, default=5.0, help="cost of reading a batch")
    parser.add_argument("--buffers", default="1,2", help="buffer sizes to compare, e.g. 1,2,4")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0], [config.LogicalDeviceConfiguration()] * 2
    )
    warmup = 3
    batches = make_batches(args.steps + warmup, args.batch_size)
    configs: dict[str, tuple[float, int]] = {"free": (0.0, 0), "inline": (args.read_ms, 0)}
    for buffer in (int(b) for b in args.buffers.split(",")):
        configs[f"ahead-{buffer}"] = (args.read_ms, buffer)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configs}
    names = list(configs)
    with mirrored.MirroredStrategy(DEVICES) as strategy:
        for round_index in range(args.rounds):
            for name in names[round_index % len(names) :] + names[: round_index % len(names)]:
                read_ms, buffer = configs[name]
                source = SlowSource(batches, read_ms / 1000)
                results[name].append(measure(strategy, source, buffer, warmup))
    reference = min(wall for wall, _ in results["free"])
    rows = []
    for name, measured in results.items():
        best = min(wall for wall, _ in measured)
        rows.append(
            {
                "config": name,
                "read_ms": configs[name][0],
                "buffer": configs[name][1],
                "best_s": best,
                "steps_per_s": args.steps / best,
                "vs_free": reference / best,
                "input_wait_share": statistics.median(w / wall for wall, w in measured),
            }
        )
    print(f"\n{'config':<10} {'read ms':>8} {'steps/s':>8} {'vs free':>8} {'input wait':>11}")
    for row in rows:
        print(
            f"{row['config']:<10} {row['read_ms']:>8.1f} {row['steps_per_s']:>8.1f} "
            f"{row['vs_free']:>7.3f}x {row['input_wait_share']:>10.1%}"
        )
    print("vs free: best to best against batches that cost nothing to read; input wait: median")
    write_report(args.json, machine_description(), settings_of(args, "json"), rows=rows)


if __name__ == "__main__":
    main()
