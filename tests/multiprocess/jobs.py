"""The programs the multi-process tests run, one function per job: ``python -m
tests.multiprocess.jobs JOB OUT_DIR [ARGS]``. Each worker writes ``OUT_DIR/rank{R}.pt``; errors
propagate (the process exits 1 with the traceback in its output)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mirrored
from mirrored import config
from mirrored.cluster.resolvers import resolve_cluster
from mirrored.comm import same_host_all_reduce, worker_group
from mirrored.comm.communicator import Communicator
from mirrored.comm.same_host_all_reduce import SameHostAllReduce
from mirrored.comm.wire_compression import bucket_compressor
from mirrored.core.values import PerReplica, ReduceOp
from mirrored.replication import zero_redundancy
from tests.allocations import AllocationCount
from tests.multiprocess import parameter_server_jobs
from tests.reference_loops import (
    OPTIMIZERS,
    DeepNet,
    adamw,
    compiled_deep_net,
    make_batches,
    make_mlp,
    replica_step,
    train_mirrored,
)
from tests.tracing.traces import replays


def _strategy(
    timeout_seconds: float = 60,
    bytes_per_pack: int = 0,
    gradient_accumulation_steps: int = 1,
    local_sgd: mirrored.LocalSGD | None = None,
    compression: str | None = None,
    zero_stage: int = 0,
) -> mirrored.MultiWorkerMirroredStrategy:
    """AUTO sums CPU tensors through shared memory between workers on one machine; tests of
    gloo's path set MIRRORED_TEST_IMPLEMENTATION=RING."""
    implementation = os.environ.get("MIRRORED_TEST_IMPLEMENTATION", "AUTO")
    return mirrored.MultiWorkerMirroredStrategy(
        communication_options=mirrored.CommunicationOptions(
            bytes_per_pack=bytes_per_pack,
            timeout_seconds=timeout_seconds,
            implementation=mirrored.CommunicationImplementation[implementation],
            compression=compression,
        ),
        gradient_accumulation_steps=gradient_accumulation_steps,
        local_sgd=local_sgd,
        zero_stage=zero_stage,
    )


def _compression(text: str) -> str | mirrored.PowerSGD | None:
    """ "" (none), "bf16", "fp16" or "powersgd:RANK"."""
    if text.startswith("powersgd:"):
        return mirrored.PowerSGD(rank=int(text.split(":")[1]))
    return text or None


def _save(strategy: mirrored.MultiWorkerMirroredStrategy, out: Path, result: Any) -> None:
    torch.save(result, out / f"rank{strategy.worker_group.rank}.pt")


def _training_step(
    model: nn.Module, optimizer: torch.optim.Optimizer
) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """The usual replica step: averaged cross-entropy, backward, update."""

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss = mirrored.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def custom_loop(
    out: Path,
    optimizer: str = "sgd",
    user_group: str = "",
    bytes_per_pack: str = "0",
    accumulation: str = "1",
    keep_zeroed_gradients: str = "",
    local_sgd_period: str = "",
    compression: str = "",
    traced: str = "",
) -> None:
    """The reference custom loop on the MLP, ragged last batch included; with ``user_group``
    the program sets up torch.distributed itself first (``_form_group``) and keeps its group
    afterwards; with
    ``accumulation`` k, one update every k steps; with ``keep_zeroed_gradients``,
    ``zero_grad(set_to_none=False)``; with ``local_sgd_period``, local SGD; ``compression``
    as ``_compression`` reads it; with ``traced``, the step under ``mirrored.function``."""
    if user_group:
        _form_group(user_group)
    sizes: dict[str, list[int]] = {"gloo": [], "shared memory": []}
    gathering = threading.local()  # inside a gather (one sum of the workers' bytes): not counted

    def counting(transport: str, all_reduce: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            tensor = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            if not getattr(gathering, "on", False):
                sizes[transport].append(tensor.numel())
            return all_reduce(*args, **kwargs)

        return counted

    def marked(*args: Any, **kwargs: Any) -> Any:
        gathering.on = True
        try:
            return gather(*args, **kwargs)
        finally:
            gathering.on = False

    gather = worker_group.gather_by_sum
    worker_group.gather_by_sum = marked  # type: ignore[assignment]

    # The cross-process all-reduces, by size and transport.
    shared = SameHostAllReduce
    shared.all_reduce_async = counting("shared memory", shared.all_reduce_async)  # type: ignore[method-assign]
    torch.distributed.all_reduce = counting("gloo", torch.distributed.all_reduce)
    with _strategy(
        bytes_per_pack=int(bytes_per_pack),
        gradient_accumulation_steps=int(accumulation),
        local_sgd=mirrored.LocalSGD(int(local_sgd_period)) if local_sgd_period else None,
        compression=_compression(compression),
    ) as strategy:
        # Each worker initialises differently: mirror gives every worker the chief's values.
        model = make_mlp(seed=1 + strategy.worker_group.rank)
        step = mirrored.function(replica_step) if traced else replica_step
        mirrored_model, _, losses = train_mirrored(
            strategy,
            model,
            OPTIMIZERS[optimizer](model),
            make_batches(),
            set_to_none=not keep_zeroed_gradients,
            step=step,
        )
        replicas = [r.state_dict() for r in mirrored_model.replicas]
        resolver = strategy.cluster_resolver
        place = (type(resolver).__name__, resolver.local_rank, resolver.local_world_size)
        result = {"losses": losses, "replicas": replicas, "all_reduces": sizes, "resolver": place}
        if traced:
            result["replayed"] = replays(step)
        _save(strategy, out, result)
    if user_group:
        assert torch.distributed.is_initialized(), "the strategy closed the program's group"
        torch.distributed.destroy_process_group()


def _form_group(init_method: str) -> None:
    """The program's own process group: ``env://`` from torchrun's variables, or ``tcp://`` as
    Ray Train's ``TorchConfig(init_method="tcp")`` forms it, which leaves RANK and WORLD_SIZE but
    no MASTER_ADDR or MASTER_PORT in the environment."""
    if init_method == "env://":
        torch.distributed.init_process_group("gloo")
        return
    address = f"tcp://{os.environ.pop('MASTER_ADDR')}:{os.environ.pop('MASTER_PORT')}"
    torch.distributed.init_process_group(
        "gloo",
        init_method=address,
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


class CountingDataset(TensorDataset):
    """Records which examples this process loaded."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__(*tensors)
        self.loaded: list[int] = []

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        self.loaded.append(index)
        return super().__getitem__(index)


def shuffled_loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    x, y = fit_data()
    return DataLoader(
        CountingDataset(x, y),
        batch_size=16,
        shuffle=True,
        generator=torch.Generator().manual_seed(5),
    )


def loader_loop(out: Path, prefetch: str = "0") -> None:
    """The custom loop fed by a shuffling DataLoader: each worker loads only its part (read
    ``prefetch`` batches ahead)."""
    loader = shuffled_loader()
    with _strategy() as strategy:
        model = make_mlp()
        mirrored_model, _, losses = train_mirrored(
            strategy,
            model,
            OPTIMIZERS["adam"](model),
            loader,  # type: ignore[arg-type]
            options=mirrored.InputOptions(experimental_per_replica_buffer_size=int(prefetch)),
        )
        _save(
            strategy,
            out,
            {
                "weights": mirrored_model.state_dict(),
                "losses": losses,
                "loaded": loader.dataset.loaded,  # type: ignore[attr-defined]
            },
        )


def same_host_sums(out: Path, fallback: str = "") -> None:
    """All-reduces of many shapes and types through the worker group, each beside gloo's sum of
    the same values; ``fallback`` makes the shared-memory set-up fail in one worker ("host": it
    claims another machine; "full": rank 0 cannot create the buffer; "attach": rank 1 cannot
    connect to it; "die": rank 0 exits while handing it out)."""
    rank = int(os.environ["RANK"])
    if fallback == "host" and rank == 1:
        same_host_all_reduce.machine_identity = lambda: "another machine"
    if (fallback, rank) in (("full", 0), ("attach", 1)):

        def fail(*args: Any) -> Any:
            raise OSError(12, "Cannot allocate memory")

        name = "_create" if fallback == "full" else "_connect"
        setattr(same_host_all_reduce, name, fail)
    if fallback == "die" and rank == 0:
        same_host_all_reduce._accept = lambda *args: os._exit(3)
    with _strategy(timeout_seconds=30) as strategy:
        group = strategy.worker_group
        generator = torch.Generator().manual_seed(rank)
        values = {
            "two chunks": torch.randn(1_500_000, generator=generator),  # 6 MB: over a 4 MiB slot
            "odd float64": torch.randn(1001, generator=generator, dtype=torch.float64),
            "bfloat16": torch.randn(130, generator=generator).to(torch.bfloat16),
            "float16": torch.randn(70, generator=generator).to(torch.float16),
            "int64": torch.arange(7) * (rank + 1),
            "int8 wraps around": torch.full((5,), 100, dtype=torch.int8),
            "empty": torch.zeros(0),
            "strided": torch.randn(6, 4, generator=generator).t(),  # summed in a contiguous copy
            "requires grad": torch.randn(9, generator=generator).requires_grad_(),
        }
        sums = {n: v.detach().clone().requires_grad_(v.requires_grad) for n, v in values.items()}
        pending = [group.all_reduce_async(sums[name], name) for name in values]  # all in flight
        for waiting in pending:
            waiting.wait()
        expected = {name: value.detach().contiguous().clone() for name, value in values.items()}
        for value in expected.values():
            torch.distributed.all_reduce(value)
        gathers = _gathers(group, rank)
        _save(
            strategy,
            out,
            {
                "sums": {name: value.detach() for name, value in sums.items()},
                "strided": sums["strided"].stride(),
                "gloo": expected,
                "shared_memory": group.uses_shared_memory,
                **gathers,
            },
        )


def _gathers(group: Any, rank: int) -> dict[str, Any]:
    """Gathers through the worker group beside gloo's own, of bits an addition could change
    (-0.0, a NaN's payload, the last bits of a float64), and how many went through gloo."""
    nan = torch.tensor([0x7FF8_0000_DEAD_BEEF], dtype=torch.int64).view(torch.float64)
    values = {
        "signed zeros and a NaN": torch.cat([torch.tensor([-0.0, 0.0, rank / 3]).double(), nan]),
        "bool": torch.tensor([True, rank == 1]),
        "complex128": torch.tensor([1 + 2j, rank - 1j], dtype=torch.complex128),
        "odd int8": torch.arange(5, dtype=torch.int8) - rank,
        "scalar": torch.tensor(rank * 7, dtype=torch.int64),
        "empty": torch.zeros(2, 0),
        "strided": torch.arange(12.0).reshape(3, 4).t() + rank,
    }
    calls = []
    backend_gather = torch.distributed.all_gather

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return backend_gather(*args, **kwargs)

    torch.distributed.all_gather = counted
    try:
        gathered = {name: group.all_gather(value, name) for name, value in values.items()}
    finally:
        torch.distributed.all_gather = backend_gather
    by_gloo = {}
    for name, value in values.items():
        parts = [torch.empty_like(value.contiguous()) for _ in range(group.world_size)]
        torch.distributed.all_gather(parts, value.contiguous())
        by_gloo[name] = parts
    return {"gathered": gathered, "gloo_gathered": by_gloo, "gathers_by_gloo": len(calls)}


def local_failure(out: Path) -> None:
    """Worker 0's shared-memory all-reduce fails on its own side (the sum cannot be written back
    into an expanded tensor); each worker records its errors."""
    with _strategy(timeout_seconds=30) as strategy:
        group = strategy.worker_group
        errors = []
        value = torch.ones(1).expand(4) if group.rank == 0 else torch.ones(4)
        for attempt in (value, torch.ones(4)):
            try:
                group.all_reduce(attempt, "local failure")
            except Exception as error:
                errors.append(f"{type(error).__name__}: {error}")
        _save(strategy, out, {"errors": errors})


def per_replica_input(out: Path) -> None:
    """distribute_datasets_from_function: each worker's function yields the per-replica batches
    of its own replicas (its InputContext says which), ragged last batch included."""
    batches = make_batches()

    def dataset_fn(context: mirrored.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
        assert context.num_input_pipelines == 2 and context.num_replicas_in_sync == 4
        local = len(config.list_logical_devices("CPU"))
        first = context.input_pipeline_id * local
        parts = []
        for x, y in batches:  # shards as the strategy cuts a global batch: larger ones first
            shards = zip(
                x.tensor_split(context.num_replicas_in_sync),
                y.tensor_split(context.num_replicas_in_sync),
                strict=True,
            )
            parts += list(shards)[first : first + local]
        return parts

    with _strategy() as strategy:
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(model, OPTIMIZERS["sgd"](model))

        step = _training_step(mirrored_model, optimizer)

        for x, y in strategy.distribute_datasets_from_function(dataset_fn):
            strategy.run(step, args=(x, y))
        _save(strategy, out, {"replicas": [r.state_dict() for r in mirrored_model.replicas]})


def wire_sum(out: Path) -> None:
    """A gradient-sized sum in 16 bits on the wire: rank 0 adds 1, the others 2**-8 each (5
    numbers: the chunks are padded). bfloat16 additions would round 1 + 2**-8 back to 1 at
    every step; a float32 sum is 1 + (N-1) * 2**-8, exact in bfloat16 for N = 3."""
    with _strategy(compression="bf16") as strategy:
        group = strategy.worker_group
        tensor = torch.full((5,), 1.0 if group.rank == 0 else 2.0**-8)
        compressor = bucket_compressor("bf16", [[(0, tensor.shape)]], [tensor.numel()])
        assert compressor is not None
        compressor.start(group, 0, tensor, "test: a 16-bit sum").wait()
        _save(strategy, out, {"sum": tensor})


def digits(out: Path, compression: str = "") -> None:
    """Train an MLP on scikit-learn's digits with fit, gradients compressed on the wire."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16
    y = torch.tensor(data.target)
    with _strategy(compression=_compression(compression)) as strategy:
        with strategy.scope():
            model = mirrored.Model(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
            compile_mlp(model)
        torch.manual_seed(3)
        model.fit(x[:1500], y[:1500], batch_size=64, epochs=12, verbose=0)
        accuracy = model.evaluate(x[1500:], y[1500:], verbose=0, return_dict=True)["accuracy"]
        _save(strategy, out, {"accuracy": accuracy, "state": model.module.state_dict()})


def zero(out: Path, stage: str) -> None:
    """zero_stage=``stage``: the custom loop on DeepNet with AdamW, each replica's share of the
    optimizer state, the consolidated state_dict (a collective), then fit and Model.save. The
    collectives move 256 bytes at a time, so every gather and reduce-scatter takes many."""
    zero_redundancy._CHUNK_BYTES = 256
    with _strategy(zero_stage=int(stage)) as strategy:
        model = DeepNet()
        mirrored_model, optimizer, _ = train_mirrored(
            strategy, model, adamw(model), make_batches(num_examples=6 * 16)
        )
        result = {
            "replicas": [r.state_dict() for r in mirrored_model.replicas],
            "state_bytes": optimizer.state_bytes(),
            "optimizer": optimizer.state_dict(),
        }
        x, y = fit_data()
        fitted = compiled_deep_net(strategy)
        # Every backup gathers the sharded state on every worker; the chief writes it.
        backup = mirrored.callbacks.BackupAndRestore(out / "backup", save_freq=3)
        fitted.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[backup])
        fitted.save(out / "model.pt")
        result["fitted"] = fitted.state_dict()
        _save(strategy, out, result)


def zero_memory(out: Path, stage: str) -> None:
    """zero_stage=``stage`` on one device per worker (one thread allocates, so the count is the
    same on every run): the tensor bytes alive at the peak from ``strategy.mirror()`` through
    three steps of Adam and the optimizer's ``state_dict()`` (what a checkpoint gathers), and the
    largest tensor each of mirrored's modules allocated."""
    count = AllocationCount()
    with _strategy(zero_stage=int(stage)) as strategy:
        torch.manual_seed(0)
        net = nn.Sequential(*(nn.Linear(32, 32) for _ in range(8)))
        with count.tracking():
            model, optimizer = strategy.mirror(net, torch.optim.Adam(net.parameters()))
        train = _training_step(model, optimizer)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            with count.tracking():
                train(x, y)

        for x, y in strategy.experimental_distribute_dataset(
            make_batches(num_examples=3 * 16, features=32)
        ):
            strategy.run(step, args=(x, y))
        with count.tracking():
            state = optimizer.state_dict()
        parameters = [p.detach() for p in model.module.parameters()]
        result = {"peak": count.peak, "largest": count.largest, "model": parameters}
        _save(strategy, out, {**result, "state": state["state"]})


def fit_data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(203, 12, generator=generator)
    return x, torch.randint(0, 5, (203,), generator=generator)


def compile_mlp(model: mirrored.Model) -> None:
    model.compile(
        optimizer=mirrored.optimizers.Adam(1e-2),
        loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )


def fit(out: Path) -> None:
    """Model.fit with shuffling and a ragged last batch, then evaluate and predict."""
    x, y = fit_data()
    with _strategy() as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            compile_mlp(model)
        torch.manual_seed(3)
        history = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
        evaluation = model.evaluate(x, y, batch_size=16, verbose=0, return_dict=True)
        predictions = model.predict(x[:37], batch_size=8, verbose=0)
        _save(
            strategy,
            out,
            {
                "weights": model.state_dict(),
                "history": history.history,
                "evaluation": evaluation,
                "predictions": predictions,
                "should_checkpoint": strategy.should_checkpoint,
            },
        )


def collectives(out: Path) -> None:
    """reduce / gather / all_reduce / all_gather across workers, with ragged shards."""
    with _strategy() as strategy:
        rank = strategy.worker_group.rank

        def replica_fn(x: torch.Tensor) -> dict[str, Any]:
            context = mirrored.get_replica_context()
            assert context is not None
            return {
                "id": torch.tensor([float(context.replica_id_in_sync_group)]),
                "sum": context.all_reduce("sum", x.sum()),
                "gathered": context.all_gather(x, axis=0),
                "x": x,
            }

        batch = torch.arange(11.0).reshape(11, 1)
        result = next(iter(strategy.experimental_distribute_dataset([batch])))
        values = strategy.run(replica_fn, args=(result,))
        _save(
            strategy,
            out,
            {
                "ids": strategy.gather(values["id"], axis=0),
                "sum": strategy.experimental_local_results(values["sum"]),
                "replica_gathered": strategy.experimental_local_results(values["gathered"]),
                "gathered": strategy.gather(values["x"], axis=0),
                "mean_axis": strategy.reduce("mean", values["x"], axis=0),
                "sum_none": strategy.reduce("sum", values["id"], axis=None),
                "rank": rank,
                "num_replicas_in_sync": strategy.num_replicas_in_sync,
            },
        )


def batch_norm_net(num_layers: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The reference MLP's shape with ``num_layers`` BatchNorm layers (3 buffers each), and its
    optimizer: SGD, as Adam would blow up the rounding noise of the gradients of the biases
    BatchNorm cancels (zero but for the summation order) into whole steps."""
    torch.manual_seed(4)
    layers: list[nn.Module] = [nn.Linear(12, 16)]
    for _ in range(num_layers):
        layers += [nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 16)]
    model = nn.Sequential(*layers, nn.Linear(16, 5))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch_norm_layers(out: Path, num_layers: str) -> None:
    """The custom loop on ``batch_norm_net``: the replicas' states, and how many collectives
    crossed the workers in all (the buffers every step changes are synced after it)."""
    with _strategy() as strategy:
        group = strategy.worker_group
        before = group._position[0]  # counts this worker's collectives
        mirrored_model, _, losses = train_mirrored(
            strategy, *batch_norm_net(int(num_layers)), make_batches()
        )
        crossed = group._position[0] - before
        replicas = [r.state_dict() for r in mirrored_model.replicas]
        _save(strategy, out, {"replicas": replicas, "losses": losses, "collectives": crossed})


def _slow_chief_writes(strategy: mirrored.MultiWorkerMirroredStrategy) -> None:
    """The chief's checkpoint writes take a second: a worker that returned before the chief
    had written would read no file."""
    if not strategy.worker_group.is_chief:
        return
    write = mirrored.checkpoint.save

    def slow_write(obj: Any, path: Any) -> Path:
        time.sleep(1)
        return write(obj, path)

    mirrored.checkpoint.save = slow_write


def checkpoint(out: Path) -> None:
    """Only the chief writes; every worker restores the chief's file as soon as save returns."""
    x, y = fit_data()
    with _strategy() as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            compile_mlp(model)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)
        _slow_chief_writes(strategy)
        path = out / "weights.pt"
        model.save_weights(path)
        model.load_weights(path)
        model.save(out / "model.pt")
        model.load(out / "model.pt")
        _save(strategy, out, {"weights": model.state_dict()})


def checkpoint_faults(out: Path) -> None:
    """The chief cannot write (the folder is a file); then each worker restores a file of its
    own with other weights. Every worker records the errors it got."""
    with _strategy() as strategy:
        with strategy.scope():
            model = mirrored.Model(make_mlp())
            compile_mlp(model)
        (out / "not-a-folder").write_text("")
        errors = []
        try:
            model.save_weights(out / "not-a-folder" / "weights.pt")
        except Exception as error:
            errors.append(f"{type(error).__name__}: {error}")
        rank = strategy.worker_group.rank
        mine = out / f"weights{rank}.pt"
        mirrored.checkpoint.save(make_mlp(seed=10 + rank).state_dict(), mine)
        try:
            model.load_weights(mine)
        except ValueError as error:
            errors.append(f"{type(error).__name__}: {error}")
        _save(strategy, out, {"errors": errors})


def train_forever(out: Path, timeout_seconds: str = "5", hang_rank: str = "-1") -> None:
    """Steps until killed; ``hang_rank`` stops stepping (sleeps) after its third step."""
    with _strategy(float(timeout_seconds)) as strategy:
        rank = strategy.worker_group.rank
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(model, torch.optim.SGD(model.parameters(), 0.1))

        step = _training_step(mirrored_model, optimizer)

        batches = make_batches()
        for step_number in range(1_000_000):
            for x, y in strategy.experimental_distribute_dataset(batches[:1]):
                strategy.run(step, args=(x, y))
            if step_number == 3:
                (out / f"started{rank}").touch()
                if rank == int(hang_rank):
                    time.sleep(1000)
            time.sleep(0.01)


def hung_peer(out: Path, timeout_seconds: str, where: str) -> None:
    """Worker 1 stops in its fourth step, ``where`` "between" steps, "inside" its replica
    function, or in its last "replica" only (run it with two replicas per worker), writing when
    it stopped. Every worker whose step fails records how long after that it failed."""
    with _strategy(float(timeout_seconds)) as strategy:
        rank = strategy.worker_group.rank
        last_replica = strategy.num_replicas_in_sync - 1
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(model, torch.optim.SGD(model.parameters(), 0.1))
        train = _training_step(mirrored_model, optimizer)
        stopped = out / "stopped"

        def stop() -> None:
            stopped.write_text(repr(time.time()))
            time.sleep(1000)

        def step(x: torch.Tensor, y: torch.Tensor, number: int) -> None:
            replica = mirrored.get_replica_context().replica_id_in_sync_group
            stops = where == "inside" or (where == "replica" and replica == last_replica)
            if rank == 1 and number == 3 and stops:
                stop()
            train(x, y)

        batches = list(strategy.experimental_distribute_dataset(make_batches()[:1])) * 6
        try:
            for number, (x, y) in enumerate(batches):
                if rank == 1 and number == 3 and where == "between":
                    stop()
                strategy.run(step, args=(x, y, number))
        except Exception as error:
            waited = time.time() - float(stopped.read_text())
            _save(strategy, out, {"waited": waited, "error": f"{type(error).__name__}: {error}"})


def caught_failure(out: Path, failing_rank: str) -> None:
    """``failing_rank`` raises in its third step; every worker catches each step's error and
    goes on, recording (step, error type, message, seconds into the step)."""
    with _strategy(60) as strategy:
        rank = strategy.worker_group.rank
        model = make_mlp()
        mirrored_model, optimizer = strategy.mirror(model, torch.optim.SGD(model.parameters(), 0.1))
        step_number = 0

        train = _training_step(mirrored_model, optimizer)

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            if rank == int(failing_rank) and step_number == 2:
                raise ValueError(f"a failure on worker {rank} only")
            train(x, y)

        errors = []
        for step_number, (x, y) in enumerate(
            strategy.experimental_distribute_dataset(make_batches()[:5])
        ):
            start = time.monotonic()
            try:
                strategy.run(step, args=(x, y))
            except Exception as error:
                errors.append(
                    (step_number, type(error).__name__, str(error), time.monotonic() - start)
                )
        _save(strategy, out, {"errors": errors})


def mismatched_all_reduce(out: Path) -> None:
    """A 3-example batch over two workers: all-reducing the shards themselves (2 and 1
    elements) is a user error the timeout must explain."""
    with _strategy(3) as strategy:
        (batch,) = strategy.experimental_distribute_dataset([torch.arange(3.0)])
        strategy.run(lambda x: mirrored.get_replica_context().all_reduce("sum", x), args=(batch,))


def different_models(out: Path) -> None:
    with _strategy() as strategy:
        rank = strategy.worker_group.rank
        module = nn.Linear(4, 3 if rank == 0 else 2)
        strategy.mirror(module, torch.optim.SGD(module.parameters(), 0.1))


def different_settings(out: Path, where: str) -> None:
    """Worker 1 builds its optimizer with another learning rate ("mirror"), or compiles with
    another scheduler ("fit")."""
    x, y = fit_data()
    with _strategy() as strategy:
        other = strategy.worker_group.rank == 1
        module = make_mlp()
        if where == "mirror":
            strategy.mirror(module, torch.optim.SGD(module.parameters(), 0.2 if other else 0.1))
            return
        optimizer = torch.optim.SGD(module.parameters(), 0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 5, gamma=0.9 if other else 0.5)
        with strategy.scope():
            model = mirrored.Model(module)
            model.compile(optimizer, "sparse_categorical_crossentropy", lr_scheduler=scheduler)
        model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def uneven_input(out: Path, kind: str) -> None:
    """Worker 1's dataset has one batch fewer: a list (its length tells) or a generator."""
    with _strategy() as strategy:
        rank = strategy.worker_group.rank
        model = make_mlp()
        batches = make_batches()[: 5 if rank == 0 else 4]
        data = batches if kind == "list" else (b for b in batches)
        train_mirrored(strategy, model, OPTIMIZERS["sgd"](model), data)  # type: ignore[arg-type]


def seeded_per_rank(out: Path, kind: str) -> None:
    """Each worker seeds torch with its rank, then shuffles: a DataLoader (``kind`` "loader")
    or ``fit`` on tensors ("fit"). The workers' global batches would differ."""
    x, y = fit_data()
    with _strategy() as strategy:
        model = make_mlp()  # seeds torch: the per-rank seed comes after it
        if kind == "loader":
            loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
            torch.manual_seed(strategy.worker_group.rank)
            train_mirrored(strategy, model, OPTIMIZERS["sgd"](model), loader)  # type: ignore[arg-type]
            return
        with strategy.scope():
            keras_model = mirrored.Model(model)
            compile_mlp(keras_model)
        torch.manual_seed(strategy.worker_group.rank)
        keras_model.fit(x, y, batch_size=16, epochs=1, verbose=0)


def backup(out: Path, backup_dir: str) -> None:
    """fit with BackupAndRestore after every batch, slowed down so that it can be killed."""
    x, y = fit_data()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    started = out / f"started{os.environ.get('RANK')}.{attempt}"
    slow = mirrored.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: (
            started.write_text(str(os.getpid())),
            time.sleep(0.05),
        )
    )
    with _strategy() as strategy:
        with strategy.scope():
            module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
            model = mirrored.Model(module)
            compile_mlp(model)
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=[slow, mirrored.callbacks.BackupAndRestore(backup_dir, save_freq=1)],
        )
        _save(strategy, out, {"weights": model.state_dict(), "history": history.history})


def preempted(out: Path, backup_dir: str, sigterm_rank: str, after: str) -> None:
    """fit with epoch backups; worker ``sigterm_rank`` is sent SIGTERM after ``after`` batches
    (0: never), as a scheduler preempting one node would."""
    x, y = fit_data()
    seen = [0]

    def maybe_terminate(batch: int, logs: Any) -> None:
        seen[0] += 1
        if os.environ.get("RANK") == sigterm_rank and seen[0] == int(after):
            os.kill(os.getpid(), signal.SIGTERM)

    with _strategy() as strategy:
        with strategy.scope():
            module = nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 5))
            model = mirrored.Model(module)
            compile_mlp(model)
        terminate = mirrored.callbacks.LambdaCallback(on_train_batch_end=maybe_terminate)
        history = model.fit(
            x,
            y,
            batch_size=16,
            epochs=3,
            verbose=0,
            callbacks=[terminate, mirrored.callbacks.BackupAndRestore(backup_dir)],
        )
        _save(strategy, out, {"weights": model.state_dict(), "history": history.history})


class _SlowStore:
    """A store whose ``set`` takes a second once ``slow`` is set; ``entered`` says one began."""

    def __init__(self, store: Any, slow: threading.Event, entered: threading.Event) -> None:
        self._store, self._slow, self._entered = store, slow, entered

    def set(self, key: str, value: str) -> None:
        if self._slow.is_set():
            self._entered.set()
            time.sleep(1.0)
        self._store.set(key, value)


def heartbeat_at_close(out: Path) -> None:
    """Close the strategy while its heartbeat is inside a (slow) store call: which heartbeat
    threads are still running once close() has returned."""
    slow, entered = threading.Event(), threading.Event()
    connect = worker_group.WorkerGroup._heartbeat_store
    worker_group.WorkerGroup._heartbeat_store = lambda group: _SlowStore(  # type: ignore[method-assign]
        connect(group), slow, entered
    )
    strategy = _strategy()
    rank = strategy.worker_group.rank
    slow.set()
    entered.wait()
    strategy.close()
    running = [t.name for t in threading.enumerate() if t.name.startswith("mirrored-heartbeat")]
    torch.save({"running after close": running}, out / f"rank{rank}.pt")


def mixed(shard: torch.Tensor) -> list[torch.Tensor]:
    """Tensors of several element sizes, gathered in one call (packed as bytes end to end)."""
    return [shard > 0, shard.to(torch.float16), shard.double(), shard.to(torch.int64)]


def communicator_levels(out: Path) -> None:
    """A Communicator over this process's replicas and a worker group of its own, used alone
    (no multi-worker strategy): each collective's results beside the values it combined."""
    rank = int(os.environ["RANK"])
    group = worker_group.WorkerGroup(resolve_cluster(), "gloo", 60.0)
    try:
        with mirrored.MirroredStrategy() as strategy:
            communicator = Communicator(strategy.cross_device_ops, strategy.devices, group)
            generator = torch.Generator().manual_seed(rank)
            values = [torch.randn(5, dtype=torch.float64, generator=generator) for _ in "ab"]
            shards = [torch.randn(1 + rank + r, 2, generator=generator) for r in range(2)]

            def replica_fn(value: torch.Tensor, shard: torch.Tensor) -> dict[str, torch.Tensor]:
                replica = mirrored.get_replica_context()
                assert replica is not None
                return {
                    "all_reduce": communicator.all_reduce_tensors(replica, ReduceOp.SUM, [value])[
                        0
                    ],
                    "all_gather": communicator.all_gather_tensors(replica, [shard], 0)[0],
                    "all_gather_mixed": communicator.all_gather_tensors(replica, mixed(shard), 0),
                }

            result = strategy.run(replica_fn, args=(PerReplica(values), PerReplica(shards)))
            layout = communicator.layout
            outgoing = torch.randn(4, dtype=torch.float64, generator=generator)
            scattered = torch.empty(2, dtype=torch.float64)
            staging = torch.empty_like(outgoing)
            communicator.reduce_scatter_across_workers(outgoing, staging, scattered, "test: rs")
            gathered = torch.empty(4)
            communicator.all_gather_across_workers(gathered, torch.full((2,), rank + 0.5), "ag")
            summed = values[0].clone()
            communicator.all_reduce_across_workers_async(summed, "test: all-reduce").wait()
            saved = {
                "layout": (layout.replicas_per_worker, layout.rank, layout.first_replica),
                "values": values,
                "shards": shards,
                "all_reduce": strategy.experimental_local_results(result["all_reduce"]),
                "all_gather": strategy.experimental_local_results(result["all_gather"]),
                "all_gather_mixed": [
                    strategy.experimental_local_results(t) for t in result["all_gather_mixed"]
                ],
                "reduce_sum": communicator.reduce(ReduceOp.SUM, PerReplica(values), None),
                "reduce_mean_axis": communicator.reduce(ReduceOp.MEAN, PerReplica(shards), 0),
                "gather": communicator.gather(shards, 0),
                "outgoing": outgoing,
                "scattered": scattered,
                "gathered": gathered,
                "summed": summed,
                "flags": communicator.sum_across_workers([1.0, float(rank)], "test: flags"),
            }
            torch.save(saved, out / f"rank{rank}.pt")
    finally:
        group.close()


JOBS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        custom_loop,
        communicator_levels,
        wire_sum,
        digits,
        same_host_sums,
        local_failure,
        loader_loop,
        per_replica_input,
        fit,
        collectives,
        batch_norm_layers,
        checkpoint,
        checkpoint_faults,
        train_forever,
        caught_failure,
        hung_peer,
        mismatched_all_reduce,
        different_models,
        different_settings,
        uneven_input,
        seeded_per_rank,
        backup,
        preempted,
        heartbeat_at_close,
        zero,
        zero_memory,
        *parameter_server_jobs.JOBS,
    )
}


def main() -> None:
    job, out, *args = sys.argv[1:]
    logical = int(os.environ.get("MIRRORED_TEST_LOGICAL_DEVICES", "1"))
    config.set_logical_device_configuration(
        config.list_physical_devices("CPU")[0], [config.LogicalDeviceConfiguration()] * logical
    )
    torch.set_default_dtype(getattr(torch, os.environ.get("MIRRORED_TEST_DTYPE", "float32")))
    torch.manual_seed(0)
    JOBS[job](Path(out), *args)


if __name__ == "__main__":
    main()
