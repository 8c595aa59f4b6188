"""PipelineStrategy: a model's layers split into stages on several devices, micro-batched.

For a model too big for one device, an ``nn.Sequential`` is cut into stages, one per device;
each global batch is cut into micro-batches that flow through the stages, so the devices work at
the same time (GPipe or 1F1B, see :mod:`mirrored.pipeline.schedule`). Several pipelines
(``num_pipelines``) add data parallelism: each holds a copy of the model on its own devices, and
their gradients are summed before the update.

The user's step function is unchanged. Each micro-batch runs it as a replica of the strategy
(``num_replicas_in_sync`` = pipelines x micro-batches): it calls the model, computes
``compute_average_loss`` over the *global* batch, calls ``loss.backward()`` and
``optimizer.step()``. The replicas of one pipeline share its model, so gradients are summed, not
copied: they accumulate in the stages and reach ``param.grad`` at ``optimizer.step()``, the step's
merge point, where the update is applied once per pipeline. So the parameters equal one device's
on the same global batch, to float rounding. Code that reads or changes ``param.grad`` between
``loss.backward()`` and ``optimizer.step()`` (clipping, unscaling) does not see the sum.
"""

from __future__ import annotations

import copy
import itertools
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mirrored import config
from mirrored.comm.cross_device_ops import ReductionToOneDevice
from mirrored.config import DeviceSpec, LogicalDevice
from mirrored.core.context import ReplicaContext, current_replica_context
from mirrored.core.device_runtime import cap_process_memory, intra_op_threads
from mirrored.core.param_groups import snapshot, take_hyperparameters
from mirrored.core.replica_meeting import ReplicaMeeting
from mirrored.core.replica_set import ReplicaSet
from mirrored.core.replica_workers import Outcome, ReplicaWorkers, close_threads
from mirrored.core.values import PerReplica, flatten, map_structure
from mirrored.pipeline.executor import (
    Pipeline,
    PipelineOutput,
    PipelineRun,
    StageTimeline,
    add_summed_gradients,
)
from mirrored.pipeline.schedule import SCHEDULES
from mirrored.pipeline.split import (
    check_stages_chain,
    meta_copy,
    place_stages,
    plan_stages,
    split_sequential,
)
from mirrored.random.routing import ReplicaRandomness, replica_streams
from mirrored.random.step_seeds import StepSeed
from mirrored.replication.mirror_checks import check_optimizer_params
from mirrored.replication.mirrored_module import MirroredModule
from mirrored.replication.mirrored_optimizer import MirroredOptimizer
from mirrored.replication.optimizer_copies import replicate_optimizer
from mirrored.replication.replica_optimizers import holds_any
from mirrored.strategies.in_process import InProcessStrategy
from mirrored.strategies.mirrored import local_devices

__all__ = ["PipelineStrategy", "PipelinedModule", "PipelinedOptimizer"]


class PipelineStrategy(InProcessStrategy):
    """Pipeline (model) parallelism, optionally data-parallel over several pipelines.

    Args:
        devices: ``num_pipelines`` x stages devices, pipeline by pipeline (pipeline 0's stages
            first); None: every logical GPU, else every logical CPU device.
        num_microbatches: micro-batches per pipeline and step; each global batch must hold at
            least ``num_pipelines * num_microbatches`` examples.
        schedule: "gpipe" (all forwards, then all backwards) or "1f1b" (the same bubble, stage
            ``s`` of ``p`` holding at most ``p - s`` micro-batches' activations).
        num_pipelines: data-parallel copies of the pipeline.
        split: how ``mirror`` cuts an ``nn.Sequential``: "parameters" (balanced parameter
            counts) or the indices where stages 2.. begin (``pipeline_split.balance_by_time``
            measures them). A list of stage modules given to ``mirror`` is split as given.
        recompute: keep only each stage's input and recompute its forward at the backward
            (activation checkpointing: less memory, one more forward).
        timeout_seconds: how long replicas and stages wait for each other before failing with
            an error that names the one missing (None: forever).
    """

    gradients_after_backward = False

    def __init__(
        self,
        devices: Sequence[DeviceSpec | LogicalDevice] | None = None,
        num_microbatches: int = 4,
        schedule: str = "gpipe",
        *,
        num_pipelines: int = 1,
        split: str | Sequence[int] = "parameters",
        recompute: bool = False,
        timeout_seconds: float | None = 1800.0,
    ) -> None:
        logical = local_devices(devices)
        _check_positive_int("num_microbatches", num_microbatches)
        _check_positive_int("num_pipelines", num_pipelines)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r}: expected one of {list(SCHEDULES)}")
        self.stage_devices = _group_into_pipelines(logical, num_pipelines)
        self.num_microbatches = num_microbatches
        self.num_pipelines = num_pipelines
        self.num_stages = len(logical) // num_pipelines
        self.schedule = schedule
        self.split = _checked_split(split)
        self.recompute = recompute
        replica_devices = [
            stages[0] for stages in self.stage_devices for _ in range(num_microbatches)
        ]
        super().__init__(replica_devices, ReductionToOneDevice(), timeout_seconds)
        config.mark_in_use(logical)
        cap_process_memory(logical)
        cpu_stages = sum(1 for d in logical if d.device_type == "CPU") or 1
        self._stage_threads = max(1, torch.get_num_threads() // cpu_stages)
        self._randomness = [
            ReplicaRandomness(i, d.torch_device) for i, d in enumerate(replica_devices)
        ]
        for randomness in self._randomness:
            self.at_close(randomness.release)
        self._workers = ReplicaWorkers(
            [
                f"pipeline{p}-microbatch{k}"
                for p in range(num_pipelines)
                for k in range(num_microbatches)
            ]
        )
        self._pipelines: list[Pipeline] = []
        # Stop the threads when the strategy is collected without close().
        self._finalizer = weakref.finalize(self, _stop, self._workers, self._pipelines)
        self._modules: list[nn.Sequential] = []  # each pipeline's whole model
        self._meta_stages: list[nn.Module] = []
        self._layer_ranges: list[tuple[int, int]] = []
        self._checked_inputs: set[Any] = set()
        self._check_lock = threading.Lock()

    def __repr__(self) -> str:
        stages = [[d.short_name for d in pipeline] for pipeline in self.stage_devices]
        return (
            f"PipelineStrategy(stages={stages}, num_microbatches={self.num_microbatches}, "
            f"schedule={self.schedule!r}, recompute={self.recompute})"
        )

    # -- running ----------------------------------------------------------------------------------
    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Run ``fn`` once per micro-batch of every pipeline (see ``Strategy.run``); a batch
        with fewer examples than micro-batches is refused before any compute."""
        for leaf in flatten((tuple(args) if isinstance(args, (tuple, list)) else args, kwargs)):
            if isinstance(leaf, PerReplica) and any(
                isinstance(v, torch.Tensor) and v.dim() and not len(v) for v in leaf.values
            ):
                total = sum(len(v) for v in leaf.values)
                raise ValueError(
                    f"a global batch of {total} examples is smaller than the "
                    f"{self.num_replicas_in_sync} micro-batches ({self.num_pipelines} pipeline(s) "
                    f"x num_microbatches={self.num_microbatches}); use larger batches, drop the "
                    "last batch (DataLoader(drop_last=True)), or fewer micro-batches"
                )
        return super().run(fn, args, kwargs)

    def _execute(
        self, tasks: Sequence[Callable[[], Any]], meeting: ReplicaMeeting
    ) -> list[Outcome]:
        with StepSeed() as step_seed:
            return self._run_pipelines(tasks, meeting, step_seed)

    def _run_pipelines(
        self, tasks: Sequence[Callable[[], Any]], meeting: ReplicaMeeting, step_seed: StepSeed
    ) -> list[Outcome]:
        for randomness in self._randomness:
            randomness.start_step(step_seed)
        for p, pipeline in enumerate(self._pipelines):
            streams = [
                torch.cuda.current_stream(d.torch_device) if d.device_type == "GPU" else None
                for d in self.stage_devices[p]
            ]
            pipeline.begin_run(
                PipelineRun(
                    meeting,
                    p * self.num_microbatches,
                    self.num_microbatches,
                    step_seed,
                    self.num_replicas_in_sync,
                    streams,
                )
            )
        try:
            outcomes = self._workers.run(
                tasks, self.timeout_seconds, meeting.abort, self._resync_now
            )
            if all(ok for ok, _ in outcomes) and self._pipelines:
                # Gradients of backwards with no optimizer.step() in the run: into param.grad.
                self._apply_gradients(self._deadline())
            return outcomes
        finally:
            end = self._deadline()
            for pipeline in self._pipelines:
                pipeline.end_run(end)

    def _deadline(self) -> float | None:
        """When a wait that starts now must end."""
        return None if self.timeout_seconds is None else time.monotonic() + self.timeout_seconds

    @contextmanager
    def _replica_scope(self, replica_id: int) -> Iterator[None]:
        # A micro-batch's thread runs the loss and the user's step around the stages: with a
        # stage's share of the cores, not a whole thread pool competing with the stages'.
        with (
            intra_op_threads(self._stage_threads),
            replica_streams(self._randomness, replica_id, self.num_replicas_in_sync),
        ):
            yield

    def _usable(self) -> bool:
        return self._workers.broken is None

    def _locate(self, replica: ReplicaContext) -> tuple[int, int]:
        """(pipeline, micro-batch) of a replica."""
        return divmod(replica.local_replica_id, self.num_microbatches)

    def _forward(
        self, replica: ReplicaContext, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """The model's output on a micro-batch, from the stages of the replica's pipeline."""
        p, k = self._locate(replica)
        pipeline = self._pipelines[p]
        self._check_input(args, kwargs)
        grad = torch.is_grad_enabled() and any(
            param.requires_grad
            for stage in pipeline.executors
            for param in stage.stage.parameters()
        )
        if not grad:
            output, _ = pipeline.forward(k, args, kwargs, grad_enabled=False)
            return output
        holder: dict[str, Any] = {}
        anchor = torch.zeros((), requires_grad=True)
        tensors = iter(PipelineOutput.apply(pipeline, k, args, kwargs, holder, anchor))
        return map_structure(
            lambda v: next(tensors) if isinstance(v, torch.Tensor) else v, holder["output"]
        )

    def _check_input(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Refuse inputs that need a gradient, and check (once per input signature, on the meta
        device) that the stages chain, before any compute."""
        leaves = [v for v in flatten((args, kwargs)) if isinstance(v, torch.Tensor)]
        if any(v.requires_grad for v in leaves):
            raise ValueError(
                "a pipelined model's inputs must not require grad (the pipeline does not send "
                "gradients back to them); pass data, or move the layers that make them into "
                "the model"
            )
        signature = tuple((tuple(v.shape), v.dtype) for v in leaves)
        with self._check_lock:
            if signature in self._checked_inputs:
                return
            check_stages_chain(self._meta_stages, self._layer_ranges, args, kwargs)
            self._checked_inputs.add(signature)

    def _step(self, replica: ReplicaContext, optimizer: PipelinedOptimizer) -> None:
        """``optimizer.step()`` on every replica: once all are here, the first sums the
        pipelines' gradients and updates each pipeline once."""
        settings = None
        if replica.local_replica_id == 0:
            settings = snapshot(optimizer.param_groups)
        replica.exchange.all("optimizer.step", settings)
        if replica.local_replica_id == 0:
            try:
                self._apply_gradients(self._deadline())
                assert settings is not None
                for other in optimizer.optimizers[1:]:
                    for group, values in zip(other.param_groups, settings, strict=True):
                        take_hyperparameters(group, values)
                for each in optimizer.optimizers:
                    each.step()
            except BaseException as error:
                replica.exchange.meeting.abort(error)
                raise
        replica.exchange.barrier("optimizer.step: pipelines updated")

    def _apply_gradients(self, deadline: float | None) -> None:
        """Wait for the stages, then add the step's gradients to every pipeline's ``param.grad``."""
        add_summed_gradients(self._pipelines, self._modules, deadline)

    # -- models -----------------------------------------------------------------------------------
    def mirror(
        self,
        module: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        sync_batch_norm: bool = False,
    ) -> Any:
        """Cut ``module`` (an ``nn.Sequential``, or a list of stage modules) into stages on
        this strategy's devices, copy it for every other pipeline, and return the model and
        optimizer proxies. ``state_dict()`` gives the plain model's state."""
        if sync_batch_norm:
            raise ValueError(
                "sync_batch_norm=True: a pipeline normalises each micro-batch on its stage; "
                "batch statistics across micro-batches are not synchronised"
            )
        sequential, points = plan_stages(module, self.num_stages, self.num_pipelines, self.split)
        if optimizer is not None:
            check_optimizer_params(sequential, optimizer)
        modules = [sequential] + [copy.deepcopy(sequential) for _ in range(self.num_pipelines - 1)]
        for pipeline in self._pipelines:
            pipeline.close()
        self._pipelines.clear()
        stage_lists = []
        for p, copy_p in enumerate(modules):
            stages = split_sequential(copy_p, points)
            place_stages(stages, self.stage_devices[p])
            stage_lists.append(stages)
        bounds = [0, *points, len(sequential)]
        self._layer_ranges = list(itertools.pairwise(bounds))
        self._meta_stages = [meta_copy(stage) for stage in stage_lists[0]]
        self._checked_inputs = set()
        self._modules = modules
        self._pipelines.extend(
            Pipeline(
                stages,
                self.stage_devices[p],
                self.schedule,
                self.recompute,
                self._stage_threads,
                p,
                self.num_pipelines,
            )
            for p, stages in enumerate(stage_lists)
        )
        model = PipelinedModule(self, modules)
        self.track_replicated(model)
        if optimizer is None:
            return model
        originals = list(sequential.parameters())
        optimizers = [optimizer] + [
            replicate_optimizer(
                optimizer, {id(a): b for a, b in zip(originals, m.parameters(), strict=True)}
            )
            for m in modules[1:]
        ]
        params = [list(m.parameters()) for m in modules]
        pipelined = PipelinedOptimizer(self, optimizers, params, [[] for _ in modules])
        self.track_replicated(pipelined)
        return model, pipelined

    def stage_timelines(self) -> list[list[StageTimeline]]:
        """Per pipeline and stage: the operations of the last run (times, activation peak)."""
        return [pipeline.timelines() for pipeline in self._pipelines]

    # -- lifetime ---------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Stop the replica and stage threads; the strategy cannot run afterwards."""
        try:
            close_threads(self._finalizer, lambda: _stop(self._workers, self._pipelines))
        finally:
            self._release_at_close()


def _stop(workers: ReplicaWorkers, pipelines: list[Pipeline]) -> None:
    """End the replica and stage threads (without a reference to the strategy)."""
    workers.close(wait=True)
    for pipeline in pipelines:
        pipeline.close()


class PipelinedModule(MirroredModule):
    """The model of a ``PipelineStrategy``: one full model per pipeline (its layers on the
    pipeline's stage devices). Calls inside ``strategy.run`` go through the pipeline of the
    current replica; outside, the layers run one stage after another on the caller's thread.
    Everything else is as for a mirrored module (``state_dict`` is the plain model's)."""

    def _current(self) -> nn.Module:
        replica = current_replica_context()
        if replica is None or replica.strategy is not self._strategy:
            return self.replicas[0]
        return self.replicas[self._strategy._locate(replica)[0]]  # type: ignore[attr-defined]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        strategy: PipelineStrategy = self._strategy
        replica = current_replica_context()
        if replica is not None and replica.strategy is strategy:
            return strategy._forward(replica, args, kwargs)
        return strategy._pipelines[0].forward_in_turn(args, kwargs)

    def __repr__(self) -> str:
        return f"PipelinedModule(pipelines={len(self.replicas)}, module={self.replicas[0]!r})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The current pipeline's gradients inside ``strategy.run`` (cleared once, by its first
        micro-batch), every pipeline's outside."""
        for index in _pipelines_to_zero(self._strategy):
            self.replicas[index].zero_grad(set_to_none=set_to_none)


class PipelinedOptimizer(MirroredOptimizer):
    """One optimizer per pipeline; ``step()`` on every micro-batch is the step's merge point:
    the gradients of all micro-batches of all pipelines are summed, and each pipeline is
    updated once."""

    def _step(self, replica: ReplicaContext) -> Any:
        self._strategy._step(replica, self)  # type: ignore[attr-defined]
        return None

    def all_reduce_gradients(self) -> None:
        """Refused: a pipeline's gradients reach ``param.grad`` only at ``step()`` (torch's
        gradient clipping inside a run calls this, so it is refused too)."""
        raise TypeError(
            "a pipeline's gradients reach param.grad only at optimizer.step(), so they cannot "
            "be summed (or clipped: torch.nn.utils.clip_grad_norm_, clip_grad_value_) before "
            "it; clip with an optimizer that clips, or on one device"
        )

    def holds_any(self, replica_id: int, tensor_ids: set[int]) -> bool:
        """Whether any of ``tensor_ids`` is a parameter of any pipeline (every micro-batch's
        replica shares its pipeline's) or the gradient of one."""
        return holds_any(itertools.chain.from_iterable(self._params), tensor_ids)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The current pipeline's gradients inside ``strategy.run``, every pipeline's outside
        (see ``PipelinedModule.zero_grad``)."""
        for index in _pipelines_to_zero(self._strategy):
            self.optimizers[index].zero_grad(set_to_none=set_to_none)


def _pipelines_to_zero(strategy: ReplicaSet) -> list[int]:
    """Which pipelines' gradients a ``zero_grad()`` call clears: inside a run, the caller's
    pipeline, by its first micro-batch only (the micro-batches share the parameters, and the
    step's sums reach ``param.grad`` only at ``optimizer.step()``, so one clearing is all the
    others' too); outside a run, every pipeline."""
    assert isinstance(strategy, PipelineStrategy)
    replica = current_replica_context()
    if replica is None or replica.strategy is not strategy:
        return list(range(strategy.num_pipelines))
    pipeline, microbatch = strategy._locate(replica)
    return [pipeline] if microbatch == 0 else []


def _group_into_pipelines(
    logical: Sequence[LogicalDevice], num_pipelines: int
) -> tuple[tuple[LogicalDevice, ...], ...]:
    """The devices of each pipeline's stages, pipeline by pipeline."""
    if len(logical) % num_pipelines:
        raise ValueError(
            f"{len(logical)} devices cannot hold {num_pipelines} pipelines of equal length; "
            "pass num_pipelines x stages devices"
        )
    num_stages = len(logical) // num_pipelines
    return tuple(
        tuple(logical[p * num_stages : (p + 1) * num_stages]) for p in range(num_pipelines)
    )


def _checked_split(split: str | Sequence[int]) -> str | list[int]:
    """``split`` as ``mirror`` uses it: "parameters", or a list of layer indices."""
    if not isinstance(split, str):
        return [int(point) for point in split]
    if split != "parameters":
        raise ValueError(
            f"split={split!r}: expected 'parameters' or a list of layer indices where "
            "stages 2.. begin (mirrored.pipeline.split.balance_by_time measures them)"
        )
    return split


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r}: expected an integer >= 1")
