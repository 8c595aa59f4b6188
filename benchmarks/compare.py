"""One table: mirrored against plain PyTorch, DistributedDataParallel and TensorFlow, four models.

Every row trains the same model with Adam (lr 1e-3) on the same synthetic global batches (fixed
seed) at the same global batch size, and every row but the plain loop splits each batch evenly
over its replicas. Workloads (``--workloads``):

- ``mlp``: overhead.py's MLP 784-512-512-10, global batch 256;
- ``bert``: multi_worker.py's BERT-tiny masked LM (2 layers, hidden 128, 2 heads, vocabulary 8000,
  128 tokens with 20 masked), global batch 32;
- ``cnn``: a small CNN on 3x32x32 images, 10 classes (conv 3->16, ReLU, max-pool 2, conv 16->32,
  ReLU, max-pool 2, linear 2048->10; 3x3 kernels, padding 1), global batch 128;
- ``mobilenet``: the articles' MobileNetV2 job at a small image size: examples/mobilenet.py's
  ``MobileNetV2`` (torchvision's layers, defined there) on 3x64x64 images, 2 classes, global
  batch 64.

Rows:

- ``plain``: the single-device loop in this process, all cores (overhead.py's ``time_plain``);
- ``mirrored-1``, ``-2``, ``-4``: ``MirroredStrategy`` on 1, 2, 4 logical CPU devices of this
  process (``config.set_logical_device_configuration`` before the first strategy; the replicas
  share the cores, ``cores // replicas`` intra-op threads each, at least 1), the custom loop of
  overhead.py's ``time_mirrored`` (``strategy.mirror``, ``experimental_distribute_dataset``,
  ``strategy.run`` of a step with ``compute_average_loss``);
- ``mirrored-2proc``: ``MultiWorkerMirroredStrategy(devices=["cpu:0"])`` in 2 processes x 1
  device, 1 thread each, on a gloo group on 127.0.0.1, with its default communication (AUTO:
  gradients summed through shared memory between the two processes of this machine, gloo for the
  rest): multi_worker.py's ``measure_mirrored``;
- ``mirrored-2proc-x2``: the same in the same 2 processes with 2 logical CPU devices each
  (``devices=["cpu:0", "cpu:1"]``, 4 replicas, the process's one thread split between its two):
  judged against ``ddp-2proc``, the same processes on the same cores, as well as any peer with 4
  devices; its breakdown shows only the input (the phase clock is the process's, and both
  replica threads would add to it);
- ``ddp-2proc``: ``DistributedDataParallel`` (gloo, defaults) in the same two processes on the
  same group, each on its half of every batch: multi_worker.py's ``measure_ddp``;
- ``tf-mirrored-1``, ``-2``, ``-4``: ``tf.distribute.MirroredStrategy`` (its defaults) on 1, 2, 4
  of 4 logical CPU devices (``tf.config.set_logical_device_configuration``), each row in a
  process of its own (strategies of different sizes in one process collide on TensorFlow's
  collective group keys); in Keras, the articles' own programs where they exist: KerasHub's
  ``BertMaskedLM`` on a randomly initialised ``BertBackbone`` of the bert_tiny shape (no
  download; inputs ``token_ids``, ``segment_ids`` of zeros, ``padding_mask`` and
  ``mask_positions``) and ``keras.applications.MobileNetV2(weights=None)`` with a 2-class head
  (logits), else the same layer shapes (the MLP, the CNN); images channels-last, TensorFlow's
  CPU layout; oneDNN kernels on (``TF_ENABLE_ONEDNN_OPTS=1`` unless set: TensorFlow's own
  default only on some CPUs), Keras's Adam (lr 1e-3), a ``tf.function`` of ``strategy.run`` with
  ``GradientTape``, ``tf.nn.compute_average_loss`` and ``apply_gradients``, input from
  ``strategy.experimental_distribute_dataset`` of a ``tf.data`` dataset of the same batches;
  TensorFlow's own thread pools. Only when ``tensorflow`` is installed and imports (the
  ``tensorflow`` extra, with KerasHub: ``pip install -e '.[tensorflow]'``); otherwise one line
  says they were skipped (without ``keras_hub``, the bert workload's TensorFlow rows fail and
  are left out of it).

Timing: each measurement builds a fresh model and optimizer (and strategy; TensorFlow's are built
once per row and reused, so that tracing is not repeated), runs 3 warm-up steps, then times
``--steps`` steps (the 2-process rows: between two barriers, rank 0's wall time). Rounds are
interleaved per workload: each round measures every row once, the order rotated by one per round,
while the other rows' processes wait idle on a pipe. Throughput is examples per second of the
fastest round; **vs plain** is best to best (interference only adds time, so the fastest round is
the least disturbed), **paired** the median over rounds of the ratio to the same round's plain
loop, as in overhead.py.

Memory per replica, two figures:

- **state**: bytes of the replica's parameters, their gradients (one per parameter that requires
  one, held from backward to ``zero_grad``) and its optimizer state, computed from the tensors
  after the timed steps; a tensor several replicas share (mirrored's optimizer state on replicas of
  one device, ``sharded_update.py``) counts 1/k to each of its k replicas. The 2-process rows hold
  one replica per process, so their state is the plain loop's. Communication buffers
  (DDP's buckets, the reducer's packs) and activations are not counted;
- **peak RSS**: the resident set's high-water mark of the process during the measurement
  (``resource.getrusage(RUSAGE_SELF).ru_maxrss`` after resetting it through
  ``/proc/self/clear_refs`` before the warm-up), and in brackets its growth over the RSS at that
  reset. It is per process: this process holds every in-process row's data, and its replicas
  share it; for the 2-process rows it is the larger of the two processes'. Where the reset is
  refused the figure is the process's lifetime peak, marked ``*``.

Per-step breakdown, shares of the median step (``time.perf_counter``; medians over rounds of each
phase's mean per step): **fwd** (forward and loss), **bwd** (``loss.backward()``), **opt**
(``optimizer.step()`` + ``zero_grad()``), **in** (getting the batch: ``next()`` of the list, or of
the distributed dataset: splitting it, and across processes the workers' agreement) and **other**
(the step less those: dispatch through ``strategy.run``, timers). Measured on the thread that runs
replica 0 (the caller's thread in mirrored), or on rank 0. Where the all-reduce runs depends on the
row: in-process mirrored sums gradients inside ``optimizer.step()`` (it includes waiting for the
other replicas' backward); DDP and ``mirrored-2proc`` all-reduce during backward, so what is not
hidden shows in bwd (and, for mirrored, the wait in ``finish_pass`` in opt). TensorFlow's step is
one ``tf.function``: only its input share is measured.

The scaling model (scaling_model.py) is checked against the 2-process rows. Its inputs are
measured here: one replica's forward, backward and Adam update with no communication (the two
processes at once, each on its half of a batch with a plain model, every round:
``max(3, steps // 2)`` steps after one warm-up, median over rounds of the two processes' mean);
the gradient bytes and buckets of the model (DDP's rule for ddp-2proc; mirrored's own
``plan_buckets`` with its defaults for mirrored-2proc); and the link: the median time of
``all_reduce`` of 4 KiB to 16 MiB of float32 between the two processes after a barrier (10
repeats after 2 warm-ups; 3 with ``--quick``), through gloo (``dist.all_reduce``: for ddp-2proc)
and through the strategy's worker group (shared memory: for mirrored-2proc), fitted to
``2(N-1)/N * G/B + 2(N-1)a``. It then predicts N = 1, 2, 4, 8 GPUs over named links (bandwidths
and latencies assumed, printed), from the plain loop's measured phases divided by
``--gpu-speedup`` (an assumption; printed) or from ``--compute-ms``.

Run from the repository root (for the MLP, BERT and the CNN about 6 minutes on 2 cores with the
TensorFlow rows, 4 without, ``--quick`` about a minute; MobileNetV2 adds minutes more, choose with
``--workloads``):
``.venv/bin/python benchmarks/compare.py [--json PATH] [--png PATH]``; ``--workloads``,
``--steps``, ``--rounds``, ``--gpu-speedup``, ``--compute-ms``, ``--no-tf``, ``--timeout``.
``--png`` needs matplotlib (``pip install "mirrored[compare]"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import math
import os
import resource
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import scaling_model
import torch
import torch.distributed as dist
from multi_worker import (
    SEQ_LEN,
    VOCAB_SIZE,
    WORKLOADS,
    Workload,
    local_part,
    measure_ddp,
    measure_mirrored,
    mlp_loss,
)
from multi_worker import train_step as phased_step
from overhead import (
    LEARNING_RATE,
    SEED,
    WARMUP_STEPS,
    Clock,
    Peer,
    free_port,
    machine_description,
    settings_of,
    time_mirrored,
    time_plain,
    write_report,
)
from torch import nn

import mirrored
from mirrored import config
from mirrored.comm.bucketing import plan_buckets

Batch = tuple[torch.Tensor, ...]
Record = dict[str, Any]

LOGICAL_DEVICES = 4
PROCESSES = 2
LINK_SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)
PHASES = ("forward", "backward", "optimizer", "input")
# Row: devices (replicas) it trains on.
DEVICE_COUNT = {
    "plain": 1,
    "mirrored-1": 1,
    "mirrored-2": 2,
    "mirrored-4": 4,
    "mirrored-2proc": 2,
    "mirrored-2proc-x2": 4,
    "ddp-2proc": 2,
    "tf-mirrored-1": 1,
    "tf-mirrored-2": 2,
    "tf-mirrored-4": 4,
}
LOCAL_ROWS = ("plain", "mirrored-1", "mirrored-2", "mirrored-4")
PROCESS_ROWS = ("mirrored-2proc", "mirrored-2proc-x2", "ddp-2proc")
# Logical CPU devices of each of the two processes (the x2 row trains on both).
PROCESS_DEVICES = 2
TF_ROWS = ("tf-mirrored-1", "tf-mirrored-2", "tf-mirrored-4")
MIRRORED_ROWS = ("mirrored-1", "mirrored-2", "mirrored-4", "mirrored-2proc", "mirrored-2proc-x2")
PEER_ROWS = ("ddp-2proc", *TF_ROWS)
# A peer judged at the same processes and cores rather than the same device count.
SAME_PROCESSES_PEER = {"mirrored-2proc-x2": "ddp-2proc"}
# The articles' MobileNetV2 job: cats against dogs, at the example's small default image size.
MOBILENET_SIDE = 64
MOBILENET_CLASSES = 2


# -- the CNN and the workloads ---------------------------------------------------------------------


def make_cnn(channels: tuple[int, int] = (16, 32), side: int = 32) -> nn.Module:
    """The same initial weights for every measurement; ``channels`` of the two convolutions,
    images of ``side`` x ``side``."""
    torch.manual_seed(SEED)
    return nn.Sequential(
        nn.Conv2d(3, channels[0], 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(channels[0], channels[1], 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(channels[1] * (side // 4) ** 2, 10),
    )


def make_mobilenet() -> nn.Module:
    """examples/mobilenet.py's MobileNetV2 (torchvision's layers, no torchvision needed)."""
    from mirrored.examples.mobilenet import MobileNetV2

    torch.manual_seed(SEED)
    return MobileNetV2(num_classes=MOBILENET_CLASSES)


def make_image_batches(
    num_batches: int, batch_size: int, side: int = 32, num_classes: int = 10
) -> list[Batch]:
    """Synthetic 3 x side x side images and labels; deterministic in every process."""
    generator = torch.Generator().manual_seed(SEED)
    return [
        (
            torch.randn(batch_size, 3, side, side, generator=generator),
            torch.randint(0, num_classes, (batch_size,), generator=generator),
        )
        for _ in range(num_batches)
    ]


@dataclasses.dataclass(frozen=True)
class Spec:
    """A workload and how it is run: global batch, timed steps (full and ``--quick``)."""

    workload: Workload
    batch_size: int
    steps: int
    quick_steps: int


SPECS = {
    "mlp": Spec(WORKLOADS["mlp"], 256, 150, 10),
    "bert": Spec(WORKLOADS["bert"], 32, 8, 2),
    "cnn": Spec(
        Workload(
            "cnn",
            "CNN conv16-conv32-linear on 3x32x32 images, 10 classes",
            make_cnn,
            make_image_batches,
            mlp_loss,
        ),
        128,
        40,
        4,
    ),
    "mobilenet": Spec(
        Workload(
            "mobilenet",
            f"MobileNetV2 (examples/mobilenet.py) on 3x{MOBILENET_SIDE}x{MOBILENET_SIDE}, "
            f"{MOBILENET_CLASSES} classes",
            make_mobilenet,
            functools.partial(
                make_image_batches, side=MOBILENET_SIDE, num_classes=MOBILENET_CLASSES
            ),
            mlp_loss,
        ),
        64,
        10,
        2,
    ),
}


# -- memory ----------------------------------------------------------------------------------------


def reset_peak_rss() -> tuple[int, bool]:
    """Reset this process's RSS high-water mark (Linux: /proc/self/clear_refs); returns the RSS
    now and whether the reset worked."""
    try:
        with open("/proc/self/clear_refs", "w") as file:
            file.write("5")
        reset = True
    except OSError:
        reset = False
    with open("/proc/self/statm") as file:
        rss = int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, reset


def peak_rss() -> int:
    """Bytes: the RSS high-water mark since the last reset (or since the process started)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def state_bytes_per_replica(
    modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer]
) -> list[float]:
    """Parameters + buffers + one gradient per parameter that requires one + optimizer state, per
    replica; a storage that k replicas share counts 1/k to each."""
    holders: dict[int, set[int]] = {}
    sizes: dict[int, int] = {}

    def hold(replica: int, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        holders.setdefault(storage.data_ptr(), set()).add(replica)
        sizes[storage.data_ptr()] = storage.nbytes()

    gradients = [0] * len(modules)
    for replica, (module, optimizer) in enumerate(zip(modules, optimizers, strict=True)):
        for param in module.parameters():
            hold(replica, param)
            if param.requires_grad:
                gradients[replica] += param.numel() * param.element_size()
        for buffer in module.buffers():
            hold(replica, buffer)
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    hold(replica, value)
    shares = [float(g) for g in gradients]
    for pointer, replicas in holders.items():
        for replica in replicas:
            shares[replica] += sizes[pointer] / len(replicas)
    return shares


# -- in-process rows -------------------------------------------------------------------------------


class Untimed(Clock):
    """A clock that records nothing: the replicas other than replica 0."""

    def add(self, key: str, seconds: float) -> None:
        pass


UNTIMED = Untimed()


def per_step_ms(clock: Clock, steps: int) -> dict[str, float]:
    return {key: 1e3 * total / steps for key, total in clock.totals.items()}


def measure_local(row: str, spec: Spec, batches: Sequence[Batch]) -> Record:
    """One measurement of ``plain`` or ``mirrored-N`` in this process."""
    workload, clock = spec.workload, Clock()
    warmup, timed = batches[:WARMUP_STEPS], batches[WARMUP_STEPS:]
    inspected: list[float] = []
    rss_before, reset = reset_peak_rss()
    if row == "plain":

        def plain_step(model: nn.Module, optimizer: Any, batch: Batch) -> torch.Tensor:
            return phased_step(
                lambda: workload.per_example_loss(model, batch).mean(), optimizer, clock
            )

        def inspect_plain(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
            inspected.extend(state_bytes_per_replica([model], [optimizer]))

        seconds = time_plain(warmup, timed, workload.make_model, plain_step, clock, inspect_plain)
    else:
        num_replicas = DEVICE_COUNT[row]

        def make_step(model: Any, optimizer: Any) -> Callable[[Batch], torch.Tensor]:
            def step(batch: Batch) -> torch.Tensor:
                context = mirrored.get_replica_context()
                mine = clock if context and context.replica_id_in_sync_group == 0 else UNTIMED
                return phased_step(
                    lambda: mirrored.compute_average_loss(workload.per_example_loss(model, batch)),
                    optimizer,
                    mine,
                )

            return step

        def inspect_mirrored(strategy: Any, model: Any, optimizer: Any) -> None:
            inspected.extend(state_bytes_per_replica(model.replicas, optimizer.optimizers))

        devices = [f"cpu:{i}" for i in range(num_replicas)]
        seconds = time_mirrored(
            devices, warmup, timed, workload.make_model, make_step, clock, inspect_mirrored
        )
    return {
        "seconds": seconds,
        "phases_ms": per_step_ms(clock, len(timed)),
        "state_bytes": max(inspected),
        "peak_rss": peak_rss(),
        "rss_before": rss_before,
        "rss_reset": reset,
    }


# -- the two processes -----------------------------------------------------------------------------


def _compute_pass(workload: Workload, batches: Sequence[Batch], steps: int) -> dict[str, float]:
    """One replica's forward, backward and Adam update with no communication, on this process's
    half of each batch, in both processes at once: seconds per step, means over ``steps``."""
    rank = dist.get_rank()
    model = workload.make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
    totals = dict.fromkeys(("forward", "backward", "update"), 0.0)
    dist.barrier()
    for index in range(steps + 1):  # the first is a warm-up
        part = local_part(batches[index % len(batches)], rank, PROCESSES)
        start = time.perf_counter()
        loss = workload.per_example_loss(model, part).mean()
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        end = time.perf_counter()
        if index:
            totals["forward"] += forward - start
            totals["backward"] += backward - forward
            totals["update"] += end - backward
    dist.barrier()
    return {key: total / steps for key, total in totals.items()}


def _link_pass(
    strategy: mirrored.MultiWorkerMirroredStrategy, sizes: Sequence[int], repeats: int
) -> dict[str, list[float]]:
    """Median seconds of one all-reduce of each size (bytes of float32) between the two
    processes, after a barrier: through gloo, and through the strategy's worker group."""
    paths: dict[str, Callable[[torch.Tensor], object]] = {
        "gloo": dist.all_reduce,
        "strategy": lambda tensor: strategy.worker_group.all_reduce(tensor, "link"),
    }
    medians: dict[str, list[float]] = {}
    for path, all_reduce in paths.items():
        medians[path] = []
        for size in sizes:
            tensor = torch.ones(size // 4)
            times = []
            for index in range(2 + repeats):  # two warm-ups
                dist.barrier()
                start = time.perf_counter()
                all_reduce(tensor)
                if index >= 2:
                    times.append(time.perf_counter() - start)
            medians[path].append(statistics.median(times))
    return medians


def _process_worker(
    rank: int,
    port: int,
    plan: dict[str, tuple[int, int]],
    timeout: float,
    commands: Any,
    results: Any,
) -> None:
    """One of the two processes: the strategy (which sets up the gloo group DDP shares), every
    workload's batches, then commands: ("measure", row, workload), ("compute", workload, steps),
    ("link", sizes, repeats); rank 0 answers with every rank's result."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(PROCESSES),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // PROCESSES))
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * PROCESS_DEVICES
    )
    options = mirrored.CommunicationOptions(timeout_seconds=timeout)
    strategy = mirrored.MultiWorkerMirroredStrategy(options, devices=["cpu:0"])
    # The x2 row's, made at its first measurement: it joins the first one's process group.
    wide: mirrored.MultiWorkerMirroredStrategy | None = None
    try:
        batches = {
            name: SPECS[name].workload.make_batches(WARMUP_STEPS + steps, batch_size)
            for name, (steps, batch_size) in plan.items()
        }
        dist.barrier()
        if rank == 0:
            results.put(repr(strategy))
        while (command := commands.get()) != "stop":
            kind, *rest = command
            answer: Any
            if kind == "measure":
                row, name = rest
                workload, steps = SPECS[name].workload, plan[name][0]
                rss_before, reset = reset_peak_rss()
                if row == "ddp-2proc":
                    answer = measure_ddp(workload, batches[name], steps, 0)
                elif row == "mirrored-2proc":
                    answer = measure_mirrored(strategy, workload, batches[name], steps, 0)
                else:
                    devices = [f"cpu:{i}" for i in range(PROCESS_DEVICES)]
                    wide = wide or mirrored.MultiWorkerMirroredStrategy(options, devices=devices)
                    answer = measure_mirrored(wide, workload, batches[name], steps, 0)
                answer.update(peak_rss=peak_rss(), rss_before=rss_before, rss_reset=reset)
            elif kind == "compute":
                name, steps = rest
                answer = _compute_pass(SPECS[name].workload, batches[name][WARMUP_STEPS:], steps)
            else:
                answer = _link_pass(strategy, *rest)
            everyone: list[Any] = [None] * PROCESSES
            dist.all_gather_object(everyone, answer)
            if rank == 0:
                results.put(everyone)
    finally:
        if wide is not None:
            wide.close()
        strategy.close()


def measure_process_row(pair: Peer, row: str, name: str) -> Record:
    ranks = pair.ask(("measure", row, name))
    first = ranks[0]
    # multi_worker.py's phase clock is the process's: with 2 replicas a process, both threads'
    # forward, backward and update add up in it, so only the step and its input are kept.
    kept = ("step", *PHASES) if DEVICE_COUNT[row] == PROCESSES else ("step", "input")
    return {
        "seconds": first["seconds"],
        "phases_ms": {key: 1e3 * first[key] for key in kept if key in first},
        "state_bytes": None,  # one replica per process: the plain loop's (see docstring)
        "peak_rss": max(r["peak_rss"] for r in ranks),
        "rss_before": max(r["rss_before"] for r in ranks),
        "rss_reset": all(r["rss_reset"] for r in ranks),
    }


# -- TensorFlow ------------------------------------------------------------------------------------


def _keras_models(tf: Any, keras: Any) -> dict[str, Callable[[], Any]]:
    """The models in Keras: the articles' own programs where there are some (KerasHub's
    BertMaskedLM, keras.applications' MobileNetV2, randomly initialised, nothing downloaded),
    else the PyTorch models' layer shapes."""

    def mlp() -> Any:
        return keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    def cnn() -> Any:
        return keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                keras.layers.MaxPooling2D(2),
                keras.layers.Flatten(),
                keras.layers.Dense(10),
            ]
        )

    def bert() -> Any:  # the bert_tiny preset's shape
        import keras_hub

        backbone = keras_hub.models.BertBackbone(
            vocabulary_size=VOCAB_SIZE,
            num_layers=2,
            num_heads=2,
            hidden_dim=128,
            intermediate_dim=512,
            max_sequence_length=SEQ_LEN,
        )
        return keras_hub.models.BertMaskedLM(backbone, preprocessor=None)

    def mobilenet() -> Any:
        return keras.applications.MobileNetV2(
            input_shape=(MOBILENET_SIDE, MOBILENET_SIDE, 3),
            weights=None,
            classes=MOBILENET_CLASSES,
            classifier_activation=None,
        )

    return {"mlp": mlp, "cnn": cnn, "bert": bert, "mobilenet": mobilenet}


def _tf_arrays(name: str, batches: Sequence[Batch]) -> tuple[Any, Any]:
    """The PyTorch batches as numpy (model input, labels), end to end: images channels-last,
    BERT's as KerasHub's BertMaskedLM takes them (its padding mask int32: a bool input fails to
    train on more than one replica, an AddN of bool in tensorflow 2.21 with keras 3.15)."""
    columns = [torch.cat(parts).numpy() for parts in zip(*batches, strict=True)]
    if name == "bert":
        ids, attention_mask, positions, labels = (c.astype("int32") for c in columns)
        inputs = {
            "token_ids": ids,
            "segment_ids": np.zeros_like(ids),
            "padding_mask": attention_mask,
            "mask_positions": positions,
        }
        return inputs, labels
    x, y = columns
    if x.ndim == 4:
        x = x.transpose(0, 2, 3, 1).copy()
    return x, y.astype("int32")


class TensorFlowRow:
    """One tf-mirrored-N row of one workload: model, optimizer, input and step, built once."""

    def __init__(self, tf: Any, keras: Any, strategy: Any, name: str, steps: int) -> None:
        spec = SPECS[name]
        self.tf, self.strategy, self.steps = tf, strategy, steps
        with self.strategy.scope():
            self.model = _keras_models(tf, keras)[name]()
            self.optimizer = keras.optimizers.Adam(learning_rate=LEARNING_RATE)
            self.optimizer.build(self.model.trainable_variables)
        inputs, labels = _tf_arrays(
            name, spec.workload.make_batches(WARMUP_STEPS + steps, spec.batch_size)
        )
        self.dataset = self.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(spec.batch_size)
        )
        model, optimizer, bert = self.model, self.optimizer, name == "bert"

        def replica_step(inputs: Any, labels: Any) -> Any:
            with tf.GradientTape() as tape:
                logits = model(inputs, training=True)
                losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
                if bert:  # per sequence: the mean over its masked positions
                    losses = tf.reduce_mean(losses, axis=1)
                loss = tf.nn.compute_average_loss(losses, global_batch_size=spec.batch_size)
            variables = model.trainable_variables
            optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables, strict=True))
            return loss

        self.step = tf.function(lambda batch: self.strategy.run(replica_step, args=batch))

    def measure(self) -> Record:
        clock = Clock()
        rss_before, reset = reset_peak_rss()
        iterator = iter(self.dataset)
        for _ in range(WARMUP_STEPS):
            loss = self.step(next(iterator))
        self._wait(loss)
        start = time.perf_counter()
        for _ in range(self.steps):
            with clock.timing("input"):
                batch = next(iterator)
            loss = self.step(batch)
        self._wait(loss)
        seconds = time.perf_counter() - start
        phases = per_step_ms(clock, self.steps)
        phases["step"] = 1e3 * seconds / self.steps
        return {
            "seconds": seconds,
            "phases_ms": phases,
            "state_bytes": self._state_bytes(),
            "peak_rss": peak_rss(),
            "rss_before": rss_before,
            "rss_reset": reset,
        }

    def _wait(self, loss: Any) -> None:
        for value in self.strategy.experimental_local_results(loss):
            value.numpy()

    def _state_bytes(self) -> float:
        """Every replica holds a copy of each variable (MirroredVariable) and of each Adam slot."""

        def size(variables: Sequence[Any]) -> int:
            return sum(math.prod(v.shape) * self.tf.as_dtype(v.dtype).size for v in variables)

        trainable = size(self.model.trainable_variables)
        return float(size(self.model.weights) + trainable + size(self.optimizer.variables))


def _tf_worker(
    rank: int, num_devices: int, plan: dict[str, tuple[int, int]], commands: Any, results: Any
) -> None:
    """A TensorFlow process: 4 logical CPU devices, one MirroredStrategy on ``num_devices`` of
    them (strategies of different sizes in one process collide on TensorFlow's collective group
    keys), then ("measure", workload) commands."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow at its best: it turns its oneDNN kernels on by itself only on some CPUs (off on
    # this project's AMD hosts, where they halve its CNN step: 45.6 -> 20.2 ms).
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    try:
        import keras
        import tensorflow as tf
    except Exception as error:  # an install that does not import: the rows are skipped
        results.put(f"import tensorflow failed: {type(error).__name__}: {error}")
        return
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * LOGICAL_DEVICES
    )
    strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(num_devices)])
    results.put(f"ok: tensorflow {tf.__version__}, keras {keras.__version__}")
    rows: dict[str, TensorFlowRow] = {}
    while (command := commands.get()) != "stop":
        _, name = command
        try:
            if name not in rows:
                rows[name] = TensorFlowRow(tf, keras, strategy, name, plan[name][0])
            results.put(rows[name].measure())
        except Exception as error:
            results.put(f"{type(error).__name__}: {error}")


# -- running the rounds ----------------------------------------------------------------------------


class TensorFlowFailed(RuntimeError):
    """A TensorFlow row failed: its rows are dropped from the workload, the rest go on."""


def measure_row(
    row: str, name: str, batches: Sequence[Batch], pair: Peer, tf_peers: dict[str, Peer]
) -> Record:
    if row in LOCAL_ROWS:
        return measure_local(row, SPECS[name], batches)
    if row in PROCESS_ROWS:
        return measure_process_row(pair, row, name)
    answer = tf_peers[row].ask(("measure", name))
    if isinstance(answer, str):
        raise TensorFlowFailed(answer)
    return answer


def run_workload(
    name: str,
    steps: int,
    rounds: int,
    rows: list[str],
    pair: Peer,
    tf_peers: dict[str, Peer],
) -> dict[str, Any]:
    """Every row once per round, the order rotated each round; then the compute pass."""
    spec = SPECS[name]
    batches = spec.workload.make_batches(WARMUP_STEPS + steps, spec.batch_size)
    print(
        f"\n== {name}: {spec.workload.description}; global batch {spec.batch_size}, {steps} "
        f"timed steps after {WARMUP_STEPS} warm-up, {rounds} rounds",
        flush=True,
    )
    measurements: dict[str, list[Record]] = {row: [] for row in rows}
    computes: list[dict[str, float]] = []
    for round_index in range(rounds):
        shift = round_index % len(rows)
        for row in rows[shift:] + rows[:shift]:
            if row not in measurements:  # failed earlier in this round
                continue
            try:
                measurements[row].append(measure_row(row, name, batches, pair, tf_peers))
            except TensorFlowFailed as error:
                print(f"{row} failed ({error}); it is left out of {name}")
                del measurements[row]
        rows = [row for row in rows if row in measurements]
        ranks = pair.ask(("compute", name, max(3, steps // 2)))
        computes.append({key: statistics.fmean(r[key] for r in ranks) for key in ranks[0]})
        print(
            f"round {round_index + 1}/{rounds}: "
            + ", ".join(
                f"{row} {1e3 * m[-1]['seconds'] / steps:.1f}" for row, m in measurements.items()
            )
            + " ms/step",
            flush=True,
        )
    return {"steps": steps, "measurements": measurements, "compute": computes}


# -- summary ---------------------------------------------------------------------------------------


def summarize(name: str, result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per row: throughput, ratios to plain, memory and the breakdown (see module docstring)."""
    spec, steps, measurements = SPECS[name], result["steps"], result["measurements"]
    plain = [m["seconds"] for m in measurements["plain"]]
    plain_state = measurements["plain"][-1]["state_bytes"]
    summary: dict[str, dict[str, Any]] = {}
    for row, records in measurements.items():
        seconds = [m["seconds"] for m in records]
        per_round = [dict(m["phases_ms"]) for m in records]
        if all(key in per_round[0] for key in PHASES):  # the rest of each round's step
            for phases in per_round:
                phases["other"] = phases["step"] - sum(phases[key] for key in PHASES)
        phases = {key: statistics.median(p[key] for p in per_round) for key in per_round[0]}
        shares = {key: phases[key] / phases["step"] for key in (*PHASES, "other") if key in phases}
        state = records[-1]["state_bytes"]
        summary[row] = {
            "devices": DEVICE_COUNT[row],
            "seconds": seconds,
            "examples_per_s": spec.batch_size * steps / min(seconds),
            "ratio_best": min(plain) / min(seconds),
            "ratio_paired": statistics.median(p / s for p, s in zip(plain, seconds, strict=True)),
            "ms_per_step_median": 1e3 * statistics.median(seconds) / steps,
            "state_bytes_per_replica": plain_state if state is None else state,
            "peak_rss": max(m["peak_rss"] for m in records),
            "rss_growth": max(0, *(m["peak_rss"] - m["rss_before"] for m in records)),
            "rss_reset": all(m["rss_reset"] for m in records),
            "phases_ms": phases,
            "shares": shares,
        }
    return summary


def verdicts(summary: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each mirrored row against each peer row with the same device count (or its
    ``SAME_PROCESSES_PEER``): throughput mine over
    the peer's, best to best and the median of per-round ratios. Beside it, each row's throughput
    over its own framework's one-device row (plain; tf-mirrored-1), best to best: what the
    distribution costs or gains apart from the framework's kernels."""
    found = []
    for mine in MIRRORED_ROWS:
        for peer in PEER_ROWS:
            if mine not in summary or peer not in summary:
                continue
            if DEVICE_COUNT[mine] != DEVICE_COUNT[peer] and SAME_PROCESSES_PEER.get(mine) != peer:
                continue
            ours, theirs = summary[mine]["seconds"], summary[peer]["seconds"]
            base = "tf-mirrored-1" if peer in TF_ROWS else "plain"
            found.append(
                {
                    "row": mine,
                    "peer": peer,
                    "best": min(theirs) / min(ours),
                    "paired": statistics.median(t / o for t, o in zip(theirs, ours, strict=True)),
                    "ahead": min(theirs) > min(ours),
                    "row_over_plain": summary[mine]["ratio_best"],
                    "peer_over_its_one_device": min(summary[base]["seconds"]) / min(theirs),
                }
            )
    return found


def print_table(summaries: dict[str, dict[str, dict[str, Any]]]) -> None:
    print(
        f"\n{'workload':<8} {'row':<17} {'dev':>3} {'ex/s':>8} {'vs plain':>8} {'paired':>7} "
        f"{'ms/step':>8} {'state MiB':>9} {'peak RSS MiB':>15} {'fwd':>4} {'bwd':>4} {'opt':>4} "
        f"{'in':>4} {'other':>5}"
    )
    for name, summary in summaries.items():
        for row, s in summary.items():
            rss = f"{s['peak_rss'] / 2**20:.0f} (+{s['rss_growth'] / 2**20:.0f})"
            rss += "" if s["rss_reset"] else "*"
            shares = " ".join(
                f"{100 * s['shares'][key]:{5 if key == 'other' else 4}.0f}"
                if key in s["shares"]
                else f"{'-':>{5 if key == 'other' else 4}}"
                for key in (*PHASES, "other")
            )
            print(
                f"{name:<8} {row:<17} {s['devices']:>3} {s['examples_per_s']:>8.0f} "
                f"{s['ratio_best']:>7.3f}x {s['ratio_paired']:>6.3f}x "
                f"{s['ms_per_step_median']:>8.2f} {s['state_bytes_per_replica'] / 2**20:>9.2f} "
                f"{rss:>15} {shares}"
            )
    print(
        "ex/s: examples/s of the fastest round; vs plain: best to best; paired: median of "
        "per-round ratios;\nms/step: median round; state: parameters + gradients + optimizer "
        "state per replica; peak RSS: per process\n(growth during the measurement); fwd .. "
        "other: % of the median step, on replica 0 / rank 0"
    )


def print_verdicts(summaries: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    print("\nGoal: every mirrored row ahead of the peers' rows at the same device count")
    everything = []
    for name, summary in summaries.items():
        found = verdicts(summary)
        judged = {v["row"] for v in found}
        for v in found:
            print(
                f"  {name:<5} {v['row']:<17} over {v['peer']:<14} best {v['best']:.3f}x, "
                f"paired {v['paired']:.3f}x: {'ahead' if v['ahead'] else 'NOT ahead':<9} "
                f"(over its 1-device row: {v['row_over_plain']:.3f}x, the peer "
                f"{v['peer_over_its_one_device']:.3f}x)"
            )
        for row in MIRRORED_ROWS:
            if row in summary and row not in judged:
                print(f"  {name:<5} {row:<15} no peer row with {DEVICE_COUNT[row]} device(s)")
        everything += [{"workload": name, **v} for v in found]
    if everything:
        held = all(v["ahead"] for v in everything)
        print(f"  goal held in every judged pair (best to best): {'yes' if held else 'NO'}")
    return everything


# -- the scaling model -----------------------------------------------------------------------------


def gradient_tensor_bytes(name: str) -> list[int]:
    """The model's gradient sizes in the order backward produces them (last parameter first)."""
    params = [p for p in SPECS[name].workload.make_model().parameters() if p.requires_grad]
    return [p.numel() * p.element_size() for p in reversed(params)]


def mirrored_bucket_bytes(name: str) -> list[int]:
    """The multi-worker reducer's buckets: its own plan with its defaults, each bucket's counts
    (one float per parameter) included (src/mirrored/replication/gradient_reducer.py)."""
    params = [p for p in SPECS[name].workload.make_model().parameters() if p.requires_grad]
    ready = list(reversed(params))
    plan = plan_buckets(
        [p.shape for p in ready],
        [p.dtype for p in ready],
        1,
        scaling_model.DDP_BUCKET_BYTES,
        scaling_model.DDP_FIRST_BUCKET_BYTES,
    )
    return [(b.numel + len(b.indices)) * ready[0].element_size() for b in plan]


def fit_links(medians: dict[str, list[float]]) -> dict[str, scaling_model.Link]:
    links = {
        "gloo": scaling_model.fit_link(
            "gloo, 2 local processes", LINK_SIZES, medians["gloo"], PROCESSES
        ),
        "strategy": scaling_model.fit_link(
            "mirrored worker group (shared memory), 2 local processes",
            LINK_SIZES,
            medians["strategy"],
            PROCESSES,
        ),
    }
    print("\nLink, measured between the two processes (median all-reduce ms) and fitted:")
    print(f"  {'bytes':>10} " + " ".join(f"{path:>20}" for path in links))
    for index, size in enumerate(LINK_SIZES):
        cells = []
        for path, link in links.items():
            fitted = scaling_model.ring_all_reduce_seconds(size, PROCESSES, link)
            cells.append(f"{1e3 * medians[path][index]:8.3f} (fit {1e3 * fitted:7.3f})")
        print(f"  {size:>10} " + " ".join(f"{c:>20}" for c in cells))
    for path, link in links.items():
        print(
            f"  {path}: B = {link.bandwidth / 1e9:.2f} GB/s, a = {1e6 * link.latency:.1f} us "
            f"({link.name})"
        )
    return links


def check_cpu_points(
    results: dict[str, dict[str, Any]],
    summaries: dict[str, dict[str, dict[str, Any]]],
    links: dict[str, scaling_model.Link],
) -> list[dict[str, Any]]:
    """The model's step time for the 2-process rows beside the measured median step."""
    print(
        "\nScaling model against the measured 2-process CPU points (N = 2; compute: one "
        "replica, no communication, median over rounds):"
    )
    print(
        f"  {'workload':<8} {'row':<15} {'fwd':>7} {'bwd':>7} {'update':>7} {'buckets (bytes)':<26}"
        f" {'comm':>7} {'predicted':>9} {'measured':>9} {'error':>7}"
    )
    checks = []
    for name, result in results.items():
        compute = scaling_model.Compute(
            *(
                statistics.median(c[key] for c in result["compute"])
                for key in ("forward", "backward", "update")
            )
        )
        sides = {
            "ddp-2proc": (scaling_model.bucket_sizes(gradient_tensor_bytes(name)), links["gloo"]),
            "mirrored-2proc": (mirrored_bucket_bytes(name), links["strategy"]),
        }
        for row, (buckets, link) in sides.items():
            prediction = scaling_model.predict_step(compute, buckets, PROCESSES, link)
            measured = summaries[name][row]["ms_per_step_median"] / 1e3
            error = prediction.step / measured - 1
            checks.append(
                {
                    "workload": name,
                    "row": row,
                    "compute_s": dataclasses.asdict(compute),
                    "buckets": buckets,
                    "link": dataclasses.asdict(link),
                    "predicted_s": prediction.step,
                    "communication_s": prediction.communication,
                    "exposed_s": prediction.exposed,
                    "measured_s": measured,
                    "relative_error": error,
                }
            )
            print(
                f"  {name:<8} {row:<15} {1e3 * compute.forward:7.2f} {1e3 * compute.backward:7.2f}"
                f" {1e3 * compute.update:7.2f} {buckets!s:<26.26} "
                f"{1e3 * prediction.communication:7.2f} {1e3 * prediction.step:9.2f} "
                f"{1e3 * measured:9.2f} {100 * error:+6.0f}%"
            )
    print(
        "  ms per step; comm: all buckets' all-reduce, of which all but the last may hide under "
        "backward; error: predicted / measured - 1"
    )
    return checks


def gpu_compute(
    phases_ms: dict[str, float], speedup: float, compute_ms: float | None = None
) -> scaling_model.Compute:
    """One GPU's compute per step: the plain loop's measured forward / backward / optimizer
    (ms) divided by ``speedup``, or scaled to ``compute_ms`` in all when given."""
    cpu = scaling_model.Compute(
        phases_ms["forward"] / 1e3, phases_ms["backward"] / 1e3, phases_ms["optimizer"] / 1e3
    )
    return cpu.scaled(speedup if compute_ms is None else cpu.total / (compute_ms / 1e3))


def predict_gpus(
    summaries: dict[str, dict[str, dict[str, Any]]],
    speedup: float,
    compute_ms: dict[str, float],
) -> list[dict[str, Any]]:
    """Weak scaling on N = 1, 2, 4, 8 GPUs over the named links, from the plain loop's phases."""
    print(
        "\nPredicted on GPUs (weak scaling: every GPU keeps this global batch; DDP's buckets). "
        f"Compute: the plain loop's measured phases / {speedup:g} (assumed GPU-over-this-CPU "
        "speedup) unless --compute-ms gives it; links assumed, not measured."
    )
    predictions = []
    counts = (1, 2, 4, 8)
    for name, summary in summaries.items():
        compute = gpu_compute(summary["plain"]["phases_ms"], speedup, compute_ms.get(name))
        buckets = scaling_model.bucket_sizes(gradient_tensor_bytes(name))
        print(
            f"  {name}: compute {1e3 * compute.total:.3f} ms per step "
            f"({'--compute-ms' if name in compute_ms else f'CPU / {speedup:g}'}), "
            f"gradients {sum(buckets) / 2**20:.2f} MiB in {len(buckets)} bucket(s)"
        )
        print(
            f"    {'link':<32} {'B GB/s':>7} {'a us':>5} "
            + " ".join(f"{f'N={n} ms (eff)':>17}" for n in counts)
        )
        for link in scaling_model.GPU_LINKS:
            cells = []
            for n in counts:
                step = scaling_model.predict_step(compute, buckets, n, link).step
                efficiency = scaling_model.scaling_efficiency(compute, buckets, n, link)
                cells.append(f"{1e3 * step:9.3f} ({100 * efficiency:3.0f}%)")
                predictions.append(
                    {
                        "workload": name,
                        "link": dataclasses.asdict(link),
                        "num_gpus": n,
                        "compute_s": dataclasses.asdict(compute),
                        "step_s": step,
                        "efficiency": efficiency,
                    }
                )
            print(
                f"    {link.name:<32} {link.bandwidth / 1e9:7.2f} {1e6 * link.latency:5.0f} "
                + " ".join(f"{c:>17}" for c in cells)
            )
    return predictions


# -- chart, arguments, main ------------------------------------------------------------------------


def write_png(path: str, summaries: dict[str, dict[str, dict[str, Any]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            f"--png {path}: matplotlib is not installed (pip install 'mirrored[compare]'); no chart"
        )
        return
    names = list(summaries)
    rows = [row for row in DEVICE_COUNT if any(row in s for s in summaries.values())]
    width = 0.8 / len(rows)
    figure, axes = plt.subplots(figsize=(12, 4.8))
    for index, row in enumerate(rows):
        offsets = [w + (index - (len(rows) - 1) / 2) * width for w in range(len(names))]
        ratios = [summaries[n][row]["ratio_best"] if row in summaries[n] else 0.0 for n in names]
        bars = axes.bar(offsets, ratios, width, label=row)
        axes.bar_label(bars, fmt="%.2f", fontsize=6, rotation=90, padding=2)
    axes.axhline(1.0, color="black", linewidth=0.8)
    axes.set_xticks(range(len(names)), names)
    axes.set_ylabel("throughput / plain PyTorch (best round)")
    axes.set_title("mirrored, DDP and TensorFlow MirroredStrategy on 2 CPU cores")
    axes.legend(ncol=5, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"chart written to {path}")


def parse_pairs(text: str, what: str, names: Sequence[str]) -> dict[str, float]:
    """``mlp=1.5,bert=8`` into a dict, names checked."""
    pairs = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        if key not in names or not value:
            raise ValueError(
                f"{what}={text!r}: expected NAME=VALUE pairs with NAME in {list(names)}"
            )
        pairs[key] = float(value)
    return pairs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--workloads", default=",".join(SPECS), help="comma-separated subset (default: all)"
    )
    parser.add_argument(
        "--steps",
        default="",
        help="timed steps: N for every workload, or mlp=N,bert=N,cnn=N "
        f"(default {','.join(f'{n}={s.steps}' for n, s in SPECS.items())})",
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 5; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="a few steps and 2 rounds (~1 min)")
    parser.add_argument("--gpu-speedup", type=float, default=20.0, help="assumed (default 20)")
    parser.add_argument(
        "--compute-ms", default="", help="GPU compute per step instead, e.g. mlp=0.5,bert=6"
    )
    parser.add_argument("--no-tf", action="store_true", help="leave the TensorFlow rows out")
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds any collective waits (default 600)"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON here")
    parser.add_argument("--png", metavar="PATH", help="a bar chart of the ratios (matplotlib)")
    args = parser.parse_args(argv)
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in args.workloads if w not in SPECS]
    if unknown or not args.workloads:
        parser.error(f"--workloads={','.join(args.workloads)}: choose from {','.join(SPECS)}")
    try:
        if args.steps.isdigit():
            args.steps = dict.fromkeys(SPECS, float(args.steps))
        else:
            args.steps = parse_pairs(args.steps, "--steps", list(SPECS))
        args.compute_ms = parse_pairs(args.compute_ms, "--compute-ms", list(SPECS))
    except ValueError as error:
        parser.error(str(error))
    args.steps = {
        name: int(args.steps.get(name, spec.quick_steps if args.quick else spec.steps))
        for name, spec in SPECS.items()
    }
    if args.rounds is None:
        args.rounds = 2 if args.quick else 5
    if args.rounds < 1 or min(args.steps.values()) < 1:
        parser.error(f"--rounds={args.rounds} and --steps={args.steps} must be at least 1")
    if not args.gpu_speedup > 0 or any(v <= 0 for v in args.compute_ms.values()):
        parser.error("--gpu-speedup and --compute-ms must be positive")
    return args


def start_tensorflow(args: argparse.Namespace, plan: dict[str, tuple[int, int]]) -> dict[str, Peer]:
    """TensorFlow's processes, one per row; none (one line says why) when left out or absent."""
    if args.no_tf:
        print("TensorFlow rows: left out (--no-tf)")
        return {}
    if importlib.util.find_spec("tensorflow") is None:
        print(
            "TensorFlow rows: skipped, tensorflow is not installed "
            "(pip install -e '.[tensorflow]' to get tf-mirrored-1/2/4)"
        )
        return {}
    peers: dict[str, Peer] = {}
    try:
        for row in TF_ROWS:
            peers[row] = Peer(_tf_worker, (DEVICE_COUNT[row], plan), 1, row)
            if not str(peers[row].ready).startswith("ok"):
                print(
                    f"TensorFlow rows: skipped, {peers[row].ready} (pip install -e '.[tensorflow]')"
                )
                for peer in peers.values():
                    peer.close()
                return {}
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    print(f"TensorFlow rows: {peers[TF_ROWS[0]].ready}, one process per row")
    return peers


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    machine = machine_description()
    print(", ".join(f"{key}: {value}" for key, value in machine.items()))
    print(
        f"Adam lr {LEARNING_RATE}; {args.rounds} interleaved rounds; timed steps "
        + ", ".join(f"{name} {args.steps[name]}" for name in args.workloads)
    )
    torch.set_num_threads(os.cpu_count() or 1)
    cpu = config.list_physical_devices("CPU")[0]
    config.set_logical_device_configuration(
        cpu, [config.LogicalDeviceConfiguration()] * LOGICAL_DEVICES
    )
    plan = {name: (args.steps[name], SPECS[name].batch_size) for name in args.workloads}
    results: dict[str, dict[str, Any]] = {}
    tf_peers = start_tensorflow(args, plan)
    try:
        environ = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // PROCESSES))}
        with Peer(
            _process_worker, (free_port(), plan, args.timeout), PROCESSES, "2-process", environ
        ) as pair:
            print(f"2-process rows: {pair.ready} (and DDP on its process group)")
            medians = pair.ask(("link", LINK_SIZES, 3 if args.quick else 10))[0]
            rows = [*LOCAL_ROWS, *PROCESS_ROWS, *tf_peers]
            for name in args.workloads:
                results[name] = run_workload(
                    name, args.steps[name], args.rounds, rows, pair, tf_peers
                )
    finally:
        for peer in tf_peers.values():
            peer.close()

    summaries = {name: summarize(name, result) for name, result in results.items()}
    print_table(summaries)
    found = print_verdicts(summaries)
    links = fit_links(medians)
    checks = check_cpu_points(results, summaries, links)
    predictions = predict_gpus(summaries, args.gpu_speedup, args.compute_ms)
    if args.png:
        write_png(args.png, summaries)
    write_report(
        args.json,
        machine,
        {**settings_of(args, "json", "png"), "warmup_steps": WARMUP_STEPS},
        batch_sizes={name: SPECS[name].batch_size for name in args.workloads},
        results=results,
        summary=summaries,
        verdicts=found,
        link_sizes=LINK_SIZES,
        link_medians_s=medians,
        links={path: dataclasses.asdict(link) for path, link in links.items()},
        cpu_checks=checks,
        gpu_predictions=predictions,
    )


if __name__ == "__main__":
    main()
