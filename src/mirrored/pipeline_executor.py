"""Running one pipeline: a thread per stage, micro-batches flowing through them.

Each stage lives on its device and has one thread (``StageExecutor``) that runs the stage's
forwards and backwards in the order ``pipeline_schedule.next_action`` gives. Activations cross
stages detached: stage ``s`` runs on leaves that require grad, keeps its graph until the
micro-batch's backward, then sends the gradient of its input to stage ``s - 1``. So the stages'
backwards run on their own threads, concurrently, whatever thread called ``loss.backward()``.

The micro-batch threads (replicas of the strategy) only send inputs and gradients and wait for
outputs. Parameter gradients accumulate in the stages' own buffers, in schedule order, and reach
``param.grad`` when ``Pipeline.take_gradients`` is called (at ``optimizer.step()``, or at the end
of the run), so no micro-batch's ``zero_grad()`` can wipe another's contribution.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from mirrored.config import LogicalDevice
from mirrored.device_runtime import ReplicaDeviceRuntime
from mirrored.pipeline_schedule import Action, StageState, next_action
from mirrored.random_routing import ReplicaRandomness
from mirrored.rendezvous import (
    Rendezvous,
    ReplicaAbortedError,
    SyncTimeoutError,
    caused_by_timeout,
)
from mirrored.step_seeds import StepSeed
from mirrored.strategy import add_note
from mirrored.values import flatten, map_structure

__all__ = ["OpRecord", "Pipeline", "PipelineRun", "StageTimeline"]

Key = tuple[int, int]  # (round, microbatch)
_POLL_SECONDS = 0.01  # how often a waiting stage looks again at threads stuck in user code


@dataclasses.dataclass(frozen=True)
class OpRecord:
    """One operation a stage ran: "F" or "B", its (round, micro-batch), perf_counter times."""

    kind: str
    round: int
    microbatch: int
    start: float
    end: float


@dataclasses.dataclass
class StageTimeline:
    """What one stage did during the last run: its operations and its activation peak."""

    device: str
    ops: list[OpRecord] = dataclasses.field(default_factory=list)
    peak_activation_bytes: int = 0

    @property
    def busy_seconds(self) -> float:
        return sum(op.end - op.start for op in self.ops)


@dataclasses.dataclass
class PipelineRun:
    """What the stages need to know about the current ``strategy.run``."""

    rendezvous: Rendezvous
    first_replica: int  # the local replica id of this pipeline's micro-batch 0
    num_microbatches: int
    step_seed: StepSeed
    rng_base: int  # random streams of stage operations are numbered from here
    caller_streams: Sequence[torch.cuda.Stream | None]  # per stage


class _Handoff:
    """A value passed between threads; on CUDA with an event its consumer's stream waits on."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.event: torch.cuda.Event | None = None
        if any(isinstance(v, torch.Tensor) and v.is_cuda for v in flatten(value)):
            self.event = torch.cuda.Event()
            self.event.record()

    def receive(self, device: torch.device) -> Any:
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        return map_structure(
            lambda v: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v,
            self.value,
        )


class _Result:
    """Where a micro-batch thread waits for its forward's output."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def wait(self, rendezvous: Rendezvous, describe: Callable[[], str]) -> Any:
        """The value, once set; a ``SyncTimeoutError`` after the rendezvous's timeout, naming
        what the stages are doing (``describe``)."""
        timeout = rendezvous.timeout_seconds
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.05):
            if rendezvous.abort_reason is not None:
                raise ReplicaAbortedError("released because another replica failed") from (
                    rendezvous.abort_reason
                )
            if deadline is not None and time.monotonic() > deadline:
                raise SyncTimeoutError(
                    f"a micro-batch's forward did not come back from the pipeline within "
                    f"{timeout} s; {describe()}"
                )
        if self._error is not None:
            raise self._error
        return self._value


@dataclasses.dataclass
class _Saved:
    leaves: Any  # the stage's inputs as autograd leaves
    output: Any  # the stage's output with its graph (None: recomputed at the backward)
    rng_id: int
    nbytes: int


class StageExecutor:
    """One stage of one pipeline, on its device, with its thread."""

    def __init__(
        self,
        pipeline: Pipeline,
        index: int,
        stage: nn.Module,
        device: LogicalDevice,
        num_threads: int,
    ) -> None:
        self._pipeline = pipeline
        self.index = index
        self.stage = stage
        self.device = device
        self.runtime = ReplicaDeviceRuntime(device, num_threads)
        self._params = list(dict.fromkeys(stage.parameters()))
        self._param_storages = {p.untyped_storage().data_ptr() for p in self._params}
        self._cond = threading.Condition()
        self._run: PipelineRun | None = None
        self._draining = False
        self._busy = False
        self._stopping = False
        self._forwards: dict[Key, tuple[_Handoff, bool]] = {}
        self._backwards: dict[Key, _Handoff] = {}
        self._saved: dict[Key, _Saved] = {}
        self._forwards_done: list[int] = []
        self._grads: dict[int, torch.Tensor] = {}
        self._activation_bytes = 0
        self.timeline = StageTimeline(device.short_name)
        self.current: Action | None = None  # the operation running now
        self._thread = threading.Thread(
            target=self._loop, name=f"mirrored-stage-{index}-{device.short_name}", daemon=True
        )
        self._thread.start()

    # -- from other threads -----------------------------------------------------------------------
    def begin_run(self, run: PipelineRun) -> None:
        with self._cond:
            self._run = run
            self._draining = False
            self._forwards_done = [0] * run.num_microbatches
            self.timeline = StageTimeline(self.device.short_name)
            self._activation_bytes = 0
            self._cond.notify_all()

    def submit_forward(self, key: Key, value: _Handoff, grad_enabled: bool) -> None:
        with self._cond:
            self._forwards[key] = (value, grad_enabled)
            self._cond.notify_all()

    def submit_backward(self, key: Key, grads: _Handoff) -> None:
        with self._cond:
            if key not in self._saved:
                raise RuntimeError(
                    "backward through a pipelined model's output after its step ended (after "
                    "optimizer.step() or strategy.run() returned); call loss.backward() before "
                    "optimizer.step(), in the same strategy.run"
                )
            self._backwards[key] = grads
            self._cond.notify_all()

    def drain(self, deadline: float | None) -> None:
        """Wait until every operation whose input can still come has run; forwards whose
        backward will not come are dropped. The micro-batch threads must all be stopped (at the
        step's sync point, or returned)."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while self._busy or self._forwards or self._backwards or self._saved:
                if self._run is not None and self._run.rendezvous.abort_reason is not None:
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"pipeline stage {self.index} on {self.device.short_name} did not finish "
                        "its operations in time"
                    )
                self._cond.wait(_POLL_SECONDS)
            self._draining = False
            self._forwards_done = [0] * len(self._forwards_done)

    def take_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The parameter gradients summed since the last call (the stage is drained)."""
        with self._cond:
            grads, self._grads = self._grads, {}
        return [(self._params[i], g) for i, g in sorted(grads.items())]

    def end_run(self, deadline: float | None) -> None:
        """Forget the run's operations and activations (the run is over or failed). An
        operation still running is waited for until ``deadline``, not at all when the run
        timed out (the micro-batch waiting for it has waited its whole timeout); past that it is
        left to finish, and what it produces is dropped (it belongs to no run)."""
        with self._cond:
            run, self._run = self._run, None  # nothing more is scheduled
            timed_out = run is not None and caused_by_timeout(run.rendezvous.abort_reason)
            while self._busy and not timed_out:
                if deadline is not None and time.monotonic() > deadline:
                    break
                self._cond.wait(_POLL_SECONDS)
            self._forwards.clear()
            self._backwards.clear()
            self._saved.clear()
            self._grads.clear()
            self._activation_bytes = 0

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the stage's thread -----------------------------------------------------------------------
    def _state(self, run: PipelineRun) -> StageState:
        waiting = run.rendezvous.waiting()
        finished = run.rendezvous.finished()
        ids = range(run.first_replica, run.first_replica + run.num_microbatches)
        idle = {k for k, r in enumerate(ids) if r in waiting or r in finished or self._draining}
        # A backward still on its way down from a later stage can come after its thread ended.
        coming = self._pipeline.backwards_in_flight()
        done = {k for k in idle if ids[k] in finished or self._draining} - coming
        return StageState(
            schedule=self._pipeline.schedule,
            stage=self.index,
            num_stages=self._pipeline.num_stages,
            forwards_done=self._forwards_done,
            waiting_forwards=self._forwards.keys(),
            waiting_backwards=self._backwards.keys(),
            in_flight=self._saved.keys(),
            idle=idle,
            finished=done,
            coming=coming,
        )

    def _loop(self) -> None:
        while True:
            with self._cond:
                action: Action | None = None
                while not self._stopping:
                    if self._run is not None:
                        action = next_action(self._state(self._run))
                        if action is not None:
                            break
                    self._cond.wait(_POLL_SECONDS if self._run is not None else None)
                if self._stopping:
                    return
                assert action is not None and self._run is not None
                run = self._run
                work = self._take(action)
                self._busy = True
                self.current = action
            try:
                if work is not None:
                    work(run)
            finally:
                with self._cond:
                    self._busy = False
                    self.current = None
                    self._cond.notify_all()

    def _take(self, action: Action) -> Callable[[PipelineRun], None] | None:
        """Under the lock: remove the action's inputs from the queues; the work to do outside."""
        key = action.key
        if action.kind == "drop":
            saved = self._saved.pop(key)
            self._activation_bytes -= saved.nbytes
            return None
        if action.kind == "F":
            value, grad_enabled = self._forwards.pop(key)
            self._forwards_done[key[1]] += 1
            return lambda run: self._forward(run, key, value, grad_enabled)
        saved = self._saved.pop(key)
        grads = self._backwards.pop(key)
        return lambda run: self._backward(run, key, saved, grads)

    @contextmanager
    def _scope(self, run: PipelineRun, rng_id: int | None) -> Iterator[None]:
        """Around an operation: the stage's device state, and with ``rng_id`` its own random
        stream (recomputation replays it)."""
        with self.runtime.task_scope(run.caller_streams[self.index]):
            if rng_id is None:
                yield
                return
            randomness = ReplicaRandomness(rng_id, self.device.torch_device)
            randomness.start_step(run.step_seed)
            with randomness:
                yield

    def _call(self, inputs: Any) -> Any:
        if self.index == 0:
            args, kwargs = inputs
            return self.stage(*args, **kwargs)
        return self.stage(inputs)

    def _forward(self, run: PipelineRun, key: Key, value: _Handoff, grad_enabled: bool) -> None:
        start = time.perf_counter()
        rng_id = self._pipeline.rng_id(run, key, self.index)
        try:
            with self._scope(run, rng_id):
                inputs = value.receive(self.device.torch_device)
                if grad_enabled:
                    leaves = inputs if self.index == 0 else map_structure(_leaf, inputs)
                    output, nbytes = self._forward_keeping_graph(leaves)
                    kept = None if self._pipeline.recompute else output
                    saved = _Saved(leaves, kept, rng_id, nbytes)
                    with self._cond:
                        if self._run is not run:  # the run ended without this operation
                            return
                        self._saved[key] = saved
                        self._activation_bytes += nbytes
                        self.timeline.peak_activation_bytes = max(
                            self.timeline.peak_activation_bytes, self._activation_bytes
                        )
                else:
                    with torch.no_grad():
                        output = self._call(inputs)
                result = _Handoff(map_structure(_detached, output))
        except BaseException as error:
            add_note(
                error,
                f"in pipeline stage {self.index} on {self.device.short_name} (forward of "
                f"micro-batch {key[1]})",
            )
            self._pipeline.forward_done(run, self.index, key, None, error, grad_enabled)
            return
        self.timeline.ops.append(OpRecord("F", key[0], key[1], start, time.perf_counter()))
        self._pipeline.forward_done(run, self.index, key, result, None, grad_enabled)

    def _forward_keeping_graph(self, leaves: Any) -> tuple[Any, int]:
        """The stage's output on ``leaves``, and the bytes kept for its backward (the inputs,
        and the tensors autograd saves, parameters excepted; only the inputs when recomputing)."""
        inputs = [v for v in flatten(leaves) if isinstance(v, torch.Tensor)]
        nbytes = sum(_nbytes(v) for v in inputs)
        if self._pipeline.recompute:
            with torch.no_grad():
                return self._call(leaves), nbytes
        saved_bytes = [0]
        # Each storage once: a layer that saves the stage's input, or two layers saving the same
        # tensor, keep no more memory.
        counted = set(self._param_storages) | {v.untyped_storage().data_ptr() for v in inputs}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storage = tensor.untyped_storage().data_ptr()
            if storage not in counted:
                counted.add(storage)
                saved_bytes[0] += _nbytes(tensor)
            return tensor

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            output = self._call(leaves)
        return output, nbytes + saved_bytes[0]

    def _backward(self, run: PipelineRun, key: Key, saved: _Saved, grads: _Handoff) -> None:
        start = time.perf_counter()
        try:
            with self._scope(run, saved.rng_id if saved.output is None else None):
                with torch.enable_grad():
                    output = self._call(saved.leaves) if saved.output is None else saved.output
                received = grads.receive(self.device.torch_device)
                pairs = [
                    (out, grad)
                    for out, grad in zip(flatten(output), flatten(received), strict=True)
                    if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None
                ]
                inputs = [
                    v
                    for v in flatten(saved.leaves)
                    if isinstance(v, torch.Tensor) and v.requires_grad
                ]
                trained = [i for i, p in enumerate(self._params) if p.requires_grad]
                params: list[torch.Tensor] = [self._params[i] for i in trained]
                results: Sequence[torch.Tensor | None] = [None] * (len(inputs) + len(params))
                if pairs:
                    results = torch.autograd.grad(
                        [o for o, _ in pairs],
                        inputs + params,
                        [g for _, g in pairs],
                        allow_unused=True,
                    )
                input_grads = dict(zip(map(id, inputs), results[: len(inputs)], strict=True))
                with self._cond:
                    if self._run is not run:  # the run ended without this operation
                        return
                    for index, grad in zip(trained, results[len(inputs) :], strict=True):
                        if grad is not None:
                            total = self._grads.get(index)
                            self._grads[index] = grad if total is None else total.add_(grad)
                upstream = map_structure(
                    lambda v: input_grads.get(id(v)) if isinstance(v, torch.Tensor) else None,
                    saved.leaves,
                )
                handoff = _Handoff(upstream) if self.index > 0 else None
        except BaseException as error:
            add_note(
                error,
                f"in pipeline stage {self.index} on {self.device.short_name} (backward of "
                f"micro-batch {key[1]})",
            )
            self._pipeline.backward_failed(run, key, error)
            return
        finally:
            with self._cond:
                if self._run is run:  # else end_run forgot the run's activations already
                    self._activation_bytes -= saved.nbytes
        self.timeline.ops.append(OpRecord("B", key[0], key[1], start, time.perf_counter()))
        self._pipeline.backward_done(run, self.index, key, handoff)


def _leaf(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.detach().requires_grad_()
    return value


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


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
        self._results: dict[Key, _Result] = {}
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
            result = self._results[key] = _Result()
        self.executors[0].submit_forward(key, _Handoff((args, kwargs)), grad_enabled)
        output = result.wait(run.rendezvous, self.describe)
        return output.receive(self.devices[0].torch_device), key

    def forward_done(
        self,
        run: PipelineRun,
        stage: int,
        key: Key,
        result: _Handoff | None,
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
            self.executors[-1].submit_backward(key, _Handoff(grads))
        except BaseException:
            with self._lock:
                self._coming.discard(key)
            raise

    def backwards_in_flight(self) -> set[int]:
        """Micro-batches with a backward between the last stage and the first."""
        with self._lock:
            return {key[1] for key in self._coming}

    def backward_done(self, run: PipelineRun, stage: int, key: Key, grads: _Handoff | None) -> None:
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
        run.rendezvous.abort(error)

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

    def timelines(self) -> list[StageTimeline]:
        return [executor.timeline for executor in self.executors]

    def close(self) -> None:
        for executor in self.executors:
            executor.close()
