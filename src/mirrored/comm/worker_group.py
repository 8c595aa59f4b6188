"""The processes of a multi-worker job as one ``torch.distributed`` process group that cannot hang.

Every cross-process collective of ``mirrored`` goes through a ``WorkerGroup``. It adds what c10d
leaves to the user:

- **Failures name the rank.** Each worker publishes its position (the collective it is in) on the
  rendezvous store from a heartbeat thread. When a collective fails (a peer's connection closed)
  or times out (a peer never came), the group reads every worker's position and heartbeat and
  raises ``WorkerLostError`` or ``SyncTimeoutError`` naming the workers that are missing, where
  they are and where this one waits.
- **A failed collective breaks the group for good.** After one, the workers' sequences of
  collectives no longer line up, so every later call raises at once instead of pairing the wrong
  messages: the job must restart (under ``mirrored launch --max-restarts``, with BackupAndRestore
  it resumes exactly). So does a step that fails on one worker only (``abort``): its peers'
  collectives fail at once, naming it and its error, rather than pair with its next step.
- **Nothing from a peer is unpickled.** Metadata (model signatures, device counts) travels as
  UTF-8 JSON in byte tensors.
- **Loopback by default.** The store listens only on the rendezvous address (127.0.0.1 unless
  told otherwise), and gloo binds to the loopback interface when that address is a loopback one.
  The rendezvous is unauthenticated: on a cluster, keep its address on a private network.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from mirrored._torch_distributed import default_store
from mirrored.cluster.resolvers import ClusterResolver
from mirrored.cluster.store import connect_store, sockets_on_loopback
from mirrored.comm.gather_by_sum import Pending, gather_by_sum
from mirrored.comm.same_host_all_reduce import LocalReduceError, SameHostAllReduce
from mirrored.core.replica_meeting import SyncMismatchError, SyncTimeoutError

__all__ = [
    "PendingCollective",
    "WorkerGroup",
    "WorkerLostError",
]

_HEARTBEAT_SECONDS = 0.5
_FAILED = "failed: "  # a worker's published position once its step failed (``abort``)
# How long a worker's heartbeat may stand still before it counts as dead or frozen.
_STALE_SECONDS = 4 * _HEARTBEAT_SECONDS
# torch 2.13 renamed all_gather_into_tensor (still there, deprecated); older releases lack the new
# name.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class WorkerLostError(RuntimeError):
    """A peer worker left the job (its process ended or its connection broke) mid-collective."""


class PendingCollective:
    """An asynchronous collective; ``wait()`` raises the group's diagnosis if it failed."""

    def __init__(self, group: WorkerGroup, work: Any, position: tuple[int, str]) -> None:
        self._group = group
        self._work = work
        self._position = position

    def succeeded(self) -> bool:
        """Whether the collective has finished without error (its output can be read)."""
        work = self._work
        return work is None or (bool(work.is_completed()) and work.exception() is None)

    def wait(self) -> None:
        """Block until the collective is done; its diagnosis (a ``WorkerLostError`` or
        ``SyncTimeoutError`` naming the missing workers) if it failed."""
        if self._work is None:
            return
        work, self._work = self._work, None
        try:
            work.wait()
        except Exception as error:
            raise self._group._failure(error, self._position) from error


class WorkerGroup:
    """One process of a multi-worker job: its rank and collectives with every other worker.

    Args:
        resolver: who this worker is and where rank 0's rendezvous store listens.
        backend: "gloo" or "nccl".
        timeout_seconds: how long any collective waits for the other workers.
        same_host: sum CPU tensors through shared memory when every worker runs on this
            machine (:mod:`mirrored.comm.same_host_all_reduce`); gloo otherwise.
    """

    def __init__(
        self,
        resolver: ClusterResolver,
        backend: str,
        timeout_seconds: float,
        same_host: bool = False,
    ) -> None:
        if resolver.rank < 0:
            raise ValueError(
                f"this process is task {resolver.task_type!r} {resolver.task_id}, which takes "
                "no part in synchronous training; run MultiWorkerMirroredStrategy only in the "
                "'chief' and 'worker' tasks of TF_CONFIG"
            )
        self.backend = backend
        self.timeout_seconds = timeout_seconds
        self._position = (0, "connecting")
        self.broken: BaseException | None = None
        self._explainers: list[weakref.WeakMethod[Callable[[], str | None]]] = []
        self._owns_process_group = not dist.is_initialized()
        if self._owns_process_group:
            self._start_process_group(resolver, datetime.timedelta(seconds=timeout_seconds))
        else:  # the user's program set up torch.distributed itself: join its default group
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
            if (resolver.rank, resolver.world_size) != (self.rank, self.world_size):
                raise ValueError(
                    f"the cluster resolver makes this process worker {resolver.rank} of "
                    f"{resolver.world_size}, but it is rank {self.rank} of {self.world_size} in "
                    "the torch.distributed process group it joins; pass no cluster_resolver "
                    "(the group's ranks are then the workers') or one that agrees with the group"
                )
            self._store: dist.Store = default_store()
            self._address: tuple[str, int] | None = None
            self._prefix = "mirrored/joined"
            self.backend = str(dist.get_backend())
        # Where small metadata tensors go: the CPU unless the group has NCCL only.
        self.meta_device = (
            torch.device("cuda", torch.cuda.current_device())
            if "gloo" not in self.backend and "nccl" in self.backend
            else torch.device("cpu")
        )
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"mirrored-heartbeat-{self.rank}", daemon=True
        )
        self._heartbeat.start()
        self._same_host: SameHostAllReduce | None = None
        if same_host:
            try:
                self._same_host = SameHostAllReduce.connect(
                    self.rank, self.world_size, timeout_seconds, self.all_gather_json
                )
            except BaseException:
                self.close()
                raise

    def _start_process_group(self, resolver: ClusterResolver, timeout: datetime.timedelta) -> None:
        """The job's process group, over the rendezvous store that rank 0 hosts."""
        self.rank, self.world_size = resolver.rank, resolver.world_size
        try:
            self._store, self._address = connect_store(resolver, timeout)
        except (RuntimeError, TimeoutError) as error:  # torch's DistStoreError among them
            raise TimeoutError(
                f"worker {resolver.rank} ({_task_of_rank(resolver, resolver.rank)}) could not "
                f"reach the chief's rendezvous store at {resolver.master_addr}:"
                f"{resolver.master_port} within {timeout.total_seconds():g} s: start the chief "
                f"({_task_of_rank(resolver, 0)}) too, and check that its address is reachable"
            ) from error
        self._prefix = f"mirrored/{resolver.restart_count}"
        self._wait_for_every_worker(resolver, timeout)
        loopback = sockets_on_loopback(self._address[0]) if self.backend == "gloo" else None
        with loopback or contextlib.nullcontext():
            dist.init_process_group(
                # With NCCL, CPU tensors (metadata, parameters not yet on their devices) go
                # through gloo.
                "cpu:gloo,cuda:nccl" if self.backend == "nccl" else self.backend,
                store=dist.PrefixStore(self._prefix + "/pg", self._store),
                rank=self.rank,
                world_size=self.world_size,
                timeout=timeout,
            )

    def _wait_for_every_worker(
        self, resolver: ClusterResolver, timeout: datetime.timedelta
    ) -> None:
        """Every worker checks in at the store before the process group forms, so that one
        that never started is named (torch's own wait names only its keys)."""
        joined = [f"{self._prefix}/joined/{rank}" for rank in range(self.world_size)]
        self._store.set(joined[self.rank], "1")
        try:
            self._store.wait(joined, timeout)
        except RuntimeError as error:  # DistStoreError: the wait timed out
            missing = [
                f"worker {rank} ({_task_of_rank(resolver, rank)})"
                for rank, key in enumerate(joined)
                if not self._store.check([key])
            ]
            raise TimeoutError(
                f"{', '.join(missing) or 'a worker'} did not join the job within "
                f"{timeout.total_seconds():g} s (worker {self.rank} waited): start every worker "
                "of the job (the same script, each with its own rank or TF_CONFIG task), or "
                "raise timeout_seconds if they start slowly"
            ) from error

    def __repr__(self) -> str:
        return f"WorkerGroup(rank={self.rank}, world_size={self.world_size}, {self.transport})"

    @property
    def transport(self) -> str:
        """How the collectives travel: the backend, with " + shared memory" where CPU
        all-reduces go through it."""
        return self.backend + (" + shared memory" if self._same_host else "")

    @property
    def uses_shared_memory(self) -> bool:
        """Whether CPU all-reduces go through shared memory (every worker on this machine)."""
        return self._same_host is not None

    @property
    def is_chief(self) -> bool:
        """Whether this worker is rank 0: the one that writes checkpoints and sends the initial
        parameters."""
        return self.rank == 0

    # -- collectives ------------------------------------------------------------------------------
    def sums_in_shared_memory(self, tensor: torch.Tensor) -> bool:
        """Whether ``all_reduce_async(tensor)`` goes through shared memory (every worker on this
        machine, a CPU tensor), not over the network."""
        return self._same_host is not None and self._same_host.supports(tensor)

    def all_reduce_async(self, tensor: torch.Tensor, label: str) -> PendingCollective:
        """Start summing ``tensor`` over every worker, in place."""
        shared = self.sums_in_shared_memory(tensor)
        with self._collective(_signed(label, tensor)) as position:
            if shared:
                assert self._same_host is not None
                work: Any = self._same_host.all_reduce_async(tensor)
            else:
                work = dist.all_reduce(tensor, async_op=True)
        return PendingCollective(self, work, position)

    def all_to_all_async(
        self, output: torch.Tensor, tensor: torch.Tensor, label: str
    ) -> PendingCollective:
        """Start sending the i-th of ``world_size`` equal chunks of ``tensor`` to worker i;
        chunk j of ``output`` comes from worker j."""
        with self._collective(_signed(label, tensor)) as position:
            work = dist.all_to_all_single(output, tensor, async_op=True)
        return PendingCollective(self, work, position)

    def all_gather_into_async(
        self, output: torch.Tensor, tensor: torch.Tensor, label: str
    ) -> PendingCollective:
        """Start gathering every worker's ``tensor`` end to end into ``output``, rank order."""
        with self._collective(_signed(label, tensor)) as position:
            work = _all_gather_single(output, tensor, async_op=True)
        return PendingCollective(self, work, position)

    def all_reduce(self, tensor: torch.Tensor, label: str) -> None:
        """Sum ``tensor`` over every worker, in place."""
        self.all_reduce_async(tensor, label).wait()

    def broadcast(self, tensor: torch.Tensor, label: str) -> None:
        """Overwrite ``tensor`` with the chief's (rank 0's)."""
        with self._collective(_signed(label, tensor)) as position:
            work = dist.broadcast(tensor, src=0, async_op=True)
        PendingCollective(self, work, position).wait()

    def all_gather_async(
        self, tensor: torch.Tensor, label: str
    ) -> tuple[list[torch.Tensor], Pending]:
        """Start gathering every worker's ``tensor`` (same shape everywhere), in rank order.
        Between workers of one machine a CPU tensor goes as one shared-memory sum
        (:mod:`mirrored.comm.gather_by_sum`), at a fraction of the backend's latency (a
        MultiWorkerMirroredStrategy step gathers buffers and the input's next batch)."""
        if self._same_host is not None and tensor.device.type == "cpu":
            signed = _signed(label, tensor)
            return gather_by_sum(
                tensor,
                self.rank,
                self.world_size,
                lambda block: self.all_reduce_async(block, signed),
                signed,
            )
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self._collective(_signed(label, tensor)) as position:
            work = dist.all_gather(parts, tensor, async_op=True)
        return parts, PendingCollective(self, work, position)

    def all_gather(self, tensor: torch.Tensor, label: str) -> list[torch.Tensor]:
        """Every worker's ``tensor`` (same shape everywhere), in rank order."""
        parts, pending = self.all_gather_async(tensor, label)
        pending.wait()
        return parts

    def all_gather_json(self, value: Any, label: str) -> list[Any]:
        """Every worker's JSON-serialisable ``value``, in rank order (no pickle on the wire)."""
        data = json.dumps(value, sort_keys=True).encode()
        size = torch.tensor([len(data)], dtype=torch.int64, device=self.meta_device)
        sizes = [int(s.item()) for s in self.all_gather(size, label + " (sizes)")]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.meta_device)
        padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = self.all_gather(padded, label)
        return [json.loads(bytes(p[:n].cpu().tolist())) for p, n in zip(parts, sizes, strict=True)]

    def add_explainer(self, explain: Callable[[], str | None]) -> None:
        """``explain()``, a bound method, may name the cause of a failed collective (e.g. input
        that ran out); held weakly, so it goes with its object."""
        self._explainers = [ref for ref in self._explainers if ref() is not None]
        self._explainers.append(weakref.WeakMethod(explain))

    @contextmanager
    def _collective(self, label: str) -> Iterator[tuple[int, str]]:
        if self.broken is not None:
            raise RuntimeError(
                f"the workers are out of step since an earlier collective failed ({self.broken}); "
                "restart the job (with BackupAndRestore it resumes from the last backup)"
            ) from self.broken
        self._position = (self._position[0] + 1, label)
        try:
            yield self._position
        except Exception as error:
            raise self._failure(error, self._position) from error

    def abort(self, error: BaseException) -> None:
        """This worker failed a step that its peers may have run on: from here the workers'
        collectives would pair one step apart. Break the group for good, publish why, and (for
        a process group this group created) close its connections, so that the peers' pending
        and next collectives fail at once with a ``WorkerLostError`` naming this worker and its
        error instead of waiting out the timeout or silently pairing with its next step."""
        if self.broken is None:  # else a collective failed: the peers see where this one is
            self.broken = RuntimeError(
                f"this worker's step failed ({error!r}), so the workers' steps no longer pair "
                "up; restart the job (with BackupAndRestore it resumes from the last backup)"
            )
            reason = f"{_FAILED}{type(error).__name__}: {error}"[:500]
            self._position = (self._position[0], reason)
            with contextlib.suppress(Exception):  # the store may be gone with its host
                self._store.set(self._board_key(self.rank), f"failed|{self._position[0]}|{reason}")
        self._close_same_host()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._owns_process_group = False

    # -- failure diagnosis ------------------------------------------------------------------------
    def _failure(self, error: Exception, position: tuple[int, str]) -> Exception:
        """The error to raise for a failed collective, naming the workers that are missing."""
        if self.broken is not None:
            return RuntimeError(f"an earlier collective failed: {self.broken}")
        seq, label = position
        if isinstance(error, LocalReduceError):  # not a peer's doing: say so, blame no one
            own = RuntimeError(
                f"worker {self.rank} could not take part in {label!r} (#{seq}) itself: {error}; "
                "its peers fail too, since the workers' collectives no longer pair up"
            )
            self.broken = own
            return own
        timed_out = "timed out" in str(error).lower() or "timeout" in str(error).lower()
        peers = self._peer_positions()
        behind, silent = [], []
        for rank, (peer_seq, peer_label, stale) in sorted(peers.items()):
            if peer_label.startswith(_FAILED):
                behind.append(
                    f"worker {rank} failed its step ({peer_label.removeprefix(_FAILED)}) and left"
                )
            elif stale:
                silent.append(
                    f"worker {rank} stopped responding (its process died or froze; last seen at "
                    f"{peer_label!r}, #{peer_seq})"
                )
            elif peer_seq == seq and peer_label != label:
                behind.append(
                    f"worker {rank} is at the same collective (#{seq}) with another tensor or "
                    f"purpose: {peer_label!r}"
                )
            elif peer_seq != seq:
                behind.append(f"worker {rank} is at {peer_label!r} (#{peer_seq})")
        missing = [r for r in range(self.world_size) if r != self.rank and r not in peers]
        parts = silent + behind + [f"worker {r} never reported" for r in missing]
        explainers = [ref() for ref in self._explainers]
        explanations = [text for explain in explainers if explain and (text := explain())]
        where = f"worker {self.rank} waited at {label!r} (#{seq})"
        if timed_out:
            summary = f"{where} for {self.timeout_seconds} s"
        elif isinstance(error, SyncMismatchError):
            summary = (
                f"worker {self.rank} reached {label!r} (#{seq}) with another tensor than its peers"
            )
        else:
            summary = f"{where} when a peer's connection broke"
        detail = "; ".join(explanations + parts) or f"no worker is behind ({error})"
        message = (
            f"{summary}: {detail}. Every worker must run the same steps; restart the job "
            "(mirrored launch --max-restarts with BackupAndRestore resumes it)"
        )
        failure: Exception
        if isinstance(error, SyncMismatchError):
            failure = SyncMismatchError(message)
        else:
            failure = SyncTimeoutError(message) if timed_out else WorkerLostError(message)
        self.broken = failure
        return failure

    def _peer_positions(self) -> dict[int, tuple[int, str, bool]]:
        """rank -> (collective number, label, heartbeat stale?) for every peer that reported."""
        first = self._read_board()
        time.sleep(_STALE_SECONDS)
        second = self._read_board()  # empty if the store's host (rank 0) has ended since
        positions = {}
        for rank in (first.keys() | second.keys()) - {self.rank}:
            beat, seq, label = second.get(rank) or first[rank]
            positions[rank] = (seq, label, first.get(rank, (None,))[0] == beat)
        return positions

    def _read_board(self) -> dict[int, tuple[str, int, str]]:
        board: dict[int, tuple[str, int, str]] = {}
        keys = [self._board_key(rank) for rank in range(self.world_size)]
        previous = self._store.timeout  # type: ignore[attr-defined]  # missing from the stubs
        try:
            self._store.set_timeout(datetime.timedelta(seconds=2))
            present = [k for k in keys if self._store.check([k])]
            for key in present:
                beat, seq, label = self._store.get(key).decode().split("|", 2)
                board[int(key.rsplit("/", 1)[1])] = (beat, int(seq), label)
        except Exception:  # the store itself is gone (its host, rank 0, died): report no one
            return {}
        finally:
            with contextlib.suppress(Exception):
                self._store.set_timeout(previous)
        return board

    def _board_key(self, rank: int) -> str:
        return f"{self._prefix}/progress/{rank}"

    def _beat(self) -> None:
        """Publish this worker's position every half second until closed."""
        beat = 0
        try:
            store = self._heartbeat_store()
            while not self._stop.wait(_HEARTBEAT_SECONDS if beat else 0):
                beat += 1
                seq, label = self._position
                store.set(self._board_key(self.rank), f"{beat}|{seq}|{label}")
        except Exception:  # the store went away with its host: diagnosis says so
            return

    def _heartbeat_store(self) -> dist.Store:
        """A connection of its own, so beats never interleave with the main thread's requests."""
        if self._address is None:
            return self._store
        host, port = self._address
        return dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30))

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the heartbeat and wait for it, then tear down the process group this group
        created; idempotent. The wait matters at the end of a program (a strategy not closed is
        closed at exit): a daemon thread that comes back from a store call while the interpreter
        finalizes is ended inside torch's C++ frames, and the process aborts ("terminate called
        without an active exception") after a run that succeeded."""
        self._stop.set()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join()
        self._close_same_host()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_process_group = False

    def _close_same_host(self) -> None:
        if self._same_host is not None:
            self._same_host.close()
            self._same_host = None


def _signed(label: str, tensor: torch.Tensor) -> str:
    """A collective's label with its tensor's size and type: workers that call the same
    collective on different tensors (which gloo cannot tell, and waits on until the timeout)
    show where they differ in the error that names them."""
    return f"{label} [{tensor.numel()} x {str(tensor.dtype).removeprefix('torch.')}]"


def _task_of_rank(resolver: ClusterResolver, rank: int) -> str:
    """The TF_CONFIG task and address of ``rank`` (the chief, then the workers), where the
    cluster is known; else its rank under torchrun."""
    spec = resolver.cluster_spec()
    tasks = [
        (job, i, address)
        for job in ("chief", "worker")
        for i, address in enumerate(spec.get(job, []))
    ]
    if rank < len(tasks):
        job, index, address = tasks[rank]
        return f"task {job}:{index} at {address}"
    return f"RANK={rank}"
