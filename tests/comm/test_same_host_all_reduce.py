"""The shared-memory all-reduce in one process: its plan, and its failures with threads standing
in for worker processes (tests/multiprocess covers real processes)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mirrored.comm.same_host_all_reduce import LocalReduceError, SameHostAllReduce, _part
from mirrored.core.replica_meeting import SyncMismatchError


@pytest.mark.parametrize("world_size", [2, 3, 8])
@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 1000, 4097])
def test_the_parts_cover_a_chunk_once_in_aligned_pieces(numel: int, world_size: int) -> None:
    parts = [_part(numel, rank, world_size) for rank in range(world_size)]
    covered = [i for lo, hi in parts for i in range(lo, hi)]
    assert covered == list(range(numel))
    assert all(lo % 64 == 0 for lo, hi in parts if hi > lo)


def _thread_exchange(world_size: int) -> Callable[[int], Callable[[Any, str], list[Any]]]:
    """Per rank, an all_gather_json over threads."""
    barrier = threading.Barrier(world_size)
    slots: list[Any] = [None] * world_size

    def for_rank(rank: int) -> Callable[[Any, str], list[Any]]:
        def exchange(value: Any, label: str) -> list[Any]:
            barrier.wait()
            slots[rank] = value
            barrier.wait()
            gathered = list(slots)
            barrier.wait()
            return gathered

        return exchange

    return for_rank


def _connect_all(world_size: int, timeout: float) -> list[SameHostAllReduce]:
    exchange = _thread_exchange(world_size)
    with ThreadPoolExecutor(world_size) as pool:
        transports = list(
            pool.map(
                lambda r: SameHostAllReduce.connect(r, world_size, timeout, exchange(r)),
                range(world_size),
            )
        )
    assert all(transports)
    return transports  # type: ignore[return-value]


@pytest.fixture
def pair() -> Iterator[list[SameHostAllReduce]]:
    transports = _connect_all(2, 2.0)
    yield transports
    for transport in transports:
        transport.close()


def test_two_ranks_sum_and_a_different_size_fails_both_at_once(
    pair: list[SameHostAllReduce],
) -> None:
    values = [torch.arange(5.0), torch.ones(5)]
    pending = [t.all_reduce_async(v) for t, v in zip(pair, values, strict=True)]
    for waiting in pending:
        waiting.wait()
    assert all(torch.equal(v, torch.arange(5.0) + 1) for v in values)
    started = time.monotonic()
    pending = [pair[0].all_reduce_async(torch.ones(3)), pair[1].all_reduce_async(torch.ones(4))]
    for rank, waiting in enumerate(pending):
        with pytest.raises(SyncMismatchError, match=f"{3 + rank} x torch.float32"):
            waiting.wait()
    assert time.monotonic() - started < 2.0  # at once, not at the 2 s timeout
    with pytest.raises(SyncMismatchError):  # the transport stays broken
        pair[0].all_reduce_async(torch.ones(3)).wait()


def test_a_peer_that_never_comes_times_out(pair: list[SameHostAllReduce]) -> None:
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="timed out"):
        pair[1].all_reduce_async(torch.ones(3)).wait()
    assert time.monotonic() - started >= 2.0


def test_a_peer_that_closes_fails_the_waiting_one_at_once(pair: list[SameHostAllReduce]) -> None:
    waiting = pair[1].all_reduce_async(torch.ones(3))
    time.sleep(0.1)  # rank 1 waits for rank 0's verdict
    started = time.monotonic()
    pair[0].close()
    with pytest.raises(ConnectionError):
        waiting.wait()
    assert time.monotonic() - started < 1.0


def test_strided_tensors_and_tensors_that_require_grad_are_summed_in_place(
    pair: list[SameHostAllReduce],
) -> None:
    strided = [torch.arange(12.0).view(3, 4).t(), torch.ones(3, 4).t()]
    leaves = [torch.ones(3, requires_grad=True), torch.full((3,), 2.0, requires_grad=True)]
    pending = [t.all_reduce_async(v) for t, v in zip(pair, strided, strict=True)]
    pending += [t.all_reduce_async(v) for t, v in zip(pair, leaves, strict=True)]
    for waiting in pending:
        waiting.wait()
    for value in strided:
        assert value.stride() == (1, 4)
        assert torch.equal(value, torch.arange(12.0).view(3, 4).t() + 1)
    for leaf in leaves:
        assert leaf.requires_grad and leaf.is_leaf
        assert torch.equal(leaf.detach(), torch.full((3,), 3.0))


def test_an_error_of_one_worker_s_own_is_not_blamed_on_a_peer(
    pair: list[SameHostAllReduce],
) -> None:
    # Writing the sum back into an expanded tensor fails on this worker alone.
    overlapping = pair[0].all_reduce_async(torch.ones(1).expand(4))
    fine = pair[1].all_reduce_async(torch.ones(4))
    with pytest.raises(LocalReduceError, match="single memory location"):
        overlapping.wait()
    fine.wait()
    with pytest.raises(LocalReduceError):  # broken for good
        pair[0].all_reduce_async(torch.ones(4)).wait()
    started = time.monotonic()
    with pytest.raises(ConnectionError):  # its peer's next collective fails at once
        pair[1].all_reduce_async(torch.ones(4)).wait()
    assert time.monotonic() - started < 1.0


def test_a_collective_started_after_close_fails_at_once(pair: list[SameHostAllReduce]) -> None:
    pair[0].close()
    pair[0].close()  # idempotent
    with pytest.raises(RuntimeError, match="was closed"):
        pair[0].all_reduce_async(torch.ones(2)).wait()


def test_a_barrier_waits_one_timeout_for_all_its_peers() -> None:
    # Rank 1 comes late, rank 2 never: rank 0 gives up one timeout after it began waiting,
    # not one timeout after each peer in turn.
    transports = _connect_all(3, 2.0)
    try:
        started = time.monotonic()
        waiting = transports[0].all_reduce_async(torch.ones(2))
        time.sleep(1.6)
        late = transports[1].all_reduce_async(torch.ones(2))
        with pytest.raises(TimeoutError, match="timed out"):
            waiting.wait()
        assert time.monotonic() - started < 3.0  # 2 s, where waiting on each in turn takes 3.6
        with pytest.raises(ConnectionError):
            late.wait()
    finally:
        for transport in transports:
            transport.close()


def test_a_forked_child_leaves_its_parent_s_connections_alone(
    pair: list[SameHostAllReduce],
) -> None:
    child = os.fork()
    if child == 0:  # as a DataLoader worker ending would
        pair[0].close()
        os._exit(0)
    assert os.waitpid(child, 0)[1] == 0
    values = [torch.ones(2), torch.ones(2)]
    pending = [t.all_reduce_async(v) for t, v in zip(pair, values, strict=True)]
    for waiting in pending:
        waiting.wait()
    assert all(torch.equal(v, torch.full((2,), 2.0)) for v in values)


def test_what_it_cannot_sum_is_refused() -> None:
    assert SameHostAllReduce.supports(torch.ones(4, 2).t())  # strided: summed in a copy
    assert SameHostAllReduce.supports(torch.ones(2, dtype=torch.bfloat16))
    assert not SameHostAllReduce.supports(torch.ones(2, dtype=torch.bool))
    assert not SameHostAllReduce.supports(torch.ones(2, dtype=torch.complex64))
    assert not SameHostAllReduce.supports(torch.eye(3).to_sparse())


def test_nothing_is_set_up_for_one_worker() -> None:
    def exchange(value: Any, label: str) -> list[Any]:
        raise AssertionError("a lone worker exchanges nothing")

    assert SameHostAllReduce.connect(0, 1, 1.0, exchange) is None
