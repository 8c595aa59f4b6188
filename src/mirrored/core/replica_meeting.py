"""Where the replica threads of one ``strategy.run`` meet to exchange values.

Every sync point (an all-reduce, a merge call, ``optimizer.step``) is one ``exchange``: each
replica posts a value and receives the list of all replicas' values. The meeting is what keeps
a multi-replica step from hanging (with ``timeout_seconds=None`` a missing replica is waited for
forever, by request; "rendezvous" is kept for the c10d store where a job's processes meet):

- a replica that fails aborts the meeting, releasing every replica waiting at a sync point;
- replicas that meet at different sync points (one in ``optimizer.step``, one in ``all_reduce``),
  or that make a different number of sync calls, get a ``SyncMismatchError`` naming both;
- a replica that never arrives makes the others fail after ``timeout_seconds``, naming it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from mirrored.core.trace_recording import refuse_while_recording

__all__ = [
    "ReplicaMeeting",
    "ReplicaAbortedError",
    "ReplicaExchange",
    "SyncMismatchError",
    "SyncTimeoutError",
    "caused_by_timeout",
]


class SyncMismatchError(RuntimeError):
    """Replicas reached different sync points: the replica function is not the same on all."""


class ReplicaAbortedError(RuntimeError):
    """Raised in a replica that was released because another replica failed."""


class SyncTimeoutError(TimeoutError):
    """A replica did not reach a sync point in time."""


def caused_by_timeout(error: BaseException | None) -> bool:
    """Whether ``error`` is a timeout, or a release caused by one: the replicas it waited for
    have had their whole timeout."""
    return isinstance(error, SyncTimeoutError) or isinstance(
        getattr(error, "__cause__", None), SyncTimeoutError
    )


class ReplicaMeeting:
    """The meeting point of ``num_replicas`` threads for the duration of one run."""

    def __init__(self, num_replicas: int, timeout_seconds: float | None) -> None:
        self.num_replicas = num_replicas
        self.timeout_seconds = timeout_seconds
        self._cond = threading.Condition()
        self._posted: dict[int, tuple[str, Any]] = {}
        self._generation = 0
        self._last_values: list[Any] = []
        self._sync_counts = [0] * num_replicas
        self._finished: set[int] = set()
        self.abort_reason: BaseException | None = None
        # Per replica: when its function started, and how long it ran before its first sync
        # point (or in all, without one): its compute, for load balancing.
        self._started = [0.0] * num_replicas
        self.busy_seconds: list[float | None] = [None] * num_replicas

    def begin(self, replica_id: int) -> None:
        """A replica's function starts now."""
        self._started[replica_id] = time.perf_counter()

    def _mark_busy(self, replica_id: int) -> None:
        if self.busy_seconds[replica_id] is None:
            self.busy_seconds[replica_id] = time.perf_counter() - self._started[replica_id]

    def exchange(self, replica_id: int, label: str, value: Any) -> list[Any]:
        """Post ``value`` at the sync point ``label``; return every replica's value, in order.
        Refused in a step being traced (:func:`mirrored.function`): replicas trace one at a time,
        and the values would be fake."""
        refuse_while_recording(f"a meeting of the replicas inside the step ({label})")
        self._mark_busy(replica_id)
        if self.num_replicas == 1:
            return [value]
        with self._cond:
            self._raise_if_aborted()
            if self._finished:
                self._abort_locked(self._mismatch_error(waiting=replica_id, label=label))
                self._raise_if_aborted()
            generation = self._generation
            self._posted[replica_id] = (label, value)
            self._sync_counts[replica_id] += 1
            if len(self._posted) == self.num_replicas:
                labels = {rid: posted[0] for rid, posted in self._posted.items()}
                if len(set(labels.values())) > 1:
                    detail = ", ".join(
                        f"replica {r} at {lbl!r}" for r, lbl in sorted(labels.items())
                    )
                    self._abort_locked(
                        SyncMismatchError(
                            f"replicas reached different sync points ({detail}); every replica "
                            "must call the same collectives in the same order"
                        )
                    )
                    self._raise_if_aborted()
                self._last_values = [self._posted[r][1] for r in range(self.num_replicas)]
                self._posted = {}
                self._generation += 1
                self._cond.notify_all()
                return self._last_values
            deadline = (
                None if self.timeout_seconds is None else time.monotonic() + self.timeout_seconds
            )
            while self._generation == generation and self.abort_reason is None:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    missing = sorted(set(range(self.num_replicas)) - set(self._posted))
                    self._abort_locked(
                        SyncTimeoutError(
                            f"replica(s) {missing} did not reach sync point {label!r} within "
                            f"{self.timeout_seconds} s; replica(s) {sorted(self._posted)} waited"
                        )
                    )
                    break
                self._cond.wait(remaining)
            # Released only if the exchange did not complete: one that completed before an
            # abort returns its values whenever this thread wakes up, so a replica's work up
            # to its next sync point (its owner update under ZeRO) does not depend on timing.
            if self._generation == generation:
                self._raise_if_aborted()
            return self._last_values

    def finish(self, replica_id: int) -> None:
        """Record that a replica's function returned; others still waiting can never be met."""
        self._mark_busy(replica_id)
        if self.num_replicas == 1:
            return
        with self._cond:
            self._finished.add(replica_id)
            if self._posted and self.abort_reason is None:
                waiting = min(self._posted)
                self._abort_locked(self._mismatch_error(waiting, self._posted[waiting][0]))

    def waiting(self) -> dict[int, str]:
        """The replicas waiting at a sync point now, with its label; every replica when the
        meeting is aborted (none of them will act on the step again)."""
        with self._cond:
            if self.abort_reason is not None:
                return dict.fromkeys(range(self.num_replicas), "aborted")
            return {replica_id: label for replica_id, (label, _) in self._posted.items()}

    def finished(self) -> frozenset[int]:
        """The replicas whose function has returned."""
        with self._cond:
            return frozenset(self._finished)

    def abort(self, reason: BaseException) -> None:
        """Release every waiting replica; the first reason wins."""
        with self._cond:
            self._abort_locked(reason)

    def _abort_locked(self, reason: BaseException) -> None:
        if self.abort_reason is None:
            self.abort_reason = reason
        self._cond.notify_all()

    def _raise_if_aborted(self) -> None:
        if self.abort_reason is not None:
            raise ReplicaAbortedError("released because another replica failed") from (
                self.abort_reason
            )

    def _mismatch_error(self, waiting: int, label: str) -> SyncMismatchError:
        done = sorted(self._finished)
        return SyncMismatchError(
            f"replica(s) {done} returned after {[self._sync_counts[r] for r in done]} sync "
            f"point(s) while replica {waiting} waits at sync point {label!r} "
            f"(#{self._sync_counts[waiting]}); every replica must make the same sync calls"
        )


class ReplicaExchange:
    """One replica's handle on the meeting, aware of CUDA streams.

    On CUDA each replica works on its own stream, so a value posted by one replica may still be
    being written by its stream: every receiver's stream waits on an event recorded at the post.
    That covers replicas on one physical GPU. Reading or writing a peer's tensor on another
    physical GPU runs on that GPU's streams as seen from this thread, which no event of the peer
    orders; such sync points (``cross_device=True``) first synchronize every GPU of the strategy.
    """

    def __init__(
        self,
        meeting: ReplicaMeeting,
        replica_id: int,
        device: torch.device,
        physical_gpus: tuple[int, ...],
    ) -> None:
        self.meeting = meeting
        self.replica_id = replica_id
        self.num_replicas = meeting.num_replicas
        self.device = device
        self._cuda = device.type == "cuda"
        self._gpus_to_synchronize = physical_gpus if len(physical_gpus) > 1 else ()

    def all(self, label: str, value: Any, cross_device: bool = False) -> list[Any]:
        """Every replica's ``value`` at this sync point, ordered by replica id.

        ``cross_device``: the caller reads or writes peers' tensors directly around this point.
        """
        if not self._cuda:
            return self.meeting.exchange(self.replica_id, label, value)
        if cross_device:
            for index in self._gpus_to_synchronize:
                torch.cuda.synchronize(index)
        event = torch.cuda.Event()
        event.record()
        posted = self.meeting.exchange(self.replica_id, label, (value, event))
        stream = torch.cuda.current_stream()
        for _, peer_event in posted:
            stream.wait_event(peer_event)
        return [v for v, _ in posted]

    def barrier(self, label: str, cross_device: bool = False) -> None:
        self.all(label, None, cross_device)
