"""What the threads of one pipeline share about a run: its settings, the values they hand over.

A pipeline has a thread per stage and one per micro-batch (a replica of the strategy). They pass
inputs, outputs and gradients to each other as ``Handoff`` values (on CUDA with an event, so the
receiving stream waits for the producing one), and a micro-batch thread waits for its forward's
output on a ``ForwardResult``, which gives up when the run is aborted or times out. Each stage
records what it ran in a ``StageTimeline`` (what the pipeline benchmark reads).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mirrored.core.replica_meeting import ReplicaAbortedError, ReplicaMeeting, SyncTimeoutError
from mirrored.core.values import flatten, map_structure
from mirrored.random.step_seeds import StepSeed

__all__ = ["ForwardResult", "Handoff", "Key", "OpRecord", "PipelineRun", "StageTimeline"]

Key = tuple[int, int]  # (round, microbatch)


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

    meeting: ReplicaMeeting
    first_replica: int  # the local replica id of this pipeline's micro-batch 0
    num_microbatches: int
    step_seed: StepSeed
    rng_base: int  # random streams of stage operations are numbered from here
    caller_streams: Sequence[torch.cuda.Stream | None]  # per stage


class Handoff:
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


class ForwardResult:
    """Where a micro-batch thread waits for its forward's output."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def set(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()

    def wait(self, meeting: ReplicaMeeting, describe: Callable[[], str]) -> Any:
        """The value, once set; a ``SyncTimeoutError`` after the meeting's timeout, naming
        what the stages are doing (``describe``)."""
        timeout = meeting.timeout_seconds
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(0.05):
            if meeting.abort_reason is not None:
                raise ReplicaAbortedError("released because another replica failed") from (
                    meeting.abort_reason
                )
            if deadline is not None and time.monotonic() > deadline:
                raise SyncTimeoutError(
                    f"a micro-batch's forward did not come back from the pipeline within "
                    f"{timeout} s; {describe()}"
                )
        if self._error is not None:
            raise self._error
        return self._value
