"""Programs of the parameter-server tests: every task runs the job; the chief (the coordinator)
writes ``OUT_DIR/chief.pt``. The scheduled functions are module functions, importable on the
workers."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch import nn

import mirrored
from mirrored.coordinator.cluster_coordinator import ClusterCoordinator, ScheduledFunctionError
from mirrored.parameter_server import rpc_cluster
from mirrored.parameter_server import task as parameter_server_task
from mirrored.parameter_server import worker as parameter_server_worker
from mirrored.partitioners import FixedShardsPartitioner
from mirrored.strategies.parameter_server import ParameterServerStrategy

BATCH = 32


def digits() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    from examples.mnist_mlp import load_digits_split

    (x, y), (x_test, y_test) = load_digits_split(seed=0)
    return (torch.from_numpy(x), torch.from_numpy(y)), (
        torch.from_numpy(x_test),
        torch.from_numpy(y_test),
    )


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


@contextlib.contextmanager
def adam_job(learning_rate: float, **options: Any) -> Iterator[tuple[ClusterCoordinator, Any, Any]]:
    """The strategy of these jobs (by default 2 shards per parameter; 60 s timeouts) with its
    coordinator, and ``make_model()`` mirrored with Adam."""
    options.setdefault("variable_partitioner", FixedShardsPartitioner(2))
    with ParameterServerStrategy(timeout_seconds=60, **options) as strategy:
        coordinator = ClusterCoordinator(strategy)
        module = make_model()
        model, optimizer = strategy.mirror(
            module, torch.optim.Adam(module.parameters(), learning_rate)
        )
        yield coordinator, model, optimizer


def digits_batches(context: mirrored.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This worker's shard of the training digits, reshuffled differently per worker."""
    (x, y), _ = digits()
    mine = torch.arange(context.input_pipeline_id, len(x), context.num_input_pipelines)
    order = mine[
        torch.randperm(
            len(mine), generator=torch.Generator().manual_seed(context.input_pipeline_id)
        )
    ]
    return [(x[i], y[i]) for i in order.split(BATCH)]


def train_step(model: nn.Module, optimizer: Any, iterator: Any) -> torch.Tensor:
    return train_on(model, optimizer, *next(iterator))


def train_on(model: nn.Module, optimizer: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).float().mean())


def train_digits(out: Path, mode: str = "async", epochs: str = "8") -> None:
    """Digits on 2 workers and 2 ps tasks (parameters cut in 2 shards each); the chief records
    the test accuracy and the ps tasks' parameters."""
    staleness = {"async": None, "ssp": 1}[mode]
    with adam_job(3e-3, max_staleness=staleness) as (coordinator, model, optimizer):
        iterator = iter(coordinator.create_per_worker_dataset(digits_batches))
        (x, _), (x_test, y_test) = digits()
        steps = int(epochs) * -(-len(x) // BATCH)
        losses = [
            coordinator.schedule(train_step, (model, optimizer, iterator)) for _ in range(steps)
        ]
        coordinator.join()
        model.pull()
        torch.save(
            {
                "accuracy": accuracy(model, x_test, y_test),
                "losses": torch.stack([loss.fetch() for loss in losses]),
                "weights": model.module.state_dict(),
            },
            out / "chief.pt",
        )


def plain_digits_accuracy(epochs: int = 8) -> float:
    """The same model trained synchronously on one device, for comparison."""
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), 3e-3)
    (x, y), (x_test, y_test) = digits()
    generator = torch.Generator().manual_seed(0)
    for _ in range(epochs):
        for index in torch.randperm(len(x), generator=generator).split(BATCH * 2):
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return accuracy(model, x_test, y_test)


def numbered_batch(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``index`` of a fixed synthetic set, the same on whichever worker asks."""
    generator = torch.Generator().manual_seed(100 + index)
    return torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def step_on_batch(model: nn.Module, optimizer: Any, index: int) -> torch.Tensor:
    return train_on(model, optimizer, *numbered_batch(index))


def plain_rounds(
    module: nn.Module, optimizer: torch.optim.Optimizer, rounds: list[list[int]]
) -> torch.Tensor:
    """Synchronous training on one process: a step per round, on the mean of its numbered
    batches' losses; every batch's loss."""
    all_losses = []
    for round_ in rounds:
        losses = [F.cross_entropy(module(x), y) for x, y in map(numbered_batch, round_)]
        torch.stack(losses).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        all_losses += [loss.detach() for loss in losses]
    return torch.stack(all_losses)


def synchronous_rounds(out: Path) -> None:
    """Synchronous mode: 7 functions on 2 workers are rounds {0, 1}, {2, 3}, {4, 5} and {6}
    (closed by join); the chief records the ps tasks' parameters, each function's loss, and the
    same computed on one process, one Adam step per round on the mean of its batches' losses."""
    with adam_job(1e-2, synchronous=True) as (coordinator, model, optimizer):
        values = [coordinator.schedule(step_on_batch, (model, optimizer, i)) for i in range(7)]
        coordinator.join()
        assert coordinator.done()
        model.pull()
        reference = make_model()
        reference_losses = plain_rounds(
            reference, torch.optim.Adam(reference.parameters(), 1e-2), [[0, 1], [2, 3], [4, 5], [6]]
        )
        torch.save(
            {
                "weights": model.module.state_dict(),
                "reference": reference.state_dict(),
                "losses": torch.stack([value.fetch() for value in values]),
                "reference_losses": reference_losses,
            },
            out / "chief.pt",
        )


def checkpoint_resume(out: Path, phase: str) -> None:
    """Synchronous rounds of ``step_on_batch``. Phase "first" (2 shards per parameter): 4
    functions, ``save``, 4 more, then ``restore``; phase "resume", in new processes with whole
    parameters: ``restore`` the first phase's file, then the same 4 more functions."""
    saved = out / "ps.ckpt"
    partitioner = FixedShardsPartitioner(2) if phase == "first" else None
    with adam_job(1e-2, synchronous=True, variable_partitioner=partitioner) as (
        coordinator,
        model,
        optimizer,
    ):
        record: dict[str, Any] = {}
        if phase == "first":
            for i in range(4):
                coordinator.schedule(step_on_batch, (model, optimizer, i))
            assert coordinator.save(saved) == saved
        else:
            coordinator.restore(saved)
        for i in range(4, 8):
            coordinator.schedule(step_on_batch, (model, optimizer, i))
        coordinator.join()
        model.pull()
        record["trained"] = {k: v.clone() for k, v in model.module.state_dict().items()}
        if phase == "first":
            coordinator.restore(saved)
            model.pull()
            record["restored"] = model.module.state_dict()
        torch.save(record, out / f"chief-{phase}.pt")


class Counter(nn.Module):
    """One parameter of 4 rows (2 shards, one per ps task); its loss has gradient 1 everywhere,
    so SGD with lr 1 counts the updates applied: each takes 1 from every row."""

    def __init__(self) -> None:
        super().__init__()
        self.value = nn.Parameter(torch.zeros(4))

    def forward(self) -> torch.Tensor:
        return self.value.sum()


@contextlib.contextmanager
def counter_job(
    mode: str, timeout_seconds: float = 30
) -> Iterator[tuple[ClusterCoordinator, Counter, Any, Any]]:
    """The strategy of the counting jobs ("async" or "sync"; 2 shards), its coordinator, and a
    ``Counter`` mirrored with SGD at lr 1."""
    with ParameterServerStrategy(
        variable_partitioner=FixedShardsPartitioner(2),
        synchronous=mode == "sync",
        timeout_seconds=timeout_seconds,
    ) as strategy:
        coordinator = ClusterCoordinator(strategy)
        module = Counter()
        model, optimizer = strategy.mirror(module, torch.optim.SGD(module.parameters(), lr=1.0))
        yield coordinator, module, model, optimizer


_functions_run = 0  # on a worker: how many count_down calls it has run


def count_down(model: nn.Module, optimizer: Any, fault: str, weight: float) -> str:
    """Two updates of ``weight`` each (a function's own gradient, so that an update applied
    twice or lost shows even in an averaged round); with fault "worker", worker1's second
    function dies between its second update's push to ps0 and its push to ps1."""
    global _functions_run
    _functions_run += 1
    name = rpc.get_worker_info().name
    for step in range(2):
        if fault == "worker" and name == "worker1" and _functions_run == 2 and step == 1:
            _die_between_ps_tasks()
        (model() * weight).backward()
        optimizer.step()
        optimizer.zero_grad()
    return name


def _die_between_ps_tasks() -> None:
    send = rpc.rpc_async

    def push_to_ps0_only(to: str, *args: Any, **kwargs: Any) -> Any:
        if to == "ps1":
            os.kill(os.getpid(), signal.SIGKILL)
        future = send(to, *args, **kwargs)
        future.wait()  # ps0 has applied it
        return future

    rpc.rpc_async = push_to_ps0_only


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def counter(out: Path, fault: str, mode: str = "async", phase: str = "first") -> None:
    """A chief, 2 workers and 2 ps tasks count down with 12 functions of 2 updates each, the
    i-th (from 1) of weight i (async: -156 in all; sync, rounds of 2: -78). Faults:
    "worker" (worker1 dies mid-function), "ps" (after a checkpoint at 4 functions the chief
    kills ps1: the next join fails; phase "resume" restores that checkpoint in new processes
    and runs the other 8), "chief" (the chief dies after 4 functions)."""
    saved = out / "counter.ckpt"
    with counter_job(mode) as (coordinator, module, model, optimizer):
        record: dict[str, Any] = {}
        runs = []
        if phase == "resume":
            coordinator.restore(saved)
        else:
            runs += [
                coordinator.schedule(count_down, (model, optimizer, fault, float(i)))
                for i in range(1, 5)
            ]
            coordinator.join()
            if fault == "chief":
                _die()
            if fault == "ps":
                coordinator.save(saved)
                rpc.rpc_async("ps1", _die)
        runs += [
            coordinator.schedule(count_down, (model, optimizer, fault, float(i)))
            for i in range(5, 13)
        ]
        try:
            coordinator.join()
        except RuntimeError as error:
            record["error"] = str(error)
        else:
            model.pull()
            record["value"] = module.value.detach().clone()
            record["ran_on"] = [run.fetch() for run in runs]
        torch.save(record, out / f"chief-{phase}.pt")


def launched_worker_lost(out: Path, when: str) -> None:
    """``counter`` without a fault, under ``mirrored launch`` (worker1 is rank 2), whose
    worker1's first process dies: "joining" the RPC group (it counted itself, but never
    joined), "mirror" (as the chief gives it the model) or "stop" (as the chief's close tells it
    to stop). The launcher restarts it; the chief's process ends once the restart has begun."""
    restarted = out / "worker1-restarted"
    if os.environ["RANK"] == "2" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        module, name = {
            "joining": (rpc_cluster, "_init_rpc"),
            "mirror": (parameter_server_worker, "register_model"),
            "stop": (parameter_server_task, "stop"),
        }[when]
        setattr(module, name, _die_instead)
    elif os.environ["RANK"] == "2":
        restarted.touch()
    counter(out, "none")
    deadline = time.monotonic() + 60  # only the chief gets here
    while not restarted.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def _die_instead(*args: Any) -> None:
    _die()


def task_index(context: mirrored.InputContext) -> list[int]:
    """A per-worker dataset that says which worker task built it."""
    return [context.input_pipeline_id]


def count_down_and_report(
    model: nn.Module, optimizer: Any, shards: Any, weight: float
) -> tuple[str, int]:
    """``count_down`` with worker1 dying mid-function; returns the worker and its shard."""
    return count_down(model, optimizer, "worker", weight), next(shards)


def rejoin(out: Path, mode: str) -> None:
    """A chief, 2 workers and 2 ps count down with functions of 2 updates (the i-th, from 1,
    of weight i), two at a time,
    until worker1, killed by its second function between its pushes to ps0 and ps1, has been
    restarted by the test and run one as ``worker1_2`` (with its task's dataset shard)."""
    with counter_job(mode) as (coordinator, module, model, optimizer):
        shards = iter(coordinator.create_per_worker_dataset(task_index))
        ran_on: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60
        while ("worker1_2", 1) not in ran_on and time.monotonic() < deadline:
            pair = [
                coordinator.schedule(
                    count_down_and_report, (model, optimizer, shards, float(len(ran_on) + i))
                )
                for i in (1, 2)
            ]
            ran_on += coordinator.fetch(pair)
            time.sleep(0.05)
        coordinator.join()
        model.pull()
        torch.save(
            {
                "value": module.value.detach().clone(),
                "ran_on": ran_on,
                "live": coordinator.strategy.live_workers(),
            },
            out / "chief-first.pt",
        )


def coordinator_rules(out: Path) -> None:
    """One coordinator per strategy; a function that cannot reach a worker fails by itself
    and loses no worker; close() fails what is still queued and a new coordinator goes on
    counting; with every worker lost the job fails after the strategy's timeout (10 s)."""
    record: dict[str, Any] = {}
    with counter_job("async", timeout_seconds=10) as (coordinator, module, model, optimizer):
        strategy = coordinator.strategy
        record["a Strategy, open"] = isinstance(strategy, mirrored.Strategy) and not strategy.closed
        record["one per strategy"] = ClusterCoordinator(strategy) is coordinator
        try:
            coordinator.schedule(lambda: 1)
        except TypeError as error:
            record["lambda"] = str(error)
        (out / "chief_only.py").write_text("def answer():\n    return 42\n")
        sys.path.insert(0, str(out))  # only here: the workers cannot import it
        chief_only = importlib.import_module("chief_only")
        try:
            coordinator.schedule(chief_only.answer).fetch()
        except ScheduledFunctionError as error:
            record["unloadable"] = str(error)
        with contextlib.suppress(ScheduledFunctionError):
            coordinator.join()  # raises the function's error once more
        record["live after"] = strategy.live_workers()
        coordinator.schedule(count_down, (model, optimizer, "none", 1.0)).fetch()
        queued = [
            coordinator.schedule(count_down, (model, optimizer, "none", 1.0)) for _ in range(6)
        ]
        coordinator.close()
        outcomes = []
        for value in queued:
            try:
                outcomes.append(value.fetch())
            except RuntimeError as error:
                outcomes.append(str(error))
        record["outcomes"] = outcomes
        for case, call in {
            "schedule after close": lambda: coordinator.schedule(count_down),
            "join after close": coordinator.join,
        }.items():
            try:
                call()
            except RuntimeError as error:
                record[case] = str(error)
        fresh = ClusterCoordinator(strategy)
        record["a new one after close"] = fresh is not coordinator
        fresh.schedule(count_down, (model, optimizer, "none", 1.0)).fetch()
        model.pull()
        record["value"] = module.value.detach().clone()
        fresh.schedule(_die)  # on one worker, then, run again, on the other
        started = time.monotonic()
        try:
            fresh.join()
        except RuntimeError as error:
            record["all lost"] = str(error)
        record["waited"] = time.monotonic() - started
    record["closed by its with"] = strategy.closed
    torch.save(record, out / "chief-first.pt")


def missing_tasks(out: Path) -> None:
    """The chief of a cluster whose other tasks never start: it must fail, naming them."""
    try:
        ParameterServerStrategy(timeout_seconds=3)
    except TimeoutError as error:
        torch.save({"error": str(error)}, out / "chief-first.pt")


def chief_fails(out: Path, ending: str, slow_task: str = "") -> None:
    """The chief's program raises, inside ``with strategy`` or at its end without close().
    ``slow_task`` (a TF_CONFIG task such as "ps1") is still inside ``init_rpc`` when the chief's
    constructor could return: it tells the chief it joined, then its other peers 2 s late."""
    if slow_task and _tf_config_task() == slow_task:
        call = rpc.api.rpc_sync

        def greet_late(to: str, func: Any, *args: Any, **kwargs: Any) -> Any:
            if func is rpc.backend_registry._update_group_membership and to != "chief":
                time.sleep(2)
            return call(to, func, *args, **kwargs)

        rpc.api.rpc_sync = greet_late
    strategy = ParameterServerStrategy(timeout_seconds=60)
    if ending == "with":
        with strategy:
            raise RuntimeError("the chief's program failed")
    raise RuntimeError("the chief's program failed")


def _tf_config_task() -> str:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}{task['index']}"


def digits_examples(context: mirrored.InputContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """fit's dataset function: this worker's shard of the digits (``digits_batches``)."""
    return digits_batches(context)


def halve_from_epoch_4(epoch: int, learning_rate: float) -> float:
    return learning_rate / 2 if epoch == 4 else learning_rate


def compiled_model(strategy: ParameterServerStrategy) -> mirrored.Model:
    """``make_model()`` as a ``mirrored.Model`` on ``strategy``, compiled with Adam."""
    with strategy.scope():
        model = mirrored.Model(make_model())
        model.compile(
            optimizer=torch.optim.Adam(model.parameters(), 3e-3),
            loss=mirrored.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    return model


def fit_digits(out: Path, data: str) -> None:
    """``mirrored.Model`` on the strategy: compile, fit (with a learning-rate callback and
    validation), evaluate, predict, save, load. ``data``: "function" (a dataset function) or
    "arrays" (each worker takes every other example)."""
    (x, y), (x_test, y_test) = digits()
    with ParameterServerStrategy(
        variable_partitioner=FixedShardsPartitioner(2), timeout_seconds=60
    ) as strategy:
        model = compiled_model(strategy)
        inputs: dict[str, Any] = (
            {"x": digits_examples} if data == "function" else {"x": x, "y": y, "batch_size": BATCH}
        )
        history = model.fit(
            **inputs,
            epochs=8,
            steps_per_epoch=-(-len(x) // BATCH),
            validation_data=(x_test, y_test),
            callbacks=[mirrored.callbacks.LearningRateScheduler(halve_from_epoch_4)],
            verbose=0,
        )
        evaluated = model.evaluate(x_test, y_test, return_dict=True, verbose=0)
        predicted = model.predict(x_test, verbose=0)
        model.save(out / "model.ckpt")
        trained = {k: v.clone() for k, v in model.state_dict().items()}
        model.fit(**inputs, epochs=1, steps_per_epoch=5, verbose=0)  # moves away from the save
        moved = {k: v.clone() for k, v in model.state_dict().items()}
        model.load(out / "model.ckpt")
        errors = {}
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
        for case, arguments in {
            "no steps_per_epoch": {"x": x, "y": y},
            "BackupAndRestore": {
                **inputs,
                "steps_per_epoch": 2,
                "callbacks": [mirrored.callbacks.BackupAndRestore(out / "backup")],
            },
            "a DataLoader": {"x": loader, "steps_per_epoch": 2},
            "y with a dataset function": {"x": digits_examples, "y": y, "steps_per_epoch": 2},
        }.items():
            try:
                model.fit(**arguments, epochs=1, verbose=0)
            except (ValueError, TypeError) as error:
                errors[case] = str(error)
        torch.save(
            {
                "errors": errors,
                "history": history.history,
                "evaluated": evaluated,
                "predicted_accuracy": float((predicted.argmax(1) == y_test).float().mean()),
                "trained": trained,
                "moved": moved,
                "loaded": model.state_dict(),
            },
            out / "chief.pt",
        )


def fit_verbose(out: Path, verbose: str) -> None:
    """fit, evaluate and predict printing their progress (``verbose`` 1, 2 or "auto"; the
    output is a pipe), with no ``close()``: the tasks end when the chief's program does."""
    (x, y), (x_test, y_test) = digits()
    model = compiled_model(ParameterServerStrategy(timeout_seconds=60))
    chosen = verbose if verbose == "auto" else int(verbose)
    steps = {"epochs": 2, "steps_per_epoch": 3, "validation_data": (x_test, y_test)}
    history = model.fit(x, y, batch_size=BATCH, verbose=chosen, **steps)
    model.evaluate(x_test, y_test, verbose=chosen)
    model.predict(x_test[:10], verbose=chosen)
    torch.save({"history": history.history}, out / "chief.pt")


JOBS = (
    train_digits,
    synchronous_rounds,
    checkpoint_resume,
    counter,
    launched_worker_lost,
    rejoin,
    coordinator_rules,
    missing_tasks,
    chief_fails,
    fit_digits,
    fit_verbose,
)
