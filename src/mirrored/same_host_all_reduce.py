"""All-reduce between worker processes on one machine through shared memory.

Gloo moves every byte of a same-machine all-reduce through loopback TCP: a 2.7 MB gradient bucket
takes about 3 ms between two processes on our 2-core VM, where copying it through a shared buffer
takes about 0.4 ms (measured with the two side by side; ``benchmarks/multi_worker.py`` shows the
effect on a whole step). So when every worker of a job runs on this machine,
``MultiWorkerMirroredStrategy`` (``CommunicationImplementation.AUTO``) sums CPU tensors here:

1. each worker copies its tensor into its own slot of a shared buffer;
2. barrier; worker ``r`` sums the ``r``-th part of every slot (slots in rank order) into the
   output area: every element is summed once, in one order, so every worker gets the same bits;
3. barrier; each worker copies the whole output back into its tensor.

Tensors larger than a slot go in slot-sized chunks. Two barriers per chunk suffice: a worker
writes its slot for the next chunk only after everyone passed the first barrier of this one
(nobody still reads the slots), and its part of the output only after everyone passed the first
barrier of the next (nobody still copies the output out).

The barriers are one-byte-per-worker messages over Unix sockets to rank 0, not spin-waits on
shared flags: they cost no CPU while waiting, their kernel calls order the buffer's writes before
the peers' reads, a peer that dies closes its socket (the others fail at once), and every wait
has the job's timeout. Each barrier also carries the collective's number, size and type, so
workers that reduce different tensors fail at once instead of summing garbage.

The buffer and socket live in a private directory (mode 0700) of ``/dev/shm`` that rank 0
removes as soon as everyone has attached: nothing is left behind, even after ``kill -9``. Where
any step of the set-up fails (workers on different machines or containers, ``/dev/shm`` too
small), every worker keeps gloo.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from mirrored.rendezvous import SyncMismatchError

__all__ = ["PendingReduce", "SameHostAllReduce"]

# Per-worker slot: small enough that 8 workers fit Docker's default 64 MB /dev/shm (9 areas).
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
_OK, _MISMATCH = b"\x01", b"\x00"

Exchange = Callable[[Any, str], list[Any]]  # WorkerGroup.all_gather_json: one value per rank


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
        self._buffer = buffer
        self._bytes = torch.frombuffer(buffer, dtype=torch.uint8)
        self._peers = peers  # rank 0: a socket per other worker, in rank order; others: rank 0's
        for peer in peers:
            peer.settimeout(timeout_seconds)
        self._timeout_seconds = timeout_seconds
        self._count = 0
        self._broken: BaseException | None = None
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
        """Attach every worker to one shared buffer, or return None on every worker where any of
        them cannot (the workers are on different machines, or ``/dev/shm`` is too small).

        Collective: every worker calls it at the same point. ``exchange`` gathers one JSON value
        from each worker.
        """
        hosts = exchange(_machine_identity(), "same-host all-reduce: machines")
        if world_size < 2 or any(host != hosts[0] for host in hosts):
            return None
        size = _SLOT_BYTES * (world_size + 1)
        directory = listener = None
        buffer, peers = None, []
        try:
            offer: dict[str, str] = {}
            if rank == 0:
                with contextlib.suppress(OSError):
                    directory, listener, token = _create(size, world_size)
                    offer = {"directory": str(directory), "token": token}
            offer = exchange(offer, "same-host all-reduce: buffer")[0]
            attached = False
            if offer and rank != 0:
                with contextlib.suppress(OSError, ValueError):
                    buffer, peer = _attach(Path(offer["directory"]), offer["token"], rank, size)
                    peers.append(peer)
                    attached = True
            attached = all(
                exchange(bool(offer) and (rank == 0 or attached), "same-host all-reduce: attached")
            )
            if attached and listener is not None:
                with contextlib.suppress(OSError, ValueError):
                    peers = _accept(listener, offer["token"], world_size, timeout_seconds)
                    buffer = _map(Path(offer["directory"]) / "buffer", size)
            if not all(exchange(buffer is not None and attached, "same-host all-reduce: ready")):
                return None
            assert buffer is not None
            transport, peers = cls(rank, world_size, buffer, peers, timeout_seconds), []
            return transport
        finally:
            for peer in peers:  # set-up failed: nothing else holds them
                peer.close()
            if listener is not None:
                listener.close()
            if directory is not None:  # everyone has attached or given up: no file outlives us
                shutil.rmtree(directory, ignore_errors=True)

    # -- collectives ------------------------------------------------------------------------------
    @staticmethod
    def supports(tensor: torch.Tensor) -> bool:
        """Whether this transport can sum ``tensor`` (a contiguous CPU tensor of a numeric type);
        the same answer on every worker for the same collective."""
        return tensor.device.type == "cpu" and tensor.dtype in _DTYPES and tensor.is_contiguous()

    def all_reduce_async(self, tensor: torch.Tensor) -> PendingReduce:
        """Start summing ``tensor`` over every worker, in place; leave it alone until ``wait()``."""
        if not self.supports(tensor):
            raise ValueError(f"cannot all-reduce a {tensor.dtype} tensor on {tensor.device} here")
        pending = PendingReduce()
        self._queue.put((tensor, pending))
        return pending

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            tensor, pending = item
            if self._broken is None:
                try:
                    self._all_reduce(tensor)
                except BaseException as error:  # every later collective fails with it
                    self._broken = error
                    self._close_peers()
            pending.finish(self._broken)

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        self._count += 1
        flat = tensor.view(-1)
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
        headers = [_receive(peer, len(header)) for peer in self._peers]
        verdict = _OK if all(h == header for h in headers) else _MISMATCH
        for peer in self._peers:
            peer.sendall(verdict)
        if verdict != _OK:
            raise SyncMismatchError(self._mismatch(header))

    def _mismatch(self, header: bytes) -> str:
        count, numel, code, _ = _HEADER.unpack(header)
        return (
            f"the workers' all-reduce #{count} of this transport has different tensors "
            f"(this worker's: {numel} x {_DTYPES[code]})"
        )

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the connections (a peer's pending or next collective fails at once) and stop the
        thread; idempotent."""
        if self._broken is None:
            self._broken = RuntimeError("the same-host all-reduce was closed")
        self._close_peers()
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _close_peers(self) -> None:
        for peer in self._peers:
            with contextlib.suppress(OSError):
                peer.shutdown(socket.SHUT_RDWR)
            peer.close()


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


def _part(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """The range of a chunk's elements that ``rank`` sums: equal parts on ``_PART_ALIGN``."""
    per = -(-numel // world_size)
    per = -(-per // _PART_ALIGN) * _PART_ALIGN
    return min(numel, rank * per), min(numel, (rank + 1) * per)


def _machine_identity() -> str:
    """The same string in every process of one running machine (its host name and boot id), and
    a different one elsewhere; containers that share a kernel are told apart at attach time."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    with contextlib.suppress(OSError):
        return f"{socket.gethostname()}/{boot.read_text().strip()}"
    return socket.gethostname()


def _create(size: int, world_size: int) -> tuple[Path, socket.socket, str]:
    """Rank 0: a private directory holding the buffer (its pages reserved now, so a full
    ``/dev/shm`` fails here rather than with SIGBUS later) and a listening socket."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    directory = Path(tempfile.mkdtemp(prefix="mirrored-", dir=base))
    try:
        token = secrets.token_hex(_TOKEN_BYTES)
        with open(directory / "buffer", "wb") as file:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(file.fileno(), 0, size)
            else:
                file.truncate(size)
        _map(directory / "buffer", size)[-_TOKEN_BYTES:] = bytes.fromhex(token)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(directory / "socket"))
            listener.listen(world_size)
        except OSError:
            listener.close()
            raise
    except OSError:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory, listener, token


def _attach(directory: Path, token: str, rank: int, size: int) -> tuple[mmap.mmap, socket.socket]:
    """Another worker: map the buffer, check it is rank 0's (its token is at the end), connect
    and introduce itself. Rank 0 accepts once everyone has connected."""
    buffer = _map(directory / "buffer", size)
    if buffer[-_TOKEN_BYTES:] != bytes.fromhex(token):
        raise ValueError("another machine's buffer")
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        peer.connect(str(directory / "socket"))
        peer.sendall(struct.pack("<I", rank) + bytes.fromhex(token))
    except OSError:
        peer.close()
        raise
    return buffer, peer


def _accept(
    listener: socket.socket, token: str, world_size: int, timeout_seconds: float
) -> list[socket.socket]:
    """Rank 0: every other worker's connection, in rank order."""
    listener.settimeout(timeout_seconds)
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < world_size - 1:
            peer, _ = listener.accept()
            peer.settimeout(timeout_seconds)
            hello = _receive(peer, 4 + _TOKEN_BYTES)
            (rank,) = struct.unpack("<I", hello[:4])
            if hello[4:] != bytes.fromhex(token) or not 0 < rank < world_size or rank in peers:
                peer.close()
                raise ValueError(f"unexpected connection to the same-host all-reduce: {hello!r}")
            peers[rank] = peer
    except BaseException:
        for peer in peers.values():
            peer.close()
        raise
    return [peers[rank] for rank in sorted(peers)]


def _map(path: Path, size: int) -> mmap.mmap:
    with open(path, "r+b") as file:
        return mmap.mmap(file.fileno(), size)


def _receive(peer: socket.socket, size: int) -> bytes:
    """Exactly ``size`` bytes; a closed connection (its worker ended) is a ConnectionError and a
    silent one a TimeoutError ("timed out"), after the job's timeout."""
    data = bytearray()
    while len(data) < size:
        received = peer.recv(size - len(data))
        if not received:
            raise ConnectionError("a peer worker's same-host connection closed")
        data += received
    return bytes(data)
