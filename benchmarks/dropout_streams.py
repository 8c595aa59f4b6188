"""Dropout drawn in replicas against torch's own dropout on the same tensor (issue 35): does
drawing each replica's masks from its own random stream cost more than torch's dropout?

Each row times one op on one tensor, ``--calls`` calls after 5 warm-up calls: the median call,
of the best of ``--rounds`` rounds (rounds interleave the two sides, so a noisy moment hits both):

- ``torch``: the op on the calling thread outside any strategy, with one intra-op thread (what
  a replica has when 2 or more replicas share 2 cores), drawing from torch's global generator:
  ``F.dropout`` is ATen's ``bernoulli_`` mask, a division and a product; attention with
  ``dropout_p`` is ATen's math path with a ``bernoulli_`` mask;
- ``replica``: the same call inside ``strategy.run`` on replica 0 of a 2-replica
  ``MirroredStrategy`` on logical CPU devices (replica 1 returns at once), where mirrored routes
  it to the replica's own generator (``mirrored.random.cpu_kernels``).

Shapes are the BERT job's (seed_bert.py: hidden 128, 2 heads, sequences of 128): the hidden
states and the attention weights of one replica's shard at a global batch of 128 on 4 replicas
(32 sequences) and on 1 (128). Both sides run in this one process after the strategy exists, so
both allocate under the same host-memory policy (``mirrored.config.set_host_memory_reuse``).
The goal: every row's replica time at most torch's (ratio <= 1.00x).

Run from the repository root: ``.venv/bin/python benchmarks/dropout_streams.py [--json PATH]``;
``--calls``, ``--rounds``, ``--p``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from overhead import machine_description, settings_of, write_report

import mirrored
from mirrored import config

Op = Callable[[], object]
SHAPES = {  # name: (dropout input shape, or attention's [batch, heads, seq, head_dim])
    "hidden [32, 128, 128]": ("dropout", (32, 128, 128)),
    "hidden [128, 128, 128]": ("dropout", (128, 128, 128)),
    "attention [32, 2, 128, 64]": ("attention", (32, 2, 128, 64)),
    "attention [128, 2, 128, 64]": ("attention", (128, 2, 128, 64)),
}


def make_op(kind: str, shape: tuple[int, ...], p: float) -> Op:
    generator = torch.Generator().manual_seed(0)
    if kind == "dropout":
        x = torch.randn(shape, generator=generator)
        return lambda: F.dropout(x, p, training=True)
    query, key, value = (torch.randn(shape, generator=generator) for _ in range(3))
    return lambda: F.scaled_dot_product_attention(query, key, value, dropout_p=p)


def time_calls(op: Op, calls: int) -> float:
    """Seconds per call, the median of ``calls`` after 5 warm-up calls."""
    for _ in range(5):
        op()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_torch(op: Op, calls: int) -> float:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_calls(op, calls)
    finally:
        torch.set_num_threads(threads)


def time_in_replica(strategy: mirrored.MirroredStrategy, op: Op, calls: int) -> float:
    def replica_fn() -> torch.Tensor:
        context = mirrored.get_replica_context()
        assert context is not None
        if context.replica_id_in_sync_group != 0:
            return torch.zeros(())
        if torch.get_num_threads() != 1:
            raise RuntimeError(f"replica 0 has {torch.get_num_threads()} intra-op threads")
        return torch.tensor(time_calls(op, calls))

    per_replica = strategy.run(replica_fn)
    return float(strategy.experimental_local_results(per_replica)[0])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="timed calls (default 40)")
    parser.add_argument("--rounds", type=int, default=3, help="default %(default)s")
    parser.add_argument("--p", type=float, default=0.1, help="dropout rate (default 0.1)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.rounds < 1 or not 0 < args.p < 1:
        parser.error("--calls and --rounds at least 1, --p in (0, 1)")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    print(f"p {args.p}; {args.calls} timed calls after 5 warm-up, {args.rounds} rounds")
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(cpu, [config.LogicalDeviceConfiguration()] * 2)
    rows: dict[str, dict[str, Any]] = {}
    with mirrored.MirroredStrategy(config.list_logical_devices("CPU")) as strategy:
        for name, (kind, shape) in SHAPES.items():
            op = make_op(kind, shape, args.p)
            torch_s, replica_s = [], []
            for _ in range(args.rounds):
                torch_s.append(time_torch(op, args.calls))
                replica_s.append(time_in_replica(strategy, op, args.calls))
            rows[name] = {"torch_ms": 1e3 * min(torch_s), "replica_ms": 1e3 * min(replica_s)}
    print(f"\n{'op and shape':<30} {'torch ms':>9} {'replica ms':>11} {'replica/torch':>14}")
    met = True
    for name, row in rows.items():
        row["ratio"] = row["replica_ms"] / row["torch_ms"]
        met &= row["ratio"] <= 1.0
        print(
            f"{name:<30} {row['torch_ms']:>9.2f} {row['replica_ms']:>11.2f} {row['ratio']:>13.2f}x"
        )
    verdict = "met" if met else "NOT met"
    print(f"\nGoal: a replica's dropout at most torch's on every row (<= 1.00x): {verdict}")
    write_report(args.json, machine, settings_of(args, "json"), rows=rows, goal_met=met)


if __name__ == "__main__":
    main()
