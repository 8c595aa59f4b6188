"""The shared-memory all-reduce in one process: its plan, and its failures with threads standing
in for worker processes (tests/multiprocess covers real processes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from mirrored.rendezvous import SyncMismatchError
from mirrored.same_host_all_reduce import SameHostAllReduce, _part


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


@pytest.fixture
def pair() -> Iterator[list[SameHostAllReduce]]:
    exchange = _thread_exchange(2)
    with ThreadPoolExecutor(2) as pool:
        transports = list(
            pool.map(lambda r: SameHostAllReduce.connect(r, 2, 2.0, exchange(r)), range(2))
        )
    assert all(transports)
    yield transports  # type: ignore[misc]
    for transport in transports:
        transport.close()  # type: ignore[union-attr]


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


def test_what_it_cannot_sum_is_refused() -> None:
    assert not SameHostAllReduce.supports(torch.ones(4, 2).t())
    assert not SameHostAllReduce.supports(torch.ones(2, dtype=torch.bool))
    assert SameHostAllReduce.supports(torch.ones(2, dtype=torch.bfloat16))
