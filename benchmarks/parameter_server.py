"""Asynchronous parameter servers against synchronous all-reduce, with and without a straggler.

Two workers train the same MLP (784-512-512-10, SGD lr 0.01, cross-entropy) on synthetic batches
of ``--batch-size`` examples per worker, one torch thread per process. The sides:

- ``ps_async``: ``ParameterServerStrategy`` (chief + 2 workers + 1 ps task, TF_CONFIG on
  127.0.0.1), fully asynchronous: the chief schedules ``2 * --steps`` functions of one batch
  each (pull, forward, backward, push) and times them from the first ``schedule`` to ``join``;
- ``ps_sync``: the same with ``synchronous=True``: rounds of one function per worker, averaged
  on the ps task (the parameter-server form of synchronous training);
- ``mwms``: ``MultiWorkerMirroredStrategy`` (2 processes x 1 CPU device), ``--steps`` steps
  of a global batch of ``2 * --batch-size``, timed by rank 0 between two barriers.

Each side runs without and with a straggler: worker 1 (the second worker task; rank 1 of the
all-reduce) sleeps ``--straggler-ms`` more in every step, several times slower than the other
with the defaults. Throughput is training examples per second. Every configuration is
a fresh set of processes after 4 warm-up steps per worker; rounds interleave the configurations
(order reversed every round); each figure is the best of the rounds (interference only adds
time), and the ratios are computed within this run:

- **kept**: throughput with the straggler over throughput without it, per side. A synchronous
  step waits for the slowest worker, so ``mwms`` and ``ps_sync`` keep about the straggler's
  share; ``ps_async`` lets the fast worker go on, and keeps about (1 + 1/s) / 2 for a
  straggler s times slower.
- **ps_async / mwms**: with and without the straggler.

On a 2-core machine the chief and the ps task share the cores with the workers (4 processes
for ``ps_*``, 2 for ``mwms``), and every function moves the parameters twice through RPC, so
without a straggler the parameter-server sides are expected to be slower than ``mwms`` here.

    .venv/bin/python benchmarks/parameter_server.py --json parameter_server.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

import mirrored

SIDES = ("ps_async", "ps_sync", "mwms")
WARMUP_STEPS = 4
LEARNING_RATE = 0.01
NUM_BATCHES = 16  # distinct synthetic batches per worker, cycled


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                         nn.Linear(512, 10))  # fmt: skip


def make_batches(worker: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(worker)
    return [
        (torch.randn(batch_size, 784, generator=generator),
         torch.randint(0, 10, (batch_size,), generator=generator))
        for _ in range(NUM_BATCHES)
    ]  # fmt: skip


def straggle(is_straggler: bool) -> None:
    delay = float(os.environ["BENCH_STRAGGLER_MS"]) / 1000
    if is_straggler and delay:
        time.sleep(delay)


# -- ps_* sides: every task runs this script ----------------------------------------------------
def worker_batches(context: mirrored.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return make_batches(context.input_pipeline_id, int(os.environ["BENCH_BATCH_SIZE"]))


def ps_step(model: nn.Module, optimizer: Any, iterator: Any) -> None:
    """One scheduled function: a step on the next batch of this worker's dataset."""
    x, y = next(iterator)
    F.cross_entropy(model(x), y).backward()
    straggle(rpc.get_worker_info().name.startswith("worker1"))
    optimizer.step()


def run_ps(synchronous: bool, steps: int, batch_size: int) -> dict[str, float]:
    with mirrored.ParameterServerStrategy(synchronous=synchronous, timeout_seconds=120) as strategy:
        coordinator = mirrored.ClusterCoordinator(strategy)
        net = make_model()
        model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), LEARNING_RATE))
        iterator = iter(coordinator.create_per_worker_dataset(worker_batches))
        functions = strategy.num_workers * steps

        def schedule(count: int) -> None:
            for _ in range(count):
                coordinator.schedule(ps_step, (model, optimizer, iterator))
            coordinator.join()

        schedule(strategy.num_workers * WARMUP_STEPS)
        start = time.perf_counter()
        schedule(functions)
        seconds = time.perf_counter() - start
    return {"examples_per_second": functions * batch_size / seconds, "seconds": seconds}


# -- mwms side -----------------------------------------------------------------------------------
def run_mwms(steps: int, batch_size: int) -> dict[str, float] | None:
    strategy = mirrored.MultiWorkerMirroredStrategy(devices=["cpu:0"])
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net = make_model()
    model, optimizer = strategy.mirror(net, torch.optim.SGD(net.parameters(), LEARNING_RATE))
    parts = [make_batches(worker, batch_size) for worker in range(world_size)]
    global_batches = [
        (torch.cat([p[i % NUM_BATCHES][0] for p in parts]),
         torch.cat([p[i % NUM_BATCHES][1] for p in parts]))
        for i in range(WARMUP_STEPS + steps)
    ]  # fmt: skip
    iterator = iter(strategy.experimental_distribute_dataset(global_batches))

    def step(batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        x, y = batch
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        straggle(rank == 1)
        optimizer.step()
        optimizer.zero_grad()

    for _ in range(WARMUP_STEPS):
        strategy.run(step, args=(next(iterator),))
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        strategy.run(step, args=(next(iterator),))
    dist.barrier()
    seconds = time.perf_counter() - start
    strategy.close()
    if rank:
        return None
    return {"examples_per_second": steps * world_size * batch_size / seconds, "seconds": seconds}


def task(side: str, steps: int, batch_size: int, out: Path) -> None:
    """One process of a configuration; the chief (rank 0) writes the measurement to ``out``."""
    torch.set_num_threads(1)
    result = (
        run_mwms(steps, batch_size)
        if side == "mwms"
        else run_ps(side == "ps_sync", steps, batch_size)
    )
    if result is not None:
        out.write_text(json.dumps(result))


# -- the driver ----------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def task_environments(side: str) -> Iterator[dict[str, str]]:
    """The environment of every process of ``side``: TF_CONFIG tasks, or torchrun's ranks."""
    if side == "mwms":
        port = free_port()
        for rank in range(2):
            yield {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        return
    tasks = [("chief", 0), ("worker", 0), ("worker", 1), ("ps", 0)]
    cluster: dict[str, list[str]] = {}
    for job, _ in tasks:
        cluster.setdefault(job, []).append(f"127.0.0.1:{free_port()}")
    for job, index in tasks:
        yield {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})}


def measure(side: str, straggler_ms: float, args: argparse.Namespace) -> float:
    """Throughput (examples/s) of one configuration, in fresh processes."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TF_CONFIG")}
        base.update(OMP_NUM_THREADS="1", BENCH_STRAGGLER_MS=str(straggler_ms),
                    BENCH_BATCH_SIZE=str(args.batch_size))  # fmt: skip
        command = [sys.executable, __file__, "--task", side, "--steps", str(args.steps),
                   "--batch-size", str(args.batch_size), "--out", str(out)]  # fmt: skip
        processes = [
            subprocess.Popen(command, env={**base, **env}, start_new_session=True)
            for env in task_environments(side)
        ]
        try:
            for process in processes:
                if process.wait(timeout=args.timeout):
                    raise RuntimeError(f"{side}: a process exited {process.returncode}")
        finally:
            for process in processes:
                if process.poll() is None:
                    os.killpg(process.pid, 9)
                    process.wait()
        return float(json.loads(out.read_text())["examples_per_second"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per worker (40)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (3)")
    parser.add_argument("--batch-size", type=int, default=64, help="examples per worker (64)")
    parser.add_argument("--straggler-ms", type=float, default=100.0, help="worker 1's delay (100)")
    parser.add_argument("--timeout", type=float, default=300.0, help="per configuration (300 s)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--task", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        task(args.task, args.steps, args.batch_size, args.out)
        return
    configurations = [(side, delay) for side in SIDES for delay in (0.0, args.straggler_ms)]
    measured: dict[str, list[float]] = {f"{s}@{d:g}": [] for s, d in configurations}
    for round_ in range(args.rounds):
        for side, delay in configurations if round_ % 2 == 0 else configurations[::-1]:
            throughput = measure(side, delay, args)
            measured[f"{side}@{delay:g}"].append(throughput)
            print(f"round {round_ + 1}: {side:8} straggler {delay:g} ms: {throughput:8.1f} ex/s",
                  flush=True)  # fmt: skip
    best = {key: max(values) for key, values in measured.items()}
    delay = f"{args.straggler_ms:g}"
    summary: dict[str, Any] = {
        "machine": f"{os.cpu_count()} cores, torch {torch.__version__}",
        "options": {k: getattr(args, k) for k in ("steps", "rounds", "batch_size", "straggler_ms")},
        "measured": measured,
        "best": best,
        "kept": {side: best[f"{side}@{delay}"] / best[f"{side}@0"] for side in SIDES},
        "ps_async_over_mwms": {
            "no straggler": best["ps_async@0"] / best["mwms@0"],
            "straggler": best[f"ps_async@{delay}"] / best[f"mwms@{delay}"],
        },
    }
    print(f"\nbest examples/s (no straggler / straggler {delay} ms) and kept:")
    for side in SIDES:
        print(f"  {side:8} {best[f'{side}@0']:8.1f} / {best[f'{side}@{delay}']:8.1f}   "
              f"kept {summary['kept'][side]:.2f}")  # fmt: skip
    ratio = summary["ps_async_over_mwms"]
    print(f"ps_async / mwms: {ratio['no straggler']:.2f}x without the straggler, "
          f"{ratio['straggler']:.2f}x with it")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
