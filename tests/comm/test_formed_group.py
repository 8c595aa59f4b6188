"""ProcessGroupClusterResolver in one process: a group of one worker, and the helpers' errors.

Two workers in a group formed with ``tcp://`` and no MASTER_* variables train in
tests/multiprocess/test_multi_worker.py (``test_custom_loop_equals_one_device``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

import mirrored
from mirrored.comm.formed_group import ProcessGroupClusterResolver, _machines, _store_address


@pytest.fixture
def one_worker_group() -> Iterator[dist.Store]:
    """A process group of one worker over a store without an address, as a program forms it."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield store
    finally:
        dist.destroy_process_group()


def test_without_a_process_group_the_resolver_says_what_to_call():
    with pytest.raises(ValueError, match=r"call torch\.distributed\.init_process_group first"):
        ProcessGroupClusterResolver()


def test_the_strategy_reads_a_group_formed_before_it(one_worker_group):
    with mirrored.MultiWorkerMirroredStrategy() as strategy:
        resolver = strategy.cluster_resolver
        assert isinstance(resolver, ProcessGroupClusterResolver)
        assert (resolver.rank, resolver.world_size) == (0, 1)
        assert (resolver.local_rank, resolver.local_world_size) == (0, 1)
        assert (resolver.master_addr, resolver.master_port) == ("127.0.0.1", 0)
    assert dist.is_initialized(), "the strategy closed the program's group"


def test_a_resolver_that_disagrees_with_the_group_is_refused(one_worker_group):
    other = mirrored.ClusterResolver(
        task_type="worker", task_id=1, rank=1, world_size=2, master_addr="h", master_port=1
    )
    with pytest.raises(ValueError, match=r"^the cluster resolver makes this process worker 1 of 2"):
        mirrored.MultiWorkerMirroredStrategy(cluster_resolver=other)


def test_the_address_is_the_tcp_store_s_under_its_prefixes():
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    wrapped = dist.PrefixStore("default_pg", dist.PrefixStore("outer", store))
    assert _store_address(wrapped, 2) == ("127.0.0.1", store.port)


def test_a_group_of_several_over_a_store_without_address_is_refused(tmp_path: Path):
    store = dist.FileStore(str(tmp_path / "store"), 2)
    with pytest.raises(ValueError, match=r"formed over a FileStore, not a TCP store.*'env://'"):
        _store_address(store, 2)


def test_a_worker_that_never_says_where_it_runs_is_named():
    with pytest.raises(TimeoutError, match=r"^worker\(s\) \[1\] of the process group did not"):
        _machines(dist.HashStore(), 0, 2, timeout_seconds=0.2)
