"""Overhead of MirroredStrategy against the plain PyTorch loop, with 2-process DDP as a peer.

Every configuration trains the same MLP (784-512-512-10, ReLU) with Adam (lr 1e-3) on the same
synthetic float32 batches (fixed seed, generated once) at the same global batch size:

- ``plain``: the single-device loop with all cores (``torch.set_num_threads(os.cpu_count())``);
- ``mirrored-1``: MirroredStrategy on ["cpu:0"], i.e. the cost of the strategy machinery alone;
- ``mirrored-2``: MirroredStrategy on two logical CPU devices sharing the same cores;
- ``ddp-2``: DistributedDataParallel over gloo, 2 processes on 127.0.0.1, cpu_count // 2 threads
  and half the global batch each.

Each measurement builds a fresh model and optimizer (and strategy), runs 3 warm-up steps, then
times ``--steps`` steps. Rounds are interleaved: each round runs every configuration once, in an
order rotated by one per round, so slow drift of the machine is spread over all of them. Ratios
to the plain loop are reported two ways (see ``summarize``); goals are judged on the fastest
measurement of each configuration. The two DDP processes are started, joined into one process group
and given their data before the first round, then wait idle (blocked on a pipe) while the other
configurations run; in their turn they build a fresh DDP model, warm up, and time the steps
between two barriers (rank 0's wall time). Process start-up and group init are not timed.
``plain`` runs on the main thread of this process, so the mirrored replicas' threads meet a main
thread that has already run parallel ops, as they would in most training scripts.

Run from the repository root: ``python benchmarks/overhead.py [--json results.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import socket
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mirrored
from mirrored import config

if TYPE_CHECKING:  # mirrored.function's type: the traced rows alone need it
    from mirrored.tracing.function import TracedFunction

Batch = tuple[torch.Tensor, torch.Tensor]

SEED = 0
LEARNING_RATE = 1e-3
WARMUP_STEPS = 3
DDP_WORLD_SIZE = 2
# Throughput goals relative to plain (None: reference or peer row, no goal).
GOALS: dict[str, float | None] = {
    "plain": None,
    "mirrored-1": 0.98,
    "mirrored-2": 0.95,
    "ddp-2": None,
}
MIRRORED_OVER_DDP_GOAL = 1.5


def make_model() -> nn.Module:
    """The same initial weights for every configuration and round."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
    )


def make_batches(num_batches: int, batch_size: int) -> list[Batch]:
    """Synthetic MNIST-shaped batches; deterministic, so the DDP processes can rebuild them."""
    generator = torch.Generator().manual_seed(SEED)
    return [
        (
            torch.randn(batch_size, 784, generator=generator),
            torch.randint(0, 10, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


class Clock:
    """Seconds per phase of a training loop, summed since the last ``reset``; the phase that runs
    now tells wrapped waits where they fall (multi_worker.py). Not thread-safe: time one thread."""

    def __init__(self) -> None:
        self.phase = "other"
        self.totals: dict[str, float] = {}

    def reset(self) -> None:
        self.totals = {}

    def add(self, key: str, seconds: float) -> None:
        self.totals[key] = self.totals.get(key, 0.0) + seconds

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        outer, self.phase = self.phase, phase
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(phase, time.perf_counter() - start)
            self.phase = outer


def timed_loop(batches: Iterable[Any], run: Callable[[Any], object], clock: Clock | None) -> float:
    """Wall seconds to ``run`` every batch. With a ``clock`` (reset first), also each step's
    seconds (``step``) and the part spent getting its batch (``input``)."""
    if clock is None:
        start = time.perf_counter()
        for batch in batches:
            run(batch)
        return time.perf_counter() - start
    clock.reset()
    iterator = iter(batches)
    start = time.perf_counter()
    while True:
        step_start = time.perf_counter()
        batch = next(iterator, None)
        if batch is None:  # the end: that last look is not a step
            break
        clock.add("input", time.perf_counter() - step_start)
        run(batch)
        clock.add("step", time.perf_counter() - step_start)
    return time.perf_counter() - start


PlainStep = Callable[[nn.Module, torch.optim.Optimizer, Any], torch.Tensor]


def time_plain(
    warmup: Sequence[Any],
    timed: Sequence[Any],
    make: Callable[[], nn.Module] = make_model,
    step: PlainStep = train_step,
    clock: Clock | None = None,
    inspect: Callable[[nn.Module, torch.optim.Optimizer], object] | None = None,
) -> float:
    """The plain loop's seconds over ``timed``; by default this script's MLP and step.
    ``clock``: see ``timed_loop``; ``inspect`` sees the model and optimizer after the steps."""
    model = make()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    for batch in warmup:
        step(model, optimizer, batch)
    seconds = timed_loop(timed, lambda batch: step(model, optimizer, batch), clock)
    if inspect is not None:
        inspect(model, optimizer)
    return seconds


ReplicaStep = Callable[[Any], torch.Tensor]


def mlp_replica_step(model: Any, optimizer: Any) -> ReplicaStep:
    """The step each replica runs, for the mirrored ``model`` and ``optimizer``."""

    def step(batch: Batch) -> torch.Tensor:
        x, y = batch
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step


class MustReplay:
    """Steps put under ``mirrored.function`` by calling this (``with MustReplay(...) as trace:
    step = trace(fn)``) must replay: a traced row that quietly ran eager would time the eager
    step under the traced row's name. While the ``with`` lasts, the warnings are recorded; at
    its end a ``mirrored.function`` warning (a fallback to eager, a retrace) or a step traced
    other than once per replica raises, naming the row. Other warnings are shown then."""

    def __init__(self, num_replicas: int, what: str) -> None:
        self.num_replicas = num_replicas
        self.what = what
        self.steps: list[TracedFunction] = []

    def __call__(self, fn: Callable[..., Any]) -> TracedFunction:
        step = mirrored.function(fn)
        self.steps.append(step)
        return step

    def __enter__(self) -> MustReplay:
        self._recording = warnings.catch_warnings(record=True)
        self._caught = self._recording.__enter__()
        warnings.simplefilter("always")
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._recording.__exit__(exc_type, error, traceback)
        ours = [w for w in self._caught if str(w.message).startswith("mirrored.function(")]
        for w in self._caught:
            if w not in ours:
                warnings.showwarning(w.message, w.category, w.filename, w.lineno)
        if error is not None:
            return
        if ours:
            raise RuntimeError(
                f"{self.what}: the traced step did not replay: {[str(w.message) for w in ours]}"
            )
        counts = [step.experimental_get_tracing_count() for step in self.steps]
        if any(count != self.num_replicas for count in counts):
            raise RuntimeError(
                f"{self.what}: traced {counts} times, expected once per replica "
                f"({self.num_replicas})"
            )


def time_mirrored(
    devices: Sequence[str],
    warmup: Sequence[Any],
    timed: Sequence[Any],
    make: Callable[[], nn.Module] = make_model,
    make_step: Callable[[Any, Any], ReplicaStep] = mlp_replica_step,
    clock: Clock | None = None,
    inspect: Callable[[mirrored.MirroredStrategy, Any, Any], object] | None = None,
) -> float:
    """Splitting the batches (experimental_distribute_dataset) is timed: it is part of the cost.
    By default this script's MLP and step; ``clock``: see ``timed_loop`` (``input`` is ``next()``
    of the distributed dataset); ``inspect`` sees the strategy, mirrored model and optimizer
    after the steps."""
    strategy = mirrored.MirroredStrategy(devices=devices)
    try:
        net = make()
        adam = torch.optim.Adam(net.parameters(), lr=LEARNING_RATE)
        model, optimizer = strategy.mirror(net, adam)
        step = make_step(model, optimizer)
        for batch in strategy.experimental_distribute_dataset(warmup):
            strategy.run(step, args=(batch,))
        seconds = timed_loop(
            strategy.experimental_distribute_dataset(timed),
            lambda batch: strategy.run(step, args=(batch,)),
            clock,
        )
        if inspect is not None:
            inspect(strategy, model, optimizer)
        return seconds
    finally:
        strategy.close()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ddp_worker(
    rank: int,
    port: int,
    steps: int,
    batch_size: int,
    commands: Any,
    results: Any,
) -> None:
    """One DDP rank: join the group once, then train a fresh model each time it is told "run"."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // DDP_WORLD_SIZE))
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DDP_WORLD_SIZE
    )
    try:
        per_rank = batch_size // DDP_WORLD_SIZE
        shard = slice(rank * per_rank, (rank + 1) * per_rank)
        batches = [(x[shard], y[shard]) for x, y in make_batches(WARMUP_STEPS + steps, batch_size)]
        dist.barrier()
        if rank == 0:
            results.put("ready")
        while commands.get() == "run":
            model = DistributedDataParallel(make_model())
            optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
            for batch in batches[:WARMUP_STEPS]:
                train_step(model, optimizer, batch)
            dist.barrier()
            start = time.perf_counter()
            for batch in batches[WARMUP_STEPS:]:
                train_step(model, optimizer, batch)
            dist.barrier()
            if rank == 0:
                results.put(time.perf_counter() - start)
    finally:
        dist.destroy_process_group()


PeerT = TypeVar("PeerT", bound="Peer")


class Peer:
    """Processes started once and kept idle (blocked on a pipe) between their turns; each command
    goes to every process and the answer comes from the first. ``target(rank, *args, commands,
    results)`` runs in each, answers "ready" once set up, then serves commands until "stop".
    ``environ``: variables set while the processes start (so they see them from their first
    line)."""

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        num_processes: int,
        name: str,
        environ: dict[str, str] | None = None,
    ) -> None:
        context = mp.get_context("spawn")
        self.name = name
        self._commands = [context.SimpleQueue() for _ in range(num_processes)]
        self._results = context.Queue()
        self._processes = [
            context.Process(
                target=target,
                args=(rank, *args, self._commands[rank], self._results),
                name=f"{name.lower()}-rank-{rank}",
            )
            for rank in range(num_processes)
        ]
        saved = {key: os.environ.get(key) for key in environ or {}}
        try:
            os.environ.update(environ or {})
            for process in self._processes:
                process.start()
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        try:
            self.ready = self._receive()  # e.g. every rank is in the group and holds its data
        except BaseException:
            self.close()
            raise

    def ask(self, command: Any) -> Any:
        for commands in self._commands:
            commands.put(command)
        return self._receive()

    def _receive(self) -> Any:
        """The next message from rank 0, or an error naming a rank that died meanwhile."""
        while True:
            try:
                return self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [(p.name, p.exitcode) for p in self._processes if not p.is_alive()]
                if dead:
                    raise RuntimeError(
                        f"{self.name} worker(s) exited early (name, exit code): {dead}"
                    ) from None

    def close(self) -> None:
        for process, commands in zip(self._processes, self._commands, strict=True):
            if process.is_alive():
                commands.put("stop")
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.terminate()
                process.join()

    def __enter__(self: PeerT) -> PeerT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class DdpPeer(Peer):
    """The DDP processes, started once and kept idle between their turns (see module docstring)."""

    def __init__(self, steps: int, batch_size: int) -> None:
        super().__init__(_ddp_worker, (free_port(), steps, batch_size), DDP_WORLD_SIZE, "DDP")

    def measure(self) -> float:
        return float(self.ask("run"))


def start_benchmark(settings: str, logical_devices: int) -> dict[str, Any]:
    """Print the machine and the run's ``settings``, give torch every core and split the CPU
    into ``logical_devices`` logical devices; returns the machine's description."""
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    print(settings)
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * logical_devices
    )
    return machine


def write_report(
    path: str | None, machine: dict[str, Any], settings: dict[str, Any], **results: Any
) -> None:
    """``--json PATH``: one run's machine, settings and results as one JSON file (nothing when
    ``path`` is None), with the load average at the end beside the one at the start."""
    if not path:
        return
    report = {"machine": machine, "settings": settings, **results}
    report["load_average_after"] = os.getloadavg()[0]
    Path(path).write_text(json.dumps(report, indent=1, default=str))


def settings_of(args: argparse.Namespace, *left_out: str) -> dict[str, Any]:
    """A run's command-line settings, but those named (output paths, a worker's own flags)."""
    return {key: value for key, value in vars(args).items() if key not in left_out}


def machine_description() -> dict[str, Any]:
    """What the figures depend on; the load average shows whether something else was running."""
    return {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_average_1min": os.getloadavg()[0],
    }


def summarize(
    times: dict[str, list[float]], steps: int, goals: dict[str, float | None] = GOALS
) -> list[dict[str, Any]]:
    """Two ratios to the plain loop, both from this run. ``ratio_best``: of the fastest
    measurement of each configuration (interference on a shared host only ever adds time, so
    the fastest is the least disturbed). ``ratio_paired``: median over rounds of the ratio to the
    same round's plain loop (cancels slow drift). Goals (``goals``: throughput over plain, or
    None) are judged on ``ratio_best``."""
    best_plain = min(times["plain"])
    rows = []
    for name, seconds in times.items():
        ratio_best = best_plain / min(seconds)
        ratio_paired = statistics.median(
            plain / mine for plain, mine in zip(times["plain"], seconds, strict=True)
        )
        goal = goals[name]
        rows.append(
            {
                "config": name,
                "seconds": seconds,
                "best_s": min(seconds),
                "median_s": statistics.median(seconds),
                "steps_per_s": steps / min(seconds),
                "ratio_best": ratio_best,
                "ratio_paired": ratio_paired,
                "goal": goal,
                "met": None if goal is None else ratio_best >= goal,
            }
        )
    return rows


def print_table(
    rows: Sequence[dict[str, Any]], steps: int, mirrored_over_ddp: float | None = None
) -> None:
    print(
        f"\n{'config':<12} {f'best s/{steps}':>11} {f'median s/{steps}':>13} {'steps/s':>8} "
        f"{'vs plain':>9} {'paired':>7} {'goal':>8} {'met':>4}"
    )
    for row in rows:
        goal = "-" if row["goal"] is None else f">={row['goal']:.2f}x"
        met = "-" if row["met"] is None else ("yes" if row["met"] else "NO")
        print(
            f"{row['config']:<12} {row['best_s']:>11.3f} {row['median_s']:>13.3f} "
            f"{row['steps_per_s']:>8.1f} {row['ratio_best']:>8.3f}x {row['ratio_paired']:>6.3f}x "
            f"{goal:>8} {met:>4}"
        )
    print("vs plain: best to best; paired: median of per-round ratios to the same round's plain")
    if mirrored_over_ddp is None:
        return
    met = "yes" if mirrored_over_ddp >= MIRRORED_OVER_DDP_GOAL else "NO"
    print(
        f"\nmirrored-2 / ddp-2 throughput (best to best): {mirrored_over_ddp:.2f}x "
        f"(aim >={MIRRORED_OVER_DDP_GOAL:.1f}x): {met}"
    )


def parse_mlp_args(
    argv: Sequence[str] | None,
    description: str,
    defaults: tuple[int, int],
    shards: int,
    why: str,
) -> argparse.Namespace:
    """``--steps``, ``--rounds`` (``defaults``), ``--batch-size`` (a multiple of ``shards``:
    ``why``) and ``--json``: the MLP benchmarks' arguments."""
    parser = argparse.ArgumentParser(description=description.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=defaults[0], help="timed steps per measurement"
    )
    parser.add_argument("--rounds", type=int, default=defaults[1], help="interleaved rounds")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch size")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error(f"--steps={args.steps} and --rounds={args.rounds} must be at least 1")
    if args.batch_size < shards or args.batch_size % shards:
        parser.error(
            f"--batch-size={args.batch_size}: must be a positive multiple of {shards} ({why})"
        )
    return args


def subset(
    parser: argparse.ArgumentParser, flag: str, value: str, choices: Sequence[str]
) -> list[str]:
    """``value``, comma-separated names of ``choices``, in the order of ``choices``."""
    chosen = [c for c in value.split(",") if c]
    if not chosen or any(c not in choices for c in chosen):
        parser.error(f"{flag}={value}: choose from {','.join(choices)}")
    return [c for c in choices if c in chosen]


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_mlp_args(
        argv, __doc__, (150, 9), DDP_WORLD_SIZE, "DDP splits it evenly over its processes"
    )
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

    with DdpPeer(args.steps, args.batch_size) as ddp:
        configs: dict[str, Callable[[], float]] = {
            "plain": lambda: time_plain(warmup, timed),
            "mirrored-1": lambda: time_mirrored(["cpu:0"], warmup, timed),
            "mirrored-2": lambda: time_mirrored(["cpu:0", "cpu:1"], warmup, timed),
            "ddp-2": ddp.measure,
        }
        times: dict[str, list[float]] = {name: [] for name in configs}
        names = list(configs)
        for round_index in range(args.rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(configs[name]())
            print(
                f"round {round_index + 1}/{args.rounds}: "
                + ", ".join(f"{name} {times[name][-1]:.3f} s" for name in names)
            )

    rows = summarize(times, args.steps)
    mirrored_over_ddp = min(times["ddp-2"]) / min(times["mirrored-2"])
    print_table(rows, args.steps, mirrored_over_ddp)
    write_report(
        args.json,
        machine,
        {**settings_of(args, "json"), "warmup_steps": WARMUP_STEPS},
        results=rows,
        mirrored_2_over_ddp_2=mirrored_over_ddp,
    )


if __name__ == "__main__":
    main()
