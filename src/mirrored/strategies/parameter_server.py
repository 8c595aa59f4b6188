"""ParameterServerStrategy: parameters on ps tasks, workers that update them asynchronously.

TensorFlow's cluster: a ``chief`` (the coordinator, which runs the training program), ``worker``
tasks (which run the functions the coordinator schedules) and ``ps`` tasks (which hold the
parameters and their optimizer state), from ``TF_CONFIG`` or ``mirrored launch --num-ps P``. Every
task runs the same script; in a worker or ps task the constructor serves the coordinator, then ends
the process when the coordinator closes the strategy or its program ends (with an error when that
program failed or the coordinator is lost). A worker task started again after it was lost rejoins
the job as a new incarnation of itself (``worker1_2``): the chief gives up the lost one on every ps
task, admits the new one (``mirrored.parameter_server.rpc_cluster``), and gives it every model and
per-worker dataset.

On the coordinator, ``mirror(model, optimizer)`` places the model's parameters and buffers on the
ps tasks (whole, or cut by a partitioner: ``mirrored.partitioners``) with an optimizer of the same
class and hyperparameters beside them, and gives every worker a copy of the model. The handles it
returns are what scheduled functions take as arguments (``ClusterCoordinator.schedule``): on a
worker they are the worker's copy, pulled fresh from the ps tasks, and an optimizer whose
``step()`` pushes the gradients, applied by each ps task as soon as they arrive (in synchronous
mode, once the coordinator commits the function's round).

Built on ``torch.distributed.rpc`` (``mirrored.parameter_server.rpc_cluster``), which unpickles what
peers send: every task of the job belongs on a private network.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol, overload

import torch
import torch.distributed.rpc as rpc
from torch import nn

from mirrored.cluster.resolvers import ClusterResolver, resolve_cluster
from mirrored.core.strategy import Strategy
from mirrored.parameter_server import shard_store
from mirrored.parameter_server import task as parameter_server_task
from mirrored.parameter_server import worker as parameter_server_worker
from mirrored.parameter_server.checkpoint import MirroredModel
from mirrored.parameter_server.handles import ParameterServerModule, ParameterServerOptimizer
from mirrored.parameter_server.rpc_cluster import (
    Admissions,
    Member,
    RpcCluster,
    forget_member,
    start_rpc,
    stop_rpc,
)
from mirrored.parameter_server.worker import shard_rows
from mirrored.partitioners import Partitioner, ShardSpec, plan_shards

__all__ = [
    "ParameterServerModule",
    "ParameterServerOptimizer",
    "ParameterServerStrategy",
    "WorkerListener",
]

_DEFAULT_TIMEOUT_SECONDS = 300.0


class WorkerListener(Protocol):
    """What the strategy tells its coordinator (``ClusterCoordinator``) about the workers: the
    strategy admits and gives up workers, the coordinator hands them functions."""

    @property
    def closed(self) -> bool:
        """Whether the coordinator was closed (a strategy then takes a new one)."""
        ...

    def retire_worker(self, worker: str, why: str) -> None:
        """Hand ``worker`` nothing more, and count nothing it still returns (``why``: it was
        lost, or its task restarted)."""
        ...

    def welcome_worker(self, member: Member) -> None:
        """Give a restarted worker what it needs, then functions to run."""
        ...

    def close(self) -> None: ...


class ParameterServerStrategy(Strategy):
    """Asynchronous training with parameter servers (TensorFlow's ``ParameterServerStrategy``).

    Args:
        cluster_resolver: the cluster (``TF_CONFIG`` by default); it must have one ``chief``, at
            least one ``worker`` and at least one ``ps`` task.
        variable_partitioner: how many shards each parameter is cut into along dim 0
            (``MinSizePartitioner``, ``FixedShardsPartitioner``); None keeps tensors whole.
        max_staleness: None for fully asynchronous updates; k to keep every worker at most k
            scheduled functions ahead of the slowest live one (stale-synchronous: 0 runs the
            workers in rounds).
        synchronous: run the scheduled functions in rounds of one per worker and apply each
            round's gradients as one averaged update (a synchronous data-parallel step over the
            round's batches), for comparison with the asynchronous modes.
        timeout_seconds: how long any call between tasks may take (default 300 s) before its
            task counts as lost.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        variable_partitioner: Partitioner | None = None,
        *,
        max_staleness: int | None = None,
        synchronous: bool = False,
        timeout_seconds: float | None = None,
    ) -> None:
        resolver = cluster_resolver if cluster_resolver is not None else resolve_cluster()
        spec = resolver.cluster_spec()
        _check_cluster(spec)
        _check_options(resolver, max_staleness, synchronous, timeout_seconds)
        self.cluster = RpcCluster.of(len(spec["worker"]), len(spec["ps"]))
        self.variable_partitioner = variable_partitioner
        self.max_staleness = max_staleness
        self.synchronous = bool(synchronous)
        self.timeout_seconds = timeout_seconds or _DEFAULT_TIMEOUT_SECONDS
        task = (
            "chief" if resolver.task_type == "chief" else f"{resolver.task_type}{resolver.task_id}"
        )
        host, port = resolver.master_addr, resolver.master_port
        member, self._store = start_rpc(
            task, self.cluster, host, port, self.timeout_seconds, resolver.agent_store
        )
        if self._store is None:  # a worker or ps task
            parameter_server_task.serve(member.name, host, port)
            raise SystemExit(0)
        # An uncaught exception the program ends with will be sys.last_value, unless it is this.
        self._earlier_error = getattr(sys, "last_value", None)
        self._model_ids = itertools.count()
        self.models: list[MirroredModel] = []  # in the order mirror() made them
        self._coordinator: WorkerListener | None = None  # the one (ClusterCoordinator)
        self._function_ids = itertools.count()  # ids of scheduled functions, per strategy
        # Each worker task's incarnation taking part (or the last one, given up), the one
        # admitted but not yet taking part, and the incarnations given up.
        self._workers = {w: Member(w, w, self.cluster.rank(w)) for w in self.cluster.workers}
        self._admitted: dict[str, Member] = {}
        self._lost: set[str] = set()
        self._membership = threading.RLock()  # held while a model or worker joins the job
        self._closed = False
        self._admissions = Admissions(
            self._store.host, self._store.port, self.timeout_seconds, self._prepare, self._welcome
        )
        _open_strategies.add(self)

    #: ``mirrored.Model`` trains through a ``ClusterCoordinator`` on this strategy.
    should_use_with_coordinator = True
    #: Gradients are pushed, not summed where the train step could unscale them.
    gradients_after_backward = False

    @property
    def num_replicas_in_sync(self) -> int:
        """1: a scheduled step runs on one worker, on one replica, and its batch is the step's
        whole batch (TensorFlow's ``ParameterServerStrategy`` counts one worker's replicas too)."""
        return 1

    def save_on_chief(self, write: Callable[[], object]) -> None:
        """Run a checkpoint's ``write``: only the chief runs the training program here."""
        write()

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints, logs and progress bars: always, since only
        the chief runs the training program."""
        return True

    def check_same_on_workers(self, value: Any, what: str) -> None:
        """Nothing to check: only the chief runs the training program and reads files; the
        workers pull the parameters from the ps tasks."""

    @property
    def num_workers(self) -> int:
        return len(self.cluster.workers)

    @property
    def num_ps(self) -> int:
        return len(self.cluster.ps)

    def __repr__(self) -> str:
        return (
            f"ParameterServerStrategy(workers={self.num_workers}, ps={self.num_ps}, "
            f"variable_partitioner={self.variable_partitioner!r}, "
            f"max_staleness={self.max_staleness}, synchronous={self.synchronous})"
        )

    # -- models ---------------------------------------------------------------------------------
    @overload
    def mirror(
        self, module: nn.Module, optimizer: None = None, *, sync_batch_norm: bool = False
    ) -> ParameterServerModule: ...

    @overload
    def mirror(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, *, sync_batch_norm: bool = False
    ) -> tuple[ParameterServerModule, ParameterServerOptimizer]: ...

    @overload
    def mirror(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> ParameterServerModule | tuple[ParameterServerModule, ParameterServerOptimizer]: ...

    def mirror(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> ParameterServerModule | tuple[ParameterServerModule, ParameterServerOptimizer]:
        """Place ``module``'s parameters and buffers on the ps tasks, with an optimizer of
        ``optimizer``'s class and hyperparameters beside them, and give every worker a copy of
        ``module`` (its class must be importable there: run the same script in every task).
        Returns the model's handle, and the optimizer's when one is given."""
        if sync_batch_norm:
            raise ValueError(
                "sync_batch_norm: each worker of a ParameterServerStrategy steps on its own "
                "batches, with no replica to synchronise batch statistics with"
            )
        param_groups = _optimizer_groups(module, optimizer)
        tensors = dict(module.named_parameters()) | dict(module.named_buffers())
        shards = plan_shards(
            [(name, t.shape, t.dtype) for name, t in tensors.items()],
            self.num_ps,
            self.variable_partitioner,
        )
        model_id = next(self._model_ids)
        optimizer_class = type(optimizer) if optimizer is not None else None
        futures = self._place(model_id, tensors, shards, optimizer_class, param_groups)
        mirrored = MirroredModel(model_id, module, tuple(shards), param_groups)
        with self._membership:  # a worker admitted meanwhile gets this model too
            self.on_every_worker(lambda member: self._register(mirrored, member.name))
            for future in futures:
                future.wait()
            self.models.append(mirrored)
        local = parameter_server_worker.WorkerModel(model_id, module, shards, self.timeout_seconds)
        handle = ParameterServerModule(model_id, local)
        if optimizer is None:
            return handle
        # The optimizer handle's hyperparameters are the very dicts the checkpoints read.
        return handle, ParameterServerOptimizer(model_id, [h for _, h in param_groups])

    def _place(
        self,
        model_id: int,
        tensors: dict[str, torch.Tensor],
        shards: list[ShardSpec],
        optimizer_class: type[torch.optim.Optimizer] | None,
        param_groups: tuple[tuple[tuple[str, ...], dict[str, Any]], ...],
    ) -> list[Any]:
        """Create the model's shards, and an optimizer over them, on every ps task (futures)."""
        futures = []
        for ps, task in enumerate(self.cluster.ps):
            mine = [s for s in shards if s.ps == ps]
            groups = [
                {**hyper, "keys": [s.key for s in mine if s.name in in_group]}
                for in_group, hyper in param_groups
            ]
            values = {s.key: shard_rows(tensors[s.name], s).detach().clone() for s in mine}
            futures.append(
                rpc.rpc_async(
                    task,
                    shard_store.create,
                    (model_id, values, optimizer_class, groups, self.synchronous),
                    timeout=self.timeout_seconds,
                )
            )
        return futures

    def _register(self, model: MirroredModel, worker: str) -> Any:
        """Give ``worker`` its copy of ``model`` (a future)."""
        return rpc.rpc_async(
            worker,
            parameter_server_worker.register_model,
            (model.model_id, model.module, list(model.shards), self.timeout_seconds),
            timeout=self.timeout_seconds,
        )

    # -- workers ----------------------------------------------------------------------------------
    def live_workers(self) -> list[str]:
        """The RPC names of the workers taking part now, in task order (``worker1_2`` is the
        second incarnation of ``worker1``, restarted after it was lost)."""
        return [member.name for member in self._live_members()]

    def _live_members(self) -> list[Member]:
        with self._membership:
            return [m for m in self._workers.values() if m.name not in self._lost]

    @contextlib.contextmanager
    def stable_members(self) -> Iterator[list[Member]]:
        """The workers taking part now; none joins or is given up until the block ends (a
        restarted worker waits), so what is done for each of them inside reaches every one."""
        with self._membership:
            yield self._live_members()

    @property
    def coordinator(self) -> WorkerListener | None:
        """The coordinator that schedules on this strategy's workers, once one is attached."""
        return self._coordinator

    def attach_coordinator(self, coordinator: WorkerListener) -> None:
        """Tell ``coordinator`` from now on of every worker that rejoins or is retired; the
        strategy closes it when it closes. A strategy has one coordinator at a time."""
        with self._membership:
            self._coordinator = coordinator

    def new_function_id(self) -> int:
        """An id for a scheduled function, never given twice by this strategy: the ps tasks
        apply each function's update once by its id, whichever coordinator scheduled it."""
        return next(self._function_ids)

    def worker_task_index(self, member: Member) -> int:
        """Which worker task ``member`` runs: the shard of the per-worker datasets it builds."""
        return self.cluster.workers.index(member.task)

    def on_every_worker(self, send: Callable[[Member], Any]) -> None:
        """``send(member)`` (an RPC, its future) to every worker taking part, then wait for
        each. One that fails and no longer answers is given up, as the coordinator gives up a
        lost worker (restarted, it rejoins and gets everything); others' errors are raised."""
        with self._membership:
            futures = [(member, send(member)) for member in self._live_members()]
            for member, future in futures:
                try:
                    future.wait()
                except Exception as error:
                    if parameter_server_task.answers(member.name, self.timeout_seconds):
                        raise
                    if self._coordinator is not None:
                        self._coordinator.retire_worker(member.name, f"lost ({error})")
                    self.give_up_worker(member.name)

    def give_up_worker(self, worker: str) -> None:
        """No push of ``worker`` counts from now on: every ps task fences it (a push under way
        finishes first). Raises when a ps task does not answer."""
        for ps in self.cluster.ps:
            rpc.rpc_sync(ps, shard_store.fence, (worker,), timeout=self.timeout_seconds)
        with self._membership:
            self._lost.add(worker)

    def _prepare(self, member: Member) -> str | None:
        """A restarted worker asks to rejoin: give up its earlier incarnations everywhere (the
        one that took part and one admitted before that never took part), then let it join the
        RPC group (``Admissions``); or say why it may not."""
        if self._closed:
            return "the job has ended"
        with self._membership:
            earlier = [self._workers[member.task], self._admitted.get(member.task)]
            for old in filter(None, earlier):
                if self._coordinator is not None:
                    self._coordinator.retire_worker(old.name, "its task was restarted")
                self.give_up_worker(old.name)
                forget_member(old)
            self._admitted[member.task] = member
        return None

    def _welcome(self, member: Member) -> None:
        """A restarted worker has joined: give it every model and per-worker dataset, then
        functions to run; until then it does not take part."""
        with self._membership:
            try:
                for model in self.models:
                    self._register(model, member.name).wait()
                if self._coordinator is not None:
                    self._coordinator.welcome_worker(member)
            except Exception as error:  # lost again: its next restart asks again
                warnings.warn(
                    f"{member.task} rejoined as {member.name} but was lost again before it could "
                    f"take part ({error})",
                    RuntimeWarning,
                    stacklevel=1,
                )
                return
            self._workers[member.task] = self._admitted.pop(member.task)

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether the job has ended (``close()``, or the strategy's ``with`` block)."""
        return self._closed

    def close(self) -> None:
        """End the job: every worker and ps task leaves its process, then this one leaves the
        RPC group; idempotent. A program that ends without it closes the strategy as it exits."""
        self._end(None)

    def _end(self, failure: str | None) -> None:
        """``close()``; with ``failure``, why the coordinator's program failed: the worker and
        ps tasks then exit with an error naming it."""
        if self._closed:
            return
        self._closed = True
        _open_strategies.discard(self)
        self._admissions.stop()
        if self._coordinator is not None:
            self._coordinator.close()
        futures = []
        for task in (*self.live_workers(), *self.cluster.ps):
            with contextlib.suppress(RuntimeError):  # a task already lost: nothing to stop
                futures.append(
                    rpc.rpc_async(
                        task, parameter_server_task.stop, (failure,), timeout=self.timeout_seconds
                    )
                )
        for future in futures:
            with contextlib.suppress(RuntimeError):
                future.wait()
        stop_rpc()

    def __exit__(self, *exc_info: object) -> None:
        error = exc_info[1]
        self._end(None if error is None else _describe(error))


_open_strategies: set[ParameterServerStrategy] = set()  # the chief's, not yet closed


@atexit.register
def _close_at_exit() -> None:
    """The coordinator's program has ended without closing its strategies: close them, so that
    the worker and ps tasks end with it (they would serve forever under a launcher that hosts
    the store), with an error naming the exception the program ended with, if any."""
    error = getattr(sys, "last_value", None)
    for strategy in list(_open_strategies):
        failed = error is not None and error is not strategy._earlier_error
        strategy._end(_describe(error) if failed else None)


def _describe(error: object) -> str:
    return f"{type(error).__name__}: {error}"


def _check_cluster(spec: dict[str, list[str]]) -> None:
    """One chief, one or more workers and ps tasks, each address once (TF_CONFIG's addresses are
    checked for duplicates when parsed)."""
    counts = {job: len(spec.get(job, [])) for job in ("chief", "worker", "ps")}
    if counts["chief"] != 1 or not counts["worker"] or not counts["ps"]:
        raise ValueError(
            f"a ParameterServerStrategy needs one 'chief', at least one 'worker' and at least "
            f"one 'ps' task in the cluster; got {counts}. Example TF_CONFIG cluster: "
            '{"chief": ["host0:2222"], "worker": ["host1:2222"], "ps": ["host2:2222"]}'
        )


def _check_options(
    resolver: ClusterResolver,
    max_staleness: int | None,
    synchronous: bool,
    timeout_seconds: float | None,
) -> None:
    """The constructor's arguments other than the cluster, each checked alone and together."""
    if max_staleness is not None and (
        not isinstance(max_staleness, int) or isinstance(max_staleness, bool) or max_staleness < 0
    ):
        raise ValueError(f"max_staleness={max_staleness!r}: expected None or an int >= 0")
    if synchronous and max_staleness is not None:
        raise ValueError(
            f"synchronous=True runs the workers in lockstep rounds; max_staleness="
            f"{max_staleness!r} bounds asynchronous updates: pass one or the other"
        )
    if timeout_seconds is not None and timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds={timeout_seconds!r}: expected a positive number")
    if resolver.task_type == "evaluator":
        raise ValueError(
            "the evaluator task takes no part in parameter-server training; read the "
            "checkpoints the coordinator writes instead"
        )


def _optimizer_groups(
    module: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[tuple[tuple[str, ...], dict[str, Any]], ...]:
    """``optimizer``'s param groups as (parameter names, hyperparameters); every tensor it holds
    must be a parameter of ``module``."""
    if optimizer is None:
        return ()
    owned = {id(p) for p in module.parameters()}
    foreign = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in owned]
    if foreign:
        raise ValueError(
            f"the optimizer holds {len(foreign)} tensor(s) that are not parameters of "
            "the module; build it from module.parameters()"
        )
    names = {id(p): name for name, p in module.named_parameters()}
    return tuple(
        (
            tuple(names[id(p)] for p in group["params"]),
            {k: v for k, v in group.items() if k != "params"},
        )
        for group in optimizer.param_groups
    )
