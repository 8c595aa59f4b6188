"""All-reduce between worker processes on one machine through shared memory.

Gloo moves every byte of a same-machine all-reduce through loopback TCP, several times slower
than copying it through a shared buffer (``benchmarks/multi_worker.py`` measures both, and the
effect on a whole step). So when every worker of a job runs on this machine,
``MultiWorkerMirroredStrategy`` (``CommunicationImplementation.AUTO``) sums CPU tensors here:

1. each worker copies its tensor into its own slot of a shared buffer;
2. barrier A; worker ``r`` sums the ``r``-th part of every slot (slots in rank order) into the
   output area: every element is summed once, in one order, so every worker gets the same bits;
3. barrier B; each worker copies the whole output back into its tensor.

Tensors larger than a slot go in slot-sized chunks. Two barriers per chunk suffice: a worker
writes its slot for the next chunk only after everyone passed barrier B of this one (everyone
has finished summing, so nobody reads the slots any more), and its part of the output only after
everyone passed barrier A of the next (everyone has finished copying this chunk's output out).

The barriers are one-byte-per-worker messages over Unix sockets to rank 0, not spin-waits on
shared flags: they cost no CPU while waiting, their kernel calls order the buffer's writes before
the peers' reads, a peer that dies closes its socket (the others fail at once), and each barrier
waits at most the job's timeout in all. Each barrier also carries the collective's number, size
and type, so workers that reduce different tensors fail at once instead of summing garbage.

Nothing has a name on any file system: the buffer is an anonymous memory file (``memfd``) that
rank 0 hands to each worker over a Unix socket in Linux's abstract namespace, which the kernel
removes with its last user, so a worker killed at any moment (during the set-up too) leaves
nothing behind. The buffer takes (workers + 1) x 4 MiB of memory (36 MiB for 8 workers), not
counted against ``/dev/shm``. Where any step of the set-up fails (workers on different machines
or in different network namespaces, no ``memfd`` outside Linux, memory short), every worker
keeps gloo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import secrets
import selectors
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mirrored.core.replica_meeting import SyncMismatchError

__all__ = ["LocalReduceError", "PendingReduce", "SameHostAllReduce", "machine_identity"]

# Per-worker slot: 8 workers' slots and the output area take 36 MiB.
_SLOT_BYTES = 4 << 20
_PART_ALIGN = 64  # elements: each worker's part starts on a cache line
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
]
_HEADER = struct.Struct("<QQBB")  # collective number, number of elements, dtype, phase
_TOKEN_BYTES = 16
_HELLO = struct.Struct(f"<I{_TOKEN_BYTES}s")  # a worker's rank and the job's token
_OK, _MISMATCH = b"\x01", b"\x00"

Exchange = Callable[[Any, str], list[Any]]  # WorkerGroup.all_gather_json: one value per rank


class LocalReduceError(RuntimeError):
    """This worker could not take part in an all-reduce for a reason of its own (not a peer's)."""


class SameHostAllReduce:
    """Sums CPU tensors over the workers of one machine; see the module docstring.

    Build it with ``connect``; ``all_reduce_async`` runs the collectives one after another, in
    the order they were started, on a thread of its own (as gloo's async work does).
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        buffer: mmap.mmap,
        peers: list[socket.socket],
        timeout_seconds: float,
    ) -> None:
        self._rank, self._world_size = rank, world_size
        self._bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self._peers = peers  # rank 0: a socket per other worker, in rank order; others: rank 0's
        self._selector = selectors.DefaultSelector()  # rank 0 waits on all its peers at once
        for index, peer in enumerate(peers):
            peer.settimeout(timeout_seconds)
            self._selector.register(peer, selectors.EVENT_READ, index)
        self._timeout_seconds = timeout_seconds
        self._count = 0
        self._broken: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue[tuple[torch.Tensor, PendingReduce] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(
            target=self._serve, name=f"mirrored-same-host-{rank}", daemon=True
        )
        self._thread.start()

    @classmethod
    def connect(
        cls, rank: int, world_size: int, timeout_seconds: float, exchange: Exchange
    ) -> SameHostAllReduce | None:
        """Give every worker the same shared buffer, or return None on every worker where any of
        them cannot have it (the workers are on different machines, or memory is short).

        Collective: every worker calls it at the same point. ``exchange`` gathers one JSON value
        from each worker.
        """
        if world_size < 2:
            return None
        identity = machine_identity() if _supported_here() else None
        hosts = exchange(identity, "same-host all-reduce: machines")
        if hosts[0] is None or any(host != hosts[0] for host in hosts):
            return None
        size = _SLOT_BYTES * (world_size + 1)
        memory, listener, buffer = None, None, None
        peers: list[socket.socket] = []
        try:
            offer: dict[str, str] = {}
            if rank == 0:
                with contextlib.suppress(OSError):
                    memory, listener, offer = _create(size, world_size)
            offer = exchange(offer, "same-host all-reduce: buffer")[0]
            if offer and rank != 0:
                with contextlib.suppress(OSError):
                    peers = [_connect(offer, rank, timeout_seconds)]
            connected = bool(offer) and (rank == 0 or bool(peers))
            if all(exchange(connected, "same-host all-reduce: connected")):
                with contextlib.suppress(OSError, ValueError):
                    if listener is not None and memory is not None:
                        peers = _accept(listener, memory, offer, world_size, timeout_seconds)
                        buffer = mmap.mmap(memory, size)
                    else:
                        buffer = _receive_buffer(peers[0], offer, size, timeout_seconds)
            if not all(exchange(buffer is not None, "same-host all-reduce: ready")):
                return None
            assert buffer is not None
            transport, peers = cls(rank, world_size, buffer, peers, timeout_seconds), []
            return transport
        finally:
            for peer in peers:  # set-up failed: nothing else holds them
                peer.close()
            if listener is not None:
                listener.close()
            if memory is not None:  # the mapping keeps the memory; the kernel frees it with that
                os.close(memory)

    # -- collectives ------------------------------------------------------------------------------
    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        """Whether this transport can sum ``tensor`` (a dense CPU tensor of a numeric type); the
        same answer on every worker for the same collective, whatever the tensor's strides."""
        return (
            tensor.device.type == "cpu"
            and tensor.layout == torch.strided
            and tensor.dtype in _DTYPES
        )

    def all_reduce_async(self, tensor: torch.Tensor) -> PendingReduce:
        """Start summing ``tensor`` over every worker, in place; leave it alone until ``wait()``.
        After ``close`` (or a failed collective) it fails at once."""
        if not self.supports(tensor):
            raise ValueError(f"cannot all-reduce a {tensor.dtype} tensor on {tensor.device} here")
        pending = PendingReduce()
        with self._lock:
            if not self._closed:
                self._queue.put((tensor, pending))
                return pending
        pending.finish(self._broken)
        return pending

    def _serve(self) -> None:
        try:
            with torch.no_grad():  # in-place writes to tensors that require grad are fine here
                while (item := self._queue.get()) is not None:
                    tensor, pending = item
                    if self._broken is None:
                        try:
                            self._all_reduce(tensor)
                        except BaseException as error:  # every later collective fails with it
                            self._broken = _blame(error)
                            self._shutdown_peers()
                    pending.finish(self._broken)
        finally:
            self._selector.close()
            for peer in self._peers:  # only this thread closes them: no fd is reused under it
                peer.close()

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._count += 1
        dense = tensor if tensor.is_contiguous() else tensor.contiguous()
        flat = dense.view(-1)
        code = _DTYPES.index(flat.dtype)
        step = _SLOT_BYTES // flat.element_size()
        slots = [self._area(i, flat.dtype, step) for i in range(self._world_size + 1)]
        output = slots.pop()
        for start in range(0, max(flat.numel(), 1), step):
            chunk = flat[start : start + step]
            n = chunk.numel()
            slots[self._rank][:n].copy_(chunk)
            self._barrier(_HEADER.pack(self._count, flat.numel(), code, 0))
            lo, hi = _part(n, self._rank, self._world_size)
            mine = output[lo:hi]
            torch.add(slots[0][lo:hi], slots[1][lo:hi], out=mine)
            for slot in slots[2:]:
                mine.add_(slot[lo:hi])
            self._barrier(_HEADER.pack(self._count, flat.numel(), code, 1))
            chunk.copy_(output[:n])
        if dense is not tensor:
            tensor.copy_(dense)

    def _area(self, index: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
        start = index * _SLOT_BYTES
        return self._bytes[start : start + _SLOT_BYTES].view(dtype)[:numel]

    def _barrier(self, header: bytes) -> None:
        """Wait until every worker has reached this point with the same ``header``."""
        if self._rank != 0:
            self._peers[0].sendall(header)
            if _receive(self._peers[0], 1) != _OK:
                raise SyncMismatchError(self._mismatch(header))
            return
        headers = self._receive_headers(len(header))
        verdict = _OK if all(h == header for h in headers) else _MISMATCH
        for peer in self._peers:
            peer.sendall(verdict)
        if verdict != _OK:
            raise SyncMismatchError(self._mismatch(header))

    def _receive_headers(self, size: int) -> list[bytes]:
        """Rank 0: ``size`` bytes from every peer, all within one timeout; a peer that closes
        fails it at once, whichever peer is still awaited."""
        deadline = time.monotonic() + self._timeout_seconds
        received = [bytearray() for _ in self._peers]
        waiting = len(self._peers)
        while waiting:
            ready = self._selector.select(deadline - time.monotonic())
            if not ready:
                raise TimeoutError("timed out")
            for key, _ in ready:
                data = received[key.data]
                wanted = size - len(data) or 1  # a peer already heard from can only have closed
                more = self._peers[key.data].recv(wanted)
                if not more or len(data) == size:
                    raise ConnectionError("a peer worker's same-host connection closed")
                data += more
                waiting -= len(data) == size
        return [bytes(data) for data in received]

    def _mismatch(self, header: bytes) -> str:
        count, numel, code, _ = _HEADER.unpack(header)
        return (
            f"the workers reached all-reduce #{count} of this transport with different tensors "
            f"(this worker's: {numel} x {_DTYPES[code]})"
        )

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Shut the connections (a peer's pending or next collective fails at once), fail this
        worker's later collectives and stop the thread; idempotent. A forked child leaves its
        parent's connections alone."""
        if os.getpid() != self._pid:
            return
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._broken is None:
                    self._broken = RuntimeError("the same-host all-reduce was closed")
                self._queue.put(None)
        self._shutdown_peers()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _shutdown_peers(self) -> None:
        """Wake a wait on the connections from any thread (closing them is ``_serve``'s)."""
        for peer in self._peers:
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)


class PendingReduce:
    """One queued all-reduce, with the part of c10d's ``Work`` interface ``PendingCollective``
    uses."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self) -> None:
        """Every wait inside the transport has the job's timeout, so this ends."""
        self._done.wait()
        if self._error is not None:
            raise self._error


def _blame(error: BaseException) -> BaseException:
    """A failed collective's error as the worker group reads it: socket errors and mismatches
    involve a peer; anything else is this worker's own (``LocalReduceError``)."""
    if isinstance(error, (OSError, SyncMismatchError)):
        return error
    local = LocalReduceError(f"{type(error).__name__}: {error}")
    local.__cause__ = error
    return local


def _part(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The range of a chunk's elements that ``rank`` sums: equal parts on ``_PART_ALIGN``."""
    per = -(-numel // world_size)
    per = -(-per // _PART_ALIGN) * _PART_ALIGN
    return min(numel, rank * per), min(numel, (rank + 1) * per)


def _supported_here() -> bool:
    """Anonymous memory files, passing descriptors, and abstract socket names: Linux's."""
    return sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


def machine_identity() -> str:
    """The same string in every process of one running machine (its host name and boot id), and
    a different one elsewhere; containers that share a kernel but not a network namespace are
    told apart when they connect."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    with contextlib.suppress(OSError):
        return f"{socket.gethostname()}/{boot.read_text().strip()}"
    return socket.gethostname()


def _create(size: int, world_size: int) -> tuple[int, socket.socket, dict[str, str]]:
    """Rank 0: the buffer as an anonymous memory file (its pages reserved now, so short memory
    fails here rather than with SIGBUS later), a socket listening on a random abstract name, and
    the offer the others need to connect to it."""
    memory = os.memfd_create("mirrored-same-host-all-reduce", os.MFD_CLOEXEC)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        os.posix_fallocate(memory, 0, size)
        offer = {
            "name": f"mirrored-{secrets.token_hex(8)}",
            "token": secrets.token_hex(_TOKEN_BYTES),
        }
        listener.bind("\0" + offer["name"])
        listener.listen(world_size)
    except OSError:
        listener.close()
        os.close(memory)
        raise
    return memory, listener, offer


def _connect(offer: dict[str, str], rank: int, timeout_seconds: float) -> socket.socket:
    """Another worker: connect to rank 0's socket and introduce itself with the job's token."""
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.settimeout(timeout_seconds)
        peer.connect("\0" + offer["name"])
        peer.sendall(_HELLO.pack(rank, bytes.fromhex(offer["token"])))
    except OSError:
        peer.close()
        raise
    return peer


def _accept(
    listener: socket.socket,
    memory: int,
    offer: dict[str, str],
    world_size: int,
    timeout_seconds: float,
) -> list[socket.socket]:
    """Rank 0: every other worker's connection, in rank order, each sent the buffer (its file
    descriptor) and the token; all within one timeout."""
    deadline = time.monotonic() + timeout_seconds
    token = bytes.fromhex(offer["token"])
    accepted: list[socket.socket] = []  # closed on failure, whatever they said
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < world_size - 1:
            listener.settimeout(max(deadline - time.monotonic(), 0.001))
            peer, _ = listener.accept()
            accepted.append(peer)
            peer.settimeout(max(deadline - time.monotonic(), 0.001))
            hello = _receive(peer, _HELLO.size)
            rank, their_token = _HELLO.unpack(hello)
            if their_token != token or not 0 < rank < world_size or rank in peers:
                raise ValueError(f"unexpected connection to the same-host all-reduce: {hello!r}")
            peers[rank] = peer
            socket.send_fds(peer, [token], [memory])
    except BaseException:
        for peer in accepted:
            peer.close()
        raise
    return [peers[rank] for rank in sorted(peers)]


def _receive_buffer(
    peer: socket.socket, offer: dict[str, str], size: int, timeout_seconds: float
) -> mmap.mmap:
    """Another worker: rank 0's buffer, mapped (checked to come with the job's token)."""
    peer.settimeout(timeout_seconds)
    message, fds, _, _ = socket.recv_fds(peer, _TOKEN_BYTES, 1)
    try:
        if message != bytes.fromhex(offer["token"]) or len(fds) != 1:
            raise ValueError("the same-host all-reduce's socket sent no buffer")
        return mmap.mmap(fds[0], size)
    finally:
        for fd in fds:
            os.close(fd)


def _receive(peer: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; a closed connection (its worker ended) is a ConnectionError and a
    silent one a TimeoutError ("timed out"), after the socket's timeout."""
    data = bytearray()
    while len(data) < size:
        received = peer.recv(size - len(data))
        if not received:
            raise ConnectionError("a peer worker's same-host connection closed")
        data += received
    return bytes(data)
