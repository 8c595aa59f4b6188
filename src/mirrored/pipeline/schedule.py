"""Which operation a pipeline stage runs next: GPipe or 1F1B, as a pure function of its state.

Each micro-batch of a step is a replica thread that calls the model (a forward ``F``) and later
``loss.backward()`` (a backward ``B``). A stage runs its operations one at a time, in a fixed
order, so that its gradients accumulate in the same order on every run (bit-for-bit reproducible)
and its activation memory follows the schedule:

- **GPipe** (Huang et al., 2019): every micro-batch's forward, in micro-batch order, then the
  backwards in micro-batch order. A stage holds the activations of all ``m`` micro-batches.
- **1F1B** (PipeDream-Flush, Narayanan et al., 2021): stage ``s`` of ``p`` runs at most ``p - s``
  forwards ahead of its backwards, then alternates one forward and one backward, so it holds the
  activations of at most ``p - s`` micro-batches whatever ``m`` is. Same bubble as GPipe.

Micro-batch threads run user code, so a thread may never come: it finished, or waits at a sync
point (an all-reduce, ``optimizer.step()``) for the others. The rules below never wait for such a
thread, which is what keeps a pipeline from deadlocking on user code that is not the textbook
forward-then-backward step (forward-only evaluation, a metric all-reduced before backward).

An operation's key is ``(round, microbatch)``: a micro-batch's ``round``-th forward since the last
``optimizer.step()``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Set

__all__ = ["SCHEDULES", "Action", "StageState", "next_action"]

SCHEDULES = ("gpipe", "1f1b")

Key = tuple[int, int]  # (round, microbatch)


@dataclasses.dataclass(frozen=True)
class Action:
    """``kind``: "F" (run a forward), "B" (run a backward), "drop" (free the activations of a
    forward whose backward can no longer come)."""

    kind: str
    key: Key


@dataclasses.dataclass
class StageState:
    """What one stage knows when it chooses its next operation.

    ``forwards_done[k]``: forwards of micro-batch ``k`` run by this stage since the last step.
    ``waiting_forwards`` / ``waiting_backwards``: operations whose input has arrived.
    ``in_flight``: forwards that kept activations for a backward not yet run.
    ``idle``: micro-batches whose thread cannot act now (its function returned, or it waits at a
    sync point). ``finished``: those whose backwards can no longer come (returned, or waiting in
    ``optimizer.step()``), a subset of ``idle``. ``coming``: those whose backward the thread
    has sent and a later stage is still passing down: an idle thread's backward is not lost then.
    """

    schedule: str
    stage: int
    num_stages: int
    forwards_done: list[int]
    waiting_forwards: Set[Key] = frozenset()
    waiting_backwards: Set[Key] = frozenset()
    in_flight: Set[Key] = frozenset()
    idle: Set[int] = frozenset()
    finished: Set[int] = frozenset()
    coming: Set[int] = frozenset()

    @property
    def max_in_flight(self) -> int | None:
        """1F1B's bound on stored activations at this stage (None: unbounded, GPipe)."""
        return self.num_stages - self.stage if self.schedule == "1f1b" else None


def _forward_turn(state: StageState) -> Key | None:
    """The forward whose turn it is: the micro-batch with the fewest forwards done here (lowest
    index first) among those that can still call the model; None if none is expected."""
    candidates = [
        (done, k)
        for k, done in enumerate(state.forwards_done)
        if k not in state.idle or (done, k) in state.waiting_forwards
    ]
    return min(candidates) if candidates else None


def next_action(state: StageState) -> Action | None:
    """The operation to run now, or None to wait for an input or a thread."""
    head = min(state.in_flight) if state.in_flight else None
    backward_ready = head is not None and head in state.waiting_backwards
    if backward_ready and state.schedule == "1f1b":
        assert head is not None
        return Action("B", head)
    turn = _forward_turn(state)
    if turn is not None and turn in state.waiting_forwards:
        limit = state.max_in_flight
        # The head's thread cannot send its backward now (and has not sent it): waiting for it
        # would deadlock.
        head_stuck = head is not None and head[1] in state.idle and head[1] not in state.coming
        if limit is None or len(state.in_flight) < limit or head_stuck:
            return Action("F", turn)
    if head is None:
        return None
    if backward_ready:  # GPipe: once no forward of the head's round is still to come
        round_ = head[0]
        pending = any(
            done <= round_ and k not in state.idle for k, done in enumerate(state.forwards_done)
        )
        if not pending:
            return Action("B", head)
        return None
    if head[1] in state.finished:
        return Action("drop", head)
    return None
