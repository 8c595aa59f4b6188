"""One stage of one pipeline: its module on its device, and the thread that runs it.

The stage's thread runs the stage's forwards and backwards in the order
``pipeline_schedule.next_action`` gives. Activations cross stages detached: stage ``s`` runs on
leaves that require grad, keeps its graph until the micro-batch's backward, then sends the
gradient of its input to stage ``s - 1``. So the stages' backwards run on their own threads,
concurrently, whatever thread called ``loss.backward()``. Parameter gradients accumulate in the
stage's own buffers, in schedule order, until the pipeline takes them at a step.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from mirrored.config import LogicalDevice
from mirrored.core.device_runtime import ReplicaDeviceRuntime
from mirrored.core.replica_failures import add_note
from mirrored.core.replica_meeting import caused_by_timeout
from mirrored.core.values import flatten, map_structure
from mirrored.pipeline.run import Handoff, Key, OpRecord, PipelineRun, StageTimeline
from mirrored.pipeline.schedule import Action, StageState, next_action
from mirrored.random.routing import ReplicaRandomness

__all__ = ["StageExecutor", "StageOwner"]

_POLL_SECONDS = 0.01  # how often a waiting stage looks again at threads stuck in user code


class StageOwner(Protocol):
    """What a stage needs from its pipeline: the schedule, and where its results go."""

    schedule: str
    num_stages: int
    recompute: bool

    def rng_id(self, run: PipelineRun, key: Key, stage: int) -> int: ...

    def backwards_in_flight(self) -> set[int]: ...

    def forward_done(
        self,
        run: PipelineRun,
        stage: int,
        key: Key,
        result: Handoff | None,
        error: BaseException | None,
        grad_enabled: bool,
    ) -> None: ...

    def backward_done(
        self, run: PipelineRun, stage: int, key: Key, grads: Handoff | None
    ) -> None: ...

    def backward_failed(self, run: PipelineRun, key: Key, error: BaseException) -> None: ...


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
        pipeline: StageOwner,
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
        self._forwards: dict[Key, tuple[Handoff, bool]] = {}
        self._backwards: dict[Key, Handoff] = {}
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

    def submit_forward(self, key: Key, value: Handoff, grad_enabled: bool) -> None:
        with self._cond:
            self._forwards[key] = (value, grad_enabled)
            self._cond.notify_all()

    def submit_backward(self, key: Key, grads: Handoff) -> None:
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
                if self._run is not None and self._run.meeting.abort_reason is not None:
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
            timed_out = run is not None and caused_by_timeout(run.meeting.abort_reason)
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
        waiting = run.meeting.waiting()
        finished = run.meeting.finished()
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

    def _forward(self, run: PipelineRun, key: Key, value: Handoff, grad_enabled: bool) -> None:
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
                result = Handoff(map_structure(_detached, output))
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

    def _backward(self, run: PipelineRun, key: Key, saved: _Saved, grads: Handoff) -> None:
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
                handoff = Handoff(upstream) if self.index > 0 else None
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
