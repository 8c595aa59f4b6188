"""Running one pipeline: micro-batches flowing through its stages, each stage on its thread.

``Pipeline`` holds a pipeline's stages (:mod:`mirrored.pipeline.stage`) and routes between them:
a forward's output to the next stage, a backward's input gradient to the stage before, the last
stage's output back to the micro-batch thread that waits for it. The micro-batch threads
(replicas of the strategy) only send inputs and gradients and wait for outputs; ``PipelineOutput``
ties an output to autograd, so that ``loss.backward()`` hands its gradient to the last stage.

Parameter gradients reach ``param.grad`` only when ``Pipeline.take_gradients`` is called (at
``optimizer.step()``, or at the end of the run), so no micro-batch's ``zero_grad()`` can wipe
another's contribution.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mirrored.config import LogicalDevice
from mirrored.core.values import flatten, map_structure
from mirrored.pipeline.run import ForwardResult, Handoff, Key, OpRecord, PipelineRun, StageTimeline
from mirrored.pipeline.stage import StageExecutor

__all__ = [
    "OpRecord",
    "Pipeline",
    "PipelineOutput",
    "PipelineRun",
    "StageTimeline",
    "add_summed_gradients",
]


class Pipeline:
    """The stages of one pipeline and the micro-batches in flight through them."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[LogicalDevice],
        schedule: str,
        recompute: bool,
        num_threads: int,
        index: int,
        num_pipelines: int,
    ) -> None:
        self.schedule = schedule
        self.recompute = recompute
        self.num_stages = len(stages)
        self.index = index
        self.num_pipelines = num_pipelines
        self.devices = tuple(devices)
        self._lock = threading.Lock()
        self._run: PipelineRun | None = None
        self._rounds: list[int] = []
        self._results: dict[Key, ForwardResult] = {}
        self._backward_error: BaseException | None = None
        self._coming: set[Key] = set()  # backwards on their way to the first stage
        self.executors = [
            StageExecutor(self, s, stage, device, num_threads)
            for s, (stage, device) in enumerate(zip(stages, devices, strict=True))
        ]

    def rng_id(self, run: PipelineRun, key: Key, stage: int) -> int:
        """A stream of its own for each (round, pipeline, micro-batch, stage) of a run."""
        round_, microbatch = key
        slot = (round_ * self.num_pipelines + self.index) * run.num_microbatches + microbatch
        return run.rng_base + slot * self.num_stages + stage

    # -- a run ------------------------------------------------------------------------------------
    def begin_run(self, run: PipelineRun) -> None:
        with self._lock:
            self._run = run
            self._rounds = [0] * run.num_microbatches
            self._results = {}
            self._backward_error = None
            self._coming = set()
        for executor in self.executors:
            executor.begin_run(run)

    def forward(
        self, microbatch: int, args: tuple[Any, ...], kwargs: dict[str, Any], grad_enabled: bool
    ) -> tuple[Any, Key]:
        """Micro-batch ``microbatch``'s forward through every stage (blocking); the output on
        the first stage's device, detached, and its (round, micro-batch) key. With
        ``grad_enabled`` the stages keep what the backward needs."""
        with self._lock:
            run = self._run
            if run is None:
                raise RuntimeError("the pipeline runs micro-batches inside strategy.run only")
            key = (self._rounds[microbatch], microbatch)
            self._rounds[microbatch] += 1
            result = self._results[key] = ForwardResult()
        self.executors[0].submit_forward(key, Handoff((args, kwargs)), grad_enabled)
        output = result.wait(run.meeting, self.describe)
        return output.receive(self.devices[0].torch_device), key

    def forward_done(
        self,
        run: PipelineRun,
        stage: int,
        key: Key,
        result: Handoff | None,
        error: BaseException | None,
        grad_enabled: bool,
    ) -> None:
        with self._lock:
            if run is not self._run:  # an operation the run gave up on: its result goes nowhere
                return
        if error is None and stage + 1 < self.num_stages:
            assert result is not None
            self.executors[stage + 1].submit_forward(key, result, grad_enabled)
            return
        with self._lock:
            waiter = self._results.pop(key, None)
        if waiter is not None:
            waiter.set(result, error)

    def backward(self, key: Key, grads: Any) -> None:
        """The gradient of micro-batch ``key``'s output, from its thread's ``loss.backward()``."""
        with self._lock:
            self._coming.add(key)
        try:
            self.executors[-1].submit_backward(key, Handoff(grads))
        except BaseException:
            with self._lock:
                self._coming.discard(key)
            raise

    def backwards_in_flight(self) -> set[int]:
        """Micro-batches with a backward between the last stage and the first."""
        with self._lock:
            return {key[1] for key in self._coming}

    def backward_done(self, run: PipelineRun, stage: int, key: Key, grads: Handoff | None) -> None:
        with self._lock:
            if run is not self._run:  # an operation the run gave up on
                return
        if stage > 0:
            assert grads is not None
            try:
                self.executors[stage - 1].submit_backward(key, grads)
                return
            except RuntimeError as error:
                self.backward_failed(run, key, error)
        with self._lock:
            self._coming.discard(key)

    def backward_failed(self, run: PipelineRun, key: Key, error: BaseException) -> None:
        with self._lock:
            self._coming.discard(key)
            if self._backward_error is None:
                self._backward_error = error
        run.meeting.abort(error)

    def take_gradients(self, deadline: float | None) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """At a step: let every stage finish (last stage first, as gradients flow), then the
        parameter gradients summed over the micro-batches since the last call, stage by stage.
        Raises the first error of a stage's backward."""
        for executor in reversed(self.executors):
            executor.drain(deadline)
        with self._lock:
            self._rounds = [0] * len(self._rounds)
            error = self._backward_error
        if error is not None:
            raise error
        for executor in self.executors:
            stream = executor.runtime.stream
            if stream is not None:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
        return [pair for executor in self.executors for pair in executor.take_gradients()]

    def end_run(self, deadline: float | None) -> None:
        """Forget the run. An operation still running is left to finish on its own (see
        ``StageExecutor.end_run``); the next run's operations on that stage wait for it, within
        their timeout."""
        for executor in self.executors:
            executor.end_run(deadline)
        with self._lock:
            self._run = None
            for waiter in self._results.values():
                waiter.set(error=RuntimeError("the run ended before this micro-batch's forward"))
            self._results = {}

    def describe(self) -> str:
        """What each stage is running now (for timeout errors)."""
        parts = []
        for executor in self.executors:
            action = executor.current
            doing = "idle" if action is None else f"{action.kind} of micro-batch {action.key[1]}"
            parts.append(f"stage {executor.index} on {executor.device.short_name}: {doing}")
        return "; ".join(parts)

    def forward_in_turn(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The stages one after another on the caller's thread (outside ``strategy.run``); the
        output on the first stage's device."""
        value: Any = None
        for s, executor in enumerate(self.executors):
            moved = _to_device((args, kwargs) if s == 0 else value, executor.device.torch_device)
            value = executor.stage(*moved[0], **moved[1]) if s == 0 else executor.stage(moved)
        return _to_device(value, self.devices[0].torch_device)

    def timelines(self) -> list[StageTimeline]:
        return [executor.timeline for executor in self.executors]

    def close(self) -> None:
        for executor in self.executors:
            executor.close()


def add_summed_gradients(
    pipelines: Sequence[Pipeline], modules: Sequence[nn.Module], deadline: float | None
) -> None:
    """Wait for every pipeline's stages, then add the gradients summed over every micro-batch of
    every pipeline (in a fixed order) to each pipeline's ``param.grad``. ``modules[p]`` is
    pipeline ``p``'s whole model; the models are copies, parameter for parameter."""
    index = [{id(param): i for i, param in enumerate(module.parameters())} for module in modules]
    totals: dict[int, torch.Tensor] = {}
    for p, pipeline in enumerate(pipelines):
        for param, grad in pipeline.take_gradients(deadline):
            i = index[p][id(param)]
            if i in totals:
                totals[i] = totals[i] + grad.to(totals[i].device)
            else:
                totals[i] = grad
    params = [list(module.parameters()) for module in modules]
    for i, total in totals.items():
        for p, pipeline_params in enumerate(params):
            param = pipeline_params[i]
            grad = total if p == 0 else total.to(param.device, copy=True)
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)


def _to_device(structure: Any, device: torch.device) -> Any:
    return map_structure(lambda v: v.to(device) if isinstance(v, torch.Tensor) else v, structure)


class PipelineOutput(torch.autograd.Function):
    """Ties a micro-batch's output to autograd: its backward hands the output's gradient to the
    last stage and returns at once; the stages' threads do the rest."""

    @staticmethod
    def forward(
        ctx: Any,
        pipeline: Pipeline,
        microbatch: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        holder: dict[str, Any],
        anchor: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        output, key = pipeline.forward(microbatch, args, kwargs, grad_enabled=True)
        holder["output"] = output
        ctx.pipeline, ctx.key, ctx.output = pipeline, key, output
        tensors = [v for v in flatten(output) if isinstance(v, torch.Tensor)]
        ctx.mark_non_differentiable(
            *[t for t in tensors if not (t.is_floating_point() or t.is_complex())]
        )
        ctx.set_materialize_grads(False)
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        received = iter(grads)
        structured = map_structure(
            lambda v: next(received) if isinstance(v, torch.Tensor) else None, ctx.output
        )
        ctx.pipeline.backward(ctx.key, structured)
        return (None,) * 6
